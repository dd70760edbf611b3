"""The WSL2 launcher run directly on Linux (it is the program that runs inside the distribution),
and the host side's command lines and environment."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from worker.serve import wsl_engine
from worker.serve.wsl_engine import WslEngine

PYTHON = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable


def _launcher(home: Path, *args: str, stdout: int | None = subprocess.PIPE) -> subprocess.Popen[bytes]:
    env = {"HOME": str(home), "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
    return subprocess.Popen([PYTHON, "-c", wsl_engine.LAUNCHER_CODE, *args], stdout=stdout,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)


def _record(home: Path, name: str = "e0", timeout_s: float = 10.0) -> dict[str, int]:
    path = home / ".local/state/gpu-provider" / f"engine-{name}.pid"
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, "the launcher wrote no pid file"
        time.sleep(0.05)
    record: dict[str, int] = json.loads(path.read_text())
    return record


def _gone(pids: list[int], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(_alive(pid) for pid in pids):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _group(pgid: int) -> list[int]:
    members = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == pgid and _alive(process.pid):
                members.append(process.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return members


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Launchers a test starts; every one and its engine group is killed afterwards."""
    launched: list[subprocess.Popen[bytes]] = []
    yield launched
    for process in launched:
        for pid in _group(process.pid) + [process.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        process.wait(5)


ENGINE_SLEEPS = ["sh", "-c", "echo engine up; sleep 60 & sleep 60; wait"]


def test_run_keeps_arguments_as_data_and_records_the_engine(tmp_path: Path,
                                                            started: list[subprocess.Popen[bytes]]) -> None:
    planted = tmp_path / "pwned"
    argv = [PYTHON, "-c", "import json, sys; print(json.dumps(sys.argv[1:]))",
            f"$(touch {planted})", '{"a": [1, "b c"]}', "--flag=x y"]
    launcher = _launcher(tmp_path, "run", "e0", "5", "--", *argv)
    started.append(launcher)
    out, _ = launcher.communicate(timeout=20)
    assert launcher.returncode == 0
    assert json.loads(out.decode().splitlines()[0]) == argv[3:]
    assert not planted.exists()
    assert not (tmp_path / ".local/state/gpu-provider/engine-e0.pid").exists()  # gone with its engine
    assert (tmp_path / ".local/state/gpu-provider/config").stat().st_mode & 0o777 == 0o700


def test_the_engine_reads_its_configuration_from_the_launchers_folder(tmp_path: Path,
                                                                      started: list[subprocess.Popen[bytes]]) -> None:
    launcher = _launcher(tmp_path, "run", "e0", "5", "--", PYTHON, "-c",
                         "import os; print(os.environ['XDG_CONFIG_HOME'])")
    started.append(launcher)
    out, _ = launcher.communicate(timeout=20)
    assert out.decode().splitlines()[0] == str(tmp_path / ".local/state/gpu-provider/config")


def test_stop_ends_the_engines_whole_group_and_the_launcher(tmp_path: Path,
                                                            started: list[subprocess.Popen[bytes]]) -> None:
    launcher = _launcher(tmp_path, "run", "e0", "5", "--", *ENGINE_SLEEPS)
    started.append(launcher)
    record = _record(tmp_path)
    assert launcher.stdout is not None and launcher.stdout.readline() == b"engine up\n"
    engine = record["engine"]
    assert record["launcher"] == launcher.pid
    assert engine != launcher.pid and os.getpgid(engine) == engine  # a group of its own
    assert os.getsid(launcher.pid) == launcher.pid  # out of the caller's session
    members = _group(engine)
    assert len(members) >= 3  # sh and both sleeps
    stop = _launcher(tmp_path, "stop", "e0", "5")
    out, _ = stop.communicate(timeout=30)
    assert stop.returncode == 0, out
    assert _gone([*members, launcher.pid], 5)
    assert not (tmp_path / ".local/state/gpu-provider/engine-e0.pid").exists()
    assert b"engine e0 stopped" in out


def test_stop_kills_an_engine_that_ignores_sigterm_after_the_grace(tmp_path: Path,
                                                                   started: list[subprocess.Popen[bytes]]) -> None:
    stubborn = ["sh", "-c", "trap '' TERM; echo engine up; while :; do sleep 0.1; done"]
    launcher = _launcher(tmp_path, "run", "e0", "30", "--", *stubborn)
    started.append(launcher)
    record = _record(tmp_path)
    assert launcher.stdout is not None and launcher.stdout.readline() == b"engine up\n"
    began = time.monotonic()
    stop = _launcher(tmp_path, "stop", "e0", "0.5")
    stop.communicate(timeout=30)
    assert stop.returncode == 0
    assert _gone([record["engine"], launcher.pid], 5)
    assert time.monotonic() - began < 15  # the stop's grace, not the launcher's 30 s


def test_the_engine_group_dies_when_nobody_reads_the_launchers_output(tmp_path: Path,
                                                                      started: list[subprocess.Popen[bytes]]) -> None:
    """The `wsl.exe` relaying the launcher's output is gone (killed with the app): the engine follows."""
    launcher = _launcher(tmp_path, "run", "e0", "1", "--", *ENGINE_SLEEPS)
    started.append(launcher)
    record = _record(tmp_path)
    assert launcher.stdout is not None and launcher.stdout.readline() == b"engine up\n"
    members = _group(record["engine"])
    launcher.stdout.close()
    assert _gone([*members, launcher.pid], 10)


def test_stop_leaves_a_stranger_with_the_recorded_pid_alone(tmp_path: Path) -> None:
    stranger = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        state = tmp_path / ".local/state/gpu-provider"
        state.mkdir(parents=True)
        (state / "engine-e0.pid").write_text(json.dumps(
            {"engine": stranger.pid, "engine_start": 1, "launcher": stranger.pid, "launcher_start": 1}))
        stop = _launcher(tmp_path, "stop", "e0", "0.2")
        out, _ = stop.communicate(timeout=20)
        assert b"another program now" in out
        time.sleep(0.3)
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


def test_stop_with_no_engine_recorded_does_nothing(tmp_path: Path) -> None:
    stop = _launcher(tmp_path, "stop", "e0", "0.2")
    out, _ = stop.communicate(timeout=20)
    assert stop.returncode == 0 and b"no engine e0" in out


@pytest.mark.parametrize("args", [
    ["run", "../x", "1", "--", "true"], ["run", ".hidden", "1", "--", "true"], ["run", "e0", "1", "true"],
    ["stop", "a/b", "1"], ["nothing"], ["stop", "e0", "soon"], ["stop", "e0", "-1"], ["stop", "e" * 65, "1"],
    ["run", "e0", "nan", "--", "true"], ["stop", "", "1"],
])
def test_anything_off_the_usage_is_refused(tmp_path: Path, args: list[str]) -> None:
    launcher = _launcher(tmp_path, *args)
    out, _ = launcher.communicate(timeout=20)
    assert launcher.returncode == 2 and b"usage" in out
    assert not (tmp_path / ".local").exists()


def test_an_engine_that_cannot_start_says_so(tmp_path: Path) -> None:
    launcher = _launcher(tmp_path, "run", "e0", "1", "--", str(tmp_path / "no-such-engine"))
    out, _ = launcher.communicate(timeout=20)
    assert launcher.returncode == 127
    assert b"cannot start" in out and b"No such file" in out


def test_a_sigkill_nobody_sent_is_reported_with_the_memory_seen(tmp_path: Path) -> None:
    """What the Linux OOM killer's kill looks like from the launcher: SIGKILL, not sent by the app."""
    launcher = _launcher(tmp_path, "run", "e0", "1", "--", "sh", "-c", "sleep 0.7; kill -9 $$")
    out, _ = launcher.communicate(timeout=20)
    assert launcher.returncode == 128 + 9
    last = out.decode().splitlines()[-1]
    match = wsl_engine.OOM_LINE.search(last)
    assert match is not None, last
    total_mib = psutil.virtual_memory().total // 2**20
    assert abs(int(match["total"]) - total_mib) <= 1
    assert 0 < int(match["free"]) <= total_mib


@pytest.mark.parametrize(("line", "for_memory"), [
    (f"{wsl_engine.LAUNCHER_PREFIX} engine ended by signal 9 (SIGKILL, not stopped by the app); oom kills 1; "
     "lowest free memory 4000 of 8000 MiB", True),
    (f"{wsl_engine.LAUNCHER_PREFIX} engine ended by signal 9 (SIGKILL, not stopped by the app); oom kills 0; "
     "lowest free memory 300 of 8000 MiB", True),
    (f"{wsl_engine.LAUNCHER_PREFIX} engine ended by signal 9 (SIGKILL, not stopped by the app); oom kills 0; "
     "lowest free memory 3000 of 8000 MiB", False),
    (f"{wsl_engine.LAUNCHER_PREFIX} engine ended by signal 9 (SIGKILL, stopped by the app); oom kills 1; "
     "lowest free memory 300 of 8000 MiB", False),
    (f"{wsl_engine.LAUNCHER_PREFIX} engine ended by signal 6 (SIGABRT, not stopped by the app); oom kills 1; "
     "lowest free memory 300 of 8000 MiB", False),
])
def test_only_an_unsent_sigkill_near_the_memory_limit_is_put_on_memory(line: str, for_memory: bool) -> None:
    assert wsl_engine.killed_for_memory(line) is for_memory


def test_the_command_lines_run_the_launcher_with_no_shell() -> None:
    engine = WslEngine("Ubuntu", "e0")
    argv = engine.start_argv(["bin/server", "--alias", "$(touch x)"], 15)
    assert argv[:7] == ["wsl.exe", "-d", "Ubuntu", "--cd", "~", "-e", "python3"]
    assert argv[7:] == ["-c", wsl_engine.LAUNCHER_CODE, "run", "e0", "15", "--", "bin/server", "--alias", "$(touch x)"]
    assert engine.stop_argv(2.5)[6:] == ["python3", "-c", wsl_engine.LAUNCHER_CODE, "stop", "e0", "2.5"]
    assert set(wsl_engine.LAUNCHER_CODE) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789()'_+/=.")
    with pytest.raises(ValueError):
        WslEngine(None, "e0; rm -rf ~")


def test_the_environment_crosses_only_through_wslenv() -> None:
    env = wsl_engine.environment({"PATH": "C:\\Windows", "WSLENV": "USERPROFILE/p:LD_PRELOAD"},
                                 {"ENGINE_KEY": "secret", "CUDA_VISIBLE_DEVICES": "1"})
    assert env["WSLENV"] == "ENGINE_KEY/u:CUDA_VISIBLE_DEVICES/u"
    assert env["ENGINE_KEY"] == "secret" and env["PATH"] == "C:\\Windows"


def test_the_stop_command_carries_no_token_and_no_wslenv_of_the_users(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict[str, object]] = []

    def run(argv: list[str], **options: object) -> subprocess.CompletedProcess[str]:
        seen.append({"argv": argv, **options})
        return subprocess.CompletedProcess(argv, 0, "gpu-provider-launcher: engine e0 stopped\n", "")

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setenv("GPU_PROVIDER_TOKEN", "the-token")
    monkeypatch.setenv("WSLENV", "GPU_PROVIDER_TOKEN/u")
    assert WslEngine("Ubuntu", "e0").stop(2.0)
    [call] = seen
    env = call["env"]
    assert isinstance(env, dict) and "GPU_PROVIDER_TOKEN" not in env and env["WSLENV"] == ""
    assert call["argv"] == WslEngine("Ubuntu", "e0").stop_argv(2.0)
    assert call["timeout"] == wsl_engine.WSL_START_S + 2.0 + 2 * wsl_engine.LAUNCHER_GONE_S
    assert f"\nGONE_S = {wsl_engine.LAUNCHER_GONE_S!r}\n" in wsl_engine.LAUNCHER  # the bound the launcher keeps
