from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.worker.hardware.recorded import NO_ENGINE_FINDER, NVML_FIXTURES
from worker.system.config import Settings
from worker.hardware import (
    GpuProcess,
    NvmlError,
    PynvmlSource,
    RecordingSource,
    ReplaySource,
    detect,
    gpu_processes,
    load_reading,
    sample_gpus,
)
from worker.hardware.nvml import find_wsl_nvml_library
from worker.hardware.replay import reading_to_json


def test_samples_carry_live_telemetry():
    _, nvml = load_reading(NVML_FIXTURES / "rtx4090x2-no-p2p.json")
    samples = sample_gpus(nvml)
    assert [(s.index, s.util_pct, s.memory_used_mib, s.power_w, s.temperature_c) for s in samples] == [
        (0, 0, 584, 19.82, 36),
        (1, 1, 1106, 23.114, 41),
    ]
    assert samples[0].energy_mj == 412998210


def test_samples_leave_out_what_a_card_does_not_report():
    _, nvml = load_reading(NVML_FIXTURES / "wsl2-rtx4090.json")
    (sample,) = sample_gpus(nvml)
    assert sample.energy_mj is None and sample.power_w == 28.455


def test_gpu_processes_list_graphics_and_compute():
    _, nvml = load_reading(NVML_FIXTURES / "rtx4090.json")
    assert gpu_processes(nvml) == [
        GpuProcess(pid=1712, gpu_index=0, used_mib=412, kind="graphics"),
        GpuProcess(pid=2290, gpu_index=0, used_mib=98, kind="graphics"),
    ]


@pytest.mark.parametrize("reader", [sample_gpus, gpu_processes])
def test_telemetry_is_empty_without_nvml(reader):
    assert reader(ReplaySource({}, init_error="NVML Shared Library Not Found")) == []


def test_replay_serves_recorded_errors_and_unrecorded_queries_as_not_supported():
    source = ReplaySource({"name:0": "NVIDIA H200", "power_mw:0": {"error": "Unknown Error"}})
    assert source.query("name", 0) == "NVIDIA H200"
    with pytest.raises(NvmlError, match="Unknown Error"):
        source.query("power_mw", 0)
    with pytest.raises(NvmlError, match="Not Supported"):
        source.query("temperature_c", 0)


def test_a_recording_replays_to_the_same_machine(tmp_path):
    host, original = load_reading(NVML_FIXTURES / "rtx4090-rtx3060.json")
    recorder = RecordingSource(original)
    first = detect(Settings(), NO_ENGINE_FINDER, host=host, nvml=recorder)
    sample_gpus(recorder)
    gpu_processes(recorder)
    path = tmp_path / "reading.json"
    path.write_text(json.dumps(reading_to_json(host, recorder)))

    host_again, replayed = load_reading(path)
    second = detect(Settings(), NO_ENGINE_FINDER, host=host_again, nvml=replayed)
    assert second == first
    assert sample_gpus(replayed) == sample_gpus(load_reading(NVML_FIXTURES / "rtx4090-rtx3060.json")[1])
    assert recorder.calls["power_mw:1"] == {"error": "Unknown Error"}


def test_real_pynvml_without_a_driver_fails_cleanly():
    source = PynvmlSource(library=None)
    with pytest.raises(NvmlError):
        source.init()
    with pytest.raises(NvmlError, match="not loadable|Not Found|cannot open"):
        PynvmlSource(library="/nonexistent/libnvidia-ml.so.1").init()


def test_wsl_library_is_found_where_wsl_puts_it(tmp_path):
    driver = tmp_path / "drivers" / "nv_dispi.inf_amd64_1234"
    driver.mkdir(parents=True)
    library = driver / "libnvidia-ml.so.1"
    library.write_bytes(b"")
    patterns = (str(tmp_path / "lib" / "libnvidia-ml.so.1"), str(tmp_path / "drivers" / "*" / "libnvidia-ml.so.1"))
    assert find_wsl_nvml_library(patterns) == str(library)
    assert find_wsl_nvml_library((str(tmp_path / "none"),)) is None


def test_recorder_runs_as_a_module_on_this_machine():
    done = subprocess.run(
        [sys.executable, "-m", "worker.hardware.record"], capture_output=True, text=True, timeout=30, check=True
    )
    reading = json.loads(done.stdout)
    assert reading["host"]["ram_mib"] > 0
    assert set(reading["nvml"]) == {"init_error", "calls"}
