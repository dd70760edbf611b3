"""A relay `Outlet` that records its frames, for tests that need no websocket."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from worker.contract import protocol

TERMINAL = (protocol.ResponseEnd, protocol.ResponseError)


class Wire:
    """The coordinator side of a relay's `Outlet`: records what is posted and sent, in order;
    `open = False` plays a dropped socket."""

    def __init__(self) -> None:
        self.frames: list[Any] = []
        self.open = True
        self.congested = False
        self._drained: list[Callable[[], None]] = []

    def post(self, frame: str) -> bool:
        if not self.open:
            return False
        self.frames.append(protocol.parse_from_node(frame))
        return True

    def when_drained(self, callback: Callable[[], None]) -> None:
        if self.congested:
            self._drained.append(callback)
        else:
            callback()

    def drain(self) -> None:
        """The coordinator caught up: whoever waited reads on."""
        self.congested = False
        waiting, self._drained = self._drained, []
        for callback in waiting:
            callback()

    async def send(self, message: Any) -> bool:
        if not self.open:
            return False
        self.frames.append(message)
        return True

    def of(self, request_id: str) -> list[Any]:
        return [f for f in self.frames if getattr(f, "id", None) == request_id or getattr(f, "ref", None) == request_id]

    def terminals(self, request_id: str) -> list[Any]:
        return [f for f in self.of(request_id) if isinstance(f, TERMINAL)]

    def data(self, request_id: str) -> str:
        return "".join(f.data for f in self.of(request_id) if isinstance(f, protocol.ResponseChunk))
