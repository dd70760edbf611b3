"""`model.prefer` (contract, Assignment): where several engine blocks fit the runtime, the
assignment's order wins over registration order; a fallback stays last whatever it asks."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.worker.hardware.recorded import replay
from worker.contract import protocol
from worker.engines import registry
from worker.hardware import EngineInstall, GpuGroup, Machine
from worker.plan.planner import Plan, Refusal, choose_engine, plan, preferred
from worker.system.config import Settings

FOLDER_BLOCK = {"source": "org/Qwen3-8B", "revision": "main", "weights_mib": 16000, "base_args": [], "tiers": {}}
GGUF_BLOCK = {"source": "https://example.org/q.gguf", "sha256": "ab" * 32, "weights_mib": 5000, "base_args": [],
              "tiers": {}}


def model(*engines: str) -> protocol.ModelSpec:
    blocks: dict[str, Any] = {name: GGUF_BLOCK if name == "llamacpp" else FOLDER_BLOCK for name in engines}
    return protocol.ModelSpec(name="qwen3-8b", **blocks)


def gpu_machine(compute_capability: str = "8.9") -> Machine:
    group = GpuGroup((0,), "NVIDIA GeForce RTX 4090", 20600, compute_capability=compute_capability)
    return Machine(os="linux", runtime="native", arch="x86_64", cpu_model="cpu", cpu_cores=8, ram_mib=65536,
                   groups=(group,), effective_vram_mib=20600)


def cpu_machine() -> Machine:
    return Machine(os="linux", runtime="cpu", arch="x86_64", cpu_model="cpu", cpu_cores=8, ram_mib=65536,
                   engines={"vllm": EngineInstall("0.32.0+cpu")})


def chosen(machine: Machine, spec: protocol.ModelSpec, prefer: tuple[str, ...] = ()) -> str:
    result = choose_engine(machine, spec, prefer)
    assert not isinstance(result, Refusal), result
    return result[0].NAME


def test_without_prefer_the_registration_order_holds_vllm_then_sglang() -> None:
    assert chosen(gpu_machine(), model("vllm", "sglang", "llamacpp")) == "vllm"
    assert chosen(gpu_machine(), model("sglang", "llamacpp")) == "sglang"


def test_prefer_puts_sglang_before_vllm() -> None:
    assert chosen(gpu_machine(), model("vllm", "sglang"), ("sglang", "vllm")) == "sglang"


def test_a_preferred_engine_without_a_block_is_passed_over() -> None:
    assert chosen(gpu_machine(), model("vllm", "llamacpp"), ("sglang",)) == "vllm"


def test_unknown_and_repeated_names_change_nothing() -> None:
    assert chosen(gpu_machine(), model("vllm", "sglang"), ("tgi", "vllm", "tgi", "sglang", "vllm")) == "vllm"


def test_a_fallback_stays_last_whatever_prefer_asks() -> None:
    """vLLM's CPU build serves `cpu` only for a model with no llama.cpp block there."""
    assert chosen(cpu_machine(), model("vllm", "llamacpp"), ("vllm",)) == "llamacpp"
    assert chosen(cpu_machine(), model("vllm"), ("vllm",)) == "vllm"


def test_preferred_keeps_unlisted_engines_in_registration_order() -> None:
    order = preferred(registry.for_runtime("native"), ("sglang",), "native")
    assert [adapter.NAME for adapter in order] == ["sglang", "vllm"]


def test_sglang_needs_compute_capability_8_where_vllm_takes_7_5() -> None:
    result = plan(gpu_machine("7.5"), protocol.Assign(assignment_id="a", model=model("sglang")), Settings())
    assert isinstance(result, Refusal) and "compute capability 8.0" in result.reason


def test_an_sglang_plan_is_told_the_share_less_its_activation_headroom() -> None:
    """The desktop card of `rtx4090-desktop.json`: 0.771 of it usable (as vLLM is told), so SGLang
    gets 0.621 for weights and KV cache, and 0.15 of the card (3.6 GiB) stays for activations."""
    result = plan(replay("rtx4090-desktop.json"), protocol.Assign(assignment_id="a", model=model("sglang")),
                  Settings())
    assert isinstance(result, Plan) and result.engine == "sglang", result
    engine = result.engines[0]
    argv = engine.argv()
    assert engine.memory_utilization == 0.771 and argv[argv.index("--mem-fraction-static") + 1] == "0.621"
    assert argv[argv.index("--tp-size") + 1] == "1" and argv[argv.index("--host") + 1] == "127.0.0.1"


def wire_assign(model_json: dict[str, Any]) -> protocol.Assign:
    frame = {"type": "assign", "assignment_id": "a-9", "model": model_json}
    message = protocol.parse_from_coordinator(json.dumps(frame), engine_names=registry.names())
    assert isinstance(message, protocol.Assign)
    return message


def test_prefer_read_off_the_wire_decides_the_plan() -> None:
    """`model.prefer` is a key of `model`, never taken for an engine's block, and the plan follows it."""
    both = {"name": "qwen3-8b", "vllm": FOLDER_BLOCK, "sglang": FOLDER_BLOCK}
    assert wire_assign(both).model.prefer == ()
    preferring = wire_assign({**both, "prefer": ["sglang", "vllm"]})
    assert preferring.model.prefer == ("sglang", "vllm") and set(preferring.model.engines) == {"vllm", "sglang"}
    assert isinstance(without := plan(gpu_machine(), wire_assign(both), Settings()), Plan) and without.engine == "vllm"
    assert isinstance(with_ := plan(gpu_machine(), preferring, Settings()), Plan) and with_.engine == "sglang"


def test_a_prefer_list_past_its_bound_is_refused_as_a_bad_message() -> None:
    frame = {"type": "assign", "assignment_id": "a-9",
             "model": {"name": "m", "vllm": FOLDER_BLOCK, "prefer": ["vllm"] * 17}}
    with pytest.raises(protocol.BadMessage, match="model.prefer"):
        protocol.parse_from_coordinator(json.dumps(frame), engine_names=registry.names())
