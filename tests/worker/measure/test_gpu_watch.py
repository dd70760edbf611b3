"""The node's GPUs through a recorded NVML source: samples, energy, and who else holds a card; RAM
measured again for vLLM's CPU build. (The fresh reading of cards is tested through the node in
`test_supervise.py`.)"""

from __future__ import annotations

import dataclasses
import os

import pytest

from tests.worker.engines.test_vllm_cpu import FOLDER, assign, cpu_machine, write_node
from worker.system.config import Settings
from worker.measure.gpu_watch import GpuWatch
from worker.hardware import ReplaySource
from worker.plan.planner import Plan, plan

CARD = {"device_count": 1, "memory:0": {"total_mib": 24564, "free_mib": 23000, "used_mib": 1564},
        "utilization_pct:0": 97, "power_mw:0": 300_000, "temperature_c:0": 70, "energy_mj:0": 1_000_000,
        "compute_processes:0": [{"pid": os.getpid(), "used_mib": 20000}, {"pid": 4242, "used_mib": 3000}],
        "graphics_processes:0": []}


async def test_samples_and_the_energy_drawn_between_them() -> None:
    calls = dict(CARD)
    watch = GpuWatch(ReplaySource(calls))
    assert await watch.sample(10.0) == {0: 0.0}  # the first sample: nothing to compare with
    assert watch.samples[0].power_w == 300.0 and watch.samples[0].util_pct == 97
    calls["energy_mj:0"] = 1_450_000
    assert await watch.sample(11.0) == {0: pytest.approx(450.0)}  # NVML's counter, exact


async def test_without_nvml_nothing_is_sampled_held_or_measured() -> None:
    watch = GpuWatch(None)
    assert await watch.sample(10.0) == {} and watch.samples == {}
    assert watch.processes_besides(lambda: pytest.fail("own processes asked without NVML")) == []
    assert watch.released({os.getpid()})


def test_processes_besides_the_apps_and_whether_a_stopped_engine_let_go() -> None:
    watch = GpuWatch(ReplaySource(dict(CARD)))
    assert [p.pid for p in watch.processes_besides(lambda: {os.getpid()})] == [4242]
    assert not watch.released({4242})
    assert watch.released({1})


async def test_a_cpu_engine_is_told_the_share_of_ram_free_now(tmp_path) -> None:
    """vLLM's CPU build refused to start for RAM another program held: the restart measures RAM
    again as vLLM does (its NUMA node), by the same usable rule, held to the assignment's cap."""
    chosen = plan(cpu_machine(usable_mib=6000, total_mib=8192), assign(vllm=FOLDER), Settings())
    assert isinstance(chosen, Plan)
    [engine] = chosen.engines
    assert engine.memory_utilization == 0.732  # as detected: 6,000 of 8,192 MiB
    write_node(tmp_path, 0, total_kb=8 * 1024 * 1024, free_kb=3 * 1024 * 1024, cache_kb=512 * 1024)
    watch = GpuWatch(None, sysfs=tmp_path)  # no NVIDIA card: RAM is read all the same
    # 4,096 MiB free now (free + file cache): 0.9 × 4,096 − 512 = 3,174 MiB usable of 8,192
    assert await watch.memory_share(cpu_machine(), engine, Settings()) == 0.387
    capped = dataclasses.replace(engine, memory_cap=0.2)
    assert await watch.memory_share(cpu_machine(), capped, Settings()) == 0.2
