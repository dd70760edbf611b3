"""Who hears of the node, and when: the app's subscribers get every snapshot (with the downloads
in progress and the latest notices, the lender's reminders among them); the coordinator a `status`
whenever what it is shown changed (and when forced: a heartbeat, a new assignment); the status
file of `gpu-provider status` is rewritten when due."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel

from worker.contract import protocol
from worker.contract.events import DownloadProgress, NodeSnapshot
from worker.node.reminders import Reminders
from worker.node.view import status_key
from worker.node.status import StatusFile

log = logging.getLogger(__name__)

Subscriber = Callable[[NodeSnapshot], None]


NOTICES_KEPT = 10


class Publisher:
    """The subscribers (who may come and go from any thread), the latest snapshot, what the
    coordinator was last told, and what only the app is told: downloads and notices."""

    def __init__(self, snapshot: Callable[[], NodeSnapshot], status: Callable[[], protocol.Status],
                 send: Callable[[BaseModel], Awaitable[bool]], status_file: StatusFile,
                 reminders: Reminders | None = None) -> None:
        """`snapshot` and `status` build the node's current ones; `send` reaches the coordinator;
        `reminders` watch the snapshots for the notices a lender asked for."""
        self._reminders = reminders
        self._build_snapshot = snapshot
        self._build_status = status
        self._send = send
        self._status_file = status_file
        self._subscribers: list[Subscriber] = []
        self._lock = threading.Lock()
        self._last_status_key: tuple[Any, ...] | None = None
        self.latest: NodeSnapshot | None = None
        self.downloads: dict[str, DownloadProgress] = {}  # in progress, by what is downloaded
        self.notices: list[str] = []  # one-off lines for notifications, newest last

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        with self._lock:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return unsubscribe

    def publish(self) -> None:
        """A new snapshot to every subscriber, on the node's loop (with a reminder that fell due)."""
        snap = self._build_snapshot()
        due = self._reminders.check(snap) if self._reminders is not None else []
        if due:
            for text in due:
                self.notice(text)
            snap = self._build_snapshot()
        self.latest = snap
        with self._lock:
            subscribers = list(self._subscribers)
        for callback in subscribers:
            try:
                callback(snap)
            except Exception:  # a broken viewer must not stop the node
                log.exception("a snapshot subscriber failed")

    def notice(self, text: str) -> None:
        """A line for a notification, shown with the next snapshot."""
        self.notices = (self.notices + [text])[-NOTICES_KEPT:]

    def on_download(self, event: DownloadProgress) -> None:
        """A download's progress, published at once; a finished or failed one leaves the list."""
        if event.finished or event.error:
            self.downloads.pop(event.what, None)
        else:
            self.downloads[event.what] = event
        self.publish()

    async def send_status(self, force: bool = False) -> bool:
        """On every state change (or `force`). True if sent (the snapshot was published with it)."""
        status = self._build_status()
        key = status_key(status)
        if not force and key == self._last_status_key:
            return False
        self._last_status_key = key
        self.publish()
        await self._send(status)
        return True

    async def tick(self, heartbeat: bool) -> None:
        """Once a second: the status if it changed (always at a `heartbeat`), else a snapshot with
        the new figures; the status file when due."""
        if not await self.send_status(force=heartbeat):
            self.publish()
        if self._status_file.due(self.latest):
            await asyncio.to_thread(self._status_file.write, self.latest)
