"""Stopping a child process the way a person's Ctrl-C would, for tests and benchmarks."""

from __future__ import annotations

import asyncio
import signal


async def terminate(process: asyncio.subprocess.Process, grace_s: float = 30.0) -> None:
    """SIGTERM (the node drains and stops its engines), then SIGKILL if it takes longer than `grace_s`."""
    if process.returncode is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(process.wait(), grace_s)
    except TimeoutError:
        process.kill()
        await process.wait()
