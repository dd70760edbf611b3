"""The one banner above the dashboard: a failure in plain words and what to do about it, or a
staged update waiting for a restart.

A failure shows its title and message, one button for its action (Retry, Sign in again, ...),
when the app tries again by itself, and the log lines folded under "Details", so a traceback is
there for whoever wants it and never in the way.
"""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QFrame, QHBoxLayout, QPlainTextEdit, QPushButton, QToolButton, QVBoxLayout

from app.format import retry_words
from app.widgets import Values
from worker.contract.events import Problem

ACTION_BUTTONS = {
    "retry": "Retry",
    "check_network": "Retry",
    "sign_in": "Sign in again",
    "settings": "Open settings",
}


class ProblemBanner(QFrame):
    """`action_requested` carries the Problem's action ("retry", "sign_in", "settings")."""

    action_requested = Signal(str)

    def __init__(self, values: Values) -> None:
        super().__init__()
        self.setObjectName("banner")
        self._values = values
        self._action = "none"
        outer = QVBoxLayout(self)
        outer.setContentsMargins(16, 12, 16, 12)
        row = QHBoxLayout()
        text = QVBoxLayout()
        text.addWidget(values.label("problem_title", "rowTitle", wrap=True))
        text.addWidget(values.label("problem_message", wrap=True))
        text.addWidget(values.label("problem_retry_at", "caption", wrap=True))
        row.addLayout(text, 1)
        self.action_button = QPushButton()
        self.action_button.setObjectName("primary")
        self.action_button.clicked.connect(lambda: self.action_requested.emit(self._action))
        row.addWidget(self.action_button)
        outer.addLayout(row)
        self.details_toggle = QToolButton()
        self.details_toggle.setCheckable(True)
        self.details_toggle.toggled.connect(self._toggle_details)
        outer.addWidget(self.details_toggle)
        self.details = QPlainTextEdit()
        self.details.setReadOnly(True)
        self.details.setMaximumHeight(180)
        outer.addWidget(self.details)
        self._toggle_details(False)

    def _toggle_details(self, shown: bool) -> None:
        self.details.setVisible(shown)
        self.details_toggle.setText("Hide details" if shown else "Details")

    def show_problem(self, problem: Problem | None, now: float | None = None) -> None:
        self.setVisible(problem is not None)
        if problem is None:
            return
        self._action = problem.action
        self._values.set("problem_title", problem.title)
        self._values.set("problem_message", problem.message)
        when = retry_words(problem.retry_at, now)
        self._values.set("problem_retry_at", when)
        self._values.labels["problem_retry_at"].setVisible(bool(when))
        label = ACTION_BUTTONS.get(problem.action)
        self.action_button.setVisible(label is not None)
        self.action_button.setText(label or "")
        self.details_toggle.setVisible(bool(problem.details))
        text = "\n".join(problem.details)
        if self.details.toPlainText() != text:
            self.details.setPlainText(text)


class UpdateBanner(QFrame):
    """An update is downloaded and checked; it is applied when the person restarts."""

    restart_requested = Signal()

    def __init__(self, values: Values) -> None:
        super().__init__()
        self.setObjectName("banner")
        self.setProperty("kind", "info")
        row = QHBoxLayout(self)
        row.setContentsMargins(16, 12, 16, 12)
        self._values = values
        row.addWidget(values.label("update", "rowTitle", wrap=True), 1)
        self.restart_button = QPushButton("Restart to update")
        self.restart_button.setObjectName("primary")
        self.restart_button.clicked.connect(self.restart_requested.emit)
        row.addWidget(self.restart_button)

    def show_update(self, version: str | None) -> None:
        self.setVisible(version is not None)
        if version is not None:
            self._values.set("update", f"Version {version} is ready. It is installed when GPU Provider restarts.")
