"""Installing an engine into a Python virtual environment the app owns: where the venv lives and
how a command reaches it (`VenvPlace`: this machine, or inside WSL2), the environment pip runs in,
pip's output as progress steps, and running one step (an argument list, never a shell). Shared by
the engines that install with pip (vLLM, SGLang); what each installs stays in its own package."""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePath

from worker.contract.events import DownloadProgress
from worker.engines.installing import InstallPlace, ProgressCallback
from worker.system import children

_SCRUBBED_ENV = (
    "GPU_PROVIDER_TOKEN",
    "PYTHONPATH",
    "PYTHONHOME",
    "PYTHONSTARTUP",
    "VIRTUAL_ENV",
    "CONDA_PREFIX",
)
_OUTPUT_TAIL_LINES = 15


@dataclass(frozen=True)
class VenvPlace:
    """Where one engine venv lives and how commands reach it (`wsl` False: this machine)."""

    folder: PurePath  # absolute here; relative to the distro user's home in WSL
    base_python: str
    wsl: bool = False
    wsl_distro: str | None = None

    def command(self, argv: Sequence[str]) -> list[str]:
        return InstallPlace(self.folder.parent, self.wsl, self.wsl_distro).command(argv)

    def in_venv(self, name: str) -> str:
        return (
            str(self.folder / "bin" / name)
            if self.wsl or os.name != "nt"
            else str(self.folder / "Scripts" / name)
        )


def pip_step(line: str) -> str | None:
    """A short description of what pip is doing, from one line of its output (None: not a step)."""
    line = line.strip()
    match = re.match(
        r"(Collecting|Downloading|Processing|Building wheel for|Installing collected packages:)\s*(.*)", line
    )
    if match is None:
        return "installed" if line.startswith("Successfully installed") else None
    verb, rest = match.groups()
    if verb.startswith("Installing"):
        return f"installing {len(rest.split(','))} packages"
    return f"{verb.lower()} {PurePath(rest.split(' ')[0]).name or rest}"  # a wheel folder's path: the file alone


def child_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for pip and venv: the user's site and the provider token kept out."""
    env = {
        k: v
        for k, v in (base if base is not None else os.environ).items()
        if k not in _SCRUBBED_ENV and not k.startswith("PIP_")
    }
    env.update(PYTHONNOUSERSITE="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    return env


class StepReporter:
    """Install steps as progress events (no byte counts: pip does not give a total), ≤ 5 a second."""

    def __init__(
        self, what: str, on_progress: ProgressCallback, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.what = what
        self._on_progress = on_progress
        self._clock = clock
        self._last: float | None = None

    def step(self, description: str, *, force: bool = False) -> None:
        now = self._clock()
        if not force and self._last is not None and now - self._last < 0.2:
            return
        self._last = now
        self._on_progress(DownloadProgress(self.what, 0, None, step=description))

    def finish(self) -> None:
        self._on_progress(DownloadProgress(self.what, 0, None, finished=True))

    def fail(self, message: str) -> None:
        self._on_progress(DownloadProgress(self.what, 0, None, error=message))


async def run_logged(argv: Sequence[str], on_line: Callable[[str], None]) -> tuple[int, list[str]]:
    """Run a child (argv, no shell), feeding each output line to `on_line`; returns rc and the last lines."""
    process = await children.start(
        argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=child_env(),
    )
    tail: list[str] = []
    assert process.stdout is not None
    async for raw in process.stdout:
        line = raw.decode("utf-8", "replace").rstrip()
        on_line(line)
        tail = (tail + [line])[-_OUTPUT_TAIL_LINES:]
    return await process.wait(), tail
