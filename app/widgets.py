"""Small building blocks the dashboard's parts share: cards, named labels, rows kept by key, and
a row of cards that folds into one column when the window is narrow."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QFrame, QGridLayout, QLabel, QVBoxLayout, QWidget

K = TypeVar("K")
T = TypeVar("T")
W = TypeVar("W", bound=QWidget)

PILL_HEIGHT = 26  # Qt drops a border radius larger than half the height


def pill_style(colour: str) -> str:
    """A state chip: white on the state's colour (mid-tones, readable in light and dark)."""
    return f"background: {colour}; color: white; border-radius: 10px; padding: 2px 12px; font-weight: 600;"


def card(title: str) -> tuple[QFrame, QVBoxLayout]:
    frame = QFrame()
    frame.setObjectName("card")
    layout = QVBoxLayout(frame)
    layout.setContentsMargins(18, 14, 18, 16)
    layout.setSpacing(10)
    heading = QLabel(title.upper())
    heading.setObjectName("cardTitle")
    heading.setWordWrap(True)
    layout.addWidget(heading)
    return frame, layout


def caption(text: str = "") -> QLabel:
    label = QLabel(text)
    label.setObjectName("caption")
    label.setWordWrap(True)
    return label


def set_dimmed(label: QLabel, dimmed: bool) -> None:
    """Greys a figure that is not live (the last measured capacity while paused)."""
    if label.property("dimmed") == dimmed:
        return
    label.setProperty("dimmed", dimmed)
    label.style().unpolish(label)
    label.style().polish(label)


class Values:
    """Named labels, so tests (and the code) address figures by meaning rather than position."""

    def __init__(self) -> None:
        self.labels: dict[str, QLabel] = {}

    def label(self, key: str, object_name: str = "", text: str = "—", *, wrap: bool = False) -> QLabel:
        label = QLabel(text)
        if object_name:
            label.setObjectName(object_name)
        label.setWordWrap(wrap)
        label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.labels[key] = label
        return label

    def set(self, key: str, text: str, tooltip: str | None = None) -> None:
        label = self.labels[key]
        label.setText(text)
        if tooltip is not None:
            label.setToolTip(tooltip)

    def text(self, key: str) -> str:
        return self.labels[key].text()


class Reflow(QWidget):
    """Widgets side by side, or stacked when narrow: `columns` wide (all by default),
    `narrow_columns` narrow."""

    def __init__(
        self,
        widgets: Sequence[QWidget],
        stretches: Sequence[int] | None = None,
        columns: int = 0,
        narrow_columns: int = 1,
    ) -> None:
        super().__init__()
        self.widgets = list(widgets)
        self._stretches = list(stretches or [1] * len(self.widgets))
        self._wide_columns = columns or len(self.widgets)
        self._narrow_columns = narrow_columns
        self._grid = QGridLayout(self)
        self._grid.setContentsMargins(0, 0, 0, 0)
        self._grid.setSpacing(16)
        self.columns = 0
        self.set_narrow(False)

    def set_narrow(self, narrow: bool) -> None:
        columns = self._narrow_columns if narrow else self._wide_columns
        if columns == self.columns:
            return
        self.columns = columns
        for widget in self.widgets:
            self._grid.removeWidget(widget)
        for column in range(self._wide_columns):
            self._grid.setColumnStretch(column, 0)
        for i, widget in enumerate(self.widgets):
            self._grid.addWidget(widget, i // columns, i % columns)
        for column in range(columns):
            stretch = self._stretches[column] if columns == len(self.widgets) else 1
            self._grid.setColumnStretch(column, stretch)


def sync_rows(
    rows: dict[K, W],
    items: dict[K, T],
    create: Callable[[T], W],
    layout: QVBoxLayout,
    show: Callable[[W, T], None],
) -> None:
    """Keep one widget per key: add new ones, drop vanished ones, update the rest in place."""
    for key in [k for k in rows if k not in items]:
        rows.pop(key).deleteLater()
    for key, item in items.items():
        if key not in rows:
            rows[key] = create(item)
            layout.addWidget(rows[key])
        show(rows[key], item)
