"""What one websocket connection sends, in order, packed into `batch` frames where its welcome
allows: the link's outgoing half.

`post` queues an encoded message without waiting (the relay's hot path calls it from an engine
socket's read callback, where nothing may wait); `send` queues one and waits until it is written.
A connection's `Outgoing` is also its requests' outlet: once that connection ends, both answer
False for good, so an answer never leaks onto a later connection.
The first message of a loop iteration, sent with nothing queued ahead of it, is written at once
(a lone message never waits for a batch); what follows it in that iteration is written by one
task early in the next: as one `batch` frame where the connection's welcome listed `batch` (a
batch takes at most `BATCH_MAX_MESSAGES` messages, `BATCH_MAX_CHARS` of JSON, or messages for
`BATCH_MAX_WAIT_S`), else as one frame per message.

Backpressure: while more than `HIGH_WATER_CHARS` of JSON waits (the coordinator reads slower
than the engines stream, as on a slow upload), `congested` is True; the relay then stops reading
the engine streams that keep filling it, and `when_drained` resumes them once the queue is down to
`LOW_WATER_CHARS`. Memory stays bounded and the engines feel the wait, instead of the queue growing
without end.

Order: websockets writes a frame to the socket before its `send` first waits, and the one writer
task writes batches oldest first, finishing each before the next; a `send` goes out at once
only when nothing is queued (a batch being written stays queued until its last frame is out).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable

from pydantic import BaseModel

from websockets.exceptions import ConnectionClosed

from worker.contract import protocol

log = logging.getLogger(__name__)

BATCH_MAX_MESSAGES = 256
BATCH_MAX_CHARS = 1024 * 1024  # of JSON: far under the 16 MiB frame limit
BATCH_MAX_WAIT_S = 0.001  # the protocol's bound on how long a batch may hold a message
HIGH_WATER_CHARS = 4 * 1024 * 1024  # queued and unwritten: about half a second of an 8-GPU node's stream
LOW_WATER_CHARS = 1024 * 1024

Write = Callable[[str], Awaitable[None]]


class _Batch:
    """Messages queued together; `sent` tells each sender whether their frame went out."""

    __slots__ = ("chars", "frames", "open", "opened_at", "sent")

    def __init__(self) -> None:
        self.opened_at = time.monotonic()
        self.frames: list[str] = []
        self.chars = 0
        self.open = True
        self.sent: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

    def add(self, frame: str) -> None:
        self.frames.append(frame)
        self.chars += len(frame)
        if (len(self.frames) >= BATCH_MAX_MESSAGES or self.chars >= BATCH_MAX_CHARS
                or time.monotonic() - self.opened_at >= BATCH_MAX_WAIT_S):
            self.open = False


class Outgoing:
    """The send queue of one connection. Loop-bound."""

    def __init__(self, write: Write, *, closed: bool = False) -> None:
        self._write = write
        self.batching = False  # the connection's welcome lists "batch"
        self._queue: deque[_Batch] = deque()
        self._writer: asyncio.Task[None] | None = None
        self.closed = closed  # the connection is gone: nothing more is written
        self._queued_chars = 0
        self.congested = False  # more than HIGH_WATER_CHARS queued: stop adding, see `when_drained`
        self._drained: list[Callable[[], None]] = []

    @classmethod
    def nowhere(cls) -> Outgoing:
        """The outlet of no connection: everything sent to it answers False."""

        async def write(frame: str) -> None:
            raise AssertionError("a closed Outgoing writes nothing")

        return cls(write, closed=True)

    def post(self, frame: str) -> bool:
        """Queues `frame` (an encoded message) after everything before it; False once the
        connection is gone."""
        if self.closed:
            return False
        self._enqueue(frame)
        return True

    def when_drained(self, callback: Callable[[], None]) -> None:
        """Calls `callback` once the queue is back under `LOW_WATER_CHARS` (or the connection
        ended); at once if it is not congested."""
        if self.congested:
            self._drained.append(callback)
        else:
            callback()

    async def send(self, message: BaseModel) -> bool:
        """Writes `message` after everything queued before it; False once the connection is gone.
        A sender cancelled while it waits does not cancel the frame it shares with others."""
        if self.closed:
            return False
        frame = protocol.encode(message)
        if not self._queue:
            self._open_batch()  # what follows in this iteration joins it, behind this frame
            return await self._write_now(frame)
        return await asyncio.shield(self._enqueue(frame).sent)

    def close(self) -> None:
        """The connection ended: what is still queued is dropped, its senders told False."""
        self.closed = True
        while self._queue:
            sent = self._queue.popleft().sent
            if not sent.done():
                sent.set_result(False)
        if self._writer is not None:
            self._writer.cancel()
        self._queued_chars = 0
        self._relieve()  # whoever waits finds the connection gone on its next post

    def _written(self, batch: _Batch) -> None:
        self._queue.popleft()
        self._queued_chars -= batch.chars
        if self.congested and self._queued_chars <= LOW_WATER_CHARS:
            self._relieve()

    def _relieve(self) -> None:
        self.congested = False
        waiting, self._drained = self._drained, []
        for callback in waiting:
            callback()

    def _enqueue(self, frame: str) -> _Batch:
        """Adds `frame` to the open batch (or a new one); returns the batch it joined."""
        queue = self._queue
        batch = queue[-1] if queue and queue[-1].open else self._open_batch()
        batch.add(frame)
        self._queued_chars += len(frame)
        if self._queued_chars > HIGH_WATER_CHARS:
            self.congested = True
        return batch

    def _open_batch(self) -> _Batch:
        batch = _Batch()
        self._queue.append(batch)
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(self._write_queued())
        return batch

    async def _write_now(self, frame: str) -> bool:
        try:
            await self._write(frame)
        except ConnectionClosed:
            self.close()
            return False
        return True

    async def _write_queued(self) -> None:
        try:
            while self._queue:
                batch = self._queue[0]
                batch.open = False
                try:
                    for frame in self._frames(batch):
                        await self._write(frame)
                except ConnectionClosed:
                    self.close()
                    return
                except Exception:  # a bug: its messages are lost, the connection's others go on
                    log.exception("writing %d queued message(s) failed", len(batch.frames))
                    self._written(batch)
                    batch.sent.set_result(False)
                    continue
                self._written(batch)
                batch.sent.set_result(True)
        finally:
            self._writer = None

    def _frames(self, batch: _Batch) -> list[str]:
        if self.batching and len(batch.frames) > 1:
            return [protocol.encode_batch(batch.frames)]
        return batch.frames
