"""llama.cpp as a release build for this platform: chosen from a manifest, hash-checked, unpacked.

The manifest is a release's list of assets with their sha256 — read from GitHub's release API
(which publishes a `digest` per asset), or any server that answers the same JSON, so the URL is
configurable and the tests serve their own. Only assets this app pins (`releases.py`) are used,
and each is checked against the pinned sha256 and size: the release page's own digest must agree
with the pin, but is never the only check. Nothing is unpacked that was not checked.
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
from typing import Any, Literal

import httpx

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
from worker.engines.llamacpp.releases import LlamacppReleases, PinnedAsset

# `{ref}` is `tags/b6500` for one build.
RELEASE_API = "https://api.github.com/repos/ggml-org/llama.cpp/releases/{ref}"
OsName = Literal["linux", "windows", "macos"]
_ARCHIVE = r"\.(?:zip|tar\.gz)"
_SERVER_NAMES = ("llama-server", "llama-server.exe")
_BUILD = re.compile(r"b\d+")
_VERSIONED_LIB = re.compile(r"^(lib.+\.so)\.(\d+)(?:\.\d+)*$")


@dataclass(frozen=True)
class ReleaseAsset:
    name: str
    url: str
    sha256: str
    size_bytes: int | None = None  # the pinned size, once `pin_manifest` checked the asset


@dataclass(frozen=True)
class ReleaseManifest:
    build: str
    assets: tuple[ReleaseAsset, ...]

    @classmethod
    def from_release_json(cls, build: str, data: Mapping[str, Any]) -> ReleaseManifest:
        """GitHub's release JSON: `assets[]` with `name`, `browser_download_url`, `digest` ("sha256:…")."""
        assets = []
        for item in data.get("assets", []):
            digest = str(item.get("digest") or "")
            if digest.startswith("sha256:") and item.get("name") and item.get("browser_download_url"):
                assets.append(
                    ReleaseAsset(item["name"], item["browser_download_url"], digest.removeprefix("sha256:"))
                )
        return cls(build, tuple(assets))


@dataclass(frozen=True)
class Target:
    """The platform a build is for: OS, CPU architecture as release names spell it, accelerator."""

    os: OsName
    arch: str  # "x64" or "arm64"
    accelerator: Accelerator
    cuda_driver: tuple[int, int] | None = None


def this_machine(accelerator: Accelerator, cuda_driver: tuple[int, int] | None = None) -> Target:
    system = {"Darwin": "macos", "Windows": "windows"}.get(platform.system(), "linux")
    arch = "arm64" if platform.machine().lower() in ("arm64", "aarch64") else "x64"
    return Target(system, arch, accelerator, cuda_driver)  # type: ignore[arg-type]


def pin_manifest(manifest: ReleaseManifest, pins: Mapping[str, PinnedAsset]) -> ReleaseManifest:
    """The release's assets this app pins, carrying the pinned sha256 and size.

    An asset the app does not pin is dropped (so never chosen); one whose published digest differs
    from the pin is refused outright: the release changed since this app was made.
    """
    kept = []
    for asset in manifest.assets:
        pin = pins.get(asset.name)
        if pin is None:
            continue
        if asset.sha256.lower() != pin.sha256:
            raise InstallError(
                Problem(
                    "llama.cpp release changed",
                    f"llama.cpp {manifest.build}: the release page gives {asset.name} the sha256 {asset.sha256}, "
                    f"but this app ships with {pin.sha256} for it. It was not downloaded. Update the app.",
                    action="update",
                )
            )
        kept.append(ReleaseAsset(asset.name, asset.url, pin.sha256, pin.size_bytes))
    return ReleaseManifest(manifest.build, tuple(kept))


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


async def fetch_manifest(
    client: httpx.AsyncClient, build: str, url_template: str = RELEASE_API
) -> ReleaseManifest:
    """The release's assets that have a published digest (still to be pinned: `pin_manifest`)."""
    url = url_template.format(ref=f"tags/{build}")
    try:
        response = await client.get(url, headers={"Accept": "application/vnd.github+json"})
    except httpx.TransportError as exc:
        raise InstallError(
            Problem(
                "Cannot reach the llama.cpp releases",
                f"Reading {url} failed ({exc}). Check the network.",
                action="check_network",
            )
        ) from exc
    if response.status_code != 200:
        raise InstallError(
            Problem(
                "llama.cpp release not found",
                f"{url} answered HTTP {response.status_code} for build {build}.",
                action="check_network",
            )
        )
    return ReleaseManifest.from_release_json(build, response.json())


async def install_release(assets: Sequence[ReleaseAsset], location: Path, fetch: Fetch, build: str) -> Path:
    """Download, check and unpack the assets into `location`; returns the llama-server inside it.

    Unpacking happens in a sibling folder that is renamed into place only when complete, so a
    half-unpacked build is never found by the next start.
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
    manifest = pin_manifest(
        await fetch_manifest(request.client, build, request.release_api or RELEASE_API), releases.builds[build]
    )
    assets = choose_assets(manifest, this_machine(request.accelerator, request.cuda_driver))
    location = engines_dir / f"llamacpp-{manifest.build}"
    server = await install_release(assets, location, request.fetch, manifest.build)
    return EngineInstall((str(server),), manifest.build, location, server.parent)


def _unpacked(folder: Path) -> bool:
    """`llamacpp-b6500`, not a `.partial` or `.downloads` folder of an install under way."""
    return bool(_BUILD.fullmatch(folder.name.removeprefix("llamacpp-")))


def _installed(location: Path, build: str) -> EngineInstall | None:
    servers = [p for p in location.rglob("*") if p.name in _SERVER_NAMES] if location.is_dir() else []
    if not servers:
        return None
    server = min(servers, key=lambda p: len(p.parts))
    return EngineInstall((str(server),), build, location, server.parent)
