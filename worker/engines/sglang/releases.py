"""The SGLang releases this app version ships with (`releases.Releases` for SGLang): one, for NVIDIA
cards on Linux (`native`) and inside WSL2 (`wsl2`).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_VERSION = "0.5.23"
RUNTIMES = frozenset({"native", "wsl2"})


@dataclass(frozen=True)
class SglangReleases:
    """SGLang releases, newest (the default) first; each serves every runtime SGLang runs on."""

    listed: tuple[str, ...]

    def versions(self, runtime: str | None) -> tuple[str, ...]:
        return self.listed if runtime is None or runtime in RUNTIMES else ()

    def normalise(self, version: str) -> str:
        """`v0.5.23` and `0.5.23` name the same release."""
        return version.removeprefix("v")

    def runtime_problem(self, version: str, runtime: str) -> str | None:
        if runtime in RUNTIMES:
            return None
        return f"SGLang {version} runs only on NVIDIA graphics cards under Linux or WSL2, not on {runtime}"


SHIPPED = SglangReleases((DEFAULT_VERSION,))
