"""An engine attempt's ending in a gamer's words: the one `Problem` the app shows.

Pure. The title says what is wrong in a few words, the message the cause and what the person can
do about it ("Close games or other programs using the GPU, then Retry."), and the engine's own
lines go to `details`, folded away. Engine flags (`--gpu-memory-utilization`, …) never reach the
title or the message: the app owns them, a person cannot change them. Which of its lines tell a
cause is the engine's own knowledge (its adapter's `FAILURE_HINTS`); the words are here, one set
for every engine. An engine inside WSL2 that Linux's OOM killer ended is told by its launcher's
last line (`wsl_engine.killed_for_memory`), before any line of the engine's own: WSL2 gets only
half of the PC's memory unless `.wslconfig` says otherwise, which a person can change.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.contract.events import Problem
from worker.engines import registry
from worker.engines.base import FailureCause, FailureHint
from worker.serve.restart_policy import Ended
from worker.serve.wsl_engine import killed_for_memory

DETAIL_LINES = 40
_CLOSE_GPU_PROGRAMS = "Close games or other programs using the GPU"


@dataclass(frozen=True)
class _Cause:
    title: str
    cause: str  # one sentence; "{engine}" is replaced with the engine's name
    advice: str  # what to do; "then Retry" is added where the app gave up


_FIT_ADVICE = ("Close games or other programs using the GPU if any are open, or lend the GPU more of its "
               "memory in Settings")  # a card nothing else uses has nothing to close
_MEMORY = _Cause("Not enough GPU memory for this model", "{engine} ran out of GPU memory.", _FIT_ADVICE)
_RAM_HELD = _Cause("Other programs are using the computer's memory",
                   "{engine} needs memory (RAM) that other programs hold.",
                   "Close programs you are not using; the model starts once the memory is free")
_WSL_MEMORY = _Cause("WSL2 ran out of memory",
                     "{engine} was stopped by Linux inside WSL2 when the memory WSL2 may use ran out. WSL2 may use "
                     "only half of this PC's memory by default.",
                     "Close programs you are not using, or let WSL2 use more: raise memory= under [wsl2] in "
                     "%UserProfile%\\.wslconfig (for example memory=24GB), then run wsl --shutdown")
_BY_KIND: dict[str, _Cause] = {
    "oom": _MEMORY,
    "context": _Cause("Not enough GPU memory for this model's chats",
                      "The model fits, but not the memory its conversations need beside it.", _FIT_ADVICE),
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
                      "If this keeps happening, restart the computer"),  # a driver is named only by its own lines
}
# What an engine's own lines say (its `FAILURE_HINTS`), before what its exit alone would.
_BY_CAUSE: dict[FailureCause, _Cause] = {
    "out_of_memory": _MEMORY,
    "port_taken": _Cause("Another program took the engine's port", "{engine} could not open its local port.",
                         "Close other AI apps running on this computer"),
    "gpu_too_old": _Cause("This GPU is too old for this model", "{engine} cannot run this model on this GPU.",
                          "The network should offer this computer another model; turn off this GPU in Settings "
                          "if it stays"),
    "driver_too_old": _Cause("The graphics driver is too old", "{engine} cannot use the GPU with the installed driver.",
                             "Update the NVIDIA graphics driver"),
    "wsl_too_old": _Cause("WSL needs an update",
                          "{engine} needs a newer WSL to use this PC's memory for the GPU inside WSL2.",
                          "Update WSL: open Terminal from the Start menu, run wsl --update, then restart the "
                          "computer"),
    "model_unreadable": _Cause("The model could not be loaded", "{engine} could not read the model's files.",
                               "If this keeps happening, delete the model from the model cache folder so it is "
                               "downloaded again"),
}


def engine_problem(engine: str, ended: Ended, *, gave_up: bool, retry_at: float | None = None) -> Problem:
    """The problem behind an engine attempt that ended: given up (`gave_up`, Retry starts it
    again) or restarting by itself (at `retry_at`, wall-clock seconds)."""
    lines = _lines(ended)
    cause = _cause(ended, lines, _hints(engine))
    name = registry.display_name(engine)
    if gave_up:
        advice = f"{cause.advice}, then Retry."
    elif ended.kind == "free_memory":
        advice = f"{cause.advice}."
    else:
        advice = f"{cause.advice}. The app is trying again by itself."
    return Problem(cause.title, f"{cause.cause.format(engine=name)} {advice}", "retry", lines[-DETAIL_LINES:],
                   None if gave_up else retry_at)


def _hints(engine: str) -> tuple[FailureHint, ...]:
    """The engine's failure lines; none for an engine this app does not have (an old snapshot)."""
    return registry.get(engine).FAILURE_HINTS if engine in registry.names() else ()


def _cause(ended: Ended, lines: tuple[str, ...], hints: tuple[FailureHint, ...]) -> _Cause:
    if ended.kind == "free_memory" and ended.in_ram:
        return _RAM_HELD  # an engine on the CPU: the RAM other programs hold, not a card's memory
    if ended.kind in ("crashed", "unhealthy", "timeout"):
        if any(killed_for_memory(line) for line in lines):
            return _WSL_MEMORY
        for hint in hints:
            if any(hint.pattern.search(line) for line in lines):
                return _BY_CAUSE[hint.cause]
    return _BY_KIND[ended.kind]


def _lines(ended: Ended) -> tuple[str, ...]:
    """The engine's lines behind the ending: its output's last lines where there are any."""
    text = "\n".join(ended.lines) if ended.lines else ended.message
    return tuple(line.rstrip("\r") for line in text.splitlines() if line.strip())
