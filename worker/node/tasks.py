"""The node's background work on its own asyncio loop: tasks kept until they are done (a failure
is logged, never lost) and cancelled together at the end; actions handed to that loop from any
thread."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger(__name__)


class LoopTasks:
    """The loop (once `bind` was called on it) and the tasks spawned on it."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[Any]] = []

    def bind(self) -> None:
        """The running loop is the one: called on it."""
        self.loop = asyncio.get_running_loop()

    def call(self, action: Callable[[], Any]) -> None:
        """`action()` on the loop: at once when called on it, else soon; never once it is closed."""
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            action()
        else:
            loop.call_soon_threadsafe(action)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        self._tasks.append(task)
        task.add_done_callback(self._done)
        return task

    async def cancel_all(self) -> None:
        """Cancels every task still running and waits until they are gone."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _done(self, task: asyncio.Task[Any]) -> None:
        if task in self._tasks:
            self._tasks.remove(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("internal task failed", exc_info=task.exception())
