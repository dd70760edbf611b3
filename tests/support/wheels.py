"""Tiny wheels written directly as zip files, so pip installs run offline from a folder (`--find-links`)."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from collections.abc import Mapping
from pathlib import Path


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def write_wheel(
    folder: Path,
    name: str,
    version: str,
    files: Mapping[str, str],
    *,
    console_scripts: Mapping[str, str] | None = None,
) -> Path:
    """A pure-Python wheel `name-version-py3-none-any.whl` holding `files` (path → source)."""
    dist_info = f"{name}-{version}.dist-info"
    contents: dict[str, bytes] = {path: text.encode() for path, text in files.items()}
    contents[f"{dist_info}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    contents[f"{dist_info}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    if console_scripts:
        lines = "".join(f"{script} = {target}\n" for script, target in console_scripts.items())
        contents[f"{dist_info}/entry_points.txt"] = f"[console_scripts]\n{lines}".encode()
    record = "".join(f"{path},{_record_hash(data)},{len(data)}\n" for path, data in contents.items())
    contents[f"{dist_info}/RECORD"] = (record + f"{dist_info}/RECORD,,\n").encode()
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as out:
        for path, data in contents.items():
            out.writestr(path, data)
    return wheel


def fake_vllm_wheel(folder: Path, version: str) -> Path:
    """A `vllm` stand-in whose `vllm --version` prints `version`, as the real CLI does."""
    cli = (
        "import sys\n"
        "from vllm import __version__\n\n"
        "def main() -> None:\n"
        "    if '--version' in sys.argv[1:]:\n"
        "        print(__version__)\n"
        "        return\n"
        "    sys.exit('this test stand-in only answers --version')\n"
    )
    return write_wheel(
        folder,
        "vllm",
        version,
        {"vllm/__init__.py": f"__version__ = {version!r}\n", "vllm/cli.py": cli},
        console_scripts={"vllm": "vllm.cli:main"},
    )
