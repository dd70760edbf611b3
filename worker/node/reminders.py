"""The two things a lender asks to be told without looking: once when the node has been online
but earning nothing for their chosen hours (with the reason), and once when it is back after being
offline. Each fires once per episode: a reminder every second is noise, so it waits for the
episode to end (earning again, or offline again) before it can fire again."""

from __future__ import annotations

import time
from collections.abc import Callable

from worker.contract.events import NodeSnapshot
from worker.system.config import Settings

BACK_ONLINE_AFTER_S = 60.0  # offline shorter than this is a blip a reconnect cures, not news
_THEIR_OWN = frozenset({"user", "timed", "game", "schedule"})  # pauses the person chose: no reminder


class Reminders:
    """Watches the snapshots; `check` returns the notices due now (usually none)."""

    def __init__(self, settings: Callable[[], Settings], monotonic: Callable[[], float] = time.monotonic) -> None:
        self._settings = settings
        self._monotonic = monotonic
        self._idle_since: float | None = None  # online and earning nothing since then
        self._idle_told = False
        self._offline_since: float | None = None

    def check(self, snap: NodeSnapshot) -> list[str]:
        now = self._monotonic()
        return [n for n in (self._idle(snap, now), self._back(snap, now)) if n is not None]

    def _idle(self, snap: NodeSnapshot, now: float) -> str | None:
        reason = snap.headline.not_earning
        chosen = snap.paused and snap.pause_reason in _THEIR_OWN
        if snap.connection.state != "connected" or reason is None or chosen:
            self._idle_since, self._idle_told = None, False
            return None
        if self._idle_since is None:
            self._idle_since = now
        hours = self._settings().notify_idle_hours
        if self._idle_told or hours is None or now - self._idle_since < hours * 3600:
            return None
        self._idle_told = True
        return f"Online but earning nothing for {hours:g} hour{'s' if hours != 1 else ''}: {reason}"

    def _back(self, snap: NodeSnapshot, now: float) -> str | None:
        state = snap.connection.state
        if state == "offline":
            if self._offline_since is None:
                self._offline_since = now
            return None
        if state != "connected" or self._offline_since is None:
            return None
        away, self._offline_since = now - self._offline_since, None
        if away < BACK_ONLINE_AFTER_S or not self._settings().notify_back_online:
            return None
        return f"Back online after {_duration(away)} offline"


def _duration(seconds: float) -> str:
    minutes = round(seconds / 60)
    if minutes < 60:
        return f"{minutes} min"
    return f"{minutes // 60} h {minutes % 60} min" if minutes % 60 else f"{minutes // 60} h"
