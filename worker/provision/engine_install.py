"""The engine an assignment needs, installed before the supervisor starts it.

Each version lives in its own folder under `paths.engines_dir` (`vllm-0.33.0`, the CPU build's
`vllm-0.32.0+cpu`, `llamacpp-b6500`), so several coexist and switching back is free; `remove_unused` deletes
the ones no assignment needs any more. A folder only counts as installed once its install
finished and was checked.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
from collections.abc import AsyncIterator, Collection
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path, PurePath

from worker.system.config import Paths
from worker.provision.hosts import download_client
from worker.engines import registry
from worker.engines.llamacpp import normalise_version as normalise_build
from worker.contract.events import Problem
from worker.hardware import Machine
from worker.provision.problems import Downloader
from worker.provision.errors import ProvisionError
from worker.provision.llamacpp_install import (
    RELEASE_API,
    Accelerator,
    choose_assets,
    fetch_manifest,
    install_release,
    pin_manifest,
    this_machine,
)
from worker.provision.progress import ProgressCallback
from worker.provision.releases import SHIPPED, Releases, VllmBuild, version_problem
from worker.provision.vllm_install import (
    MARKER,
    VenvPlace,
    host_place,
    install_vllm,
    is_installed,
    wsl_place,
)

_SERVER_NAMES = ("llama-server", "llama-server.exe")
_BUILD = re.compile(r"b\d+")


@dataclass(frozen=True)
class EngineInstall:
    """What the supervisor starts: the argv prefix of the engine, its version and where it lives."""

    executable: tuple[str, ...]
    version: str
    location: PurePath  # a folder here, or (inside WSL2) relative to the distro user's home
    library_dir: Path | None = None  # for LD_LIBRARY_PATH / PATH where the build ships libraries


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
    use_wsl: bool | None = None,
    wsl_distro: str | None = None,
    downloader: Downloader | None = None,
    release_api: str = RELEASE_API,
    releases: Releases = SHIPPED,
) -> EngineInstall:
    """Find or install `engine` at `version` (None: the newest installed, else the default); raises `ProvisionError`.

    Only versions in `releases` (what this app ships with) are found or installed, and only the
    engines this app has an installer for (an engine without one runs from `--engine-bin`). vLLM:
    the build for the machine's `runtime` (its CPU build on `cpu`; None: the build of the version
    named, else the GPU build's default), `index_url`/`find_links` choose where pip looks (a folder
    of wheels offline), and on Windows (`use_wsl` None means "when on Windows") it goes inside
    WSL2. llama.cpp: the pinned release assets for this platform and `accelerator`, downloaded
    with `downloader` (one is made if not given).
    """
    problem = version_problem(engine, version, releases, runtime)
    if problem is not None:
        raise ProvisionError(Problem("Engine version not allowed", problem + ".", action="update"))
    if engine == "vllm":
        wsl = os.name == "nt" if use_wsl is None else use_wsl
        build = _vllm_build(version, runtime, paths.engines_dir, wsl, releases)
        return await _ensure_vllm(
            build, paths, on_progress, index_url, find_links, cuda_driver, python, wsl, wsl_distro
        )
    if engine == "llamacpp":
        return await _ensure_llamacpp(
            version, paths, on_progress, accelerator, cuda_driver, downloader, release_api, releases
        )
    raise ProvisionError(_no_installer(engine))


def _vllm_build(
    version: str | None, runtime: str | None, engines_dir: Path, wsl: bool, releases: Releases
) -> VllmBuild:
    """The build asked for; with no version, the newest installed here for this runtime, else its default."""
    builds = releases.vllm_for(runtime)
    if version is not None:
        chosen = releases.vllm_build(version, runtime)
    else:
        by_folder = {b.installed_version: b for b in builds}
        installed = None if wsl else _newest_installed(engines_dir, "vllm", tuple(by_folder))
        chosen = by_folder[installed] if installed is not None else (builds[0] if builds else None)
    if chosen is None:
        raise ProvisionError(_none_shipped("vLLM"))
    return chosen


async def _ensure_vllm(
    build: VllmBuild,
    paths: Paths,
    on_progress: ProgressCallback,
    index_url: str | None,
    find_links: str | None,
    cuda_driver: tuple[int, int] | None,
    python: str | None,
    wsl: bool,
    wsl_distro: str | None,
) -> EngineInstall:
    folder_version = build.installed_version
    place: VenvPlace = (
        wsl_place(folder_version, wsl_distro) if wsl else host_place(paths.engines_dir, folder_version, python)
    )
    if not await is_installed(place, build):
        await install_vllm(
            place, build, on_progress, index_url=index_url, find_links=find_links, cuda_driver=cuda_driver
        )
    return EngineInstall(tuple(place.command([place.in_venv("vllm")])), folder_version, place.folder)


async def _ensure_llamacpp(
    version: str | None,
    paths: Paths,
    on_progress: ProgressCallback,
    accelerator: Accelerator,
    cuda_driver: tuple[int, int] | None,
    downloader: Downloader | None,
    release_api: str,
    releases: Releases,
) -> EngineInstall:
    build = (
        normalise_build(version)
        if version
        else _newest_installed(paths.engines_dir, "llamacpp", tuple(releases.llamacpp))
        or releases.default_llamacpp
    )
    if build is None:
        raise ProvisionError(_none_shipped("llama.cpp"))
    installed = _installed_llamacpp(paths.engines_dir / f"llamacpp-{build}", build)
    if installed is not None:
        return installed
    async with _downloader(downloader) as loader:
        manifest = pin_manifest(
            await fetch_manifest(loader.client, build, release_api), releases.llamacpp[build]
        )
        assets = choose_assets(manifest, this_machine(accelerator, cuda_driver))
        location = paths.engines_dir / f"llamacpp-{manifest.build}"
        server = await install_release(assets, location, loader, on_progress, manifest.build)
    return EngineInstall((str(server),), manifest.build, location, server.parent)


@asynccontextmanager
async def _downloader(given: Downloader | None) -> AsyncIterator[Downloader]:
    if given is not None:
        yield given
        return
    async with download_client() as client:  # public https hosts only, each redirect checked
        yield Downloader(client)


def _none_shipped(name: str) -> Problem:
    return Problem(
        f"No {name} release to install",
        f"This app version ships with no {name} release it may install. Update the app.",
        action="update",
    )


def _no_installer(engine: str) -> Problem:
    name = registry.display_name(engine)
    return Problem(
        f"{name} is not installed",
        f"This app cannot install {name}. Install it, and start the app with --engine-bin {engine}=PATH.",
        action="settings",
    )


def _installed_llamacpp(location: Path, build: str) -> EngineInstall | None:
    servers = [p for p in location.rglob("*") if p.name in _SERVER_NAMES] if location.is_dir() else []
    if not servers:
        return None
    server = min(servers, key=lambda p: len(p.parts))
    return EngineInstall((str(server),), build, location, server.parent)


def _newest_installed(engines_dir: Path, engine: str, allowed: Collection[str]) -> str | None:
    """The highest `allowed` version already installed here (a finished install only)."""
    versions = []
    for folder in engines_dir.glob(f"{engine}-*") if engines_dir.is_dir() else ():
        version = folder.name.removeprefix(f"{engine}-")
        finished = (folder / MARKER).is_file() if engine == "vllm" else bool(_BUILD.fullmatch(version))
        if folder.is_dir() and finished and version in allowed:
            versions.append(version)
    return max(versions, key=_version_key, default=None)


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", version))


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
    """`vllm-0.33.0`, `llamacpp-b6500`: a folder named for a registered engine and a version."""
    return any(name.startswith(f"{engine}-") for engine in registry.names())


# --- what an install needs from the machine, and what its process needs -------------------------


def accelerator_of(machine: Machine) -> Accelerator:
    """The llama.cpp build this machine runs: Metal on Apple silicon, CUDA with an NVIDIA card."""
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
