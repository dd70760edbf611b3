"""An honest double of WSL2 on Linux: a `wsl.exe` on PATH whose distributions are real Linux
namespaces (see `wsl.exe` beside this file for what it does and why).

A test calls `install_fake_wsl(bin_dir, [FakeDistro("Ubuntu", root=...)], hide=[app folders])`,
puts `bin_dir` first on PATH, and calls `kill_all()` when done.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "wsl.exe"
TOOLS = HERE / "tools"
REPO = HERE.parents[2]  # the checkout: what a test may `keep` visible inside
CONFIG_NAME = "fake-wsl.json"
STATE_DIR_NAME = "fake-wsl-state"
SYSTEM_PYTHON = Path("/usr/bin/python3")
PYTHON_MINOR = SYSTEM_PYTHON.resolve().name  # python3.11: stock Ubuntu's versioned name, same wrapper


@dataclass(frozen=True)
class FakeDistro:
    """One installed distribution. `root` is the host folder standing for its file system (its
    `home/<user>` is the user's home inside); None: a folder beside the fake's config."""

    name: str
    version: int = 2
    default: bool = False
    root: Path | None = None
    user: str = "lender"


@dataclass
class FakeWsl:
    """The installed fake: where each distro's files are on the host, and what runs inside."""

    bin_dir: Path
    distros: dict[str, FakeDistro]

    def environment(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """`base` (the test's own environment by default) with this `wsl.exe` first on PATH."""
        env = dict(os.environ if base is None else base)
        env["PATH"] = os.pathsep.join(filter(None, [str(self.bin_dir), env.get("PATH")]))
        return env

    def root(self, distro: str) -> Path:
        root = self.distros[distro].root
        assert root is not None
        return root

    def home(self, distro: str) -> Path:
        """The user's home inside `distro`, as a host folder."""
        return self.root(distro) / "home" / self.distros[distro].user

    def linux_path_on_host(self, distro: str, linux_path: str) -> Path:
        """The host path that a path inside stands for (what `\\\\wsl.localhost\\<distro>\\…` is to
        Windows). Only the distro's /home is its own; /tmp inside has no host path."""
        path = PurePosixPath(linux_path.replace("~", f"/home/{self.distros[distro].user}", 1)
                             if linux_path.startswith("~") else linux_path)
        if not path.is_absolute():
            raise ValueError(f"not an absolute Linux path: {linux_path}")
        if path.parts[1:2] == ("home",):
            return self.root(distro).joinpath(*path.parts[1:])
        if path.parts[1:2] == ("tmp",):
            raise ValueError(f"{linux_path} is in the distro's private /tmp: no host path stands for it")
        return Path(path)

    def _running(self, distro: str) -> dict[str, Any] | None:
        """The running distro's record. Its namespace is trusted only while its agent is alive in
        it: namespace numbers are reused, and a stale one may be another test's distro now."""
        try:
            state: dict[str, Any] = json.loads((self.bin_dir / STATE_DIR_NAME / f"{distro}.json").read_text())
        except (OSError, ValueError):
            return None
        return state if _ns_of(state["agent"]) == state["mnt_ns"] else None

    def processes(self, distro: str) -> list[int]:
        """Host pids of every live process started inside `distro` (grandchildren included; the
        fake's own init is not one of them)."""
        state = self._running(distro)
        return [] if state is None else _members(state["mnt_ns"], {state["agent"]})

    def kill_all(self, timeout_s: float = 5.0) -> None:
        """SIGKILL everything inside every distro and the distros' inits, and wait (bounded) until
        they are gone: test clean-up, and `wsl --shutdown` as Docker Desktop or an update does it."""
        doomed: list[int] = []
        for name in self.distros:
            state = self._running(name)
            if state is None:
                continue
            doomed += [*_members(state["mnt_ns"], set()), state["holder"]]
            (self.bin_dir / STATE_DIR_NAME / f"{name}.json").unlink(missing_ok=True)
        for pid in doomed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout_s
        while any(_ns_of(pid) is not None for pid in doomed) and time.monotonic() < deadline:
            time.sleep(0.02)


def install_fake_wsl(bin_dir: Path, distros: Sequence[FakeDistro], *, hide: Sequence[Path] = (),
                     keep: Sequence[Path] = (), ensurepip: bool = False) -> FakeWsl:
    """Put `wsl.exe` (and its config) in `bin_dir`, which the test puts first on PATH. `keep`:
    folders seen inside at their own paths, read-only, even under /tmp or /home (which the distro
    has its own of): software under test, as if installed in the distro."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(SCRIPT, bin_dir / "wsl.exe")
    (bin_dir / "wsl.exe").chmod(0o755)
    placed: dict[str, FakeDistro] = {}
    entries = []
    for distro in distros:
        root = (distro.root or bin_dir / "fake-wsl-distros" / distro.name).resolve()
        (root / "home" / distro.user).mkdir(parents=True, exist_ok=True)
        placed[distro.name] = FakeDistro(distro.name, distro.version, distro.default, root, distro.user)
        tools = bin_dir / "fake-wsl-tools" / distro.name
        _write_tools(tools, root, ensurepip)
        entries.append({"name": distro.name, "version": distro.version, "default": distro.default,
                        "root": str(root), "user": distro.user, "tools": str(tools.resolve())})
    config = {"distros": entries, "hide": [str(Path(p).resolve()) for p in hide], "ensurepip": ensurepip,
              "keep": [str(Path(p).resolve()) for p in keep]}
    (bin_dir / CONFIG_NAME).write_text(json.dumps(config, indent=2))
    return FakeWsl(bin_dir, placed)


def _write_tools(folder: Path, root: Path, ensurepip: bool) -> None:
    """The distro's /usr/local/bin: `wslpath`, a `python3` as stock Ubuntu's, no working `sudo`, no pip."""
    folder.mkdir(parents=True, exist_ok=True)
    tools = {"wslpath": "wslpath", "python3": "python3", PYTHON_MINOR: "python3", "sudo": "sudo", "pip": "pip",
             "pip3": "pip"}
    for tool, template in tools.items():
        text = (TOOLS / template).read_text()
        text = text.replace("@ROOT@", json.dumps(str(root)))
        text = text.replace("@ENSUREPIP@", "True" if ensurepip else "False")
        (folder / tool).write_text(text)
        (folder / tool).chmod(stat.S_IRWXU | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)


def _ns_of(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def _members(mnt_ns: str, exclude: set[int]) -> list[int]:
    return sorted(int(entry.name) for entry in os.scandir("/proc")
                  if entry.name.isdigit() and int(entry.name) not in exclude and _ns_of(int(entry.name)) == mnt_ns)
