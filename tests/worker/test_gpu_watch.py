"""The node's GPUs through a recorded NVML source: samples, energy, and who else holds a card.
(The fresh memory reading is tested through the node in `test_supervise.py`.)"""

from __future__ import annotations

import os

import pytest

from worker.gpu_watch import GpuWatch
from worker.hardware import ReplaySource

CARD = {"device_count": 1, "memory:0": {"total_mib": 24564, "free_mib": 23000, "used_mib": 1564},
        "utilization_pct:0": 97, "power_mw:0": 300_000, "temperature_c:0": 70, "energy_mj:0": 1_000_000,
        "compute_processes:0": [{"pid": os.getpid(), "used_mib": 20000}, {"pid": 4242, "used_mib": 3000}],
        "graphics_processes:0": []}


async def test_samples_and_the_energy_drawn_between_them() -> None:
    calls = dict(CARD)
    watch = GpuWatch(ReplaySource(calls))
    assert await watch.sample(10.0) == 0.0  # the first sample: nothing to compare with
    assert watch.samples[0].power_w == 300.0 and watch.samples[0].util_pct == 97
    calls["energy_mj:0"] = 1_450_000
    assert await watch.sample(11.0) == pytest.approx(450.0)  # NVML's counter, exact


async def test_without_nvml_nothing_is_sampled_held_or_measured() -> None:
    watch = GpuWatch(None)
    assert await watch.sample(10.0) == 0.0 and watch.samples == {}
    assert watch.processes_besides(lambda: pytest.fail("own processes asked without NVML")) == []
    assert watch.released({os.getpid()})


def test_processes_besides_the_apps_and_whether_a_stopped_engine_let_go() -> None:
    watch = GpuWatch(ReplaySource(dict(CARD)))
    assert [p.pid for p in watch.processes_besides(lambda: {os.getpid()})] == [4242]
    assert not watch.released({4242})
    assert watch.released({1})
