"""A provisioning failure in a gamer's words: the network's (offline, DNS, timeout, a server's
5xx), which the node tries again by itself, or one the person fixes (a damaged file, a full disk),
shown as it is with Retry.

Pure. It reads the downloader's failures (`provision.fetch`), so it sits above provisioning, with
the node that decides what to do about them.
"""

from __future__ import annotations

import errno
import re
import socket
from collections.abc import Iterator
from dataclasses import replace

from worker.contract.events import Problem
from worker.provision import fetch as download


_NETWORK_ERRNOS = {errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.ENETUNREACH, errno.ENETDOWN,
                   errno.EHOSTUNREACH, errno.EHOSTDOWN, errno.ETIMEDOUT}
_NETWORK_TYPES = {"TransportError", "LocalEntryNotFoundError"}  # httpx's (and its fork's), huggingface_hub's offline
_NETWORK_WORDS = re.compile(
    r"Temporary failure in name resolution|Name or service not known|nodename nor servname|getaddrinfo failed"
    r"|Failed to establish a new connection|Network is unreachable|No route to host|Connection (refused|reset)"
    r"|timed out|answered HTTP 5\d\d", re.I)


def network_failure(exc: BaseException) -> bool:
    """Whether a provisioning failure is the network's (offline, DNS, timeout, a server's 5xx),
    which trying again later may cure; a damaged file or a full disk is not."""
    for cause in _chain(exc):
        if isinstance(cause, (download.Damaged, download.NoSpace, download.TooLarge)):
            return False
        if isinstance(cause, download.Refused):
            return cause.status >= 500 or cause.status == 429
        if isinstance(cause, (download.GaveUp, socket.gaierror, TimeoutError)):
            return True
        if isinstance(cause, OSError) and cause.errno in _NETWORK_ERRNOS:
            return True
        if _NETWORK_TYPES & {t.__name__ for t in type(cause).__mro__}:
            return True
        status = getattr(getattr(cause, "response", None), "status_code", None)
        if isinstance(status, int) and status >= 500:
            return True
    problem = getattr(exc, "problem", None)
    return isinstance(problem, Problem) and problem.action == "check_network" and bool(
        _NETWORK_WORDS.search(problem.message))


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and what it was raised from or while handling (`raise … from None` keeps the latter)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def offline_problem(problem: Problem, retry_at: float) -> Problem:
    """A download or install the network cut short, tried again by itself at `retry_at` (which
    the app shows beside the message, as it does for restarts): the address and the error go to
    `details`."""
    return Problem(
        "Waiting for the network",
        f"{problem.title}. Check the internet connection; the app tries again by itself, or press Retry.",
        "retry",
        (*problem.details, problem.message),
        retry_at,
    )


def provision_problem(problem: Problem) -> Problem:
    """A provisioning failure trying again will not cure by itself: shown as it is, Retry offered
    where it had no other action (after the person fixed the cause)."""
    return replace(problem, action="retry") if problem.action == "none" else problem
