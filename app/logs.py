"""The logs window: the app's log and each engine run's log, searchable, and "copy diagnostics"
(a text bundle for a bug report, scrubbed of the provider token before it reaches the clipboard)."""

from __future__ import annotations

import platform
import sys
from collections.abc import Callable
from pathlib import Path

import PySide6
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

import worker
from app.bridge import Bridge
from app.format import machine_summary
from worker.system import secrets
from worker.contract.events import NodeSnapshot

TAIL_BYTES = 2 * 2**20  # a log can grow large; the window shows its end
DIAGNOSTIC_LINES = 80


def redact_token(text: str) -> str:
    """The core's redaction, after reading the stored token so that it is among those redacted."""
    secrets.get_token()
    return secrets.redact(text)


def read_tail(path: Path, limit: int = TAIL_BYTES) -> str:
    """The last `limit` bytes of a log, starting at a whole line; a missing file reads as a note."""
    try:
        with path.open("rb") as handle:
            size = handle.seek(0, 2)
            handle.seek(max(0, size - limit))
            data = handle.read()
    except OSError as exc:
        return f"(could not read {path}: {exc.strerror or exc})"
    text = data.decode("utf-8", errors="replace")
    return text.split("\n", 1)[1] if size > limit and "\n" in text else text


def matching_lines(text: str, query: str) -> list[str]:
    """Lines containing `query`, ignoring case; every line when the query is empty."""
    lines = text.splitlines()
    needle = query.strip().casefold()
    return [line for line in lines if needle in line.casefold()] if needle else lines


def diagnostics(snapshot: NodeSnapshot, log_files: dict[str, Path], redact: Callable[[str], str]) -> str:
    """Versions, platform, hardware, state and recent log lines, passed through `redact` last."""
    parts = [
        "GPU Provider diagnostics",
        f"app {worker.__version__} · Python {sys.version.split()[0]} · PySide6 {PySide6.__version__}",
        f"platform {platform.platform()} ({platform.machine()})",
        "",
        machine_summary(snapshot),
        "",
        f"state {snapshot.state} · paused {snapshot.paused} ({snapshot.pause_reason}) · model {snapshot.model}",
        f"connection {snapshot.connection.state} · {snapshot.connection.coordinator_url}",
    ]
    if snapshot.problem:
        parts.append(f"problem: {snapshot.problem.title}: {snapshot.problem.message}")
    for engine in snapshot.engines:
        parts.append(
            f"engine {engine.engine_id} {engine.engine} {engine.state} restarts={engine.restarts} "
            f"last_error={engine.last_error}"
        )
    for name, path in log_files.items():
        tail = read_tail(path).splitlines()[-DIAGNOSTIC_LINES:]
        parts += ["", f"--- {name} ({path}), last {len(tail)} lines ---", *tail]
    return redact("\n".join(parts) + "\n")


class LogsWindow(QWidget):
    def __init__(self, bridge: Bridge, redact: Callable[[str], str], parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("GPU Provider logs")
        self.resize(900, 600)
        self._bridge = bridge
        self._redact = redact
        self._text = ""
        layout = QVBoxLayout(self)
        bar = QHBoxLayout()
        self.source = QComboBox()
        self.source.setAccessibleName("Which log")
        self.source.currentTextChanged.connect(self.load)
        bar.addWidget(self.source)
        self.search = QLineEdit()
        self.search.setPlaceholderText("Search")
        self.search.setAccessibleName("Search the log")
        self.search.setClearButtonEnabled(True)
        self.search.textChanged.connect(self._filter)
        bar.addWidget(self.search, 1)
        self.count = QLabel()
        bar.addWidget(self.count)
        reload_button = QPushButton("Reload")
        reload_button.clicked.connect(self.refresh)
        bar.addWidget(reload_button)
        copy = QPushButton("Copy diagnostics")
        copy.clicked.connect(self.copy_diagnostics)
        bar.addWidget(copy)
        layout.addLayout(bar)
        self.view = QPlainTextEdit()
        self.view.setReadOnly(True)
        self.view.setAccessibleName("Log")
        self.view.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
        self.view.setStyleSheet("font-family: monospace;")
        layout.addWidget(self.view)
        self.refresh()

    def refresh(self) -> None:
        """Re-list the logs (a new engine run adds one) and reload the one shown."""
        chosen = self.source.currentText()
        self.source.blockSignals(True)
        self.source.clear()
        self.source.addItems(list(self._bridge.log_files()))
        if chosen:
            self.source.setCurrentText(chosen)
        self.source.blockSignals(False)
        self.load(self.source.currentText())

    def load(self, name: str) -> None:
        path = self._bridge.log_files().get(name)
        self._text = self._redact(read_tail(path)) if path else ""
        self._filter(self.search.text())

    def _filter(self, query: str) -> None:
        lines = matching_lines(self._text, query)
        self.view.setPlainText("\n".join(lines))
        total = len(self._text.splitlines())
        self.count.setText(f"{len(lines):,} of {total:,} lines" if query.strip() else f"{total:,} lines")
        self.view.moveCursor(self.view.textCursor().MoveOperation.End)  # the newest lines, from their start:
        self.view.moveCursor(self.view.textCursor().MoveOperation.StartOfLine)  # a long last line scrolled right
        self.view.horizontalScrollBar().setValue(0)

    def copy_diagnostics(self) -> str:
        text = diagnostics(self._bridge.latest, self._bridge.log_files(), self._redact)
        QGuiApplication.clipboard().setText(text)
        return text
