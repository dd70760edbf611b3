"""The process edge on real (small) child processes: groups, logs, pid files, graceful-then-forced stop."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from worker.serve import process as procs
from worker.system.config import DataFolderUnsafe

QUICK = procs.StopTiming(grace_s=0.3, gone_s=3.0, gpu_release_s=2.0, poll_s=0.02)


def test_logs_rotate_keeping_the_last_runs(tmp_path: Path) -> None:
    for run in range(7):
        procs.rotate_logs(tmp_path, "e0", keep=3).write_text(f"run {run}")
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["engine-e0.1.log", "engine-e0.2.log", "engine-e0.log"]
    assert [(tmp_path / name).read_text() for name in ("engine-e0.log", "engine-e0.1.log", "engine-e0.2.log")] == [
        "run 6", "run 5", "run 4"]


def test_pid_file_round_trip_keeps_no_argument_in_clear(tmp_path: Path) -> None:
    path = procs.pid_file(tmp_path, "e0")
    record = procs.PidRecord(4242, 1.5, "vllm", "ab" * 32, 7)
    procs.write_pid_file(path, record)
    assert procs.read_pid_file(path) == record
    path.write_text("{not json")
    assert procs.read_pid_file(path) is None
    assert procs.read_pid_file(tmp_path / "missing.json") is None


def test_a_link_planted_among_the_engine_logs_is_never_chmodded_through(tmp_path: Path) -> None:
    """Rotation moves a planted link aside and refuses it; what it points at keeps its mode."""
    target = tmp_path / "elsewhere"
    target.write_text("not a log")
    target.chmod(0o644)
    logs = tmp_path / "logs"
    logs.mkdir(mode=0o700)
    (logs / "engine-e0.log").symlink_to(target)
    with pytest.raises(DataFolderUnsafe):
        procs.rotate_logs(logs, "e0", keep=3)
    assert target.stat().st_mode & 0o777 == 0o644 and target.read_text() == "not a log"


def test_a_pid_file_that_is_a_link_is_not_read(tmp_path: Path) -> None:
    """A planted pid file pointing at another record would name a process to kill: ignored."""
    elsewhere = tmp_path / "elsewhere.json"
    procs.write_pid_file(elsewhere, procs.PidRecord(4242, 1.5, "vllm", "ab" * 32, 7))
    path = procs.pid_file(tmp_path, "e0")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(elsewhere)
    assert procs.read_pid_file(path) is None


def test_record_recognises_a_script_run_through_its_interpreter(tmp_path: Path) -> None:
    script = tmp_path / "engine"
    script.write_text("#!/bin/sh\nsleep 30\n")
    script.chmod(0o755)
    argv = [str(script), "serve", "--api-key", "secret"]
    child = subprocess.Popen(argv, start_new_session=True)
    try:
        time.sleep(0.2)
        process = psutil.Process(child.pid)
        assert process.cmdline()[0] != str(script)  # /bin/sh stands in front
        record = procs.PidRecord.of(child.pid, argv)
        assert record.matches(process)
        assert "secret" not in str(record)
        other_args = procs.PidRecord.of(child.pid, [str(script), "serve", "--api-key", "other"])
        assert not other_args.matches(process)
        restarted = procs.PidRecord(child.pid, record.create_time - 5, record.program, record.args_sha256,
                                    record.args_count)
        assert not restarted.matches(process)
    finally:
        child.kill()
        child.wait()


async def test_spawn_logs_lines_and_stop_ends_the_whole_group(tmp_path: Path) -> None:
    lines: list[str] = []
    pid_path = procs.pid_file(tmp_path, "e0")
    argv = ["/bin/sh", "-c", "echo first; echo second >&2; sleep 30 & wait"]
    engine = procs.spawn(argv, env=dict(os.environ), log_path=tmp_path / "e0.log", pid_path=pid_path,
                         on_line=lines.append)
    await _until(lambda: len(lines) == 2 and len(engine.members()) == 2)
    assert os.getpgid(engine.pid) == engine.pid != os.getpgid(0)
    assert procs.read_pid_file(pid_path).pid == engine.pid
    members = engine.members()
    status = await engine.stop(QUICK)
    assert status == -signal.SIGTERM
    assert lines == ["first", "second"] and list(engine.tail) == lines
    assert (tmp_path / "e0.log").read_text() == "first\nsecond\n"
    assert not any(_alive(pid) for pid in members)
    assert not pid_path.exists()


async def test_stop_forces_a_group_that_ignores_sigterm(tmp_path: Path) -> None:
    argv = ["/bin/sh", "-c", "trap '' TERM INT; echo up; sleep 30 & wait"]
    lines: list[str] = []
    engine = procs.spawn(argv, env=dict(os.environ), log_path=tmp_path / "e0.log", on_line=lines.append)
    await _until(lambda: lines == ["up"] and len(engine.members()) == 2)
    members = engine.members()
    began = time.monotonic()
    status = await engine.stop(QUICK)
    assert status == -signal.SIGKILL and time.monotonic() - began >= QUICK.grace_s
    assert not any(_alive(pid) for pid in members)


async def test_stop_waits_for_the_gpu_memory_to_be_released(tmp_path: Path) -> None:
    asked: list[set[int]] = []

    def released(pids) -> bool:
        asked.append(set(pids))
        return len(asked) >= 3

    engine = procs.spawn(["sleep", "30"], env=dict(os.environ), log_path=tmp_path / "e0.log")
    await engine.stop(QUICK, gpu_released=released)
    assert len(asked) == 3 and all(engine.pid in pids for pids in asked)


async def test_spawn_reports_a_missing_program(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        procs.spawn([str(tmp_path / "nothing-here")], env={}, log_path=tmp_path / "e0.log")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def _until(check, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def sleeping_group() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "60"], start_new_session=True)


def killed_within(process: subprocess.Popen[bytes], seconds: float) -> bool:
    try:
        process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return False
    return process.returncode == -signal.SIGKILL


def test_the_guard_kills_the_group_when_its_pipe_closes_unless_told_to_stand_down() -> None:
    """Closing is what the kernel does for a dead app; a stop that saw the group gone stands it down first."""
    armed, released = sleeping_group(), sleeping_group()
    try:
        guard = procs._Guard()
        guard.arm(armed.pid)
        guard.close()
        assert killed_within(armed, 5)
        guard = procs._Guard()
        guard.arm(released.pid)
        guard.release()
        assert not killed_within(released, 1)  # a group id is never killed once its engine's stop saw it gone
    finally:
        for process in (armed, released):
            process.kill()
            process.wait()


# --- Windows: the stop from a windowed app ------------------------------------------------------


class Kernel32Function:
    """One kernel32 function as ctypes hands it out: argtypes and restype to set, then calls."""

    def __init__(self, name: str, calls: list[tuple[object, ...]], result: Callable[..., int]) -> None:
        self.name, self._calls, self._result = name, calls, result
        self.argtypes: list[type] | None = None
        self.restype: type | None = None

    def __call__(self, *args: object) -> int:
        self._calls.append((self.name, *args))
        return self._result(*args)


class FakeKernel32:
    """kernel32's Job Object functions: a job holds the processes assigned to it, and ending it
    ends them (here: real Linux children, by SIGKILL)."""

    JOB = 0x1F4

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []
        self.assigned: dict[int, subprocess.Popen[bytes]] = {}
        self.CreateJobObjectW = Kernel32Function("CreateJobObjectW", self.calls, lambda *a: self.JOB)
        self.SetInformationJobObject = Kernel32Function("SetInformationJobObject", self.calls, lambda *a: 1)
        self.AssignProcessToJobObject = Kernel32Function("AssignProcessToJobObject", self.calls, self._assign)
        self.TerminateJobObject = Kernel32Function("TerminateJobObject", self.calls, self._terminate)
        self.children: dict[int, subprocess.Popen[bytes]] = {}

    def _assign(self, job: int, handle: int) -> int:
        self.assigned[handle] = self.children[handle]
        return 1

    def _terminate(self, job: int, code: int) -> int:
        for process in self.assigned.values():
            process.kill()
        return 1


class WindowlessChild:
    """A child of a windowed app as `subprocess.Popen` shows it on Windows: a process handle, and
    `send_signal(CTRL_BREAK_EVENT)` failing because there is no console to send it through."""

    def __init__(self, process: subprocess.Popen[bytes], kernel32: FakeKernel32) -> None:
        self._process = process
        self.pid, self.stdout, self._handle = process.pid, process.stdout, 1000 + process.pid
        self.signals: list[int] = []
        kernel32.children[self._handle] = process

    @property
    def returncode(self) -> int | None:
        return self._process.returncode

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)
        raise OSError(22, "GenerateConsoleCtrlEvent: the parameter is incorrect")

    def wait(self) -> int:
        return self._process.wait()

    def kill(self) -> None:
        self._process.kill()


async def test_a_windows_stop_ends_the_job_at_once_and_never_waits_the_grace(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kernel32 = FakeKernel32()
    monkeypatch.setattr(ctypes, "WinDLL", lambda name, use_last_error=False: kernel32, raising=False)
    process = subprocess.Popen(["sleep", "60"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    child = WindowlessChild(process, kernel32)
    patient = procs.StopTiming(grace_s=60.0, gone_s=5.0, poll_s=0.02)
    try:
        with monkeypatch.context() as windows:  # undone before pytest reports: its own paths need the real os.name
            windows.setattr(os, "name", "nt")
            windows.setattr(signal, "CTRL_BREAK_EVENT", 1, raising=False)
            job = procs._WindowsJob()
            job.add(child)  # type: ignore[arg-type]
            engine = procs.EngineProcess(child, tmp_path / "e0.log", None, asyncio.get_running_loop(),  # type: ignore[arg-type]
                                         None, job=job)
            began = time.monotonic()
            async with asyncio.timeout(patient.gone_s * 2):
                status = await engine.stop(patient)
            took = time.monotonic() - began
    finally:
        process.kill()
        process.wait()
    assert status == -signal.SIGKILL and took < patient.gone_s
    assert ("TerminateJobObject", FakeKernel32.JOB, 1) in kernel32.calls and child.signals == []
    from ctypes import wintypes
    assert kernel32.TerminateJobObject.argtypes == [wintypes.HANDLE, wintypes.UINT]
    assert kernel32.AssignProcessToJobObject.argtypes == [wintypes.HANDLE, wintypes.HANDLE]


# --- macOS: dying with the app without PR_SET_PDEATHSIG ---------------------------------------------

MAC_APP = textwrap.dedent("""
    import asyncio, os, sys, threading
    from pathlib import Path
    from worker.serve import process as procs

    # The engine says whether the kernel would kill it with its parent (PR_GET_PDEATHSIG), then
    # starts a child of its own in its process group, as vLLM starts EngineCore and a Worker.
    ENGINE = ("import ctypes, subprocess, sys, time; "
              "signal = ctypes.c_int(-1); ctypes.CDLL(None).prctl(2, ctypes.byref(signal), 0, 0, 0); "
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
              "print(child.pid, signal.value, flush=True); time.sleep(300)")

    async def main(log):
        real, sys.platform = sys.platform, "darwin"  # as spawn reads it on a Mac: no prctl there
        try:
            engine = procs.spawn([sys.executable, "-c", ENGINE], env=dict(os.environ), log_path=Path(log))
        finally:
            sys.platform = real
        while not engine.tail:
            await asyncio.sleep(0.02)
        print(engine.pid, engine.tail[0], flush=True)
        await asyncio.sleep(3600)

    core = threading.Thread(target=asyncio.run, args=(main(sys.argv[1]),))
    core.start()
    core.join()
""")


def test_on_a_mac_the_guard_alone_ends_the_engine_and_its_children_when_the_app_is_killed(tmp_path: Path) -> None:
    app = subprocess.Popen([sys.executable, "-c", MAC_APP, str(tmp_path / "engine.log")],
                           cwd=Path(__file__).resolve().parents[3], stdout=subprocess.PIPE, text=True)
    left: list[int] = []
    try:
        assert app.stdout is not None
        engine, child, death_signal = map(int, app.stdout.readline().split())
        left = [engine, child]
        assert death_signal == 0  # no die-with-parent: the pipe guard is all there is, as on macOS
        assert os.getpgid(child) == os.getpgid(engine) != os.getpgid(app.pid)
        app.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in (engine, child)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in (engine, child)), "left behind after the app was killed"
    finally:
        app.kill()
        app.wait()
        for pid in left:  # only where the test failed: not to leave them to the next test
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
