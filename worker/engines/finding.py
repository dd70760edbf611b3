"""Which registered engines this machine already has, and whether one of them drives its NVIDIA
cards: the engines' part of detection, which `hardware.detect` is handed (`Finder`), as the
hardware package sits below this one.

Each adapter's `find_installed` (its `<engine>/find.py`) does the looking; `--engine-bin NAME=PATH`
(`engine_bins`) says where to look instead. A version probe that runs an engine binary is a
subprocess bounded by a timeout, run only for a binary that is there.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field

from worker.engines import registry
from worker.engines.base import EngineAdapter, GpuGroups, VersionRunner, child_environment
from worker.hardware.model import IN_WSL, EngineInstall, GpuGroup
from worker.system import children

_LINUX_GPU_RUNTIMES = frozenset({"native", "wsl2"})  # NVIDIA cards on Linux, or inside WSL2 on Windows


def run_for_version(argv: list[str], timeout_s: float, env: Mapping[str, str] | None = None) -> str | None:
    """stdout and stderr together (llama-server prints its version on stderr), or None.

    The probe runs an engine binary, so it gets what an engine child gets: `env` (default: the
    app's own) without the provider token, engine keys or `LLAMA_ARG_*`."""
    try:
        done = children.run(argv, timeout_s=timeout_s,
                            env=child_environment(os.environ if env is None else env))
    except (OSError, subprocess.SubprocessError):
        return None
    return (done.stdout or "") + (done.stderr or "") if done.returncode == 0 else None


def find_engines(
    system: str,
    engine_bins: Mapping[str, str] | None = None,
    run: VersionRunner = run_for_version,
) -> dict[str, EngineInstall]:
    """Every registered engine, found or not (`version` None), by name."""
    bins = engine_bins or {}
    return {adapter.NAME: adapter.find_installed(system, bins.get(adapter.NAME), run)
            for adapter in registry.adapters()}


def drives(group: GpuGroup, found: Mapping[str, EngineInstall], system: str) -> bool:
    """Whether a registered engine that serves NVIDIA cards on Linux runs on `group`: here, or on
    Windows only where it is installed inside WSL2. This names the runtime (`native`, `wsl2`)."""
    return any(_serves(adapter, group) for adapter in registry.adapters()
               if adapter.RUNTIMES & _LINUX_GPU_RUNTIMES
               and (system != "Windows" or found.get(adapter.NAME, EngineInstall(None)).path == IN_WSL))


def _serves(adapter: EngineAdapter, group: GpuGroup) -> bool:
    """The adapter's own rule (`GpuGroups`), else every NVIDIA group."""
    return adapter.serves_group(group) if isinstance(adapter, GpuGroups) else True


@dataclass(frozen=True)
class Finder:
    """The registry's engines as `hardware.detect` asks for them (`hardware.detect.EngineFinder`)."""

    engine_bins: Mapping[str, str] = field(default_factory=dict)
    run: VersionRunner = run_for_version

    def find(self, system: str) -> dict[str, EngineInstall]:
        return find_engines(system, self.engine_bins, self.run)

    def drives(self, group: GpuGroup, found: Mapping[str, EngineInstall], system: str) -> bool:
        return drives(group, found, system)
