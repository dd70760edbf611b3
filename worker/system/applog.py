"""Logging for the app and the headless node: readable lines, a rotated file, no token ever.

Both front ends (the Qt app and `gpu-provider run --headless`) call `configure` once, so the logs
view, "copy diagnostics" and a support request all read the same file.
"""

from __future__ import annotations

import io
import logging
import logging.handlers
import sys
from pathlib import Path
from typing import cast

from worker.system.config import Paths, private_dir, private_opener
from worker.system.secrets import install_redaction

LOG_FILE_NAME = "gpu-provider.log"
_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


def log_file(paths: Paths) -> Path:
    return paths.log_dir / LOG_FILE_NAME


class _PrivateRotatingFileHandler(logging.handlers.RotatingFileHandler):
    """Each log file (the current one and every one a rollover starts) is this user's alone (0600):
    logs name models, paths and hardware."""

    def _open(self) -> io.TextIOWrapper:
        stream = open(self.baseFilename, self.mode, encoding=self.encoding, errors=self.errors,  # noqa: SIM115
                      opener=private_opener)
        return cast(io.TextIOWrapper, stream)


def configure(paths: Paths, *, console: bool, verbose: bool = False) -> Path:
    """Root logger → `logs/gpu-provider.log` (5 × 2 MB) and, when `console`, stderr."""
    private_dir(paths.log_dir)
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    file_handler = _PrivateRotatingFileHandler(log_file(paths), maxBytes=2_000_000, backupCount=5, encoding="utf-8")
    file_handler.setFormatter(logging.Formatter(_FORMAT))
    root.addHandler(file_handler)
    if console:
        stream = logging.StreamHandler(sys.stderr)
        stream.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        root.addHandler(stream)
    for noisy in ("httpx", "httpcore", "websockets", "huggingface_hub", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    install_redaction(root)
    return log_file(paths)
