"""Tiny stand-ins for release builds: archives whose `gpu-provider` is a script.

The script behaves like a new version of the app would at start: it writes the hello marker
through the real `mark_hello_reached` (or crashes, or hangs), reading `--data-dir` from argv.
"""

from __future__ import annotations

import hashlib
import io
import sys
import tarfile
import zipfile

BEHAVIOURS = {
    "good": (
        "from worker.system.config import Paths\n"
        "from worker.update import mark_hello_reached\n"
        "mark_hello_reached(Paths.under(data_dir), VERSION)"
    ),
    "launcher": (  # a good build that records the launcher it was told about
        "open(data_dir + '/launcher.txt', 'w').write(os.environ.get('GPU_PROVIDER_LAUNCHER', ''))\n"
        "from worker.system.config import Paths\n"
        "from worker.update import mark_hello_reached\n"
        "mark_hello_reached(Paths.under(data_dir), VERSION)"
    ),
    "crash": "sys.exit(3)",
    "hang": "open(data_dir + '/hang.pid', 'w').write(str(os.getpid())); time.sleep(60)",
}

SCRIPT = """#!{python}
import os, sys, time
VERSION = {version!r}
data_dir = sys.argv[sys.argv.index("--data-dir") + 1]
{behaviour}
"""


def script(version: str, behaviour: str = "good") -> bytes:
    return SCRIPT.format(
        python=sys.executable, version=version, behaviour=BEHAVIOURS[behaviour]
    ).encode()


def tarball(
    version: str, behaviour: str = "good", *, folder: str | None = None
) -> bytes:
    """A .tar.gz of a one-folder build; `folder` nests it in one top-level folder."""
    prefix = f"{folder}/" if folder else ""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        _add(tar, f"{prefix}gpu-provider", script(version, behaviour), 0o755)
        _add(tar, f"{prefix}_internal/VERSION", version.encode(), 0o644)
    return buffer.getvalue()


def zipped(version: str) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("gpu-provider", script(version))
        archive.writestr("_internal/VERSION", version)
    return buffer.getvalue()


def _add(tar: tarfile.TarFile, name: str, data: bytes, mode: int) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = mode
    tar.addfile(info, io.BytesIO(data))


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
