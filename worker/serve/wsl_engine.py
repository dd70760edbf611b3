"""An engine process inside WSL2: how it starts, how its environment crosses, how it is stopped.

From Windows an engine in a WSL2 distribution is a `wsl.exe` child of the app, and `wsl.exe` is no
handle on the Linux processes: killing it leaves them running (microsoft/WSL#2496), and the host
pid file names only `wsl.exe`. So the engine runs under a small launcher (`LAUNCHER`, stdlib only,
any python3 of a distribution) started as
`wsl.exe -d D --cd ~ -e python3 -c CODE run NAME GRACE -- ENGINE ARGV…`, which inside the distribution:

- leaves `wsl.exe`'s session (`setsid`) and starts the engine in a process group of its own,
  with its user configuration looked up in a folder the launcher owns;
- writes `~/.local/state/gpu-provider/engine-NAME.pid` (the engine's and its own pid, each with
  its start time from `/proc`, so a later stop never signals a stranger that got the same pid);
- relays the engine's output to its own, and kills the engine's whole group when its `wsl.exe`
  is gone. The sign chosen is its *output* losing its reader (the write end of a pipe or socket
  reports POLLERR/POLLHUP once the far end closes; a write fails with EPIPE), or its parent
  changing: `serve.process.spawn` gives every engine stdin from the null device, so a stdin pipe
  the app holds would need the process edge to change for this one kind of engine, while the
  output is a pipe the app holds already, the one `wsl.exe` relays. The app's own guard (or Job
  Object) ends `wsl.exe` when the app dies, so the engine follows however the app ends;
- on the engine's exit, kills what is left of its group, and says in one line how the engine
  ended when a signal ended it, with whether the kernel's OOM killer struck and the lowest free
  memory it saw: an engine the distribution's memory limit killed looks like any SIGKILL from
  outside (`killed_for_memory` tells the two apart).

`stop NAME GRACE` ends the group a pid file names (TERM, KILL after `GRACE` seconds, until none is
left) and the launcher with it; the supervisor runs it after the drain, and once before the first
start to reap an engine a previous run of the app left inside (the same name: engines are `e0`,
`e1`…). The program crosses as `exec` of its zlib+base64 text: no quote, space or backslash in
the argument, so no Windows command-line quoting can change it.

The environment (the run's key, the cards to use, the engine's settings) crosses only through
`WSLENV` (`environment`), never argv. The engine listens on 127.0.0.1 and a port: WSL forwards
it to Windows' localhost (a Unix socket inside the VM is not reachable from Windows).

The VM stays up while the engine serves: WSL's `instanceIdleTimeout` counts only once every
process of the instance has exited, and the engine's `wsl.exe` stays attached from start to stop;
the app never runs `wsl --terminate` or `--shutdown`, so nothing of its own ends the VM under an
engine. Between a stop and the next start (a restart's wait, a pause) the instance may idle out
(15 s); the next start then boots it again, within `WSL_START_S`, and loses nothing: the engine,
its model and its pid file live on the distribution's disk. Nothing else keeps the VM up or needs to.
"""

from __future__ import annotations

import base64
import logging
import os
import re
import subprocess
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from worker.engines.base import child_environment
from worker.system import children, wsl

log = logging.getLogger(__name__)

NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
WSL_START_S = 30.0  # a Stopped distribution boots first (platforms.md: more than 5 s is common)
LAUNCHER_GONE_S = 10.0  # the launcher's own GONE_S: after SIGKILL for the group, then for the launcher
LAUNCHER_PREFIX = "gpu-provider-launcher:"

# The launcher, run inside the distribution by its python3 (3.8 or newer, stdlib only).
LAUNCHER = r'''
import json, os, select, signal, sys, time

PREFIX = "gpu-provider-launcher:"
STATE = os.path.join(os.path.expanduser("~"), ".local", "state", "gpu-provider")
NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")
POLL_S = 0.5
GONE_S = 10.0
SIGNALLED = []


def say(text):
    try:
        os.write(1, ("%s %s\n" % (PREFIX, text)).encode())
    except OSError:
        pass


def start_time(pid):
    """Field 22 of /proc/PID/stat (clock ticks after boot); None when there is no such process."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as stat:
            fields = stat.read(4096).rsplit(b")", 1)[1].split()
        return None if fields[0] == b"Z" else int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def group_members(group):
    """Live pids whose process group is `group` (one pass over /proc)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % entry, "rb") as stat:
                fields = stat.read(4096).rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[0] != b"Z" and fields[2] == str(group).encode():
            members.append(int(entry))
    return members


def wait_gone(check, seconds):
    deadline = time.monotonic() + seconds
    while check():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def end_group(group, grace):
    """TERM to the group, KILL after `grace` seconds; True once none of it is left."""
    for sig, seconds in ((signal.SIGTERM, grace), (signal.SIGKILL, GONE_S)):
        try:
            os.killpg(group, sig)
        except (ProcessLookupError, PermissionError):
            pass
        if wait_gone(lambda: group_members(group), seconds):
            return True
    return False


def pid_path(name):
    return os.path.join(STATE, "engine-%s.pid" % name)


def read_record(name):
    try:
        fd = os.open(pid_path(name), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        data = json.loads(os.read(fd, 4096).decode())
        return {key: int(data[key]) for key in ("engine", "engine_start", "launcher", "launcher_start")}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    finally:
        os.close(fd)


def write_record(name, record):
    temporary = pid_path(name) + ".new"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(record, out)
    os.replace(temporary, pid_path(name))


def forget(name, engine):
    record = read_record(name)
    if record is not None and record["engine"] == engine:
        os.unlink(pid_path(name))


def stop(name, grace):
    """End the engine group and launcher a pid file names, if they are still the ones it names."""
    record = read_record(name)
    if record is None:
        say("no engine %s to stop" % name)
        return 0
    engine, launcher, ok = record["engine"], record["launcher"], True
    ours = lambda: start_time(launcher) == record["launcher_start"]
    if ours():
        try:
            os.kill(launcher, signal.SIGTERM)  # it says the engine was stopped, and ends the group too
        except (ProcessLookupError, PermissionError):
            pass
    leader = start_time(engine)
    if leader is not None and leader != record["engine_start"]:
        say("pid %d is another program now; left alone" % engine)
    elif group_members(engine):
        ok = end_group(engine, grace)
    if ours() and not wait_gone(ours, GONE_S):
        try:
            os.kill(launcher, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if ok:
        try:
            os.unlink(pid_path(name))
        except OSError:
            pass
    say("engine %s stopped" % name if ok else "engine %s is still there" % name)
    return 0 if ok else 1


def memory():
    """(MemAvailable, MemTotal) in MiB."""
    values = {}
    with open("/proc/meminfo") as info:
        for line in info:
            key, _, rest = line.partition(":")
            if key in ("MemAvailable", "MemTotal"):
                values[key] = int(rest.split()[0]) // 1024
    return values.get("MemAvailable", 0), values.get("MemTotal", 0)


def oom_kills():
    try:
        with open("/proc/vmstat") as stat:
            for line in stat:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def start_engine(argv, config):
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setpgid(0, 0)
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(write_end, 1)
            os.dup2(write_end, 2)
            os.closerange(3, 1 << 16)
            os.environ["XDG_CONFIG_HOME"] = config
            os.execvp(argv[0], argv)
        except OSError as exc:
            os.write(2, ("%s cannot start %s: %s\n" % (PREFIX, argv[0], exc.strerror)).encode())
        os._exit(127)
    try:
        os.setpgid(pid, pid)
    except OSError:
        pass
    os.close(write_end)
    return pid, read_end


def relay(read_end):
    """Copy what the engine wrote; False once nobody reads this launcher's output."""
    try:
        chunk = os.read(read_end, 65536)
    except OSError:
        chunk = b""
    if not chunk:
        return None
    view = memoryview(chunk)
    while view:
        try:
            view = view[os.write(1, view):]
        except OSError:
            return False
    return True


def serve(name, argv, grace):
    try:
        os.setsid()
    except OSError:
        pass
    os.makedirs(STATE, mode=0o700, exist_ok=True)
    os.makedirs(os.path.join(STATE, "config"), mode=0o700, exist_ok=True)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, lambda number, frame: SIGNALLED.append(number))
    parent, kills = os.getppid(), oom_kills()
    lowest, total = memory()
    engine, read_end = start_engine(argv, os.path.join(STATE, "config"))
    write_record(name, {"engine": engine, "engine_start": start_time(engine), "launcher": os.getpid(),
                        "launcher_start": start_time(os.getpid())})
    poll = select.poll()
    poll.register(1, 0)
    poll.register(read_end, select.POLLIN)
    host_gone = False
    while True:
        done, status = os.waitpid(engine, os.WNOHANG)
        if done:
            break
        if host_gone or SIGNALLED:
            end_group(engine, grace)
            continue
        try:
            events = poll.poll(POLL_S * 1000)
        except InterruptedError:
            events = []
        for fd, event in events:
            if fd == 1 and event & (select.POLLERR | select.POLLHUP):
                host_gone = True
            elif fd == read_end:
                copied = relay(read_end)
                if copied is None:
                    poll.unregister(read_end)
                host_gone = host_gone or copied is False
        host_gone = host_gone or os.getppid() != parent
        lowest = min(lowest, memory()[0])
    if group_members(engine):  # what the engine started and left: it could hold its output open
        end_group(engine, 0)
    while relay(read_end):
        pass
    forget(name, engine)
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        stopped = "stopped" if host_gone or SIGNALLED else "not stopped"
        say("engine ended by signal %d (%s, %s by the app); oom kills %d; lowest free memory %d of %d MiB"
            % (number, signal.Signals(number).name, stopped, oom_kills() - kills, lowest, total))
        return 128 + number
    return os.WEXITSTATUS(status)


def seconds(text):
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0 <= value <= 3600 else None


def main(args):
    named = len(args) >= 3 and 0 < len(args[1]) <= 64 and set(args[1]) <= NAME_CHARS and args[1][0] != "."
    grace = seconds(args[2]) if named else None
    if grace is not None and args[0] == "stop" and len(args) == 3:
        return stop(args[1], grace)
    if grace is not None and args[0] == "run" and len(args) >= 5 and args[3] == "--":
        return serve(args[1], args[4:], grace)
    say("usage: run NAME GRACE -- ARGV... | stop NAME GRACE")
    return 2


sys.exit(main(sys.argv[1:]))
'''


def _bootstrap(source: str) -> str:
    """`python3 -c` code that runs `source`: letters, digits and `().'_+/=` only."""
    packed = base64.b64encode(zlib.compress(source.encode("utf-8"), 9)).decode("ascii")
    return f"exec(__import__('zlib').decompress(__import__('base64').b64decode('{packed}')))"


LAUNCHER_CODE = _bootstrap(LAUNCHER)


@dataclass(frozen=True)
class WslEngine:
    """An engine inside WSL2: the distribution (None: the default one) and its name there."""

    distro: str | None
    name: str

    def __post_init__(self) -> None:
        if not NAME.fullmatch(self.name):
            raise ValueError(f"not an engine name: {self.name!r}")

    def start_argv(self, linux_argv: Sequence[str], grace_s: float) -> list[str]:
        """`wsl.exe` running `linux_argv` under the launcher; no shell re-parses any argument."""
        return wsl.command(["python3", "-c", LAUNCHER_CODE, "run", self.name, f"{grace_s:g}", "--", *linux_argv],
                           distro=self.distro)

    def stop_argv(self, grace_s: float) -> list[str]:
        return wsl.command(["python3", "-c", LAUNCHER_CODE, "stop", self.name, f"{grace_s:g}"], distro=self.distro)

    def stop(self, grace_s: float) -> bool:
        """End the engine's Linux processes (blocking; call it in a thread). False, logged, when
        it could not be done in time: a stop never hangs on a distribution that does not answer."""
        timeout = WSL_START_S + grace_s + 2 * LAUNCHER_GONE_S
        try:
            done = children.run(self.stop_argv(grace_s), timeout_s=timeout,
                                env=environment(child_environment(os.environ), {}))
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("could not stop engine %s inside WSL2: %s", self.name, exc)
            return False
        said = " ".join(done.stdout.split())
        if done.returncode != 0:
            log.warning("engine %s inside WSL2: stop ended with status %d: %s %s", self.name, done.returncode,
                        said, done.stderr.strip()[-500:])
            return False
        log.info("engine %s inside WSL2: %s", self.name, said)
        return True


def environment(base: Mapping[str, str], passed: Mapping[str, str]) -> dict[str, str]:
    """The environment of the engine's `wsl.exe`: `base` with `passed` crossing into the
    distribution through `WSLENV` and nothing else crossing: a `WSLENV` of the user's would
    bring more of Windows' variables in, so it is dropped (closed world)."""
    return wsl.with_wslenv({k: v for k, v in base.items() if k != "WSLENV"}, passed)


# The launcher's line for an engine killed by SIGKILL that nobody sent: the kernel's OOM killer
# struck, or the free memory had fallen under a twentieth of the distribution's.
OOM_LINE = re.compile(
    rf"{LAUNCHER_PREFIX} engine ended by signal 9 \(SIGKILL, not stopped by the app\); "
    r"oom kills (?P<kills>\d+); lowest free memory (?P<free>\d+) of (?P<total>\d+) MiB")


def killed_for_memory(line: str) -> bool:
    match = OOM_LINE.search(line)
    if match is None:
        return False
    free, total = int(match["free"]), int(match["total"])
    return int(match["kills"]) > 0 or (total > 0 and free * 20 <= total)
