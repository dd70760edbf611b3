"""What an engine's installer (`<engine>/install.py`) is handed, gives back and may raise.

Generic: the provisioner (`worker.provision.engine_install`) finds the adapter's installer
(`Installer`), makes an `InstallRequest` (the version, the machine's facts, a `InstallPlace`,
and a way to download), and turns an `InstallError` into its own error. An installer imports
nothing from `worker.provision`: the downloader reaches it as the request's `fetch`.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePath, PurePosixPath
from typing import Literal, Protocol, runtime_checkable

import httpx

from worker.contract.events import DownloadProgress, Problem
from worker.engines.releases import Releases
from worker.system import wsl

ProgressCallback = Callable[[DownloadProgress], None]
Accelerator = Literal["cuda", "metal", "cpu"]  # what an engine's build runs on: CUDA, Apple's Metal, the CPU
WSL_ENGINES_DIR = PurePosixPath(".local/share/gpu-provider/engines")  # under the distro user's home
MARKER = ".gpu-provider-installed"  # in an install's folder once it finished and was checked: its version


class InstallError(Exception):
    """An install failed in a way a person can act on (`problem`: what happened, what to do)."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(f"{problem.title}: {problem.message}")
        self.problem = problem


@dataclass(frozen=True)
class InstallPlace:
    """Where engine installs live, one folder per engine and version, and how a command reaches
    them: on this machine, or inside a WSL2 distribution (`wsl`; its default where `wsl_distro` is None)."""

    engines_dir: PurePath  # absolute on this machine; relative to the distro user's home inside WSL2
    wsl: bool = False
    wsl_distro: str | None = None

    def folder(self, engine: str, version: str) -> PurePath:
        return self.engines_dir / f"{engine}-{version}"

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` as this place runs it: as is here, inside WSL2 through `wsl.exe … --cd ~ -e`
        (no shell there re-parses an argument)."""
        return wsl.command(argv, distro=self.wsl_distro) if self.wsl else list(argv)


class Fetch(Protocol):
    """The app's resumable downloader: `url` to `destination`, checked against `sha256`, never more
    than `max_bytes` (`size_said`: where that figure comes from, for the message)."""

    def __call__(self, url: str, destination: Path, *, what: str, sha256: str, max_bytes: int | None,
                 size_said: str) -> Awaitable[Path]: ...


@dataclass(frozen=True)
class InstallRequest:
    """One engine to find or install: `version` is listed in `releases` (None: the newest
    installed, else the default); the rest is the machine and where things come from."""

    version: str | None
    releases: Releases  # the engine's own list (its `RELEASES`, or a test's)
    place: InstallPlace
    on_progress: ProgressCallback
    client: httpx.AsyncClient  # public https hosts only, each redirect checked (release pages)
    fetch: Fetch
    runtime: str | None = None
    accelerator: Accelerator = "cpu"
    cuda_driver: tuple[int, int] | None = None
    base_python: str | None = None  # an interpreter to make venvs from (None: the installer's choice)
    index_url: str | None = None  # a Python package index instead of PyPI
    find_links: str | None = None  # a folder of wheels, offline
    release_api: str | None = None  # where a release's assets are downloaded (llama.cpp: a template with {build}, {name})


@dataclass(frozen=True)
class EngineInstall:
    """What the supervisor starts: the argv prefix of the engine, its version and where it lives."""

    executable: tuple[str, ...]
    version: str
    location: PurePath  # a folder here, or (inside WSL2) relative to the distro user's home
    library_dir: Path | None = None  # for LD_LIBRARY_PATH / PATH where the build ships libraries
    in_wsl: bool = False  # it lives inside WSL2: `executable` is the Linux argv, run through `wsl.command`
    wsl_distro: str | None = None  # the distribution it lives in (None: the default one)


@runtime_checkable
class Installer(Protocol):
    """An adapter that can install its engine; one without runs from `--engine-bin`."""

    async def install(self, request: InstallRequest) -> EngineInstall:
        """Find `request.version` in `request.place`, or install it there; raises `InstallError`."""


def newest_installed(engines_dir: Path, engine: str, allowed: Collection[str],
                     finished: Callable[[Path], bool]) -> str | None:
    """The highest `allowed` version installed in `engines_dir` whose folder is `finished`."""
    versions = []
    for folder in engines_dir.glob(f"{engine}-*") if engines_dir.is_dir() else ():
        version = folder.name.removeprefix(f"{engine}-")
        if folder.is_dir() and version in allowed and finished(folder):
            versions.append(version)
    return max(versions, key=version_key, default=None)


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", version))


def none_shipped(name: str) -> Problem:
    return Problem(
        f"No {name} release to install",
        f"This app version ships with no {name} release it may install. Update the app.",
        action="update",
    )


def human_bytes(n_bytes: float) -> str:
    """Bytes as a short figure for messages ("1.5 GiB", "300 MiB", "12 KiB")."""
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n_bytes) >= size:
            return f"{n_bytes / size:.1f} GiB" if unit == "GiB" else f"{n_bytes / size:.0f} {unit}"
    return f"{n_bytes:.0f} bytes"
