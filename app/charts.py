"""Charts (pyqtgraph): live series pulled from the core's history once a second while visible,
and the last 30 days of net earnings. Colours come from the theme and follow its changes; text
sizes are multiples of the system font's, as the rest of the app's are.

Axes are honest: every live value axis starts at 0 and reads in the series' own unit (no SI
prefixes: a flat idle line is "0 tok/s", not "mtok/s" from −400 to 400), and a day that lost
money is a red bar below the line."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pyqtgraph as pg
from PySide6.QtCore import QTimer
from PySide6.QtGui import QFont, QFontMetrics, QGuiApplication, QHideEvent, QShowEvent
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
HEADROOM = 1.15  # a growing axis reaches this far above the highest point
# text sizes, as multiples of the system font's (the stylesheet's captions are 0.9)
TITLE_SCALE = 0.9
TICK_SCALE = 0.85

pg.setConfigOptions(antialias=True)


@dataclass(frozen=True)
class PlotSpec:
    """One live chart: its title, the unit its axis reads in, and how far the axis reaches at
    least (from 0; `fixed`: exactly, for percentages), so a flat line sits at its height."""

    title: str
    unit: str
    top: float
    fixed: bool = False


# GPU plots get a line per GPU
PLOTS: dict[str, PlotSpec] = {
    "tokens_per_s": PlotSpec("Tokens per second", "tok/s", 10.0),
    "kv_usage": PlotSpec("Chat memory in use", "%", 100.0, fixed=True),
    "util_pct": PlotSpec("GPU busy", "%", 100.0, fixed=True),
    "power_w": PlotSpec("GPU power", "W", 100.0),
    "temperature_c": PlotSpec("GPU temperature", "°C", 100.0),
}
GPU_PLOTS = ("util_pct", "power_w", "temperature_c")


def point_size(scale: float) -> float:
    """A chart text size following the system font, as the stylesheet's sizes do."""
    app = QGuiApplication.instance()
    base = theme.base_point_size(app) if isinstance(app, QGuiApplication) else theme.DEFAULT_POINT_SIZE
    return base * scale


def _style_plot(plot: pg.PlotItem | pg.PlotWidget, title: str, c: theme.Colours) -> None:
    item = plot.getPlotItem() if isinstance(plot, pg.PlotWidget) else plot
    if title:
        item.setTitle(title, size=f"{point_size(TITLE_SCALE):.1f}pt", color=c.text)
    tick_font = QFont()
    tick_font.setPointSizeF(point_size(TICK_SCALE))
    for side in ("left", "bottom"):
        axis = item.getAxis(side)
        axis.setPen(pg.mkPen(c.chart_fg))
        axis.setTextPen(pg.mkPen(c.chart_fg))
        axis.setStyle(tickFont=tick_font)
        if axis.labelText or axis.labelUnits:
            axis.setLabel(axis.labelText, units=axis.labelUnits, **{"font-size": f"{point_size(TICK_SCALE):.1f}pt"})


def _plot(spec: PlotSpec) -> pg.PlotWidget:
    plot = pg.PlotWidget(axisItems={"bottom": pg.DateAxisItem(orientation="bottom")})
    plot.setMenuEnabled(False)
    plot.setMouseEnabled(x=False, y=False)
    plot.hideButtons()
    plot.showGrid(x=False, y=True, alpha=0.15)
    left = plot.getAxis("left")
    left.enableAutoSIPrefix(False)  # "0 tok/s", never "mtok/s"
    plot.setLabel("left", units=spec.unit)
    plot.setYRange(0, spec.top, padding=0)
    plot.setFixedHeight(PLOT_HEIGHT)
    plot.setMinimumWidth(200)
    plot.setAccessibleName(f"{spec.title} chart, last ten minutes")
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
        self.plots = {key: _plot(spec) for key, spec in PLOTS.items()}
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
                plot.addLegend(offset=(8, 4))
            for i in self.gpus:
                self.curves[f"gpu{i}.{key}"] = plot.plot(name=f"GPU {i}")
            plot.setVisible(bool(self.gpus))
        self.apply_theme()

    def apply_theme(self) -> None:
        c = theme.colours()
        for key, plot in self.plots.items():
            plot.setBackground(c.chart_bg)
            _style_plot(plot, PLOTS[key].title, c)
            legend = plot.plotItem.legend
            if legend is not None:
                legend.setLabelTextColor(c.text)
                legend.setLabelTextSize(f"{point_size(TICK_SCALE):.1f}pt")
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
        redrawn: set[str] = set()
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
            redrawn.add(series.rsplit(".", 1)[-1])
        for key in redrawn:
            self._fit_values(key)
        if slide:
            self._slid_at = now
            for plot in self.plots.values():
                plot.setXRange(now - WINDOW_S, now + IDLE_REDRAW_S, padding=0)
        if self.grid.isHidden() == has_data:  # only on a change: showing or hiding re-lays out the window
            self.grid.setVisible(has_data)
            self.empty_note.setVisible(not has_data)

    def _fit_values(self, key: str) -> None:
        """The value axis from 0 to the highest point drawn (with headroom), at least to the
        plot's `top`: a flat idle line reads 0 at the bottom, not a sliver mid-chart."""
        spec = PLOTS[key]
        if spec.fixed:
            return
        peak = max((float(y.max()) for series, curve in self.curves.items()
                    if series.rsplit(".", 1)[-1] == key and (y := curve.getData()[1]) is not None and len(y)),
                   default=0.0)
        self.plots[key].setYRange(0, max(spec.top, peak * HEADROOM), padding=0)

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
    """Net earnings per day for the last 30 days, a bar per day (red below zero: a day electricity
    cost more than serving earned), the currency on the axis."""

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
        self.setAccessibleName("Net earnings per day, last 30 days")
        theme.notifier().changed.connect(self.apply_theme)
        self.apply_theme()

    def apply_theme(self) -> None:
        c = theme.colours()
        self.setBackground(c.chart_bg)
        _style_plot(self, "", c)
        self._paint_bars(c)

    def _paint_bars(self, c: theme.Colours) -> None:
        """Green for a day that earned, the theme's error red for one that lost."""
        colours = [c.error if d.net < 0 else c.series[1] for d in self.days]
        self.bars.setOpts(brushes=[pg.mkBrush(colour) for colour in colours], brush=c.series[1])

    def show_days(self, days: Sequence[DayEarnings], currency: str) -> None:
        self.days = tuple(days)
        self.money_axis.currency = currency
        self.money_axis.setTicks(None)  # re-draws the tick labels, in the new currency
        self.bars.setOpts(x=list(range(len(days))), height=[d.net for d in days])
        self._paint_bars(theme.colours())
        self.getAxis("bottom").setTicks([_day_ticks(days)])
        self.setXRange(-1.0, max(len(days), 1) + 0.6, padding=0)  # room for the first date and "Today"
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
