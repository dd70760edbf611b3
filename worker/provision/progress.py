"""Throttled progress events (bytes, rate, ETA) for downloads and installs."""

from __future__ import annotations

import time
from collections.abc import Callable

from worker.contract.events import DownloadProgress
from worker.engines.installing import ProgressCallback

__all__ = ["ProgressCallback", "ProgressMeter"]


class ProgressMeter:
    """Turns a running byte count into `DownloadProgress` events, at most `max_per_s` a second.

    The rate counts only bytes moved in this session (a resumed download's earlier bytes would
    otherwise make it look impossibly fast); the first and final events are always sent.
    """

    def __init__(
        self,
        what: str,
        on_progress: ProgressCallback,
        *,
        total_bytes: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_per_s: float = 5.0,
    ) -> None:
        self.what = what
        self.total_bytes = total_bytes
        self._on_progress = on_progress
        self._clock = clock
        self._interval = 1.0 / max_per_s
        self._started_at = clock()
        self._start_bytes: int | None = None
        self._last_sent: float | None = None
        self.done_bytes = 0

    def start(self, done_bytes: int, total_bytes: int | None) -> None:
        """A (re)started transfer: `done_bytes` are already on disk and don't count toward the rate."""
        self.total_bytes = total_bytes
        self.done_bytes = done_bytes
        self._start_bytes = done_bytes
        self._started_at = self._clock()
        self._emit(self._event())

    def update(self, done_bytes: int) -> None:
        self.done_bytes = done_bytes
        now = self._clock()
        if self._last_sent is not None and now - self._last_sent < self._interval:
            return
        self._emit(self._event())

    def finish(self) -> None:
        done = self.total_bytes if self.total_bytes is not None else self.done_bytes
        self._emit(DownloadProgress(self.what, done, self.total_bytes, finished=True))

    def fail(self, error: str) -> None:
        self._emit(DownloadProgress(self.what, self.done_bytes, self.total_bytes, error=error))

    def _event(self) -> DownloadProgress:
        rate = self._rate()
        eta = None
        if rate and self.total_bytes is not None:
            eta = max(0.0, (self.total_bytes - self.done_bytes) / rate)
        return DownloadProgress(self.what, self.done_bytes, self.total_bytes, rate_bps=rate, eta_s=eta)

    def _rate(self) -> float | None:
        elapsed = self._clock() - self._started_at
        moved = self.done_bytes - (self._start_bytes or 0)
        if elapsed <= 0 or moved <= 0:
            return None
        return moved / elapsed

    def _emit(self, event: DownloadProgress) -> None:
        self._last_sent = self._clock()
        self._on_progress(event)
