"""The engine releases this app version ships with: the only ones an assignment may ask for.

A coordinator names `engine_version`; a version not listed here is refused, so nobody can steer a
node to an old, vulnerable engine. llama.cpp builds are pinned by the sha256 (and size) of every
release asset the installer may download, so an asset that was replaced on the release page is
refused even when the page's own digest agrees with it. The list changes only with the app.

The b10423 pins were taken from two public projects that pin the same official GitHub release
assets (their values agree where they overlap); check them against GitHub's release API digests
whenever the list is updated.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from worker.engines import registry
from worker.engines.llamacpp import build_number

DEFAULT_VLLM_VERSION = "0.33.0"
_VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")


@dataclass(frozen=True)
class PinnedAsset:
    """One release asset as this app expects it, byte for byte."""

    sha256: str
    size_bytes: int


@dataclass(frozen=True)
class Releases:
    """vLLM versions (the first is the default) and llama.cpp builds → asset name → pin."""

    vllm: tuple[str, ...]
    llamacpp: Mapping[str, Mapping[str, PinnedAsset]]

    @property
    def default_vllm(self) -> str | None:
        return self.vllm[0] if self.vllm else None

    @property
    def default_llamacpp(self) -> str | None:
        """The newest pinned build, used when an assignment names none."""
        return max(self.llamacpp, key=build_number, default=None)


SHIPPED = Releases(
    vllm=(DEFAULT_VLLM_VERSION,),
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


def version_problem(engine: str, version: str | None, releases: Releases = SHIPPED) -> str | None:
    """Why `engine` at `version` may not be used, or None (no version: the app's default; or a listed one)."""
    if version is None:
        return None
    if not _VERSION.fullmatch(version):
        return f"engine version {version!r} is not a version number"
    if engine not in registry.names():
        return registry.refusal(engine)
    adapter = registry.get(engine)
    listed = adapter.shipped_versions(releases)
    if adapter.normalise_version(version) in listed:
        return None
    name = adapter.DISPLAY_NAME
    shipped = ", ".join(listed) or "none"
    return (
        f"{name} version {version} is not one this app ships with ({shipped}); "
        f"update the app, or ask the network for {name} {listed[0] if listed else 'another engine'}"
    )
