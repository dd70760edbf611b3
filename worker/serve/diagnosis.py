"""Failures in a gamer's words: how an engine attempt ended, or why provisioning failed, as the
one `Problem` the app shows.

Pure. The title says what is wrong in a few words, the message the cause and what the person can
do about it ("Close games or other programs using the GPU, then Retry."), and the engine's own
lines go to `details`, folded away. Engine flags (`--gpu-memory-utilization`, …) never reach the
title or the message: the app owns them, a person cannot change them. The engines' failure lines
matched here are those the engines reference lists (vLLM A3, llama.cpp B3).
"""

from __future__ import annotations

import errno
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass, replace

from worker.provision import fetch as download
from worker.engines.registry import display_name
from worker.contract.events import Problem
from worker.serve.restart_policy import Ended

DETAIL_LINES = 40
_CLOSE_GPU_PROGRAMS = "Close games or other programs using the GPU"


@dataclass(frozen=True)
class _Cause:
    title: str
    cause: str  # one sentence; "{engine}" is replaced with the engine's name
    advice: str  # what to do; "then Retry" is added where the app gave up


_MEMORY = _Cause("Not enough GPU memory for this model", "{engine} ran out of GPU memory.", _CLOSE_GPU_PROGRAMS)
_RAM_HELD = _Cause("Other programs are using the computer's memory",
                   "{engine} needs memory (RAM) that other programs hold.",
                   "Close programs you are not using; the model starts once the memory is free")
_BY_KIND: dict[str, _Cause] = {
    "oom": _MEMORY,
    "context": _Cause("Not enough GPU memory for this model's chats",
                      "The model fits, but not the memory its conversations need beside it.", _CLOSE_GPU_PROGRAMS),
    "free_memory": _Cause("Another program is using the GPU",
                          "{engine} needs GPU memory that another program holds.",
                          f"{_CLOSE_GPU_PROGRAMS}; the model starts once the memory is free"),
    "unhealthy": _Cause("The model stopped responding", "{engine} stopped answering while serving.",
                        "If this keeps happening, restart the computer"),
    "timeout": _Cause("The model took too long to start", "{engine} did not become ready in time.",
                      "Close programs that keep the computer busy"),
    "unstartable": _Cause("The engine could not be started", "{engine} could not be started on this computer.",
                          "Reinstall the app if this keeps happening"),
    "crashed": _Cause("The model stopped unexpectedly", "{engine} quit with an error.",
                      "If this keeps happening, restart the computer or update the graphics driver"),
}
# What the engine's own lines say, before what its exit alone would (first match wins).
_BY_LINE: tuple[tuple[re.Pattern[str], _Cause], ...] = (
    (re.compile(r"out of memory|cudaMalloc failed|not enough GPU memory|No available memory for the cache blocks"
                r"|failed to allocate .*buffer|not enough GPU memory available to serve", re.I), _MEMORY),
    (re.compile(r"Address already in use|couldn't bind HTTP server socket"),
     _Cause("Another program took the engine's port", "{engine} could not open its local port.",
            "Close other AI apps running on this computer")),
    (re.compile(r"Bfloat16 is only supported|compute capability", re.I),
     _Cause("This GPU is too old for this model", "{engine} cannot run this model on this GPU.",
            "The network should offer this computer another model; turn off this GPU in Settings if it stays")),
    (re.compile(r"CUDA driver version is insufficient|no CUDA-capable device|NVIDIA driver", re.I),
     _Cause("The graphics driver is too old", "{engine} cannot use the GPU with the installed driver.",
            "Update the NVIDIA graphics driver")),
    (re.compile(r"UVA is not available"),
     _Cause("This engine version does not run in WSL2", "{engine} cannot run inside WSL2 in this version.",
            "Update the app")),
    (re.compile(r"error loading model|failed to load model|exiting due to model loading error", re.I),
     _Cause("The model could not be loaded", "{engine} could not read the model's files.",
            "If this keeps happening, delete the model from the model cache folder so it is downloaded again")),
)


def engine_problem(engine: str, ended: Ended, *, gave_up: bool, retry_at: float | None = None) -> Problem:
    """The problem behind an engine attempt that ended: given up (`gave_up`, Retry starts it
    again) or restarting by itself (at `retry_at`, wall-clock seconds)."""
    lines = _lines(ended)
    cause = _cause(ended, lines)
    name = display_name(engine)
    if gave_up:
        advice = f"{cause.advice}, then Retry."
    elif ended.kind == "free_memory":
        advice = f"{cause.advice}."
    else:
        advice = f"{cause.advice}. The app is trying again by itself."
    return Problem(cause.title, f"{cause.cause.format(engine=name)} {advice}", "retry", lines[-DETAIL_LINES:],
                   None if gave_up else retry_at)


def _cause(ended: Ended, lines: tuple[str, ...]) -> _Cause:
    if ended.kind == "free_memory" and ended.in_ram:
        return _RAM_HELD  # vLLM's CPU build: the RAM other programs hold, not a card's memory
    if ended.kind in ("crashed", "unhealthy", "timeout"):
        for pattern, cause in _BY_LINE:
            if any(pattern.search(line) for line in lines):
                return cause
    return _BY_KIND[ended.kind]


def _lines(ended: Ended) -> tuple[str, ...]:
    """The engine's lines behind the ending: its output's last lines where there are any."""
    text = "\n".join(ended.lines) if ended.lines else ended.message
    return tuple(line.rstrip("\r") for line in text.splitlines() if line.strip())


# --- provisioning ------------------------------------------------------------------------------

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
