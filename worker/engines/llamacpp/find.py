"""Finding `llama-server` on this machine (named with `--engine-bin`, else on PATH) and reading
its build from `--version`, a bounded subprocess run only where the binary is there."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from worker.engines.base import VersionRunner
from worker.hardware.model import EngineInstall

_VERSION = re.compile(r"version:\s*(\S+)(?:\s*\((\w+)\))?")


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
    match = _VERSION.search(output)
    if not match:
        return None
    version = match.group(1)
    return f"b{version}" if version.isdigit() else version
