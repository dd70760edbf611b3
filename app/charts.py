"""Charts (pyqtgraph): live series pulled from the core's history once a second while visible,
and the last 30 days of net earnings. Colours come from the theme and follow its changes."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Sequence

import pyqtgraph as pg
from PySide6.QtCore import QTimer
from PySide6.QtGui import QFontMetrics, QHideEvent, QShowEvent
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from app import theme
from app.format import money
from app.widgets import Reflow
from worker.contract.events import DayEarnings

History = Callable[[str, float], list[tuple[float, float]]]  # (series, window_s) -> [(t, value)]

WINDOW_S = 10 * 60
REFRESH_MS = 1000
IDLE_REDRAW_S = 30.0  # how often the window slides (5 % of it): an idle node's only repaint
RECENT_S = 3.0  # how far back a refresh looks to see whether a line changed
PLOT_HEIGHT = 180

pg.setConfigOptions(antialias=True)

# plot key: (title, unit, y range or None to follow the data); GPU plots get a line per GPU
PLOTS: dict[str, tuple[str, str, tuple[float, float] | None]] = {
    "tokens_per_s": ("Tokens per second", "tok/s", None),
    "kv_usage": ("Chat memory in use", "%", (0, 100)),
    "util_pct": ("GPU busy", "%", (0, 100)),
    "power_w": ("GPU power", "W", None),
    "temperature_c": ("GPU temperature", "°C", None),
}
GPU_PLOTS = ("util_pct", "power_w", "temperature_c")


def _style_plot(plot: pg.PlotItem | pg.PlotWidget, title: str, c: theme.Colours) -> None:
    item = plot.getPlotItem() if isinstance(plot, pg.PlotWidget) else plot
    if title:
        item.setTitle(title, size="9pt", color=c.text)
    for side in ("left", "bottom"):
        axis = item.getAxis(side)
        axis.setPen(pg.mkPen(c.chart_fg))
        axis.setTextPen(pg.mkPen(c.chart_fg))


def _plot(title: str, unit: str, y_range: tuple[float, float] | None) -> pg.PlotWidget:
    plot = pg.PlotWidget(axisItems={"bottom": pg.DateAxisItem(orientation="bottom")})
    plot.setMenuEnabled(False)
    plot.setMouseEnabled(x=False, y=False)
    plot.hideButtons()
    plot.showGrid(x=False, y=True, alpha=0.15)
    plot.setLabel("left", units=unit)
    if y_range is not None:
        plot.setYRange(*y_range, padding=0.02)
    plot.setFixedHeight(PLOT_HEIGHT)
    plot.setMinimumWidth(200)
    return plot


class LiveCharts(QWidget):
    """Small time series over the last ten minutes, x in clock time; the timer runs between
    showEvent and hideEvent only. GPU charts have one line per GPU and are absent on CPU nodes."""

    def __init__(self, history: History, clock: Callable[[], float] = time.time, parent: QWidget | None = None):
        super().__init__(parent)
        self._history = history
        self._clock = clock
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        self.empty_note = QLabel("Charts fill in once the engine serves: tokens per second, GPU load and memory.")
        self.empty_note.setObjectName("muted")
        self.empty_note.setWordWrap(True)
        outer.addWidget(self.empty_note)
        self.plots = {key: _plot(title, unit, y_range) for key, (title, unit, y_range) in PLOTS.items()}
        self.grid = Reflow(list(self.plots.values()), columns=2)
        outer.addWidget(self.grid)
        self.curves: dict[str, pg.PlotDataItem] = {
            "tokens_per_s": self.plots["tokens_per_s"].plot(),
            "kv_usage": self.plots["kv_usage"].plot(),
        }
        self.gpus: tuple[int, ...] | None = None  # None until the first snapshot says
        self._drawn: dict[str, tuple[float | None, bool]] = {}  # series: (newest value drawn, any points)
        self._slid_at = 0.0
        self.set_gpus(())
        self.timer = QTimer(self)
        self.timer.setInterval(REFRESH_MS)
        self.timer.timeout.connect(self.refresh)
        theme.notifier().changed.connect(self.apply_theme)

    def set_gpus(self, indices: Sequence[int]) -> None:
        """A line per GPU in each GPU chart; none (and no GPU charts) on a CPU node."""
        if tuple(indices) == self.gpus:
            return
        self.gpus = tuple(indices)
        for key in GPU_PLOTS:
            plot = self.plots[key]
            for series in [s for s in self.curves if s.endswith("." + key)]:
                plot.removeItem(self.curves.pop(series))
                self._drawn.pop(series, None)
            if plot.plotItem.legend is None and len(self.gpus) > 1:
                plot.addLegend(offset=(8, 4), labelTextSize="8pt")
            for i in self.gpus:
                self.curves[f"gpu{i}.{key}"] = plot.plot(name=f"GPU {i}")
            plot.setVisible(bool(self.gpus))
        self.apply_theme()

    def apply_theme(self) -> None:
        c = theme.colours()
        for key, plot in self.plots.items():
            plot.setBackground(c.chart_bg)
            _style_plot(plot, PLOTS[key][0], c)
            legend = plot.plotItem.legend
            if legend is not None:
                legend.setLabelTextColor(c.text)
                legend.setBrush(pg.mkBrush(c.chart_bg + "CC"))
        for series, curve in self.curves.items():
            colour = _series_colour(series, c)
            filled = not series.startswith("gpu")
            curve.setPen(pg.mkPen(colour, width=2))
            curve.setFillLevel(0 if filled else None)
            curve.setBrush(pg.mkBrush(colour + "22") if filled else None)

    def refresh(self) -> None:
        """Redraws a series when its newest value changed; flat lines (an idle node's) only when
        the window slides, every `IDLE_REDRAW_S`, all in that one repaint. The window reaches that
        far past now, so points arriving in between are drawn at once. Deciding asks the core for
        the last seconds only, not the whole window."""
        now = self._clock()
        slide = now - self._slid_at >= IDLE_REDRAW_S
        has_data = False
        for series, curve in self.curves.items():
            recent = self._history(series, RECENT_S)
            newest = recent[-1][1] if recent else None
            drawn = self._drawn.get(series)
            if drawn is not None and drawn[0] == newest and not slide:
                has_data = has_data or drawn[1]
                continue
            history = [(t, v) for t, v in self._history(series, WINDOW_S) if now - t <= WINDOW_S]
            self._drawn[series] = (newest, bool(history))
            has_data = has_data or bool(history)
            curve.setData([t for t, _ in history], [v for _, v in history])
        if slide:
            self._slid_at = now
            for plot in self.plots.values():
                plot.setXRange(now - WINDOW_S, now + IDLE_REDRAW_S, padding=0)
        if self.grid.isHidden() == has_data:  # only on a change: showing or hiding re-lays out the window
            self.grid.setVisible(has_data)
            self.empty_note.setVisible(not has_data)

    def showEvent(self, event: QShowEvent) -> None:
        super().showEvent(event)
        self.refresh()
        self.timer.start()

    def hideEvent(self, event: QHideEvent) -> None:
        self.timer.stop()
        super().hideEvent(event)


def _series_colour(series: str, c: theme.Colours) -> str:
    if series == "tokens_per_s":
        return c.series[0]
    if series == "kv_usage":
        return c.series[3]
    index = int(series.split(".")[0].removeprefix("gpu"))
    return c.series[index % len(c.series)]


class MoneyAxis(pg.AxisItem):
    """Tick labels in the network's currency ("$0.40"), never bare numbers."""

    def __init__(self, currency: str) -> None:
        super().__init__(orientation="left")
        self.currency = currency

    def tickStrings(self, values: list[float], scale: float, spacing: float) -> list[str]:  # noqa: N802
        return [money(v * scale, self.currency) for v in values]


class EarningsChart(pg.PlotWidget):
    """Net earnings per day for the last 30 days, a bar per day, the currency on the axis."""

    def __init__(self, parent: QWidget | None = None) -> None:
        self.money_axis = MoneyAxis("USD")
        super().__init__(parent, axisItems={"left": self.money_axis})
        self.setMenuEnabled(False)
        self.setMouseEnabled(x=False, y=False)
        self.hideButtons()
        self.setFixedHeight(170)
        self.setMinimumWidth(200)
        self.showGrid(x=False, y=True, alpha=0.15)
        self.bars = pg.BarGraphItem(x=[], height=[], width=0.7, pen=None)
        self.addItem(self.bars)
        self.days: tuple[DayEarnings, ...] = ()
        theme.notifier().changed.connect(self.apply_theme)
        self.apply_theme()

    def apply_theme(self) -> None:
        c = theme.colours()
        self.setBackground(c.chart_bg)
        _style_plot(self, "", c)
        self.bars.setOpts(brush=c.series[1])

    def show_days(self, days: Sequence[DayEarnings], currency: str) -> None:
        self.days = tuple(days)
        self.money_axis.currency = currency
        self.money_axis.setTicks(None)  # re-draws the tick labels, in the new currency
        self.bars.setOpts(x=list(range(len(days))), height=[d.net for d in days])
        self.getAxis("bottom").setTicks([_day_ticks(days)])
        self.setXRange(-0.6, max(len(days), 1) + 0.6, padding=0)  # room for the "Today" label
        top = max([d.net for d in days] + [0.0])
        bottom = min([d.net for d in days] + [0.0])
        self.setYRange(bottom, top if top > bottom else bottom + 0.01, padding=0.08)
        self._fit_axis(top, bottom, currency)

    def _fit_axis(self, top: float, bottom: float, currency: str) -> None:
        """Room for the widest label now: pyqtgraph widens an axis only on a later paint, so the
        first picture (and a screenshot) would show it without its figures."""
        metrics = QFontMetrics(self.money_axis.style.get("tickFont") or self.font())
        widest = max(metrics.horizontalAdvance(money(v, currency)) for v in (top * 1.1, bottom * 1.1, 0.0))
        self.money_axis.setWidth(widest + 12)


def _day_ticks(days: Sequence[DayEarnings]) -> list[tuple[int, str]]:
    """A date every week, and today."""
    ticks: list[tuple[int, str]] = []
    for i, day in enumerate(days):
        if (len(days) - 1 - i) % 7 == 0:
            date = dt.date.fromisoformat(day.day)
            ticks.append((i, "Today" if i == len(days) - 1 else f"{date:%b} {date.day}"))
    return ticks
