"""Which notification, if any, a new snapshot deserves: at most one per change, one per incident.

An incident is a failure until the node serves again, goes idle or is paused: the restarts of a
crash loop are not news (they may recover); its final failure is told once, and failing again
after a Retry is the same incident. A state's notification is titled with the core's headline,
as the tray and the dashboard show it; every message is one short sentence in the person's words; log lines stay in the dashboard's Details and the logs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from app.format import clock_time, tray_state
from worker.contract.events import NodeSnapshot

MESSAGE_LIMIT = 120  # characters: what a desktop notification shows without cutting it off
FALLBACK_FAILURE = "Serving stopped and could not be restarted. Open the dashboard to see why."


@dataclass(frozen=True)
class Notification:
    title: str
    message: str
    level: Literal["info", "warning", "critical"] = "info"


def short_sentence(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """The first sentence of the first line, cut at a word with "…" when still too long."""
    first = " ".join(text.strip().splitlines()[0].split()) if text.strip() else ""
    sentence = re.split(r"(?<=[.!?])\s", first, maxsplit=1)[0]
    if len(sentence) <= limit:
        return sentence
    cut = sentence[: limit - 1].rsplit(" ", 1)[0].rstrip(",;:")
    return cut + "…"


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


def failure_notification(snapshot: NodeSnapshot) -> Notification:
    """The headline's title (as tray and dashboard say it) and one sentence of what to do; never
    the engine's log line."""
    title = snapshot.headline.title
    problem = snapshot.problem
    if problem is None:
        return Notification(title, FALLBACK_FAILURE, "critical")
    if problem.retry_at is None:
        return Notification(title, short_sentence(problem.message), "critical")
    when = f" Trying again at {clock_time(problem.retry_at, snapshot.at)}."
    return Notification(title, short_sentence(problem.message, MESSAGE_LIMIT - len(when)) + when, "warning")


class Notifier:
    """Remembers what was already told (the incident, the model announced, the update offered),
    so that repeated snapshots, restarts and recoveries do not speak twice."""

    def __init__(self) -> None:
        self._previous: NodeSnapshot | None = None
        self._incident_told = False  # this failure was told; it ends when serving, idle or paused
        self._announced_model: str | None = None  # the model whose "Serving" was told
        self._update_told: str | None = None

    def update(self, snapshot: NodeSnapshot) -> Notification | None:
        """The one notification this snapshot deserves, the most important first. The rest wait
        for a later change (an update offer) or are dropped (a core notice that repeats the news)."""
        previous, self._previous = self._previous, snapshot
        self._track(snapshot)
        if snapshot.stopping:
            return None  # quitting: engines stopping on purpose are no news
        return (self._failure(snapshot) or self._game_pause(previous, snapshot) or self._serving(snapshot)
                or self._update(snapshot) or self._notice(previous, snapshot))

    def _track(self, snapshot: NodeSnapshot) -> None:
        """Ends an incident once the node serves, idles or pauses; forgets the model when idle."""
        state = tray_state(snapshot)
        if state in ("serving", "idle", "paused"):
            self._incident_told = False
        if state == "idle":
            self._announced_model = None

    def _failure(self, snapshot: NodeSnapshot) -> Notification | None:
        if tray_state(snapshot) != "failed" or self._incident_told:
            return None
        self._incident_told = True
        self._announced_model = None  # serving again after a failure is news
        return failure_notification(snapshot)

    def _game_pause(self, previous: NodeSnapshot | None, current: NodeSnapshot) -> Notification | None:
        was_game = previous is not None and previous.paused and previous.pause_reason == "game"
        if not (current.paused and current.pause_reason == "game") or was_game:
            return None
        return Notification(current.headline.title, "The GPU is yours; serving resumes when the game ends.")

    def _serving(self, snapshot: NodeSnapshot) -> Notification | None:
        """Told once per model: not again after a pause or a restart that recovered."""
        if tray_state(snapshot) != "serving" or snapshot.model == self._announced_model:
            return None
        self._announced_model = snapshot.model
        return Notification(snapshot.headline.title, f"{snapshot.model or 'The model'} is ready and serving.")

    def _update(self, snapshot: NodeSnapshot) -> Notification | None:
        version = snapshot.update_ready
        if version is None or version == self._update_told:
            return None
        self._update_told = version
        return Notification(f"Update {version} ready",
                            "It installs when the GPU is idle, or choose Restart to update in the tray menu.")

    def _notice(self, previous: NodeSnapshot | None, current: NodeSnapshot) -> Notification | None:
        """The newest of the core's one-off lines (several at once would be a burst). Lines that
        come with a failure repeat it ("Engine … failed: <log line>"): the state speaks. A reminder
        that comes as the node changes state otherwise ("Back online after 2 h offline") is told."""
        if previous is None:
            return None  # from before the app opened: old news
        if tray_state(current) in ("failed", "degraded") and tray_state(previous) != tray_state(current):
            return None
        lines = new_notices(previous, current)
        return Notification("GPU Provider", short_sentence(lines[-1])) if lines else None
