"""Fixtures for the tests that start real processes."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Start a real process that the OS names `name` (a link to Python so named), ready once it returns.

    `argv0` stands in for the command line's first word: Wine and Proton put a Windows path there.
    """
    started: list[subprocess.Popen[bytes]] = []

    def start(name: str, argv0: str | None = None) -> subprocess.Popen[bytes]:
        link = tmp_path / name
        link.symlink_to(sys.executable)
        code = "print('up', flush=True); import time; time.sleep(120)"
        process = subprocess.Popen([argv0 or str(link), "-c", code], executable=link, stdout=subprocess.PIPE)
        started.append(process)
        assert process.stdout is not None and process.stdout.readline() == b"up\n"  # exec'd and running
        return process

    yield start
    for process in started:
        process.kill()
        process.wait()
        if process.stdout is not None:
            process.stdout.close()
