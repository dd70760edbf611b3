"""Failures of work the node repeats (each second's tick, the status file every few seconds):
logged once per kind, with what failed, and once more when it works again, not at every repeat,
so that a file Windows keeps locked for an hour is one log line, not 360."""

from __future__ import annotations

import logging


class OncePerKind:
    """What has failed, by where and the kind of error, until it works again."""

    def __init__(self, log: logging.Logger) -> None:
        self._log = log
        self._failing: dict[str, set[str]] = {}  # where -> the kinds of error seen there

    def failed(self, where: str, exc: BaseException) -> None:
        """`where` raised `exc`; logged with its traceback the first time this kind fails there."""
        kinds = self._failing.setdefault(where, set())
        kind = type(exc).__qualname__
        if kind in kinds:
            self._log.debug("%s failed again: %s", where, exc)
            return
        kinds.add(kind)
        self._log.error("%s failed (logged once until it works again): %s", where, exc, exc_info=exc)

    def worked(self, where: str) -> None:
        if self._failing.pop(where, None):
            self._log.info("%s works again", where)
