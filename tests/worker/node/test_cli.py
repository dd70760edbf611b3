from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.worker.hardware.recorded import replay
from worker import __version__
from worker.node import cli
from worker.contract import protocol

ROOT = Path(__file__).resolve().parents[3]
NVML = ROOT / "tests" / "fixtures" / "nvml"
ASSIGN = {
    "type": "assign", "assignment_id": "a-17",
    "model": {"name": "qwen3.8-27b",
              "vllm": {"source": "org/Qwen3.8-27B-W4A16", "weights_mib": 17800,
                       "base_args": ["--max-model-len", "32768", "--enforce-eager"],
                       "tiers": {"24000": ["--no-enforce-eager"], "40000": ["--no-enforce-eager", "--max-model-len", "65536"]}}},
}


def gpu_provider(*args: str, data_dir: Path) -> subprocess.CompletedProcess[str]:
    """The real command line, as a subprocess, with its data kept in a temporary folder."""
    return subprocess.run(
        [sys.executable, "-m", "worker", *args], capture_output=True, text=True, timeout=30, cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "HOME": str(data_dir), "XDG_RUNTIME_DIR": str(data_dir)},
    )


@pytest.mark.parametrize("where", ["before", "after"])
def test_detect_prints_the_hello_shapes_with_data_dir_either_side(tmp_path, where):
    args = ["--data-dir", str(tmp_path), "detect"] if where == "before" else ["detect", "--data-dir", str(tmp_path)]
    started = time.perf_counter()
    done = gpu_provider(*args, data_dir=tmp_path)
    elapsed = time.perf_counter() - started
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert protocol.PlatformInfo.model_validate(data["platform"]).runtime == "cpu"
    protocol.HardwareInfo.model_validate(data["hardware"])
    assert set(data["engines"]) == {"vllm", "sglang", "llamacpp"}
    assert elapsed < 5  # the process, interpreter start included; detect itself is timed in test_detect


def in_process(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """`cli.main` in this process, for the cases where a subprocess adds nothing but time."""
    status = cli.main(list(args))
    return status, capsys.readouterr().out


def test_data_dir_settings_are_used(tmp_path, capsys):
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "settings.json").write_text(json.dumps({"gpus_to_lend": [1]}))
    status, out = in_process(capsys, "detect", "--data-dir", str(tmp_path), "--reading", str(NVML / "rtx4090-rtx3060.json"))
    assert status == 0
    assert [g["gpu_indices"] for g in json.loads(out)["hardware"]["groups"]] == [[1]]


def test_detect_pretty_is_a_table(tmp_path, capsys):
    status, out = in_process(capsys, "--data-dir", str(tmp_path), "detect", "--pretty", "--reading", str(NVML / "rtx4090x2-no-p2p.json"))
    assert status == 0
    assert "NVIDIA GeForce RTX 4090" in out and "Effective VRAM  41,200 MiB" in out


def test_detect_with_engine_bin(tmp_path, capsys):
    server = tmp_path / "llama-server"
    server.write_text('#!/bin/sh\necho "version: 7001 (abc)" >&2\n')
    server.chmod(0o755)
    status, out = in_process(capsys, "--data-dir", str(tmp_path), "detect", "--engine-bin", f"llamacpp={server}")
    assert json.loads(out)["engines"]["llamacpp"] == "b7001"


@pytest.mark.parametrize("reading", ["/nonexistent.json", str(NVML.parent / "vllm" / "oom.log")])
def test_bad_reading_is_an_error(tmp_path, capsys, reading):
    status, out = in_process(capsys, "--data-dir", str(tmp_path), "detect", "--reading", reading)
    assert status == 2 and "reading file" in json.loads(out)["error"]


def test_bad_engine_bin_is_an_error(tmp_path, capsys):
    status, out = in_process(capsys, "--data-dir", str(tmp_path), "detect", "--engine-bin", "tgi=/x")
    assert status == 2 and "NAME=PATH" in json.loads(out)["error"]


def _write(path: Path, data: object) -> Path:
    path.write_text(json.dumps(data))
    return path


def test_plan_from_a_detect_output(tmp_path):
    hardware = gpu_provider("detect", "--reading", str(NVML / "rtx4090x2-no-p2p.json"), data_dir=tmp_path).stdout
    (tmp_path / "hw.json").write_text(hardware)
    done = gpu_provider("plan", "--hardware", str(tmp_path / "hw.json"), "--assignment",
                        str(_write(tmp_path / "a.json", ASSIGN)), data_dir=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(done.stdout)
    assert data["engine"] == "vllm"
    (engine,) = data["engines"]
    assert (engine["gpu_indices"], engine["layout"], engine["memory_mib"]) == ([0, 1], "tensor", 41200)
    assert engine["argv"][-6:] == ["--host", "127.0.0.1", "--port", "18100", "--served-model-name", "qwen3.8-27b"]
    assert "--api-key" not in engine["argv"]  # the key travels in the engine's environment
    assert "65536" in engine["argv"]


def test_plan_refusal_exits_2(tmp_path):
    _write(tmp_path / "hw.json", replay("m4-max-128gb.json").to_detect_json())
    done = gpu_provider("plan", "--data-dir", str(tmp_path), "--hardware", str(tmp_path / "hw.json"),
                        "--assignment", str(_write(tmp_path / "a.json", ASSIGN)), data_dir=tmp_path)
    assert done.returncode == 2
    assert "no llamacpp build" in json.loads(done.stdout)["error"]


@pytest.mark.parametrize(
    ("hardware", "assignment", "words"),
    [
        ("missing.json", "a.json", "cannot read the hardware file"),
        ("notjson.json", "a.json", "is not JSON"),
        ("hw.json", "badassign.json", "is not a valid assignment"),
        ("list.json", "a.json", "is not a valid hardware"),
    ],
)
def test_plan_bad_files_exit_2_with_a_clear_error(tmp_path, capsys, hardware, assignment, words):
    (tmp_path / "notjson.json").write_text("{nope")
    _write(tmp_path / "list.json", [1, 2])
    _write(tmp_path / "a.json", ASSIGN)
    _write(tmp_path / "badassign.json", {"type": "assign", "model": {"name": ""}})
    _write(tmp_path / "hw.json", replay("rtx4090.json").to_detect_json())
    status, out = in_process(capsys, "plan", "--data-dir", str(tmp_path), "--hardware", str(tmp_path / hardware),
                             "--assignment", str(tmp_path / assignment))
    assert status == 2
    assert words in json.loads(out)["error"]


def test_version_and_help(tmp_path):
    assert gpu_provider("--version", data_dir=tmp_path).stdout.strip() == f"gpu-provider {__version__}"
    help_text = gpu_provider("--help", data_dir=tmp_path).stdout
    assert "detect" in help_text and "plan" in help_text and "--data-dir" in help_text


@pytest.mark.parametrize("args", [[], ["--minimized"], ["run", "--coordinator", "local"]])
def test_the_core_asked_for_the_app_says_where_it_opens(tmp_path, capsys, args):
    assert cli.main([*args, "--data-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "pip install 'gpu-provider[gui]'" in err and "gpu-provider run --headless" in err


def test_python_m_worker_without_a_command_never_loads_the_gui(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", "import sys, runpy\n"
         "try:\n    runpy.run_module('worker', run_name='__main__')\n"
         "except SystemExit as exit:\n    print(exit.code, sorted(m for m in sys.modules"
         " if m.split('.')[0] in ('app', 'PySide6')))"],
        capture_output=True, text=True, timeout=30, cwd=ROOT, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert done.stdout.strip() == "1 []", done.stdout + done.stderr
    assert "desktop app" in done.stderr


@pytest.mark.parametrize(("argv", "desktop"), [
    ([], []),
    (["--data-dir", "/d", "--minimized"], ["--data-dir", "/d", "--minimized"]),
    (["run", "--coordinator", "local", "--data-dir", "/d", "--engine-bin", "vllm=/v"],
     ["--data-dir", "/d", "--coordinator", "local", "--engine-bin", "vllm=/v"]),
    (["--headless"], None),
    (["run", "--headless", "--coordinator", "local"], None),
    (["detect", "--pretty"], None),
    (["status"], None),
    (["--version"], None),
    (["--help"], None),
])
def test_desktop_arguments_tell_the_launcher_which_command_lines_are_the_apps(argv, desktop):
    assert cli.desktop_arguments(argv) == desktop


def test_help_lists_every_flag_the_desktop_app_takes(capsys: pytest.CaptureFixture[str]) -> None:
    """`gpu-provider --help` is where a person looks; it used to list no app flag, and
    `gpu-provider --coordinator local --help` failed."""
    with pytest.raises(SystemExit) as done:
        cli.main(["--coordinator", "local", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    app_flags = {"--coordinator", "--hardware", "--engine-bin", "--model", "--openai-port", "--verbose",
                 "--minimized", "--quit-after", "--data-dir"}
    assert {flag for flag in app_flags if flag in text} == app_flags


@pytest.mark.parametrize("minutes", ["0", "-5", "100000"])
def test_a_tuning_budget_the_contract_refuses_exits_2_before_anything_starts(tmp_path, capsys, minutes):
    code = cli.main(["run", "--headless", "--coordinator", "local", "--tune-minutes", minutes,
                 "--data-dir", str(tmp_path / "data")])
    assert code == 2
    assert "--tune-minutes" in capsys.readouterr().err
    assert not (tmp_path / "data").exists()  # refused before the data folder was made


def test_tune_minutes_hands_local_mode_its_tune_block(tmp_path, monkeypatch):
    from worker.node import headless

    given: dict[str, object] = {}
    monkeypatch.setattr(headless, "run_headless", lambda paths, settings, **kwargs: given.update(kwargs) or 0)
    assert cli.main(["run", "--headless", "--coordinator", "local", "--tune-minutes", "20",
                 "--data-dir", str(tmp_path / "data")]) == 0
    assert given["local_tune"] == {"enabled": True, "when": ["on_assign"], "budget": {"max_minutes": 20.0,
                                                                                       "max_trials": 12}}
    given.clear()
    assert cli.main(["run", "--headless", "--coordinator", "local", "--data-dir", str(tmp_path / "data")]) == 0
    assert given["local_tune"] is None
