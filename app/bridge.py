"""The one QObject that holds the core's Node and turns its snapshots into a Qt signal.

The Node calls back on the core's loop thread; emitting a signal whose receivers live in the GUI
thread queues the call there, so widgets are only touched on the GUI thread. Commands go the
other way as plain method calls, which the Node makes thread-safe.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from PySide6.QtCore import QObject, Signal

from worker.system.config import Settings
from worker.contract.events import NodeSnapshot, Problem

TOMORROW_HOUR = 6  # "until tomorrow" means tomorrow morning, not midnight tonight


class SharePreviewLike(Protocol):
    """What the Settings slider needs of `worker.plan.share_preview.SharePreview`."""

    @property
    def words(self) -> str: ...


class NodeLike(Protocol):
    """The Node surface the app uses (worker/node/node.py, or a scripted stand-in in tests)."""

    async def run(self) -> None: ...

    def subscribe(self, callback: Callable[[NodeSnapshot], None]) -> Callable[[], None]: ...

    def snapshot(self) -> NodeSnapshot: ...

    def pause(self, duration_s: float | None = None, reason: str = "user") -> None: ...

    def resume(self) -> None: ...

    def shutdown(self) -> None: ...

    def save_settings(self, settings: Settings) -> None: ...

    def token_changed(self) -> None: ...

    def sign_out(self) -> None: ...

    def retry(self) -> None: ...

    def install_update_now(self) -> None: ...

    def history(self, series: str, since: float) -> list[tuple[float, float]]: ...

    def log_files(self) -> dict[str, Path]: ...

    def pause_download(self) -> None: ...

    def resume_download(self) -> None: ...

    def cancel_download(self) -> None: ...

    def preview_share(self, gpu_index: int, pct: int) -> SharePreviewLike: ...


def seconds_until_tomorrow(now: dt.datetime) -> float:
    """Seconds from `now` (local, naive) to tomorrow at TOMORROW_HOUR:00."""
    tomorrow = (now + dt.timedelta(days=1)).replace(hour=TOMORROW_HOUR, minute=0, second=0, microsecond=0)
    return (tomorrow - now).total_seconds()


class Bridge(QObject):
    snapshot_changed = Signal(object)  # NodeSnapshot
    core_failed = Signal(object)  # Problem: the core itself stopped, so no snapshot will say so

    def __init__(self, node: NodeLike, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.node = node
        self.latest: NodeSnapshot = node.snapshot()
        self._crossed = self.latest.without_clock()  # what the GUI thread was last handed, clock zeroed
        self.snapshot_changed.connect(self._remember)
        self._unsubscribe = node.subscribe(self._from_core)
        self._stop_requested = False

    def _from_core(self, snapshot: NodeSnapshot) -> None:
        """On the core's thread: only a snapshot that shows something new crosses to the GUI's.
        An idle node's once-a-second tick moves only its clock, and each crossing wakes the GUI
        thread (a good part of a hidden app's idle CPU)."""
        visible = snapshot.without_clock()
        if visible == self._crossed:
            return
        self._crossed = visible
        self.snapshot_changed.emit(snapshot)

    def _remember(self, snapshot: NodeSnapshot) -> None:
        self.latest = snapshot

    def report_core_failure(self, error: BaseException) -> None:
        """Called on the core's thread as it dies; the signal carries the news to the GUI thread."""
        self.core_failed.emit(
            Problem(
                "GPU Provider stopped serving",
                f"The serving core stopped after an error ({type(error).__name__}: {error}). "
                "Quit and start GPU Provider again; View logs has the details.",
            )
        )

    def pause(self) -> None:
        self.node.pause(None, "user")

    def pause_for(self, seconds: float) -> None:
        self.node.pause(seconds, "timed")

    def pause_until_tomorrow(self, now: Callable[[], dt.datetime] = dt.datetime.now) -> None:
        self.pause_for(seconds_until_tomorrow(now()))

    def resume(self) -> None:
        self.node.resume()

    def save_settings(self, settings: Settings) -> None:
        """The core saves them (its one save path) and applies them; `OSError` where it could not."""
        self.node.save_settings(settings)

    def token_changed(self) -> None:
        """A token was stored: the link stops waiting in `signed_out` and connects now."""
        self.node.token_changed()

    def sign_out(self) -> None:
        """The token was removed: the core closes the link and waits in `signed_out`."""
        self.node.sign_out()

    def retry(self) -> None:
        """The person's Retry: try a failed start, download or connection again now."""
        self.node.retry()

    def install_update_now(self) -> None:
        """Restart to update: apply the staged update now (after the drain)."""
        self.node.install_update_now()

    def pause_download(self) -> None:
        """Hold the download (the person's own hold: no bytes move until Resume)."""
        self.node.pause_download()

    def resume_download(self) -> None:
        self.node.resume_download()

    def cancel_download(self) -> None:
        """Stop the download and drop what it fetched so far."""
        self.node.cancel_download()

    def preview_share(self, gpu_index: int, pct: int) -> str:
        """What lending `pct` % of a card's memory would leave and hold, in words, before saving."""
        return self.node.preview_share(gpu_index, pct).words

    def history(
        self, series: str, window_s: float, clock: Callable[[], float] = time.time
    ) -> list[tuple[float, float]]:
        return self.node.history(series, clock() - window_s)

    def log_files(self) -> dict[str, Path]:
        return self.node.log_files()

    def request_stop(self) -> None:
        """Quit was asked: the core drains and stops while snapshots keep coming ("Stopping…")."""
        if not self._stop_requested:
            self._stop_requested = True
            self.node.shutdown()

    def shutdown(self) -> None:
        """Stop listening, then ask the core to stop its engines and end its loop (once)."""
        self._unsubscribe()
        self.request_stop()
