"""Which notifications a change between two snapshots deserves; each transition speaks once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from app.format import tray_state
from worker.events import NodeSnapshot


@dataclass(frozen=True)
class Notification:
    title: str
    message: str
    level: Literal["info", "warning", "critical"] = "info"


def failure_reason(snapshot: NodeSnapshot) -> str:
    if snapshot.problem is not None:
        return f"{snapshot.problem.message}"
    errors = [e.last_error for e in snapshot.engines if e.last_error]
    return errors[-1] if errors else "The engine stopped; see View logs for details."


def new_notices(previous: NodeSnapshot | None, current: NodeSnapshot) -> tuple[str, ...]:
    """Notices added since the previous snapshot (the core appends, newest last)."""
    if previous is None:
        return current.notices
    old = previous.notices
    for start in range(len(old) + 1):
        tail = old[start:]
        if current.notices[: len(tail)] == tail:
            return current.notices[len(tail) :]
    return current.notices


def notifications_between(previous: NodeSnapshot | None, current: NodeSnapshot) -> list[Notification]:
    """Ready, failed (with its reason), paused for a game, and the core's one-off notices."""
    found: list[Notification] = []
    before = tray_state(previous) if previous is not None else None
    after = tray_state(current)
    if after == "serving" and before != "serving" and before != "paused":
        found.append(Notification("Serving", f"{current.model or 'The model'} is ready and serving."))
    if after == "failed" and before != "failed":
        found.append(Notification("Serving failed", failure_reason(current), "critical"))
    was_game = previous is not None and previous.paused and previous.pause_reason == "game"
    if current.paused and current.pause_reason == "game" and not was_game:
        game = current.pause_detail or "a game"
        found.append(Notification(f"Paused for {game}", "The GPU is yours; serving resumes when the game ends."))
    found.extend(Notification("GPU Provider", line) for line in new_notices(previous, current))
    return found
