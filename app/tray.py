"""The tray icon and its menu. The menu is rebuilt from the latest snapshot each time it opens
(Vorta's pattern), so it can never show a stale state or offer a command that makes no sense."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from PySide6.QtCore import QObject, Signal
from PySide6.QtGui import QAction
from PySide6.QtWidgets import QMenu, QSystemTrayIcon

from app.bridge import Bridge
from app.format import status_line, tooltip, tray_state
from app.icons import state_icon
from app.notify import Notification, notifications_between
from worker.events import NodeSnapshot, Problem

TIMED_PAUSES = (("Pause for 15 min", 15 * 60), ("Pause for 1 hour", 60 * 60))

_LEVEL_ICONS = {
    "info": QSystemTrayIcon.MessageIcon.Information,
    "warning": QSystemTrayIcon.MessageIcon.Warning,
    "critical": QSystemTrayIcon.MessageIcon.Critical,
}


class Tray(QObject):
    open_dashboard = Signal()
    open_settings = Signal()
    open_logs = Signal()
    quit_requested = Signal()

    def __init__(self, bridge: Bridge, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.bridge = bridge
        self.menu = QMenu()
        self.menu.aboutToShow.connect(self.rebuild_menu)
        self.icon = QSystemTrayIcon(self)
        self.icon.setContextMenu(self.menu)
        self.icon.activated.connect(self._on_activated)
        self.shown_notifications: list[Notification] = []
        self._previous: NodeSnapshot | None = None
        self._shown_state: str | None = None  # the state whose icon is up
        bridge.snapshot_changed.connect(self.on_snapshot)
        bridge.core_failed.connect(self.on_core_failed)
        self.on_snapshot(bridge.latest)
        self.rebuild_menu()

    def on_snapshot(self, snapshot: NodeSnapshot) -> None:
        """Icon and tooltip only when they change: each update is a round trip to the desktop's
        tray host (D-Bus on Linux), and snapshots arrive every second."""
        state, text = tray_state(snapshot), tooltip(snapshot)
        if state != self._shown_state:
            self._shown_state = state
            self.icon.setIcon(state_icon(state))
        if text != self.icon.toolTip():
            self.icon.setToolTip(text)
        for note in notifications_between(self._previous, snapshot):
            self._notify(note)
        self._previous = snapshot

    def on_core_failed(self, problem: Problem) -> None:
        self._shown_state = "failed"
        self.icon.setIcon(state_icon("failed"))
        self.icon.setToolTip(f"GPU Provider — {problem.title}")
        self._notify(Notification(problem.title, problem.message, "critical"))

    def _notify(self, note: Notification) -> None:
        self.shown_notifications.append(note)
        self.icon.showMessage(note.title, note.message, _LEVEL_ICONS[note.level], 8000)

    def rebuild_menu(self) -> None:
        snapshot = self.bridge.latest
        self.menu.clear()
        status = self.menu.addAction(status_line(snapshot))
        status.setEnabled(False)
        self.menu.addSeparator()
        if snapshot.paused:
            self._add(self.menu, "Resume serving", self.bridge.resume)
        else:
            self._add(self.menu, "Pause serving", self.bridge.pause)
        timed = [
            self._add(self.menu, label, partial(self.bridge.pause_for, seconds)) for label, seconds in TIMED_PAUSES
        ]
        timed.append(self._add(self.menu, "Pause until tomorrow", self.bridge.pause_until_tomorrow))
        for action in timed:
            action.setEnabled(not snapshot.paused)  # resume first; a pause never silently shortens another
        self.menu.addSeparator()
        self._add(self.menu, "Open dashboard", self.open_dashboard.emit)
        self._add(self.menu, "Settings…", self.open_settings.emit)
        self._add(self.menu, "View logs", self.open_logs.emit)
        self.menu.addSeparator()
        self._add(self.menu, "Quit", self.quit_requested.emit)

    @staticmethod
    def _add(menu: QMenu, text: str, slot: Callable[[], object]) -> QAction:
        action = menu.addAction(text)
        action.triggered.connect(lambda _checked=False: slot())
        return action

    def _on_activated(self, reason: QSystemTrayIcon.ActivationReason) -> None:
        if reason in (QSystemTrayIcon.ActivationReason.Trigger, QSystemTrayIcon.ActivationReason.DoubleClick):
            self.open_dashboard.emit()
