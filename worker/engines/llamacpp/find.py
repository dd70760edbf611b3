"""Finding `llama-server` on this machine (named with `--engine-bin`, else on PATH) and reading
its build from `--version`, a bounded subprocess run only where the binary is there.

One found on PATH (winget, scoop, Homebrew) counts only at a build this app ships with
(`releases.SHIPPED`): another build may lack the flags the app passes (`--fit` came late), and a
coordinator may only steer a node to listed builds. Any other is reported as absent, so the
shipped build is installed. One named with `--engine-bin` is the person's choice and stays as it is.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Collection
from pathlib import Path

from worker.engines.base import VersionRunner
from worker.engines.llamacpp.releases import SHIPPED
from worker.hardware.model import EngineInstall

_VERSION = re.compile(r"version:\s*(\S+)(?:\s*\((\w+)\))?")


def find_llama_server(where: str | None, run: VersionRunner,
                      shipped: Collection[str] = tuple(SHIPPED.builds)) -> EngineInstall:
    """The llama-server at `where` at whatever build it is; else the one on PATH, if its build is
    one of `shipped`."""
    path = where or shutil.which("llama-server")
    if not path or not Path(path).is_file():
        return EngineInstall(version=None)
    folder = str(Path(path).resolve().parent)
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (folder, env.get("LD_LIBRARY_PATH", "")) if p)
    version = parse_llama_version(run([path, "--version"], 5.0, env) or "")
    if where is None and version not in shipped:
        return EngineInstall(version=None)
    return EngineInstall(version=version, path=path)


def parse_llama_version(output: str) -> str | None:
    """`version: 6153 (abc1234)` → `b6153`; `version: 0.6.0-dev` stays as printed."""
    match = _VERSION.search(output)
    if not match:
        return None
    version = match.group(1)
    return f"b{version}" if version.isdigit() else version
