"""The pynvml adapter itself (`PynvmlSource`), against a `pynvml` module that behaves as the real one.

Replayed readings never run the adapter's NVML calls; these tests do, through `detect`,
`sample_gpus` and `gpu_processes`, on a display-attached GeForce card.
"""

from __future__ import annotations

from dataclasses import replace

import pynvml
import pytest

from tests.support.fake_pynvml import FakeCard, FakeNvml, FakeProcess
from tests.worker.hardware.recorded import NO_ENGINE_FINDER
from worker.system.config import Settings
from worker.hardware import (
    GpuProcess,
    HostFacts,
    NvmlError,
    PynvmlSource,
    RecordingSource,
    ReplaySource,
    detect,
    gpu_processes,
    sample_gpus,
)

HOST = HostFacts("Linux", "x86_64", "6.8.0-49-generic", "AMD Ryzen 9 7950X 16-Core Processor", 16, 63896)

XORG = FakeProcess(1712, used_mib=612)
GNOME_SHELL = FakeProcess(2290, used_mib=288, sm_pct=2)
BROWSER_GPU = FakeProcess(3105, used_mib=146, sm_pct=1)
GAME = FakeProcess(4711, used_mib=4096, sm_pct=90)
CUDA_JOB = FakeProcess(5120, used_mib=2048, graphics=False, compute=True, sm_pct=35)


def desktop_card(*extra: FakeProcess) -> FakeCard:
    return FakeCard(processes=[XORG, GNOME_SHELL, BROWSER_GPU, *extra])


def machine_of(fake: FakeNvml):
    return detect(Settings(), NO_ENGINE_FINDER, nvml=PynvmlSource(), host=HOST)


def test_detect_and_telemetry_read_two_geforce_cards_through_the_adapter(monkeypatch):
    second = FakeCard(
        uuid="GPU-0c4d5e6f-1111-2222-3333-444455556666",
        display_active=False,
        energy_mj=None,  # no energy counter on this one
        util_pct=0,
        power_mw=18_400,
    )
    fake = FakeNvml([desktop_card(), second]).install(monkeypatch)

    machine = machine_of(fake)

    first, other = machine.gpus
    assert (first.name, first.uuid, first.compute_capability) == ("NVIDIA GeForce RTX 4090", FakeCard.uuid, "8.9")
    assert (first.memory_total_mib, first.memory_free_mib, first.memory_used_mib) == (24564, 23176, 1388)
    assert (first.pcie_gen, first.pcie_width, first.power_limit_w, first.temperature_c) == (4, 16, 450.0, 41)
    assert first.memory_bandwidth_gbps == 1008.0
    assert first.p2p_peers == () and other.p2p_peers == ()  # GeForce: NVML says no peer-to-peer
    assert first.errors == () and not first.mig_enabled  # MIG is "Not Supported" on GeForce: absent, not an error
    assert other.memory_free_mib == 24564 - 342
    assert (machine.driver_version, machine.cuda_version, machine.problems) == ("580.95.05", "13.0", ())

    fake.cards[0].processes.append(GAME)
    busy, idle = sample_gpus(PynvmlSource())
    assert (busy.util_pct, busy.memory_used_mib, busy.power_w, busy.temperature_c) == (4, 1388 + 4096, 31.25, 41)
    assert (busy.energy_mj, idle.util_pct, idle.power_w, idle.energy_mj) == (912_334_571, 0, 18.4, None)
    assert fake.sessions == 0  # every nvmlInit had its nvmlShutdown


def test_gpu_processes_list_the_desktop_and_carry_memory_and_utilisation(monkeypatch):
    both = FakeProcess(6001, used_mib=512, graphics=True, compute=True, sm_pct=12)
    FakeNvml([desktop_card(CUDA_JOB, both)]).install(monkeypatch)

    assert gpu_processes(PynvmlSource()) == [
        GpuProcess(5120, 0, 2048, "compute", 35),
        GpuProcess(6001, 0, 512, "compute", 12),
        GpuProcess(1712, 0, 612, "graphics", 0),  # Xorg drew nothing in the last second
        GpuProcess(2290, 0, 288, "graphics", 2),
        GpuProcess(3105, 0, 146, "graphics", 1),
        GpuProcess(6001, 0, 512, "graphics", 12),
    ]


def test_an_idle_gpu_reports_every_process_at_zero(monkeypatch):
    idle = [replace(p, sm_pct=0) for p in (XORG, GNOME_SHELL, BROWSER_GPU)]
    FakeNvml([FakeCard(processes=idle)]).install(monkeypatch)  # NVML raises NotFound: no samples

    assert [(p.pid, p.sm_pct) for p in gpu_processes(PynvmlSource())] == [(1712, 0), (2290, 0), (3105, 0)]


def test_a_card_that_cannot_sample_processes_leaves_utilisation_unknown(monkeypatch):
    FakeNvml([FakeCard(processes=[XORG, GAME], process_sampling=False)]).install(monkeypatch)

    assert [(p.pid, p.used_mib, p.sm_pct) for p in gpu_processes(PynvmlSource())] == [
        (1712, 612, None),
        (4711, 4096, None),
    ]


def test_windows_wddm_lists_processes_without_memory(monkeypatch):
    FakeNvml([desktop_card(GAME)], wddm=True).install(monkeypatch)

    assert [(p.pid, p.used_mib, p.sm_pct) for p in gpu_processes(PynvmlSource())] == [
        (1712, None, 0),
        (2290, None, 2),
        (3105, None, 1),
        (4711, None, 90),
    ]


def test_a_driver_older_than_the_bindings_gives_no_processes_instead_of_raising(monkeypatch):
    missing = frozenset({"nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v3"})
    fake = FakeNvml([desktop_card(GAME)], missing_functions=missing).install(monkeypatch)

    assert gpu_processes(PynvmlSource()) == []
    assert fake.sessions == 0


def test_nvml_unusable_or_outside_a_session_fails_as_nvml_does(monkeypatch):
    fake = FakeNvml([desktop_card()], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED).install(monkeypatch)
    assert machine_of(fake).problems == ("NVIDIA driver not usable (Driver Not Loaded)",)
    assert sample_gpus(PynvmlSource()) == [] and gpu_processes(PynvmlSource()) == []

    fake.init_error = None
    source = PynvmlSource()
    with pytest.raises(NvmlError, match="Uninitialized"):
        source.query("name", 0)
    source.init()
    assert source.query("name", 0) == "NVIDIA GeForce RTX 4090"
    source.shutdown()
    with pytest.raises(NvmlError, match="Uninitialized"):
        source.query("name", 0)


def test_a_live_recording_replays_the_same_processes(monkeypatch):
    FakeNvml([desktop_card(GAME), FakeCard(processes=[CUDA_JOB])]).install(monkeypatch)
    recorder = RecordingSource(PynvmlSource())
    live = gpu_processes(recorder)
    replayed = gpu_processes(ReplaySource.from_json(recorder.to_json()))

    assert replayed == live
    busy = [(p.pid, p.gpu_index, p.sm_pct) for p in live if p.sm_pct]
    assert busy == [(2290, 0, 2), (3105, 0, 1), (4711, 0, 90), (5120, 1, 35)]
