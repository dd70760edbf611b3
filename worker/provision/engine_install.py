"""The engine an assignment needs, installed before the supervisor starts it.

Generic: the engine's adapter installs it (`installing.Installer`; one without runs from
`--engine-bin`), into a place this module gives it: this machine's engines folder, or, on a Windows
machine (its `Machine.os`, so a `--hardware` file of one takes the same path anywhere) for an
engine that does not run on Windows itself, the same folder inside the machine's WSL2 distribution. Each version lives
in its own folder there (`<engine>-<version>`, with a build tag where it has one), so
several coexist and switching back is free; `remove_unused` deletes the ones no assignment needs
any more. A folder only counts as installed once its install finished and was checked.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator, Callable, Collection
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

from worker.contract.events import Problem
from worker.engines import registry
from worker.engines.installing import (
    WSL_ENGINES_DIR,
    Accelerator,
    EngineInstall,
    InstallError,
    Installer,
    InstallPlace,
    InstallRequest,
)
from worker.engines.releases import Releases, version_problem
from worker.hardware import Machine
from worker.provision.errors import ProvisionError
from worker.provision.hosts import download_client
from worker.provision.problems import Downloader, fetch
from worker.provision.progress import ProgressCallback
from worker.provision.transfer import TransferControl
from worker.system import wsl
from worker.system.config import Paths

async def ensure_engine(
    engine: str,
    version: str | None,
    paths: Paths,
    on_progress: ProgressCallback,
    *,
    index_url: str | None = None,
    find_links: str | None = None,
    cuda_driver: tuple[int, int] | None = None,
    accelerator: Accelerator = "cpu",
    runtime: str | None = None,
    python: str | None = None,
    machine_os: str | None = None,
    use_wsl: bool | None = None,
    wsl_distro: str | None = None,
    downloader: Downloader | None = None,
    release_api: str | None = None,
    releases: Releases | None = None,
    control: TransferControl | None = None,
) -> EngineInstall:
    """Find or install `engine` at `version` (None: the newest installed, else the default); raises `ProvisionError`.

    Only versions its releases list (what this app ships with; `releases` stands in for them) are
    found or installed, for the machine's `runtime`, and only by an engine that has an installer.
    `use_wsl` None means: inside WSL2 (`wsl_distro`) where `machine_os` (None: this machine's) is
    Windows and the engine does not run on Windows itself.
    `index_url`/`find_links` choose where pip looks (a folder of wheels offline), `release_api`
    where a release's assets are downloaded (llama.cpp: a template with `{build}` and `{name}`); downloads go through `downloader` (one is made if not given, obeying
    `control`: held, paced, counted, cancelled). What pip fetches for an engine is pip's own traffic:
    not held, paced or counted.
    """
    adapter = registry.get(engine) if engine in registry.names() else None
    shipped = releases if releases is not None or adapter is None else adapter.RELEASES
    problem = version_problem(engine, version, runtime, shipped)
    if problem is not None:
        raise ProvisionError(Problem("Engine version not allowed", problem + ".", action="update"))
    if not isinstance(adapter, Installer):
        raise ProvisionError(_no_installer(engine))
    wsl = in_wsl(adapter.RUNTIMES, machine_os or host_os()) if use_wsl is None else use_wsl
    place = wsl_place(adapter.DISPLAY_NAME, wsl_distro) if wsl else InstallPlace(paths.engines_dir)
    async with _downloader(downloader, control) as loader:
        request = InstallRequest(
            version, shipped, place, on_progress, loader.client, partial(fetch, loader, on_progress=on_progress),
            runtime=runtime, accelerator=accelerator, cuda_driver=cuda_driver, base_python=python,
            index_url=index_url, find_links=find_links, release_api=release_api,
        )
        try:
            return await adapter.install(request)
        except InstallError as exc:
            raise ProvisionError(exc.problem) from exc


def host_os() -> str:
    """This machine's `Machine.os` as far as installing goes: Windows or not."""
    return "windows" if os.name == "nt" else "posix"


def in_wsl(runtimes: Collection[str], machine_os: str) -> bool:
    """Whether an engine serving `runtimes` installs inside WSL2: on a Windows machine, one that
    does not run on Windows itself (vLLM, SGLang: `wsl2` with an NVIDIA card, vLLM's CPU build on
    `cpu`)."""
    return machine_os == "windows" and "windows" not in runtimes


def wsl_place(name: str, distro: str | None, *,
              which: Callable[[str], str | None] = shutil.which) -> InstallPlace:
    """The engines folder inside the WSL2 distribution `distro` (detection's); a person without
    WSL2, or without a distribution for it, is told how to get one."""
    if distro is None or which(wsl.WSL_EXE) is None:
        raise ProvisionError(
            Problem(
                f"{name} needs WSL2",
                f"On Windows, {name} runs inside WSL2, which is not installed. Open PowerShell as "
                "administrator, run `wsl --install`, restart the computer, open Ubuntu once to finish "
                "its setup, then resume the app.",
                action="settings",
            )
        )
    return InstallPlace(WSL_ENGINES_DIR, wsl=True, wsl_distro=distro)


@asynccontextmanager
async def _downloader(given: Downloader | None, control: TransferControl | None) -> AsyncIterator[Downloader]:
    if given is not None:
        yield given
        return
    async with download_client() as client:  # public https hosts only, each redirect checked
        yield Downloader(client, control=control)


def _no_installer(engine: str) -> Problem:
    name = registry.display_name(engine)
    return Problem(
        f"{name} is not installed",
        f"This app cannot install {name}. Install it, and start the app with --engine-bin {engine}=PATH.",
        action="settings",
    )


async def remove_unused(paths: Paths, keep: Collection[EngineInstall]) -> list[Path]:
    """Delete every engine folder here (and unfinished leftovers) that no install in `keep` uses."""
    kept = {Path(install.location) for install in keep}

    def sweep() -> list[Path]:
        removed = []
        for folder in sorted(paths.engines_dir.glob("*")) if paths.engines_dir.is_dir() else ():
            if _engine_folder(folder.name) and folder not in kept:
                if folder.is_dir():
                    shutil.rmtree(folder, ignore_errors=True)
                else:
                    folder.unlink(missing_ok=True)
                removed.append(folder)
        return removed

    return await asyncio.to_thread(sweep)


def _engine_folder(name: str) -> bool:
    """`<engine>-<version>`: a folder named for a registered engine and a version."""
    return any(name.startswith(f"{engine}-") for engine in registry.names())


# --- what an install needs from the machine, and what its process needs -------------------------


def accelerator_of(machine: Machine) -> Accelerator:
    """The engine build this machine runs: Metal on Apple silicon, CUDA with an NVIDIA card."""
    if machine.runtime == "apple-silicon":
        return "metal"
    return "cuda" if machine.gpus else "cpu"


def cuda_version(text: str | None) -> tuple[int, int] | None:
    """The driver's CUDA version as detected ("12.8", "13") → (12, 8), (13, 0); None otherwise."""
    major, _, minor = (text or "").partition(".")
    return (int(major), int(minor or 0)) if major.isdigit() and (minor or "0").isdigit() else None


def library_env(folder: Path) -> dict[str, str]:
    """Engines shipped with their shared libraries beside them find them through the loader path."""
    if not any(folder.glob("*.so*")) and not any(folder.glob("*.dylib")):
        return {}
    name = "DYLD_LIBRARY_PATH" if os.uname().sysname == "Darwin" else "LD_LIBRARY_PATH"
    existing = os.environ.get(name)
    return {name: f"{folder}{os.pathsep}{existing}" if existing else str(folder)}
