"""The charts, read back from pyqtgraph's items (offscreen Qt): value axes from 0 in units a
person reads, text following the system font size, and a red bar for a day that lost money."""

from __future__ import annotations

import datetime as dt

import pytest
from PySide6.QtGui import QFont

from app import charts, theme
from app.charts import EarningsChart, LiveCharts
from worker.contract.events import DayEarnings

NOW = 1_800_000_000.0


def live(qtbot, points: dict[str, list[tuple[float, float]]]) -> LiveCharts:
    widget = LiveCharts(lambda series, window_s: [p for p in points.get(series, []) if p[0] >= NOW - window_s],
                        clock=lambda: NOW)
    qtbot.addWidget(widget)
    return widget


def y_range(widget: LiveCharts, key: str) -> list[float]:
    return [float(v) for v in widget.plots[key].getViewBox().viewRange()[1]]


@pytest.mark.usefixtures("scheme")
def test_a_flat_idle_line_reads_zero_tokens_per_second_from_zero(qtbot) -> None:
    widget = live(qtbot, {"tokens_per_s": [(NOW - s, 0.0) for s in range(120)]})
    widget.refresh()
    assert y_range(widget, "tokens_per_s") == [0.0, charts.PLOTS["tokens_per_s"].top]
    axis = widget.plots["tokens_per_s"].getAxis("left")
    assert "(tok/s)" in axis.labelString() and "mtok" not in axis.labelString()
    assert axis.autoSIPrefixScale == 1.0


@pytest.mark.usefixtures("scheme")
def test_a_busy_line_grows_the_axis_in_plain_tokens(qtbot) -> None:
    points = {"tokens_per_s": [(NOW - s, 3768.0 if s < 60 else 900.0) for s in range(120)]}
    widget = live(qtbot, points)
    widget.refresh()
    assert y_range(widget, "tokens_per_s") == pytest.approx([0.0, 3768.0 * charts.HEADROOM])
    axis = widget.plots["tokens_per_s"].getAxis("left")
    axis.resizeEvent()  # pyqtgraph picks its SI prefix as the axis is laid out
    assert "ktok" not in axis.labelString() and axis.autoSIPrefixScale == 1.0
    assert axis.tickStrings([0.0, 2000.0, 4000.0], 1.0, 2000.0) == ["0", "2000", "4000"]


@pytest.mark.usefixtures("scheme")
def test_percentages_keep_their_whole_range(qtbot) -> None:
    widget = live(qtbot, {"kv_usage": [(NOW - s, 3.0) for s in range(60)]})
    widget.refresh()
    assert y_range(widget, "kv_usage") == [0.0, 100.0]


@pytest.fixture
def font_pt(qapp):
    """The system font at 15 pt (a person reading at 150 %), put back afterwards."""
    before = qapp.font()
    font = QFont(before)
    font.setPointSizeF(15)
    qapp.setFont(font)
    yield 15.0
    qapp.setFont(before)


@pytest.mark.usefixtures("scheme")
def test_chart_text_follows_the_system_font(qtbot, font_pt: float) -> None:
    widget = live(qtbot, {})
    widget.set_gpus((0, 1))  # two cards: a legend
    plot = widget.plots["power_w"].getPlotItem()
    tick_font = plot.getAxis("left").style["tickFont"]
    assert tick_font is not None and tick_font.pointSizeF() == pytest.approx(font_pt * charts.TICK_SCALE)
    assert plot.titleLabel.opts["size"] == f"{font_pt * charts.TITLE_SCALE:.1f}pt"
    assert plot.legend.opts["labelTextSize"] == f"{font_pt * charts.TICK_SCALE:.1f}pt"
    earnings = EarningsChart()
    qtbot.addWidget(earnings)
    assert earnings.money_axis.style["tickFont"].pointSizeF() == pytest.approx(font_pt * charts.TICK_SCALE)


def days(*nets: float) -> list[DayEarnings]:
    today = dt.date(2026, 11, 25)
    return [DayEarnings((today - dt.timedelta(days=len(nets) - 1 - i)).isoformat(), max(net, 0.0) + 0.5, 0.5 - min(net, 0.0))
            for i, net in enumerate(nets)]


def test_a_day_that_lost_money_is_a_red_bar(qtbot, scheme) -> None:
    chart = EarningsChart()
    qtbot.addWidget(chart)
    chart.show_days(days(1.20, -0.50, 0.0, 0.80), "USD")
    c = theme.colours()
    assert list(chart.bars.opts["height"]) == pytest.approx([1.20, -0.50, 0.0, 0.80])
    brushes = [b.color().name().upper() for b in chart.bars.opts["brushes"]]
    assert brushes == [c.series[1].upper(), c.error.upper(), c.series[1].upper(), c.series[1].upper()]
    low, high = chart.getViewBox().viewRange()[1]
    assert low < -0.50 and high > 1.20  # the loss is drawn below the line, not cut off
