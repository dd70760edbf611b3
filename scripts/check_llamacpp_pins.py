"""Release-time check of the llama.cpp builds this app ships (`worker/engines/llamacpp/releases.py`).

1. Every pin against the sha256 and size GitHub publishes for the asset (its release API), so a
   pin copied wrong is found before users meet it. The app itself never asks that API (60
   unauthenticated requests an hour per address): it downloads the pinned names and checks them.
2. Every Mach-O file of each pinned macOS tarball against the oldest macOS the app supports
   (`LSMinimumSystemVersion` in build.spec): llama.cpp's arm64 b9428–b10141 needed macOS 26.

Needs the network, so neither the tests nor CI run it; run it whenever the pins change:
`.venv/bin/python scripts/check_llamacpp_pins.py` (exit status 1 and one line per problem).
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
import tarfile
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from worker.engines.llamacpp import macho  # noqa: E402
from worker.engines.llamacpp.install import RELEASE_DOWNLOAD  # noqa: E402
from worker.engines.llamacpp.releases import SHIPPED, PinnedAsset  # noqa: E402

RELEASE_API = "https://api.github.com/repos/ggml-org/llama.cpp/releases/tags/{build}"
_MACOS_TARBALL = re.compile(r"llama-b\d+-bin-macos-(arm64|x64)\.tar\.gz")
_CPU = {"arm64": macho.CPU_ARM64, "x64": macho.CPU_X86_64}


def published_problems(build: str, release: Mapping[str, Any], pins: Mapping[str, PinnedAsset]) -> list[str]:
    """Each pin of `build` that the release JSON (`assets[]`: name, size, digest "sha256:…") does
    not bear out, in words."""
    published = {str(a.get("name")): a for a in release.get("assets", []) if isinstance(a, dict)}
    problems = []
    for name, pin in sorted(pins.items()):
        asset = published.get(name)
        if asset is None:
            problems.append(f"{build}: {name} is not on the release")
            continue
        digest = str(asset.get("digest") or "").removeprefix("sha256:").lower()
        if digest != pin.sha256:
            problems.append(f"{build}: {name} is published with sha256 {digest or '(none)'}, pinned {pin.sha256}")
        if asset.get("size") != pin.size_bytes:
            problems.append(f"{build}: {name} is published at {asset.get('size')} bytes, pinned {pin.size_bytes}")
    return problems


def macos_problem(build: str, name: str, tarball: Path, oldest: macho.Version) -> str | None:
    """Why the macOS tarball `name` would not start on `oldest`, or None."""
    match = _MACOS_TARBALL.fullmatch(name)
    if match is None:
        return None
    with tempfile.TemporaryDirectory() as folder, tarfile.open(tarball) as archive:
        archive.extractall(folder, filter="data")
        try:
            needs = macho.build_requirement(sorted(Path(folder).rglob("*")), _CPU[match.group(1)])
        except macho.MachOError as exc:
            return f"{build}: {name} holds an unreadable Mach-O file ({exc})"
        if needs is None or needs.minos <= oldest:
            return None
        return (f"{build}: {name} needs macOS {macho.version_name(needs.minos)} "
                f"({needs.file.relative_to(folder)}); the app supports macOS {macho.version_name(oldest)}")


def oldest_macos(spec: Path = ROOT / "build.spec") -> macho.Version:
    """The app's `LSMinimumSystemVersion`."""
    match = re.search(r'"LSMinimumSystemVersion":\s*"([\d.]+)"', spec.read_text())
    version = macho.parse_version(match.group(1)) if match else None
    if version is None:
        raise SystemExit(f"no LSMinimumSystemVersion in {spec}")
    return version


def check(client: httpx.Client, oldest: macho.Version) -> list[str]:
    problems: list[str] = []
    for build, pins in SHIPPED.builds.items():
        response = client.get(RELEASE_API.format(build=build), headers={"Accept": "application/vnd.github+json"})
        response.raise_for_status()
        problems += published_problems(build, response.json(), pins)
        for name, pin in pins.items():
            if _MACOS_TARBALL.fullmatch(name):
                problems += _downloaded_macos_problems(client, build, name, pin, oldest)
    return problems


def _downloaded_macos_problems(client: httpx.Client, build: str, name: str, pin: PinnedAsset,
                               oldest: macho.Version) -> list[str]:
    with tempfile.TemporaryDirectory() as folder:
        tarball = Path(folder) / name
        response = client.get(RELEASE_DOWNLOAD.format(build=build, name=name))
        response.raise_for_status()
        tarball.write_bytes(response.content)
        if hashlib.sha256(response.content).hexdigest() != pin.sha256:
            return [f"{build}: {name} as downloaded does not match its pin"]
        problem = macos_problem(build, name, tarball, oldest)
        return [problem] if problem else []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--oldest-macos", help="instead of build.spec's LSMinimumSystemVersion")
    given = parser.parse_args()
    oldest = macho.parse_version(given.oldest_macos) if given.oldest_macos else oldest_macos()
    if oldest is None:
        parser.error(f"--oldest-macos {given.oldest_macos!r} is not a macOS version")
    with httpx.Client(follow_redirects=True, timeout=120.0) as client:
        problems = check(client, oldest)
    for problem in problems:
        print(problem)
    print("llama.cpp pins: " + ("all agree" if not problems else f"{len(problems)} problem(s)"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
