"""llama.cpp as a release build for this platform: chosen from the pinned assets, hash-checked, unpacked.

Only assets this app pins (`releases.py`) are used, each downloaded from its address on the
release (`RELEASE_DOWNLOAD`, built from the pinned name: no GitHub API call, whose unauthenticated
limit is 60 an hour per address) and checked against its pinned sha256 and size. Only the assets
this machine takes are downloaded or checked: a pin of another platform cannot stop this install.
Nothing is unpacked that was not checked, and on a Mac nothing is put in place that this macOS
cannot start (`macho.py`).
"""

from __future__ import annotations

import asyncio
import os
import platform
import re
import shutil
import stat
import tarfile
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from worker.contract.events import Problem
from worker.engines.installing import (
    Accelerator,
    EngineInstall,
    Fetch,
    InstallError,
    InstallRequest,
    none_shipped,
    newest_installed,
)
from worker.engines.llamacpp import macho
from worker.engines.llamacpp.releases import LlamacppReleases, PinnedAsset

# Where a release's asset is downloaded from; a test or a mirror gives its own.
RELEASE_DOWNLOAD = "https://github.com/ggml-org/llama.cpp/releases/download/{build}/{name}"
OsName = Literal["linux", "windows", "macos"]
_ARCHIVE = r"\.(?:zip|tar\.gz)"
_SERVER_NAMES = ("llama-server", "llama-server.exe")
_BUILD = re.compile(r"b\d+")
_VERSIONED_LIB = re.compile(r"^(lib.+\.so)\.(\d+)(?:\.\d+)*$")
_MACHO_CPU = {"arm64": macho.CPU_ARM64, "x64": macho.CPU_X86_64}
# What `platform.mac_ver()` says on macOS 11 or later to a Python built with an older SDK: no version.
_COMPAT_MACOS = (10, 16, 0)


@dataclass(frozen=True)
class ReleaseAsset:
    name: str
    url: str
    sha256: str
    size_bytes: int


@dataclass(frozen=True)
class ReleaseManifest:
    build: str
    assets: tuple[ReleaseAsset, ...]


@dataclass(frozen=True)
class Target:
    """The platform a build is for: OS, CPU architecture as release names spell it, accelerator."""

    os: OsName
    arch: str  # "x64" or "arm64"
    accelerator: Accelerator
    cuda_driver: tuple[int, int] | None = None
    macos: macho.Version | None = None  # this Mac's macOS (None: not a Mac, or not known)


def this_machine(accelerator: Accelerator, cuda_driver: tuple[int, int] | None = None) -> Target:
    system = {"Darwin": "macos", "Windows": "windows"}.get(platform.system(), "linux")
    arch = "arm64" if platform.machine().lower() in ("arm64", "aarch64") else "x64"
    macos = macho.parse_version(platform.mac_ver()[0]) if system == "macos" else None
    if macos == _COMPAT_MACOS:
        macos = None
    return Target(system, arch, accelerator, cuda_driver, macos)  # type: ignore[arg-type]


def pinned_manifest(build: str, pins: Mapping[str, PinnedAsset],
                    url_template: str = RELEASE_DOWNLOAD) -> ReleaseManifest:
    """The assets this app pins for `build`, each at its download address, with its pin."""
    return ReleaseManifest(build, tuple(
        ReleaseAsset(name, url_template.format(build=build, name=name), pin.sha256, pin.size_bytes)
        for name, pin in pins.items()))


def choose_assets(manifest: ReleaseManifest, target: Target) -> list[ReleaseAsset]:
    """The archive(s) to unpack for `target`, best first choice: CUDA (with its runtime), then CPU.

    Among CUDA builds, the newest CUDA the driver supports; with the driver unknown, the oldest.
    """
    by_name = {a.name: a for a in manifest.assets}
    if target.accelerator == "cuda" and target.os in ("linux", "windows"):
        cuda = _cuda_assets(manifest, target, by_name)
        if cuda:
            return cuda
    os_tag = {"linux": "ubuntu", "windows": "win-cpu", "macos": "macos"}[target.os]
    plain = re.compile(rf"llama-{manifest.build}-bin-{os_tag}-{target.arch}{_ARCHIVE}")
    found = [a for a in manifest.assets if plain.fullmatch(a.name)]
    if not found:
        raise InstallError(
            Problem(
                "No llama.cpp build for this computer",
                f"llama.cpp release {manifest.build} has no build for {target.os} {target.arch} "
                f"({target.accelerator}) among those this app ships with. The network should offer another "
                "engine version, or a newer app may have one.",
            )
        )
    return found[:1]


def _cuda_assets(
    manifest: ReleaseManifest, target: Target, by_name: Mapping[str, ReleaseAsset]
) -> list[ReleaseAsset]:
    os_tag = "ubuntu" if target.os == "linux" else "win"
    pattern = re.compile(rf"llama-{manifest.build}-bin-{os_tag}-cuda-(\d+)\.(\d+)-{target.arch}({_ARCHIVE})")
    builds = []
    for asset in manifest.assets:
        match = pattern.fullmatch(asset.name)
        if match:
            builds.append(((int(match.group(1)), int(match.group(2))), match.group(3), asset))
    usable = [b for b in builds if target.cuda_driver is None or b[0] <= target.cuda_driver]
    if not usable:
        return []
    (major, minor), suffix, chosen = (min if target.cuda_driver is None else max)(usable, key=lambda b: b[0])
    runtime = by_name.get(f"cudart-llama-bin-{os_tag}-cuda-{major}.{minor}-{target.arch}{suffix}")
    return [chosen, runtime] if runtime else [chosen]


async def install_release(assets: Sequence[ReleaseAsset], location: Path, fetch: Fetch, build: str,
                          target: Target) -> Path:
    """Download, check and unpack the assets into `location`; returns the llama-server inside it.

    Unpacking happens in a sibling folder that is renamed into place only when complete (and, on
    a Mac, only when this macOS can start every file of it), so a half-unpacked build, or one that
    cannot start here, is never found by the next start.
    """
    staging = location.with_name(location.name + ".partial")
    downloads = location.with_name(location.name + ".downloads")
    await asyncio.to_thread(shutil.rmtree, staging, True)
    for asset in assets:
        archive = await fetch(
            asset.url,
            downloads / asset.name,
            what=f"engine llama.cpp {build}",
            sha256=asset.sha256,
            max_bytes=asset.size_bytes,
            size_said=f"the size this app pins for {asset.name}; update the app",
        )
        await asyncio.to_thread(unpack, archive, staging)
    server = await asyncio.to_thread(_prepare, staging)
    if target.os == "macos":
        await asyncio.to_thread(_check_macos, staging, target, build)
    await asyncio.to_thread(_replace_dir, staging, location)
    shutil.rmtree(downloads, ignore_errors=True)
    return location / server.relative_to(staging)


def unpack(archive: Path, into: Path) -> None:
    """Extract a zip or tar.gz, refusing members that would land outside `into`."""
    into.mkdir(parents=True, exist_ok=True)
    if archive.name.endswith(".zip"):
        _unzip(archive, into)
    else:
        with tarfile.open(archive) as tar:
            tar.extractall(into, filter="data")


def _unzip(archive: Path, into: Path) -> None:
    root = into.resolve()
    with zipfile.ZipFile(archive) as zipped:
        for member in zipped.infolist():
            target = (root / member.filename).resolve()
            if not target.is_relative_to(root):
                raise InstallError(
                    Problem(
                        "Damaged llama.cpp build",
                        f"{archive.name} holds a file outside its folder: {member.filename}",
                    )
                )
            zipped.extract(member, root)
            mode = member.external_attr >> 16
            if mode & 0o111 and not member.is_dir():
                target.chmod(target.stat().st_mode | (mode & 0o755))


def _prepare(folder: Path) -> Path:
    """Find llama-server, make it executable, and restore shared-library links zip files drop."""
    servers = [p for p in folder.rglob("*") if p.name in _SERVER_NAMES and p.is_file()]
    if not servers:
        raise InstallError(
            Problem("Damaged llama.cpp build", "The downloaded llama.cpp build has no llama-server in it.")
        )
    server = min(servers, key=lambda p: len(p.parts))
    server.chmod(server.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    for library_folder in {p.parent for p in folder.rglob("lib*.so.*")}:
        _link_versioned_libraries(library_folder)
    return server


def _link_versioned_libraries(folder: Path) -> None:
    """`libllama.so.0.0.123` → also `libllama.so.0` and `libllama.so`, as the loader looks for them."""
    if os.name == "nt":
        return
    for library in sorted(folder.glob("lib*.so.*")):
        match = _VERSIONED_LIB.match(library.name)
        if match is None or library.is_symlink():
            continue
        base, major = match.groups()
        for alias in (f"{base}.{major}", base):
            link = folder / alias
            if not link.exists() and not link.is_symlink():
                link.symlink_to(library.name)


def _check_macos(folder: Path, target: Target, build: str) -> None:
    """Refuse (removing `folder`) a build with a file this Mac's macOS is too old to start; one
    whose macOS is not known is let through (dyld then says why it cannot start)."""
    try:
        needs = macho.build_requirement(folder.rglob("*"), _MACHO_CPU[target.arch])
    except macho.MachOError as exc:
        shutil.rmtree(folder, ignore_errors=True)
        raise InstallError(
            Problem("Damaged llama.cpp build", f"llama.cpp {build}: a file of it is unreadable ({exc}).")
        ) from exc
    if needs is None or target.macos is None or needs.minos <= target.macos:
        return
    shutil.rmtree(folder, ignore_errors=True)
    raise InstallError(
        Problem(
            "This Mac's macOS is too old for this llama.cpp",
            f"This llama.cpp build needs macOS {macho.version_name(needs.minos)} or later; this Mac has "
            f"{macho.version_name(target.macos)}. Update macOS or the app.",
            action="update",
            details=(f"llama.cpp {build}: {needs.file.relative_to(folder)} is built for macOS "
                     f"{macho.version_name(needs.minos)} or later ({target.arch}).",),
        )
    )


def _replace_dir(staging: Path, location: Path) -> None:
    if location.exists():
        shutil.rmtree(location)
    staging.rename(location)


async def install(request: InstallRequest) -> EngineInstall:
    """The build asked for (none: the newest pinned one installed here, else the newest pinned),
    found in the engines folder or downloaded, checked and unpacked there for this platform."""
    releases = request.releases
    assert isinstance(releases, LlamacppReleases), "llama.cpp's installer reads llama.cpp's pins"
    engines_dir = Path(request.place.engines_dir)  # a release build runs on this machine itself
    build = (
        releases.normalise(request.version)
        if request.version
        else newest_installed(engines_dir, "llamacpp", tuple(releases.builds), _unpacked) or releases.default
    )
    if build is None:
        raise InstallError(none_shipped("llama.cpp"))
    installed = _installed(engines_dir / f"llamacpp-{build}", build)
    if installed is not None:
        return installed
    target = this_machine(request.accelerator, request.cuda_driver)
    # `release_api`: where the release's assets are (`RELEASE_DOWNLOAD` unless a test or mirror says)
    manifest = pinned_manifest(build, releases.builds[build], request.release_api or RELEASE_DOWNLOAD)
    assets = choose_assets(manifest, target)
    location = engines_dir / f"llamacpp-{build}"
    server = await install_release(assets, location, request.fetch, build, target)
    return EngineInstall((str(server),), build, location, server.parent)


def _unpacked(folder: Path) -> bool:
    """`llamacpp-b6500`, not a `.partial` or `.downloads` folder of an install under way."""
    return bool(_BUILD.fullmatch(folder.name.removeprefix("llamacpp-")))


def _installed(location: Path, build: str) -> EngineInstall | None:
    servers = [p for p in location.rglob("*") if p.name in _SERVER_NAMES] if location.is_dir() else []
    if not servers:
        return None
    server = min(servers, key=lambda p: len(p.parts))
    return EngineInstall((str(server),), build, location, server.parent)
