"""Throttled progress events (bytes, speed, time left, why a download waits) for downloads and installs."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Literal

from worker.contract.events import DownloadHold, DownloadProgress
from worker.engines.installing import ProgressCallback
from worker.provision.transfer import TransferControl

__all__ = ["ProgressCallback", "ProgressMeter"]

RATE_WINDOW_S = 5.0  # the speed shown is over the last few seconds: it follows a limit or a slow patch
SAMPLE_EVERY_S = 0.1  # at most this many samples kept per second, so the window stays small


class ProgressMeter:
    """Turns a running byte count into `DownloadProgress` events, at most `max_per_s` a second.

    The speed is a moving average over the last `RATE_WINDOW_S` and counts only bytes moved in this
    transfer (a resumed download's earlier bytes would otherwise make it look impossibly fast). While
    `control` holds downloads the event says why, with no speed or time left, and the wait does not
    drag the speed down afterwards. The first and final events, and a change of hold, are always sent;
    while a hold lasts, nothing more is (no figure moves).
    """

    def __init__(
        self,
        what: str,
        on_progress: ProgressCallback,
        *,
        total_bytes: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_per_s: float = 5.0,
        control: TransferControl | None = None,
        kind: Literal["model", "engine"] | None = None,
    ) -> None:
        self.what = what
        self.total_bytes = total_bytes
        self.kind: Literal["model", "engine"] = kind or ("model" if what.startswith("model") else "engine")
        self._on_progress = on_progress
        self._clock = clock
        self._interval = 1.0 / max_per_s
        self._control = control
        self._samples: deque[tuple[float, int]] = deque()
        self._last_sent: float | None = None
        self._last_held: tuple[DownloadHold, str | None] | None = None
        self.done_bytes = 0

    def start(self, done_bytes: int, total_bytes: int | None) -> None:
        """A (re)started transfer: `done_bytes` are already on disk and don't count toward the speed."""
        self.total_bytes = total_bytes
        self.done_bytes = done_bytes
        self._samples.clear()
        self._samples.append((self._clock(), done_bytes))
        self._emit(self._event())

    def update(self, done_bytes: int) -> None:
        self.done_bytes = done_bytes
        now = self._clock()
        held = self._held()
        if held is not None and held == self._last_held:
            return  # nothing moves while held, and the last event already says why
        if held != self._last_held:
            self._samples.clear()  # the speed after a wait starts from where it resumed
        if not self._samples or now - self._samples[-1][0] >= SAMPLE_EVERY_S:
            self._samples.append((now, done_bytes))
        while len(self._samples) > 1 and self._samples[1][0] <= now - RATE_WINDOW_S:
            self._samples.popleft()
        if held == self._last_held and self._last_sent is not None and now - self._last_sent < self._interval:
            return
        self._emit(self._event())

    def finish(self) -> None:
        done = self.total_bytes if self.total_bytes is not None else self.done_bytes
        self._emit(DownloadProgress(self.what, done, self.total_bytes, finished=True, kind=self.kind))

    def fail(self, error: str) -> None:
        self._emit(DownloadProgress(self.what, self.done_bytes, self.total_bytes, error=error, kind=self.kind))

    def cancelled(self) -> None:
        """The person cancelled: the download leaves the list (ended, with "cancelled" as its step), no error."""
        self._emit(DownloadProgress(self.what, self.done_bytes, self.total_bytes, finished=True, step="cancelled",
                                    kind=self.kind))

    def _held(self) -> tuple[DownloadHold, str | None] | None:
        return self._control.held() if self._control is not None else None

    def _event(self) -> DownloadProgress:
        held = self._held()
        self._last_held = held
        rate = None if held is not None else self._rate()
        eta = None
        if rate and self.total_bytes is not None:
            eta = max(0.0, (self.total_bytes - self.done_bytes) / rate)
        return DownloadProgress(self.what, self.done_bytes, self.total_bytes, rate_bps=rate, eta_s=eta,
                                held=held[0] if held else None, held_detail=held[1] if held else None,
                                kind=self.kind)

    def _rate(self) -> float | None:
        if not self._samples:
            return None
        since, bytes_then = self._samples[0]
        elapsed = self._clock() - since
        moved = self.done_bytes - bytes_then
        if elapsed <= 0 or moved <= 0:
            return None
        return moved / elapsed

    def _emit(self, event: DownloadProgress) -> None:
        self._last_sent = self._clock()
        self._on_progress(event)
