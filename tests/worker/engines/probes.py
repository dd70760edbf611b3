"""Small executables that stand in for an engine binary's `--version` (real processes, run for real)."""

from __future__ import annotations

import stat
from pathlib import Path


def script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path
