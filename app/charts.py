"""Live charts (pyqtgraph) that pull the core's history once a second, and only while visible."""

from __future__ import annotations

import time
from collections.abc import Callable

import pyqtgraph as pg
from PySide6.QtCore import QTimer
from PySide6.QtGui import QHideEvent, QShowEvent
from PySide6.QtWidgets import QGridLayout, QLabel, QVBoxLayout, QWidget

from worker.events import EarningsSnapshot

History = Callable[[str, float], list[tuple[float, float]]]  # (series, window_s) -> [(t, value)]

WINDOW_S = 10 * 60
REFRESH_MS = 1000
IDLE_REDRAW_S = 10.0

pg.setConfigOptions(antialias=True, background="w", foreground="#5B6472")

# (series, title, unit, colour, y range or None to follow the data)
SERIES: tuple[tuple[str, str, str, str, tuple[float, float] | None], ...] = (
    ("tokens_per_s", "Tokens per second (this run)", "tok/s", "#2563EB", None),
    ("gpu_util", "GPU utilisation", "%", "#16A34A", (0, 100)),
    ("power_w", "GPU power", "W", "#D97706", None),
    ("kv_usage", "KV cache in use", "%", "#7C3AED", (0, 100)),
)


def _plot(title: str, unit: str, y_range: tuple[float, float] | None) -> pg.PlotWidget:
    plot = pg.PlotWidget()
    plot.setTitle(title, size="9pt", color="#1F2937")
    plot.setMenuEnabled(False)
    plot.setMouseEnabled(x=False, y=False)
    plot.hideButtons()
    plot.showGrid(x=False, y=True, alpha=0.15)
    plot.setLabel("left", units=unit)
    plot.setLabel("bottom", "seconds ago")
    plot.setXRange(-WINDOW_S, 0, padding=0)
    if y_range is not None:
        plot.setYRange(*y_range, padding=0.02)
    plot.setFixedHeight(180)
    return plot


class LiveCharts(QWidget):
    """Four small time series; the timer runs between showEvent and hideEvent only."""

    def __init__(self, history: History, clock: Callable[[], float] = time.time, parent: QWidget | None = None):
        super().__init__(parent)
        self._history = history
        self._clock = clock
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        self.empty_note = QLabel("Charts fill in once the engine serves: tokens per second, GPU load and KV use.")
        self.empty_note.setObjectName("muted")
        outer.addWidget(self.empty_note)
        self.plots = QWidget()
        layout = QGridLayout(self.plots)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(12)
        outer.addWidget(self.plots)
        self.curves: dict[str, pg.PlotDataItem] = {}
        self._drawn: dict[str, tuple[tuple[int, float | None], float]] = {}  # series: ((points, newest), drawn at)
        for i, (series, title, unit, colour, y_range) in enumerate(SERIES):
            plot = _plot(title, unit, y_range)
            self.curves[series] = plot.plot(pen=pg.mkPen(colour, width=2), fillLevel=0, brush=pg.mkBrush(colour + "22"))
            layout.addWidget(plot, i // 2, i % 2)
        self.timer = QTimer(self)
        self.timer.setInterval(REFRESH_MS)
        self.timer.timeout.connect(self.refresh)

    def refresh(self) -> None:
        """Redraws a series when it gained or lost points, else every `IDLE_REDRAW_S` (to slide
        the old points left): an idle node costs almost no repaints."""
        now = self._clock()
        has_data = False
        for series, curve in self.curves.items():
            history = [(t, v) for t, v in self._history(series, WINDOW_S) if now - t <= WINDOW_S]
            has_data = has_data or bool(history)
            key = (len(history), history[-1][0] if history else None)
            drawn = self._drawn.get(series)
            if drawn is not None and drawn[0] == key and now - drawn[1] < IDLE_REDRAW_S:
                continue
            self._drawn[series] = (key, now)
            curve.setData([t - now for t, _ in history], [v for _, v in history])
        self.plots.setVisible(has_data)
        self.empty_note.setVisible(not has_data)

    def showEvent(self, event: QShowEvent) -> None:
        super().showEvent(event)
        self.refresh()
        self.timer.start()

    def hideEvent(self, event: QHideEvent) -> None:
        self.timer.stop()
        super().hideEvent(event)


class EarningsChart(pg.PlotWidget):
    """Earned, electricity and net for today and this week, side by side."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setMenuEnabled(False)
        self.setMouseEnabled(x=False, y=False)
        self.hideButtons()
        self.setFixedHeight(150)
        self.showGrid(x=False, y=True, alpha=0.15)
        self.getAxis("bottom").setTicks([[(1, "Today"), (4, "This week")]])
        self.addLegend(offset=(8, 4), labelTextSize="8pt")
        self.bars: dict[str, pg.BarGraphItem] = {}
        for offset, name, colour in (
            (-0.8, "Earned", "#2563EB"),
            (0, "Electricity", "#D97706"),
            (0.8, "Net", "#16A34A"),
        ):
            bar = pg.BarGraphItem(
                x=[1 + offset, 4 + offset], height=[0, 0], width=0.7, brush=colour, pen=None, name=name
            )
            self.addItem(bar)
            self.bars[name] = bar
        self.setXRange(-0.5, 5.5, padding=0)

    def show_earnings(self, earnings: EarningsSnapshot) -> None:
        self.bars["Earned"].setOpts(height=[earnings.today, earnings.week])
        self.bars["Electricity"].setOpts(height=[earnings.energy_cost_today, earnings.energy_cost_week])
        self.bars["Net"].setOpts(height=[earnings.net_today, earnings.net_week])
