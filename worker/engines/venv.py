"""Installing an engine into a Python virtual environment the app owns: where the venv lives and
how a command reaches it (`VenvPlace`: this machine, or inside WSL2), the environment pip runs in,
pip's output as progress steps, and running one step (an argument list, never a shell). Shared by
the engines that install with pip (vLLM, SGLang); what each installs stays in its own package.

Inside WSL2 the venv is made from the distribution's python3 without sudo: stock Ubuntu and Debian
leave ensurepip out (it comes with `python3-venv`, which needs root), so the venv is made
`--without-pip` and pip is installed into it from a pinned pip wheel (`PIP`) that the app's own
downloader puts into the distribution and checks by its sha256; a wheel runs as a program
(`python pip.whl/pip install …`), which is how pip's own docs bootstrap it.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePath, PurePosixPath

from worker.contract.events import DownloadProgress, Problem
from worker.engines.installing import InstallError, InstallPlace, InstallRequest, ProgressCallback
from worker.system import children, wsl

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


@dataclass(frozen=True)
class PinnedWheel:
    """One wheel the app downloads itself, pinned as an engine release's assets are."""

    name: str
    version: str
    url: str
    sha256: str
    size: int

    @property
    def filename(self) -> str:
        return f"{self.name}-{self.version}-py3-none-any.whl"


PIP = PinnedWheel(  # pypi.org/simple/pip: pip 26.3, its published sha256 and size
    "pip", "26.3",
    "https://files.pythonhosted.org/packages/07/25/ee8c38ae72d66b844ce8eb9711ba905dba21ca1a8a0c960057c41cd23337/"
    "pip-26.3-py3-none-any.whl",
    "f3b60b20ffaadd4415ed7957212a38ac63fa4c5fa375bd0f4a797777940fad13", 1_950_951,
)
WSL_WHEELS_DIR = PurePosixPath(".cache/gpu-provider/wheels")  # under the distro user's home


def create_steps(place: VenvPlace, pip_wheel: str | None) -> list[tuple[str, list[str]]]:
    """(what it is doing, argv) that make the venv with pip in it: here with the base Python's
    ensurepip; inside WSL2 without it, then pip from `pip_wheel` (its Linux path)."""
    if not place.wsl:
        return [("creating the virtual environment", [place.base_python, "-m", "venv", str(place.folder)])]
    if pip_wheel is None:
        raise ValueError("a venv inside WSL2 needs the pip wheel to bootstrap from")
    wheels = str(PurePosixPath(pip_wheel).parent)
    return [
        ("creating the virtual environment", [place.base_python, "-m", "venv", "--without-pip", str(place.folder)]),
        ("installing pip", [place.in_venv("python"), f"{pip_wheel}/pip", "install", "--isolated", "--no-index",
                            "--find-links", wheels, "--progress-bar", "off", f"{PIP.name}=={PIP.version}"]),
    ]


async def pip_wheel_inside(request: InstallRequest) -> str:
    """The Linux path of `PIP` inside the request's distribution: in its `find_links` folder
    (offline), else downloaded (sha256 checked) by the app into the user's cache there."""
    if request.find_links is not None:
        return str(PurePosixPath(request.find_links) / PIP.filename)
    distro = request.place.wsl_distro
    try:
        home = await asyncio.to_thread(wsl.home, distro)
        folder = await asyncio.to_thread(wsl.host_folder, home / WSL_WHEELS_DIR, distro=distro)
    except wsl.WslError as exc:
        raise InstallError(wsl_problem(exc)) from exc
    await request.fetch(PIP.url, folder / PIP.filename, what=f"pip {PIP.version}", sha256=PIP.sha256,
                        max_bytes=PIP.size, size_said="the size this app pins for it")
    return str(home / WSL_WHEELS_DIR / PIP.filename)


async def host_folder_inside(place: VenvPlace) -> Path:
    """The folder that holds `place`'s venv inside WSL2, as this machine writes to it (its disk is
    the distribution's); made if missing."""
    try:
        home = await asyncio.to_thread(wsl.home, place.wsl_distro)
        return await asyncio.to_thread(wsl.host_folder, home / PurePosixPath(place.folder).parent,
                                       distro=place.wsl_distro)
    except wsl.WslError as exc:
        raise InstallError(wsl_problem(exc)) from exc


def wsl_problem(error: wsl.WslError) -> Problem:
    """WSL2 did not do what the install asked of it, in words a person can act on."""
    return Problem(
        "WSL2 did not answer",
        f"The app could not prepare its folder inside WSL2 ({error}). Open your Linux distribution "
        "once from the Start menu to finish its setup (or run `wsl --update` in PowerShell), then "
        "resume the app.",
        action="settings",
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
