"""One engine in plain words: what it runs on, how far its start got, what it can hold, and its
command line and last error folded under "Details" (engine flags are the app's business)."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QFrame,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QProgressBar,
    QToolButton,
    QVBoxLayout,
)

from app.format import (
    PHASE_STEPS,
    STATE_COLOURS,
    context_words,
    engine_state_words,
    gib,
    gpus_words,
    kv_tooltip,
    retry_words,
    tuned_words,
)
from app.widgets import PILL_HEIGHT, Values, caption, pill_style
from worker.engines import registry
from worker.contract.events import EngineSnapshot

ENGINE_COLOURS = {
    "ready": STATE_COLOURS["serving"],
    "starting": STATE_COLOURS["starting"],
    "degraded": STATE_COLOURS["degraded"],
    "failed": STATE_COLOURS["failed"],
    "paused": STATE_COLOURS["paused"],
}
ROWS = (("context", "Context"), ("memory", "Memory"), ("requests", "Requests"), ("tuned", "Tuned"),
        ("health", "Health"))


class EngineCard(QFrame):
    def __init__(self, values: Values, engine: EngineSnapshot) -> None:
        super().__init__()
        self.key = f"engine:{engine.engine_id}"
        self._values = values
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 6, 0, 6)
        layout.setSpacing(6)
        head = QHBoxLayout()
        head.addWidget(values.label(f"{self.key}.title", "rowTitle", wrap=True), 1)
        self.state_chip = values.label(f"{self.key}.state", "pill")
        self.state_chip.setFixedHeight(PILL_HEIGHT)
        head.addWidget(self.state_chip, 0, Qt.AlignmentFlag.AlignTop)
        layout.addLayout(head)
        self.phase_bar = QProgressBar()
        self.phase_bar.setRange(0, len(PHASE_STEPS) - 1)
        self.phase_bar.setTextVisible(False)
        layout.addWidget(self.phase_bar)
        layout.addWidget(values.label(f"{self.key}.phase", "caption", wrap=True))
        grid = QGridLayout()
        grid.setHorizontalSpacing(18)
        grid.setVerticalSpacing(4)
        self._row_titles: dict[str, QLabel] = {}
        for row, (name, title) in enumerate(ROWS):
            title_label = caption(title)
            title_label.setWordWrap(False)
            self._row_titles[name] = title_label
            grid.addWidget(title_label, row, 0, Qt.AlignmentFlag.AlignTop)
            grid.addWidget(values.label(f"{self.key}.{name}", wrap=True), row, 1)
        grid.setColumnStretch(1, 1)
        layout.addLayout(grid)
        layout.addWidget(values.label(f"{self.key}.error", "error", wrap=True))
        self.argv_toggle = QToolButton()
        self.argv_toggle.setCheckable(True)
        self.argv_toggle.toggled.connect(self._toggle_argv)
        layout.addWidget(self.argv_toggle)
        self.argv = QPlainTextEdit()
        self.argv.setReadOnly(True)
        self.argv.setMaximumHeight(140)
        layout.addWidget(self.argv)
        self._toggle_argv(False)

    def _toggle_argv(self, shown: bool) -> None:
        self.argv.setVisible(shown)
        self.argv_toggle.setText("Hide details" if shown else "Details")

    def _row(self, name: str, text: str, tooltip: str | None = None) -> None:
        self._values.set(f"{self.key}.{name}", text, tooltip)
        self._values.labels[f"{self.key}.{name}"].setVisible(bool(text))
        self._row_titles[name].setVisible(bool(text))

    def show_engine(self, engine: EngineSnapshot) -> None:
        key = self.key
        where = gpus_words(engine.gpu_indices, engine.layout)
        self._values.set(f"{key}.title", f"{registry.display_name(engine.engine)} on {where}")
        self._values.set(f"{key}.state", engine_state_words(engine))
        chip = pill_style(ENGINE_COLOURS.get(engine.state, STATE_COLOURS["idle"]))
        if self.state_chip.styleSheet() != chip:
            self.state_chip.setStyleSheet(chip)
        starting = engine.phase is not None and engine.phase != "ready" and engine.state == "starting"
        waiting = engine.retry_at is not None and engine.state != "ready"
        self.phase_bar.setVisible(starting and not waiting)
        self._values.labels[f"{key}.phase"].setVisible(starting or waiting)
        if waiting:
            self._values.set(f"{key}.phase", retry_words(engine.retry_at))
        elif engine.phase is not None:
            step = PHASE_STEPS.index(engine.phase)
            self.phase_bar.setValue(step)
            self._values.set(f"{key}.phase", f"{engine.phase.capitalize()} (step {step + 1} of {len(PHASE_STEPS)})")
        self._row("context", context_words(engine), kv_tooltip(engine))
        self._row("memory", memory_words(engine))
        self._row("requests", requests_words(engine))
        self._row("tuned", tuned_words(engine.tuned))
        self._row("health", health_words(engine))
        failed = engine.state in ("failed", "degraded") and bool(engine.last_error)
        self._values.set(f"{key}.error", "Stopped after an error: see Details." if failed else "")
        self._values.labels[f"{key}.error"].setVisible(failed)
        details = details_text(engine)
        if self.argv.toPlainText() != details:
            self.argv.setPlainText(details)


def memory_words(engine: EngineSnapshot) -> str:
    """The engine's own memory: the graphics memory it may hold on its cards, or on the CPU the
    memory its chats take (never the RAM budget the plan allowed it, which is most of the machine's)."""
    usage = "" if engine.kv_usage_pct is None else f" · {engine.kv_usage_pct:.0f}% of its chat memory in use"
    if engine.gpu_indices and engine.memory_mib:
        return f"Up to {gib(engine.memory_mib)} of graphics memory{usage}"
    if not engine.gpu_indices and engine.kv_cache_gib is not None:
        return f"{engine.kv_cache_gib:.1f} GiB of memory for chats{usage}"
    return ""


def requests_words(engine: EngineSnapshot) -> str:
    """Requests waiting for a turn (those being answered are the dashboard's one in-flight figure)."""
    if not engine.requests_waiting:
        return ""
    return f"{engine.requests_waiting} waiting for a turn"


def health_words(engine: EngineSnapshot) -> str:
    """Restarts of an engine still going; a failed one says so in the banner, not with a count."""
    if engine.state == "failed" or engine.restarts == 0 or engine.failures_in_a_row:
        return ""
    return f"Restarted {engine.restarts} time{'s' if engine.restarts != 1 else ''}"


def details_text(engine: EngineSnapshot) -> str:
    parts = ["Command line: " + (" ".join(engine.argv) if engine.argv else "(not started)")]
    if engine.last_error:
        parts.append("What the engine said:\n" + engine.last_error)
    if engine.log_path:
        parts.append(f"Log: {engine.log_path}")
    return "\n\n".join(parts)
