"""llama.cpp on Windows, where a start that does not fit spills into shared system memory instead
of failing: what it logged it put on each card, and the larger margin it is planned with there."""

from __future__ import annotations

from typing import Any

import pytest

from tests.worker.plan.test_planner import assign
from worker.contract import protocol
from worker.engines import llamacpp
from worker.hardware.model import GpuGroup, Machine
from worker.plan.planner import Plan, Refusal, plan
from worker.system.config import Settings

RTX_4090 = "NVIDIA GeForce RTX 4090"


@pytest.mark.parametrize(
    ("line", "buffer"),
    [
        ("0.02.411.950 I load_tensors:        CUDA0 model buffer size =  6956.38 MiB", (0, 6956.38)),
        ("llama_kv_cache:      CUDA1 KV buffer size =   512.00 MiB", (1, 512.0)),
        ("llama_memory_recurrent:      CUDA0 RS buffer size =   201.00 MiB", (0, 201.0)),
        ("sched_reserve:      CUDA0 compute buffer size =   519.62 MiB", (0, 519.62)),
        ("llama_context:      CUDA0 compute buffer size =   519.62 MiB", (0, 519.62)),  # before about b8200
        ("sched_reserve:  CUDA_Host compute buffer size =    24.01 MiB", None),  # pinned host memory
        ("load_tensors:   CPU_Mapped model buffer size =   417.66 MiB", None),
        ("llama_kv_cache: size =  354.75 MiB (  8448 cells,  43 layers,  1/1 seqs)", None),  # the buffers' total
    ],
)
def test_what_llama_server_put_on_each_card_is_read_from_its_buffer_lines(
    line: str, buffer: tuple[int, float] | None
) -> None:
    assert llamacpp.device_buffer(line) == buffer


def machine(runtime: str, usable_per_gpu: int, gpus: int = 1) -> Machine:
    group = GpuGroup(tuple(range(gpus)), RTX_4090, usable_per_gpu, compute_capability="8.9")
    return Machine(os="windows", runtime=runtime, arch="x86_64", cpu_model="cpu", cpu_cores=8, ram_mib=65536,
                   groups=(group,), effective_vram_mib=group.usable_mib_total)  # type: ignore[arg-type]


def judged(result: Plan | Refusal) -> list[tuple[int, str | None]]:
    assert isinstance(result, Plan), result
    return [(e.memory_mib, e.tier) for e in result.engines]


def llamacpp_only(weights_mib: int, **block: Any) -> protocol.Assign:
    return assign(weights_mib, engines=("llamacpp",), llamacpp=block)


def test_on_windows_each_card_keeps_a_gigabyte_more_free() -> None:
    """A tier the card clears only by the last gigabyte is not taken on Windows: there it would
    spill and run slowly instead of failing over to the lower tier."""
    tiers = {"tiers": {"20000": ["--ctx-size", "65536"]}}

    assert judged(plan(machine("windows", 20600), llamacpp_only(6000, **tiers), Settings())) == [(19576, None)]
    assert judged(plan(machine("windows", 20600, gpus=2), llamacpp_only(6000, **tiers), Settings())) == [
        (39152, "20000")]
    assert judged(plan(machine("apple-silicon", 20600), llamacpp_only(6000, **tiers), Settings())) == [
        (20600, "20000")]


def test_on_windows_a_model_that_fits_only_by_the_spare_gigabyte_is_refused_in_its_words() -> None:
    result = plan(machine("windows", 20600), llamacpp_only(18000), Settings())

    assert isinstance(result, Refusal)
    assert f"19,576 MiB usable on {RTX_4090}" in result.reason
    assert isinstance(plan(machine("apple-silicon", 20600), llamacpp_only(18000), Settings()), Plan)
