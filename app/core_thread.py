"""The core's asyncio loop on its own thread, so a busy GUI never stalls serving (or the reverse)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger(__name__)


class CoreThread(threading.Thread):
    """Runs `node.run()` to completion on a fresh event loop; an error is logged and reported, a
    clean end (asked for, or an update handing over) reported as finished.

    Not a daemon: the process waits for the core to stop its engines rather than cutting it off.
    """

    def __init__(
        self,
        run: Callable[[], Coroutine[Any, Any, None]],
        on_failure: Callable[[BaseException], None],
        on_finished: Callable[[], None] = lambda: None,
    ) -> None:
        super().__init__(name="gpu-provider-core", daemon=False)
        self._run = run
        self._on_failure = on_failure
        self._on_finished = on_finished

    def run(self) -> None:
        try:
            asyncio.run(self._run())
        except Exception as exc:
            log.exception("the core stopped with an error")
            self._on_failure(exc)
            return
        self._on_finished()
