"""vLLM's tuning: knobs only from its allowlist, the field notes' seeds, its own trap lines, and
the step budget that may not fall below the requests run at once."""

from __future__ import annotations

from worker.contract.protocol import Runtime
from worker.engines.vllm import tuning
from worker.engines.vllm.args import ALLOWLIST
from worker.hardware.model import Gpu, Machine


def machine(runtime: Runtime = "native", gpu_mib: int = 24576, name: str = "NVIDIA GeForce RTX 4090") -> Machine:
    gpus = () if runtime == "cpu" else (Gpu(0, "GPU-0", name, gpu_mib, gpu_mib, gpu_mib),)
    return Machine(os="linux", runtime=runtime, arch="x86_64", cpu_model="cpu", cpu_cores=8, ram_mib=65536,
                   gpus=gpus)


def test_every_knob_seed_and_never_flag_is_on_the_allowlist() -> None:
    names = {flag.name for flag in ALLOWLIST.flags}
    assert {knob.flag for knob in tuning.KNOBS} <= names
    assert tuning.NEVER <= set(ALLOWLIST.published(allow_remote_code=True))
    assert {"--max-model-len", "--gpu-memory-utilization", "--dtype", "--trust-remote-code"} <= tuning.NEVER
    for seed in tuning.SEEDS:
        assert ALLOWLIST.check(seed) is None


def test_traps_match_the_engines_own_warnings() -> None:
    assert tuning.TUNING.trap("WARNING 12-02 [vllm.py:2521] Truncating max_cudagraph_capture_size to 256") \
        == "trap:capture_truncated"
    assert tuning.TUNING.trap("cudagraph_capture_sizes specified in compilation_config [1, 2, 512] is overridden "
                              "by config [1, 2]") == "trap:capture_truncated"
    assert tuning.TUNING.trap("DFlash draft attention (FLASH_ATTN) does not support full CUDA graphs; running "
                              "the draft eagerly.") == "trap:drafter_graph_off"
    assert tuning.TUNING.trap("Graph capturing finished in 5 secs, took 0.40 GiB") is None


def test_a_step_budget_below_the_requests_at_once_is_no_candidate() -> None:
    assert tuning.fix(("--max-num-seqs", "64"), ("--max-num-batched-tokens", "32"), machine()) is None
    assert tuning.fix((), ("--max-num-seqs=4096",), machine()) is None  # the default budget here is 2048
    assert tuning.fix((), ("--max-num-seqs", "512"), machine()) == ("--max-num-seqs", "512")
    assert tuning.fix(("--max-num-batched-tokens", "8k"), ("--max-num-seqs", "4096"), machine()) == \
        ("--max-num-seqs", "4096")


def test_defaults_follow_the_engines_own_table() -> None:
    assert tuning.defaults(machine("cpu"))["--max-num-seqs"] == "128"
    assert tuning.defaults(machine())["--max-num-batched-tokens"] == "2048"
    assert tuning.defaults(machine(gpu_mib=143771, name="NVIDIA H200"))["--max-num-seqs"] == "1024"
    assert tuning.defaults(machine(gpu_mib=81920, name="NVIDIA A100-SXM4-80GB"))["--max-num-seqs"] == "256"
