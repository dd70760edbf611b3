"""The tray icon and its menu. The menu is rebuilt from the latest snapshot each time it opens
(Vorta's pattern), so it can never show a stale state or offer a command that makes no sense."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from functools import partial

from PySide6.QtCore import QObject, Signal
from PySide6.QtGui import QAction
from PySide6.QtWidgets import QMenu, QSystemTrayIcon

from app.bridge import Bridge, seconds_until_tomorrow
from app.earnings_panel import today_words
from app.format import offers_pause, rate, tray_state
from app.icons import state_icon
from app.notify import Notification, Notifier, short_sentence
from worker.contract.events import NodeSnapshot, Problem
from worker.node.headline import ACTION_LABELS

# (label while serving, label while paused, seconds): while paused they add to the pause
TIMED_PAUSES = (("Pause for 15 min", "Pause for 15 more min", 15 * 60),
                ("Pause for 1 hour", "Pause for 1 more hour", 60 * 60))
UNTIL_TOMORROW = ("Pause until tomorrow", "Keep paused until tomorrow")

_LEVEL_ICONS = {
    "info": QSystemTrayIcon.MessageIcon.Information,
    "warning": QSystemTrayIcon.MessageIcon.Warning,
    "critical": QSystemTrayIcon.MessageIcon.Critical,
}


STOPPING = "Stopping…"  # the headline's title while the core drains; said at once when Quit is chosen


def tray_status(snapshot: NodeSnapshot, quitting: bool = False) -> str:
    """The menu's first line: the core's headline, word for word (as the dashboard and `status`)."""
    return STOPPING if quitting else snapshot.headline.title


def figures_line(snapshot: NodeSnapshot) -> str:
    """What is left to drain while stopping; else live tok/s while serving and today's earnings
    after electricity, in the network's currency."""
    if snapshot.headline.kind == "stopping" and snapshot.headline.detail:
        return snapshot.headline.detail
    earned = today_words(snapshot.earnings)  # "net" only where electricity is measured and priced
    live = snapshot.throughput.live_tokens_per_s
    if live is None or tray_state(snapshot) not in ("serving", "degraded"):
        return earned
    return f"{rate(live)} · {earned}"


def tray_tooltip(snapshot: NodeSnapshot, quitting: bool = False) -> str:
    return f"GPU Provider — {tray_status(snapshot, quitting)}\n{figures_line(snapshot)}"


RETRIES = ("retry", "check_network", "free_disk")


def offers_retry(snapshot: NodeSnapshot) -> bool:
    problems = (snapshot.problem, snapshot.connection.problem)
    return snapshot.headline.action in RETRIES or any(p is not None and p.action == "retry" for p in problems)


def extended_pause_s(snapshot: NodeSnapshot, seconds: float, now: float) -> float:
    """A timed pause chosen while paused adds to the time left, so it never shortens the pause."""
    left = snapshot.pause_until - now if snapshot.paused and snapshot.pause_until is not None else 0.0
    return max(0.0, left) + seconds


class Tray(QObject):
    setup_requested = Signal()
    open_dashboard = Signal()
    open_settings = Signal()
    open_logs = Signal()
    quit_requested = Signal()
    sign_in_requested = Signal()
    retry_requested = Signal()
    update_requested = Signal()

    def __init__(self, bridge: Bridge, parent: QObject | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(parent)
        self.bridge = bridge
        self._clock = clock
        self.menu = QMenu()
        self.menu.aboutToShow.connect(self.rebuild_menu)
        self.icon = QSystemTrayIcon(self)
        self.icon.setContextMenu(self.menu)
        self.icon.activated.connect(self._on_activated)
        self.shown_notifications: list[Notification] = []
        self.quitting = False  # Quit was chosen: "Stopping…" before the core's snapshot says so
        self._notifier = Notifier()
        self._shown_state: str | None = None  # the state whose icon is up
        bridge.snapshot_changed.connect(self.on_snapshot)
        bridge.core_failed.connect(self.on_core_failed)
        self.on_snapshot(bridge.latest)
        self.rebuild_menu()

    def on_snapshot(self, snapshot: NodeSnapshot) -> None:
        """Icon and tooltip only when they change: each update is a round trip to the desktop's
        tray host (D-Bus on Linux), and snapshots arrive every second."""
        state = tray_state(snapshot)
        if state != self._shown_state:
            self._shown_state = state
            self.icon.setIcon(state_icon(state))
        self._show_tooltip(tray_tooltip(snapshot, self.quitting))
        note = self._notifier.update(snapshot)
        if note is not None and not self.quitting:
            self._notify(note)

    def on_core_failed(self, problem: Problem) -> None:
        self._shown_state = "failed"
        self.icon.setIcon(state_icon("failed"))
        self._show_tooltip(f"GPU Provider — {problem.title}")
        self._notify(Notification(problem.title, short_sentence(problem.message), "critical"))

    def _show_tooltip(self, text: str) -> None:
        if text != self.icon.toolTip():
            self.icon.setToolTip(text)

    def _notify(self, note: Notification) -> None:
        self.shown_notifications.append(note)
        self.icon.showMessage(note.title, note.message, _LEVEL_ICONS[note.level], 8000)

    def rebuild_menu(self) -> None:
        snapshot = self.bridge.latest
        self.menu.clear()
        for line in (tray_status(snapshot, self.quitting), figures_line(snapshot)):
            self.menu.addAction(line).setEnabled(False)  # information, not commands
        self.menu.addSeparator()
        if self.quitting or snapshot.stopping:
            self._add("Open dashboard", self.open_dashboard.emit)
            self._add("View logs", self.open_logs.emit)
            self.menu.addSeparator()
            self._add("Quit", self.request_quit).setEnabled(False)  # already on its way out
            return
        self._add_remedies(snapshot)
        self._add_pauses(snapshot)
        self.menu.addSeparator()
        self._add("Open dashboard", self.open_dashboard.emit)
        self._add("Settings…", self.open_settings.emit)
        self._add("View logs", self.open_logs.emit)
        self.menu.addSeparator()
        self._add("Quit", self.request_quit)

    def _add_remedies(self, snapshot: NodeSnapshot) -> None:
        """The headline's remedy in its own words (as the dashboard's main button), then Try again
        and Restart to update where they apply besides."""
        action = snapshot.headline.action
        remedies: dict[str, Callable[[], None]] = {
            "finish_setup": self.setup_requested.emit, "sign_in": self.sign_in_requested.emit,
            "retry": self.retry_requested.emit, "check_network": self.retry_requested.emit,
            "free_disk": self.retry_requested.emit, "settings": self.open_settings.emit,
            "update": self.update_requested.emit,
        }
        shown = []
        if action in remedies:
            shown.append(self._add(snapshot.headline.action_label, remedies[action]))
        if offers_retry(snapshot) and action not in RETRIES:
            shown.append(self._add(ACTION_LABELS["retry"], self.retry_requested.emit))
        if snapshot.update_ready is not None and action != "update":
            shown.append(self._add("Restart to update", self.update_requested.emit))
        if shown:
            self.menu.addSeparator()

    def _add_pauses(self, snapshot: NodeSnapshot) -> None:
        """Pause or Resume, then timed pauses; while paused these extend (or keep) the pause. Offered
        only while the node works or is paused: a failed, offline or unfinished node has nothing to pause."""
        paused = snapshot.paused
        if not (paused or offers_pause(snapshot)):
            return
        if paused:
            self._add("Resume serving", self.bridge.resume)
        else:
            self._add("Pause serving", self.bridge.pause)
        for label, longer, seconds in TIMED_PAUSES:
            self._add(longer if paused else label, partial(self._pause_for, seconds))
        tomorrow = self._add(UNTIL_TOMORROW[paused], self.bridge.pause_until_tomorrow)
        tomorrow.setEnabled(not self._paused_past_tomorrow(snapshot))

    def _pause_for(self, seconds: float) -> None:
        self.bridge.pause_for(extended_pause_s(self.bridge.latest, seconds, self._clock()))

    def _paused_past_tomorrow(self, snapshot: NodeSnapshot) -> bool:
        """Already paused beyond tomorrow morning: "until tomorrow" would shorten the pause."""
        if not snapshot.paused or snapshot.pause_until is None:
            return False
        now = self._clock()
        tomorrow = now + seconds_until_tomorrow(dt.datetime.fromtimestamp(now))
        return snapshot.pause_until >= tomorrow

    def request_quit(self) -> None:
        """Quit: say "Stopping…" at once (the drain can take a while) and offer Quit no more."""
        self.quitting = True
        self._show_tooltip(tray_tooltip(self.bridge.latest, quitting=True))
        self.quit_requested.emit()

    def _add(self, text: str, slot: Callable[[], object]) -> QAction:
        action = self.menu.addAction(text)
        action.triggered.connect(lambda _checked=False: slot())
        return action

    def _on_activated(self, reason: QSystemTrayIcon.ActivationReason) -> None:
        if reason in (QSystemTrayIcon.ActivationReason.Trigger, QSystemTrayIcon.ActivationReason.DoubleClick):
            self.open_dashboard.emit()
