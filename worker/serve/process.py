"""The process edge: start an engine so that it can never outlive the app, and stop it for good.

- The child gets an argument list (never a shell) and its own session, so one signal reaches the
  engine and every process it starts (vLLM runs several).
- Linux: the child asks the kernel for SIGKILL when its parent dies (PR_SET_PDEATHSIG). The
  kernel fires it when the *thread* that forked exits, so `spawn` must be called from a thread
  that lives as long as the app: the core's asyncio loop thread, which is where the supervisor
  runs. That covers the engine's own process only: vLLM's EngineCore and Worker processes are its
  children and would be re-parented to init, holding the card. So on Linux and macOS each engine
  also gets a guard: a tiny process forked from the app (before the engine starts) that holds the
  read end of a pipe whose write end only the app has. When the app dies, however it dies, the
  kernel closes that end; the guard reads EOF and SIGKILLs the engine's whole process group. A
  stop that saw the group gone tells the guard so first, and it leaves quietly.
  Windows: the child joins its own Job Object, which kills it when the app's handle closes; a
  stop ends the Job at once (a windowed app has no console for CTRL_BREAK to go through).
- Output (stdout and stderr, in order) goes through a reader thread to a per-run log file (the
  last few runs are kept) and to a callback, line by line, on the caller's loop.
- A pid file per engine lets the next start reap an engine a killed app left behind; it is killed
  only if its command line and start time are still the ones recorded, so a stranger that got the
  same pid is left alone.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import psutil

from worker.system import children
from worker.system.config import (
    narrow_existing,
    private_dir,
    private_opener,
    read_private_text,
    replace_file,
    write_private_text,
)

log = logging.getLogger(__name__)

LOG_RUNS_KEPT = 5
TAIL_LINES = 40
PR_SET_PDEATHSIG = 1

LineCallback = Callable[[str], None]
# True once none of these pids holds GPU memory (an NVML process list, read in a thread).
GpuReleased = Callable[[Collection[int]], bool]


@dataclass(frozen=True)
class StopTiming:
    grace_s: float = 15.0  # after SIGTERM, before SIGKILL
    gone_s: float = 10.0  # after SIGKILL, for the group to disappear
    gpu_release_s: float = 30.0  # for the driver to hand the memory back
    poll_s: float = 0.05


@dataclass(frozen=True)
class PidRecord:
    """What the pid file keeps: enough to recognise our engine, and no secret (the key is hashed)."""

    pid: int
    create_time: float | None
    program: str  # basename of argv[0]
    args_sha256: str  # of argv[1:], NUL-joined
    args_count: int

    @classmethod
    def of(cls, pid: int, argv: Sequence[str]) -> PidRecord:
        return cls(pid, _create_time(pid), os.path.basename(argv[0]), _args_digest(argv[1:]), len(argv) - 1)

    def matches(self, process: psutil.Process) -> bool:
        """Same start time and same command line (an interpreter may stand in front of argv[0])."""
        try:
            cmdline = process.cmdline()
            started = process.create_time()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return False
        if self.create_time is not None and abs(started - self.create_time) > 0.01:
            return False
        split = len(cmdline) - self.args_count
        if split < 1 or _args_digest(cmdline[split:]) != self.args_sha256:
            return False
        return any(os.path.basename(part) == self.program for part in cmdline[:split])


def _args_digest(args: Sequence[str]) -> str:
    return hashlib.sha256("\0".join(args).encode("utf-8", "surrogateescape")).hexdigest()


def _create_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


# --- pid files -------------------------------------------------------------------------------


def pid_file(run_dir: Path, name: str) -> Path:
    return run_dir / f"engine-{name}.pid.json"


def write_pid_file(path: Path, record: PidRecord) -> None:
    write_private_text(path, json.dumps(record.__dict__))


def read_pid_file(path: Path) -> PidRecord | None:
    try:
        data = json.loads(read_private_text(path))  # no link followed, no giant file read
        return PidRecord(int(data["pid"]), data.get("create_time"), str(data["program"]),
                         str(data["args_sha256"]), int(data["args_count"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring unreadable engine pid file %s (%s)", path, exc)
        return None


def reap_leftovers(run_dir: Path, timing: StopTiming = StopTiming()) -> list[int]:
    """Kill every engine a previous run of the app left behind; returns the pids killed.

    Blocking (it waits for them to go): call it in a thread at start, before any engine runs.
    """
    reaped = (reap_pid_file(path, timing) for path in sorted(run_dir.glob("engine-*.pid.json")))
    return [pid for pid in reaped if pid is not None]


def reap_pid_file(path: Path, timing: StopTiming = StopTiming()) -> int | None:
    """Kill the engine one pid file names if it is still ours; the file is removed either way.

    Returns the pid killed, or None (no file, process gone, or a stranger now has that pid).
    """
    record = read_pid_file(path)
    killed = record.pid if record is not None and _reap_one(record, timing) else None
    path.unlink(missing_ok=True)
    return killed


def _reap_one(record: PidRecord, timing: StopTiming) -> bool:
    try:
        process = psutil.Process(record.pid)
    except psutil.NoSuchProcess:
        return False
    if not record.matches(process):
        log.info("pid %d from an old engine pid file is another program now; leaving it alone", record.pid)
        return False
    log.warning("stopping engine pid %d left behind by a previous run", record.pid)
    group = _group_of(record.pid)
    _signal_group(record.pid, group, signal.SIGTERM)
    if not _wait_gone(record.pid, group, timing.grace_s, timing.poll_s):
        _signal_group(record.pid, group, signal.SIGKILL)
        _wait_gone(record.pid, group, timing.gone_s, timing.poll_s)
    return True


# --- process groups --------------------------------------------------------------------------


def _group_of(pid: int) -> int | None:
    """The process group to signal: the engine's own, never the app's."""
    if os.name == "nt":
        return None
    try:
        group = os.getpgid(pid)
    except ProcessLookupError:
        return None
    return group if group != os.getpgid(0) else None


def _signal_group(pid: int, group: int | None, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if group is not None:
            os.killpg(group, sig)
        else:
            os.kill(pid, sig)


def _alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def group_members(pid: int, group: int | None) -> list[int]:
    """Live (non-zombie) pids of the engine: its process group, or the pid alone without one."""
    if group is None:
        with contextlib.suppress(psutil.Error):
            return [pid] if _alive(psutil.Process(pid)) else []
        return []
    members = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(process.pid) == group and _alive(process):
                members.append(process.pid)
    return members


def _wait_gone(pid: int, group: int | None, timeout_s: float, poll_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while group_members(pid, group):
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


# --- die with the app --------------------------------------------------------------------------


def _die_with_parent(parent_pid: int) -> Callable[[], None]:
    """preexec step (Linux): SIGKILL when the forking thread dies; exit if the app is already gone."""
    libc = ctypes.CDLL(None, use_errno=True)

    def preexec() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:
            os._exit(1)

    return preexec


class _Guard:
    """The app's end of one engine's guard (see the module doc): `arm` names the engine's process
    group, `release` ends the guard without a kill (the group is gone), `close` with one."""

    def __init__(self) -> None:
        read_fd, self._fd = os.pipe()
        with warnings.catch_warnings():  # 3.12+ warns of fork with threads; the guard calls no lock-taking code
            warnings.simplefilter("ignore", DeprecationWarning)
            first = os.fork()
        if first == 0:  # a middle child, so the guard is re-parented to init and nobody has to reap it
            try:
                if os.fork() == 0:
                    _watch(read_fd)
            finally:
                os._exit(0)
        os.close(read_fd)
        os.waitpid(first, 0)

    def arm(self, group: int) -> None:
        try:
            os.write(self._fd, f"{group}\n".encode())
        except OSError as exc:  # the guard is gone: the engine still runs, with die-with-parent only
            log.warning("engine group %d runs without its guard (%s)", group, exc)

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._fd, _GUARD_STAND_DOWN)
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


_GUARD_STAND_DOWN = b"x"


def _watch(read_fd: int) -> NoReturn:
    """The guard: its own session (no terminal signal or app signal handler reaches it), nothing
    of the app's held open but the pipe; on EOF, SIGKILL to the group named unless told to stand down."""
    try:
        os.setsid()
        with contextlib.suppress(ValueError, OSError):  # an app without handlers: nothing to undo
            signal.set_wakeup_fd(-1)
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_DFL)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.closerange(3, read_fd)
        os.closerange(read_fd + 1, 1 << 20)
        said = b""
        while chunk := os.read(read_fd, 64):
            said += chunk[: 64 - len(said)]
        group, _, rest = said.partition(b"\n")
        if group.isdigit() and rest != _GUARD_STAND_DOWN:
            with contextlib.suppress(OSError):
                os.killpg(int(group), signal.SIGKILL)
    finally:
        os._exit(0)


class _WindowsJob:
    """One engine's Job Object, with kill-on-close: when the app exits, however it exits, Windows
    closes the handle and kills every process in the job. `terminate` is the forced stop.

    The child runs for a moment before it is assigned; a process it starts in that moment escapes
    the job (engines start their workers much later, once the model is being loaded)."""

    KILL_ON_JOB_CLOSE = 0x2000
    EXTENDED_LIMIT_INFORMATION = 9

    def __init__(self) -> None:
        from ctypes import wintypes

        class _Basic(ctypes.Structure):
            _fields_ = [("PerProcessUserTimeLimit", ctypes.c_int64), ("PerJobUserTimeLimit", ctypes.c_int64),
                        ("LimitFlags", wintypes.DWORD), ("MinimumWorkingSetSize", ctypes.c_size_t),
                        ("MaximumWorkingSetSize", ctypes.c_size_t), ("ActiveProcessLimit", wintypes.DWORD),
                        ("Affinity", ctypes.c_size_t), ("PriorityClass", wintypes.DWORD),
                        ("SchedulingClass", wintypes.DWORD)]

        class _Extended(ctypes.Structure):
            _fields_ = [("BasicLimitInformation", _Basic), ("IoInfo", ctypes.c_uint64 * 6),
                        ("ProcessMemoryLimit", ctypes.c_size_t), ("JobMemoryLimit", ctypes.c_size_t),
                        ("PeakProcessMemoryUsed", ctypes.c_size_t), ("PeakJobMemoryUsed", ctypes.c_size_t)]

        kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)  # type: ignore[attr-defined]
        kernel32.CreateJobObjectW.argtypes = [ctypes.c_void_p, wintypes.LPCWSTR]
        kernel32.CreateJobObjectW.restype = wintypes.HANDLE
        kernel32.SetInformationJobObject.argtypes = [wintypes.HANDLE, ctypes.c_int, ctypes.c_void_p, wintypes.DWORD]
        kernel32.AssignProcessToJobObject.argtypes = [wintypes.HANDLE, wintypes.HANDLE]
        kernel32.TerminateJobObject.argtypes = [wintypes.HANDLE, wintypes.UINT]
        self._kernel32 = kernel32
        self._handle = kernel32.CreateJobObjectW(None, None)
        if not self._handle:
            raise ctypes.WinError(ctypes.get_last_error())  # type: ignore[attr-defined]
        info = _Extended()
        info.BasicLimitInformation.LimitFlags = self.KILL_ON_JOB_CLOSE
        if not kernel32.SetInformationJobObject(self._handle, self.EXTENDED_LIMIT_INFORMATION, ctypes.byref(info),
                                                ctypes.sizeof(info)):
            raise ctypes.WinError(ctypes.get_last_error())  # type: ignore[attr-defined]

    def add(self, process: subprocess.Popen[bytes]) -> None:
        if not self._kernel32.AssignProcessToJobObject(self._handle, int(process._handle)):  # type: ignore[attr-defined]
            raise ctypes.WinError(ctypes.get_last_error())  # type: ignore[attr-defined]

    def terminate(self) -> None:
        self._kernel32.TerminateJobObject(self._handle, 1)


# --- logs --------------------------------------------------------------------------------------


def rotate_logs(log_dir: Path, name: str, keep: int = LOG_RUNS_KEPT) -> Path:
    """`engine-NAME.log` for this run; earlier runs move to `.1.log` … `.{keep-1}.log`."""
    private_dir(log_dir)
    current = log_dir / f"engine-{name}.log"
    older = [log_dir / f"engine-{name}.{n}.log" for n in range(1, keep)]
    if older:
        older[-1].unlink(missing_ok=True)
        for newer, elder in zip(reversed([current, *older[:-1]]), reversed(older), strict=False):
            if newer.exists():
                replace_file(newer, elder)
                narrow_existing(elder)  # a run logged by an older, less careful version; never through a link
    else:
        current.unlink(missing_ok=True)
    return current


# --- the child ---------------------------------------------------------------------------------


class EngineProcess:
    """One running engine: its pid, its log, the tail of its output, and how it ended."""

    def __init__(self, popen: subprocess.Popen[bytes], log_path: Path, pid_path: Path | None,
                 loop: asyncio.AbstractEventLoop, on_line: LineCallback | None, job: _WindowsJob | None = None,
                 guard: _Guard | None = None):
        self._popen = popen
        self._job = job
        self._guard = guard
        self.pid = popen.pid
        self.log_path = log_path
        self._pid_path = pid_path
        self._loop = loop
        self._on_line = on_line
        self._group = popen.pid if os.name != "nt" else None
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._exited: asyncio.Future[int] = loop.create_future()
        self._output_done: asyncio.Future[None] = loop.create_future()
        threading.Thread(target=self._pump, name=f"engine-{self.pid}-output", daemon=True).start()
        threading.Thread(target=self._wait, name=f"engine-{self.pid}-wait", daemon=True).start()

    @property
    def returncode(self) -> int | None:
        return self._exited.result() if self._exited.done() else None

    async def wait(self) -> int:
        """The exit status, once the process has exited."""
        return await asyncio.shield(self._exited)

    async def output_closed(self) -> None:
        """Every line the engine wrote has been delivered (its pipes are closed)."""
        await asyncio.shield(self._output_done)

    def _pump(self) -> None:
        assert self._popen.stdout is not None
        with open(self.log_path, "ab", buffering=0, opener=private_opener) as out:
            for raw in self._popen.stdout:
                out.write(raw)
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                self._deliver(line)
        self._settle(self._output_done, None)

    def _deliver(self, line: str) -> None:
        def on_loop() -> None:
            self.tail.append(line)
            if self._on_line is not None:
                self._on_line(line)

        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is listening any more
            self._loop.call_soon_threadsafe(on_loop)

    def _wait(self) -> None:
        self._settle(self._exited, self._popen.wait())

    def _settle(self, future: asyncio.Future, value: object) -> None:  # type: ignore[type-arg]
        def on_loop() -> None:
            if not future.done():
                future.set_result(value)

        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(on_loop)

    def members(self) -> list[int]:
        """Live pids of the engine's process group (the engine and what it started)."""
        return group_members(self.pid, self._group)

    async def stop(self, timing: StopTiming = StopTiming(), gpu_released: GpuReleased | None = None) -> int | None:
        """SIGTERM to the group, then SIGKILL after the grace time (Windows: the Job ended at once);
        returns once the group is gone (and, given `gpu_released`, once the GPU memory is free or
        `gpu_release_s` has passed)."""
        pids = set(await asyncio.to_thread(self.members)) | {self.pid}
        if os.name == "nt":
            await self._stop_windows(timing)
        else:
            _signal_group(self.pid, self._group, signal.SIGTERM)
            gone = await self._group_gone(timing.grace_s, timing.poll_s)
            if not gone:
                log.warning("engine pid %d ignored SIGTERM for %.0f s; killing it", self.pid, timing.grace_s)
                _signal_group(self.pid, self._group, signal.SIGKILL)
                gone = await self._group_gone(timing.gone_s, timing.poll_s)
                if not gone:
                    log.error("engine pid %d is still there after SIGKILL", self.pid)
            if self._guard is not None and gone:
                self._guard.release()
            elif self._guard is not None:
                self._guard.close()  # not gone: the guard sends its SIGKILL too
        if gpu_released is not None:
            await _wait_for(lambda: gpu_released(pids), timing.gpu_release_s, timing.poll_s)
        self._forget()
        return self.returncode

    async def _group_gone(self, timeout_s: float, poll_s: float) -> bool:
        def gone() -> bool:
            return self._popen.returncode is not None and not self.members()

        return await _wait_for(gone, timeout_s, poll_s)

    async def _stop_windows(self, timing: StopTiming) -> None:
        """The Job ends at once, with every process in it: CTRL_BREAK reaches only processes that
        share the caller's console, and the windowed app has none, so a polite signal would only
        wait out `grace_s` while a game needs the card. The caller drained the requests already."""
        if self._job is not None:
            self._job.terminate()
        with contextlib.suppress(OSError):  # gone already with the job
            self._popen.kill()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.wait(), timing.gone_s)

    def _forget(self) -> None:
        """The engine is gone: its pid file no longer names anything to reap."""
        if self._pid_path is not None:
            self._pid_path.unlink(missing_ok=True)


async def _wait_for(check: Callable[[], bool], timeout_s: float, poll_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(check):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(poll_s)
    return True


def spawn(argv: Sequence[str], *, env: Mapping[str, str], log_path: Path, pid_path: Path | None = None,
          on_line: LineCallback | None = None) -> EngineProcess:
    """Start `argv` as an engine child; call it on the core's loop thread (see the module doc).

    Raises OSError when the program cannot be started (missing, not executable).
    """
    loop = asyncio.get_running_loop()
    private_dir(log_path.parent)
    windows = os.name == "nt"
    linux = sys.platform.startswith("linux")
    guard = None if windows else _Guard()  # before the engine: no moment where it runs unguarded
    try:
        popen = children.popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=dict(env),
            start_new_session=not windows, preexec_fn=_die_with_parent(os.getpid()) if linux else None,
            flags=children.CREATE_NEW_PROCESS_GROUP if windows else 0,
        )
    except BaseException:
        if guard is not None:
            guard.release()
        raise
    if guard is not None:
        guard.arm(popen.pid)  # its own session: the group id is its pid
    job = _WindowsJob() if windows else None
    if job is not None:
        job.add(popen)
    if pid_path is not None:
        write_pid_file(pid_path, PidRecord.of(popen.pid, argv))
    return EngineProcess(popen, log_path, pid_path, loop, on_line, job, guard)

