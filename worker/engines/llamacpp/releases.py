"""The llama.cpp builds this app version ships with, each release asset pinned by its sha256 and
size (`releases.Releases` for llama.cpp).

Each asset is downloaded by its pinned name and checked against its pin alone, so an asset replaced
on the release page is refused whatever the page says. The b10423 pins were taken from two public
projects that pin the same official GitHub release assets (their values agree where they overlap);
`scripts/check_llamacpp_pins.py` checks every pin against GitHub's published digests, and each
macOS build against the oldest macOS the app supports, whenever the list is updated.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class PinnedAsset:
    """One release asset as this app expects it, byte for byte."""

    sha256: str
    size_bytes: int


@dataclass(frozen=True)
class LlamacppReleases:
    """Builds → asset name → pin; the same builds on every runtime."""

    builds: Mapping[str, Mapping[str, PinnedAsset]]

    def versions(self, runtime: str | None) -> tuple[str, ...]:
        """The pinned builds, newest (the default) first."""
        return tuple(sorted(self.builds, key=build_number, reverse=True))

    def normalise(self, version: str) -> str:
        """ "10423" and "b10423" both name llama.cpp build b10423."""
        return version if version.startswith("b") else f"b{version}"

    def runtime_problem(self, version: str, runtime: str) -> str | None:
        """Every pinned build is listed for every platform it runs on: none to refuse here."""
        return None

    @property
    def default(self) -> str | None:
        """The newest pinned build, used when an assignment names none."""
        return max(self.builds, key=build_number, default=None)


def build_number(build: str) -> int:
    digits = build.removeprefix("b")
    return int(digits) if digits.isdigit() else -1


SHIPPED = LlamacppReleases(
    {
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
    }
)
