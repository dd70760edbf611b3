"""Every child process the app starts goes through here, so every one gets the same treatment.

An argument list, never a shell. On Windows a console program (an engine, `wsl.exe`, a probe, pip)
started by the windowed app would get a console window of its own, visible for its whole life,
and closing it would kill the child: each child is started with `CREATE_NO_WINDOW` instead (the
flag is ignored with `DETACHED_PROCESS`, which a child that must outlive the app asks for and
which opens no console either). `tests/system/test_children.py` fails on any start outside this
module.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

CREATE_NO_WINDOW = 0x08000000  # winbase.h; defined here so the flag is the same on every system
DETACHED_PROCESS = 0x00000008
CREATE_NEW_PROCESS_GROUP = 0x00000200


def creation_flags(extra: int = 0, *, system: str | None = None) -> int:
    """`extra` plus what every child needs on Windows (no console window); 0 elsewhere."""
    if (system or os.name) != "nt":
        return 0
    return extra if extra & DETACHED_PROCESS else extra | CREATE_NO_WINDOW


def run(argv: Sequence[str], *, timeout_s: float, env: Mapping[str, str] | None = None,
        cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run a short child to the end (stdout and stderr captured as text, stdin closed).

    Raises OSError when it cannot start and `subprocess.TimeoutExpired` past `timeout_s`.
    """
    return subprocess.run(  # noqa: S603 - an argument list, never a shell
        list(argv), capture_output=True, text=True, encoding="utf-8", errors="replace",
        timeout=timeout_s, check=False, stdin=subprocess.DEVNULL,
        env=None if env is None else dict(env), cwd=cwd, creationflags=creation_flags(),
    )


def run_bytes(argv: Sequence[str], *, timeout_s: float,
              env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
    """`run`, with stdout and stderr as bytes (a child whose encoding the caller decides)."""
    return subprocess.run(  # noqa: S603 - an argument list, never a shell
        list(argv), capture_output=True, timeout=timeout_s, check=False, stdin=subprocess.DEVNULL,
        env=None if env is None else dict(env), creationflags=creation_flags(),
    )


def popen(argv: Sequence[str], *, flags: int = 0, **options: Any) -> subprocess.Popen[bytes]:
    """Start a long-lived child (`options` as `subprocess.Popen` takes them, `flags` its Windows
    creation flags); raises OSError when it cannot start."""
    return subprocess.Popen(  # noqa: S603 - an argument list, never a shell
        list(argv), creationflags=creation_flags(flags), **options,
    )


def call(argv: Sequence[str]) -> int:
    """Run a child in the foreground and return its exit status (a hand-over to another build)."""
    return subprocess.call(list(argv), creationflags=creation_flags())  # noqa: S603


async def start(argv: Sequence[str], *, flags: int = 0, **options: Any) -> asyncio.subprocess.Process:
    """Start a child on the running loop (`options` as `asyncio.create_subprocess_exec` takes them)."""
    return await asyncio.create_subprocess_exec(*argv, creationflags=creation_flags(flags), **options)
