"""Finding vLLM on this machine: a venv or executable named with `--engine-bin`, or the app's own
Python. On Windows it runs only inside WSL2, where `engines.finding` looks for the app's own
installs instead.

Fast on the common path: package metadata first; a bounded subprocess only for an executable
that is there.
"""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

from worker.engines.base import VersionRunner
from worker.hardware.model import EngineInstall

_DIST_INFO = re.compile(r"^vllm-(\d[^-]*)\.dist-info$")
_PLAIN_VERSION = re.compile(r"(\d+\.\d+\.\d+\S*)")


def find_vllm(system: str, where: str | None, run: VersionRunner) -> EngineInstall:
    """vLLM at `where`, else in the app's own Python (`system`: the same on every Linux-like one)."""
    if where:
        return _vllm_at(Path(where), run)
    try:
        return EngineInstall(version=importlib.metadata.version("vllm"))
    except importlib.metadata.PackageNotFoundError:
        return EngineInstall(version=None)


def _vllm_at(path: Path, run: VersionRunner) -> EngineInstall:
    """A venv folder, or an executable inside one (read its metadata), or any `vllm` to ask."""
    venv = path if path.is_dir() else path.parent.parent
    for site in [*venv.glob("lib/python*/site-packages"), venv / "Lib" / "site-packages"]:
        for entry in site.glob("vllm-*.dist-info") if site.is_dir() else ():
            match = _DIST_INFO.match(entry.name)
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
