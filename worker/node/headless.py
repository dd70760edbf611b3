"""`gpu-provider run --headless`: the whole node without Qt, its progress as log lines."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from pathlib import Path
from typing import Any

from worker.system.applog import configure
from worker.system.config import Paths, Settings
from worker.contract.events import NodeSnapshot
from worker.node.node import Node

log = logging.getLogger(__name__)


class _ProgressLines:
    """Headless mode's progress bar: one log line per download every few seconds."""

    def __init__(self, every_s: float = 3.0) -> None:
        self._every_s = every_s
        self._last: dict[str, float] = {}

    def __call__(self, snap: NodeSnapshot) -> None:
        now = time.monotonic()
        for d in snap.downloads:
            if now - self._last.get(d.what, 0.0) < self._every_s:
                continue
            self._last[d.what] = now
            if d.step:
                log.info("%s: %s", d.what, d.step)
                continue
            share = f"{d.fraction:.0%} " if d.fraction is not None else ""
            total = f" of {d.total_bytes / 1e6:,.0f} MB" if d.total_bytes else ""
            rate = f", {d.rate_bps / 1e6:,.1f} MB/s" if d.rate_bps else ""
            eta = f", {d.eta_s:,.0f} s left" if d.eta_s is not None else ""
            log.info("downloading %s: %s(%s MB%s%s%s)", d.what, share, f"{d.done_bytes / 1e6:,.0f}", total, rate, eta)


def run_headless(
    paths: Paths,
    settings: Settings,
    *,
    coordinator_url: str,
    hardware_override: Path | None = None,
    engine_bins: dict[str, str] | None = None,
    model: str | None = None,
    openai_port: int | None = None,
    local_tune: dict[str, Any] | None = None,
    verbose: bool = False,
) -> int:
    """The node until Ctrl-C / SIGTERM, which drain and exit 0."""
    configure(paths, console=True, verbose=verbose)
    node = Node(
        paths,
        settings,
        coordinator_url=coordinator_url,
        hardware_override=hardware_override,
        engine_bins=engine_bins,
        model=model,
        openai_port=openai_port,
        local_tune=local_tune,
    )
    node.subscribe(_ProgressLines())

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, node.shutdown)
            except (NotImplementedError, RuntimeError):  # Windows: Ctrl-C arrives as KeyboardInterrupt
                pass
        await node.run()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass
    log.info("stopped")
    return 0
