"""Finding SGLang on this machine: a venv (or its Python) named with `--engine-bin`. Package
metadata only. On Windows it runs only inside WSL2, where `engines.finding` looks for the app's own
installs instead.
"""

from __future__ import annotations

import re
from pathlib import Path

from worker.engines.base import VersionRunner
from worker.hardware.model import EngineInstall

_DIST_INFO = re.compile(r"^sglang-(\d[^-]*)\.dist-info$")


def find_sglang(system: str, where: str | None, run: VersionRunner) -> EngineInstall:
    """SGLang in the venv at `where`; else not found, as the app installs it into a venv of its own
    rather than into its own Python."""
    if where:
        return _sglang_at(Path(where))
    return EngineInstall(version=None)


def _sglang_at(path: Path) -> EngineInstall:
    """A venv folder or a Python inside one: the version its `sglang` record carries, and that
    Python (which runs the launcher)."""
    venv = path if path.is_dir() else path.parent.parent
    for site in [*venv.glob("lib/python*/site-packages"), venv / "Lib" / "site-packages"]:
        for entry in site.glob("sglang-*.dist-info") if site.is_dir() else ():
            if match := _DIST_INFO.match(entry.name):
                python = path if path.is_file() else _venv_python(venv)
                return EngineInstall(version=match.group(1), path=str(python) if python else None)
    return EngineInstall(version=None)


def _venv_python(venv: Path) -> Path | None:
    return next((p for p in (venv / "bin" / "python3", venv / "Scripts" / "python.exe") if p.is_file()), None)
