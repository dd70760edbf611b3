"""Which engines this machine already has, and their versions.

Fast on the common path: importlib metadata and `shutil.which` first; a subprocess (bounded by a
timeout) only for an engine binary that is actually there, or for the WSL2 probe on Windows.
`engine_bins` (from `--engine-bin NAME=PATH`) says where to look instead. Each registered engine's
adapter (`find_installed`) picks its finder here.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Callable, Mapping

from worker.engines import registry
from worker.engines.base import child_environment
from worker.hardware.model import EngineInstall

VersionRunner = Callable[[list[str], float, Mapping[str, str] | None], str | None]

_VLLM_DIST_INFO = re.compile(r"^vllm-(\d[^-]*)\.dist-info$")
_LLAMA_VERSION = re.compile(r"version:\s*(\S+)(?:\s*\((\w+)\))?")
_PLAIN_VERSION = re.compile(r"(\d+\.\d+\.\d+\S*)")
WSL_VLLM_PROBE = ["wsl.exe", "-e", "python3", "-c", "import importlib.metadata as m; print(m.version('vllm'))"]


def run_for_version(argv: list[str], timeout_s: float, env: Mapping[str, str] | None = None) -> str | None:
    """stdout and stderr together (llama-server prints its version on stderr), or None.

    The probe runs an engine binary, so it gets what an engine child gets: `env` (default: the
    app's own) without the provider token, engine keys or `LLAMA_ARG_*`."""
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout_s, check=False,
            env=child_environment(os.environ if env is None else env),
        )
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


def find_vllm(system: str, where: str | None, run: VersionRunner) -> EngineInstall:
    """vLLM runs on Linux only: on Windows it can only be inside WSL2, so ask there (bounded)."""
    if where:
        return _vllm_at(Path(where), run)
    if system == "Windows":
        match = _PLAIN_VERSION.search(run(WSL_VLLM_PROBE, 5.0, None) or "")
        return EngineInstall(version=match.group(1) if match else None, path="wsl" if match else None)
    try:
        return EngineInstall(version=importlib.metadata.version("vllm"))
    except importlib.metadata.PackageNotFoundError:
        return EngineInstall(version=None)


def _vllm_at(path: Path, run: VersionRunner) -> EngineInstall:
    """A venv folder, or an executable inside one (read its metadata), or any `vllm` to ask."""
    venv = path if path.is_dir() else path.parent.parent
    for site in [*venv.glob("lib/python*/site-packages"), venv / "Lib" / "site-packages"]:
        for entry in site.glob("vllm-*.dist-info") if site.is_dir() else ():
            match = _VLLM_DIST_INFO.match(entry.name)
            if match:
                executable = path if path.is_file() else _venv_executable(venv)
                return EngineInstall(version=match.group(1), path=str(executable) if executable else None)
    if path.is_file():
        match = _PLAIN_VERSION.search(run([str(path), "--version"], 30.0, None) or "")
        return EngineInstall(version=match.group(1) if match else None, path=str(path))
    return EngineInstall(version=None)


def _venv_executable(venv: Path) -> Path | None:
    for candidate in (venv / "bin" / "vllm", venv / "Scripts" / "vllm.exe"):
        if candidate.is_file():
            return candidate
    return None


def find_llama_server(where: str | None, run: VersionRunner) -> EngineInstall:
    path = where or shutil.which("llama-server")
    if not path or not Path(path).is_file():
        return EngineInstall(version=None)
    folder = str(Path(path).resolve().parent)
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (folder, env.get("LD_LIBRARY_PATH", "")) if p)
    return EngineInstall(version=parse_llama_version(run([path, "--version"], 5.0, env) or ""), path=path)


def parse_llama_version(output: str) -> str | None:
    """`version: 6153 (abc1234)` → `b6153`; `version: 0.6.0-dev` stays as printed."""
    match = _LLAMA_VERSION.search(output)
    if not match:
        return None
    version = match.group(1)
    return f"b{version}" if version.isdigit() else version
