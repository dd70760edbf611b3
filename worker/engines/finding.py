"""Which registered engines this machine already has, and whether one of them drives its NVIDIA
cards: the engines' part of detection, which `hardware.detect` is handed (`Finder`), as the
hardware package sits below this one.

Each adapter's `find_installed` (its `<engine>/find.py`) does the looking; `--engine-bin NAME=PATH`
(`engine_bins`) says where to look instead. A version probe that runs an engine binary is a
subprocess bounded by a timeout, run only for a binary that is there.

On Windows an engine that does not run on Windows itself lives inside WSL2, in the app's own
venvs (`installing.WSL_ENGINES_DIR`), never in the distribution's system Python (which PEP 668
keeps pip out of): one bounded probe lists the finished ones of every such engine.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from worker.engines import registry
from worker.engines.base import EngineAdapter, GpuGroups, VersionRunner, child_environment
from worker.engines.installing import MARKER, WSL_ENGINES_DIR, version_key
from worker.hardware.model import IN_WSL, EngineInstall, GpuGroup
from worker.system import children, wsl

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
    wsl_distro: str | None = None,
) -> dict[str, EngineInstall]:
    """Every registered engine, found or not (`version` None), by name; on Windows, an engine that
    runs only inside WSL2 is looked for in `wsl_distro` (not at all where there is none)."""
    bins = engine_bins or {}
    in_wsl = [a for a in registry.adapters() if system == "Windows" and "windows" not in a.RUNTIMES]
    inside = find_in_wsl([a.NAME for a in in_wsl], wsl_distro, run) if in_wsl and wsl_distro else {}
    return {adapter.NAME: _newest_inside(adapter, inside.get(adapter.NAME, ())) if adapter in in_wsl
            else adapter.find_installed(system, bins.get(adapter.NAME), run)
            for adapter in registry.adapters()}


# Run by the distribution's python3 inside WSL2: the finished installs (marker naming the folder's
# version) of each engine named, under the user's home, as one JSON line; at most 32 per engine.
_WSL_PROBE = """
import json, pathlib, sys
root, marker = pathlib.Path.home() / sys.argv[1], sys.argv[2]
found = {}
for engine in sys.argv[3:]:
    for folder in sorted(root.glob(engine + "-*"))[:32]:
        version = folder.name[len(engine) + 1:]
        try:
            done = (folder / marker).read_text()[:64].strip() == version
        except OSError:
            done = False
        if done:
            found.setdefault(engine, []).append(version)
print(json.dumps(found))
"""
_WSL_PROBE_TIMEOUT_S = 30.0  # a stopped distribution boots first
_VERSION = re.compile(r"[0-9][0-9A-Za-z.+-]{0,40}")


def find_in_wsl(engines: Sequence[str], distro: str | None, run: VersionRunner) -> dict[str, tuple[str, ...]]:
    """The versions of `engines` the app installed (and finished) inside `distro`, by engine; none
    where the probe fails, hangs or answers what is no such list."""
    argv = wsl.command(["python3", "-c", _WSL_PROBE, str(WSL_ENGINES_DIR), MARKER, *engines], distro=distro)
    answer = run(argv, _WSL_PROBE_TIMEOUT_S, None) or ""
    line = next((line for line in answer[:wsl.MAX_OUTPUT_BYTES].splitlines() if line.startswith("{")), "{}")
    try:
        listed = json.loads(line)
    except ValueError:
        return {}
    if not isinstance(listed, dict):
        return {}
    return {engine: tuple(v for v in versions if isinstance(v, str) and _VERSION.fullmatch(v))
            for engine, versions in listed.items() if engine in engines and isinstance(versions, list)}


def _newest_inside(adapter: EngineAdapter, versions: Sequence[str]) -> EngineInstall:
    """The newest install inside WSL2 of a release this app ships (`IN_WSL`), else not found."""
    shipped = adapter.RELEASES.versions(None)
    listed = [v for v in versions if adapter.RELEASES.normalise(v) in shipped]
    newest = max(listed, key=version_key, default=None)
    return EngineInstall(newest, IN_WSL if newest else None)


def drives(group: GpuGroup) -> bool:
    """Whether a registered engine that serves NVIDIA cards on Linux runs on `group` (on Windows,
    inside WSL2, where the app installs it when missing). This names the runtime (`native`, `wsl2`);
    whether Windows has a WSL2 distribution for it is the caller's question."""
    return any(_serves(adapter, group) for adapter in registry.adapters() if adapter.RUNTIMES & _LINUX_GPU_RUNTIMES)


def _serves(adapter: EngineAdapter, group: GpuGroup) -> bool:
    """The adapter's own rule (`GpuGroups`), else every NVIDIA group."""
    return adapter.serves_group(group) if isinstance(adapter, GpuGroups) else True


@dataclass(frozen=True)
class Finder:
    """The registry's engines as `hardware.detect` asks for them (`hardware.detect.EngineFinder`)."""

    engine_bins: Mapping[str, str] = field(default_factory=dict)
    run: VersionRunner = run_for_version

    def find(self, system: str, wsl_distro: str | None = None) -> dict[str, EngineInstall]:
        return find_engines(system, self.engine_bins, self.run, wsl_distro)

    def drives(self, group: GpuGroup) -> bool:
        return drives(group)
