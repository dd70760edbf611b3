"""The earnings card, read back from its widgets (offscreen Qt): earnings first, red with a plain
warning when electricity costs more than serving earns, "net of electricity" only where power is
measured, the rate and a day's projection, and served requests never beside "No earnings yet"
without the reason. One test feeds it the real ledger's summary."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from PySide6.QtWidgets import QLabel

from app import theme
from app.earnings_panel import EMPTY, NOT_MEASURED, EarningsPanel, today_words
from app.widgets import Values
from tests.app import snapshots
from worker.contract.events import ConnectionSnapshot, ConnectionState, DayEarnings, EarningsSnapshot, NodeSnapshot
from worker.contract.protocol import Price
from worker.measure.ledger import SERVING_SERIES, Ledger

LOSING = EarningsSnapshot(
    currency="USD", today=0.10, week=1.00, all_time=5.00, energy_cost_today=0.60, energy_cost_week=0.70,
    energy_cost_all_time=1.50, energy_kwh_today=2.0, net_per_hour=-0.05, electricity_price_per_kwh=0.30,
    power_measured=True, projected_per_day=-1.20,
    days=(DayEarnings("2026-11-24", 0.90, 0.10), DayEarnings("2026-11-25", 0.10, 0.60)),
)
EARNING = replace(LOSING, today=2.84, energy_cost_today=0.61, net_per_hour=0.19, projected_per_day=4.56)


@pytest.fixture
def panel(qtbot, scheme) -> EarningsPanel:
    widget = EarningsPanel(Values())
    qtbot.addWidget(widget)
    widget.show()
    return widget


def text(panel: EarningsPanel, key: str) -> str:
    return panel._values.text(key)


def colour(label: QLabel) -> str:
    label.ensurePolished()
    return label.palette().color(label.foregroundRole()).name().upper()


def seen(panel: EarningsPanel, key: str) -> bool:
    return panel._values.labels[key].isVisibleTo(panel)


def test_losing_money_is_red_with_a_plain_warning(panel: EarningsPanel, qtbot) -> None:
    panel.show_earnings(LOSING)
    error = theme.colours().error.upper()
    assert text(panel, "earn.headline") == "−$0.50"
    assert colour(panel._values.labels["earn.headline"]) == error
    assert panel.losing.isVisibleTo(panel)
    assert text(panel, "earn.losing") == "Electricity costs more than this earns: −$0.50 today."
    assert colour(panel._values.labels["earn.today.net"]) == error
    assert text(panel, "earn.projection") == "At this rate: about −$1.20 a day"
    assert colour(panel._values.labels["earn.projection"]) == error
    with qtbot.waitSignal(panel.settings_requested, timeout=500):  # where to stop serving when it does not pay
        panel.stop_button.click()


def test_earning_is_not_red_and_says_its_rate_and_projection(panel: EarningsPanel) -> None:
    panel.show_earnings(EARNING)
    assert text(panel, "earn.headline") == "$2.23"
    assert colour(panel._values.labels["earn.headline"]) != theme.colours().error.upper()
    assert not panel.losing.isVisibleTo(panel)
    assert text(panel, "earn.title") == "EARNINGS, NET OF ELECTRICITY"
    assert text(panel, "earn.per_hour") == "$0.19 per hour while serving (last 24 hours)"
    assert text(panel, "earn.projection") == "At this rate: about $4.56 a day"
    assert text(panel, "energy_today") == "2.00 kWh used today at $0.30/kWh"


def test_a_day_losing_per_hour_warns_before_the_day_is_down(panel: EarningsPanel) -> None:
    panel.show_earnings(replace(EARNING, net_per_hour=-0.05))
    assert text(panel, "earn.losing") == "Electricity costs more than this earns: −$0.05 per hour while serving."
    assert colour(panel._values.labels["earn.per_hour"]) == theme.colours().error.upper()


def test_where_power_is_not_measured_nothing_says_net_of_electricity(panel: EarningsPanel) -> None:
    cpu = replace(EARNING, power_measured=False, energy_cost_today=0.0, energy_cost_week=0.0,
                  energy_cost_all_time=0.0, energy_kwh_today=0.0, electricity_price_per_kwh=0.0)
    panel.show_earnings(cpu)
    shown = [label.text() for label in panel.findChildren(QLabel) if label.isVisibleTo(panel)]
    assert not any("net of electricity" in words.lower() for words in shown), shown
    assert text(panel, "earn.title") == "EARNINGS"
    assert text(panel, "energy_today") == NOT_MEASURED
    assert not seen(panel, "earn.today.energy") and not seen(panel, "earn.today.net")
    assert "Electricity" not in shown and "Net" not in shown  # no column of zeros that reads "free"
    assert not panel.nudge.isVisibleTo(panel)  # a price it could not use is not asked for
    assert text(panel, "earn.per_hour") == "$0.19 per hour while serving (last 24 hours)"
    assert text(panel, "earn.chart_title") == "Earned per day, last 30 days (USD)"


def test_an_unset_price_is_nudged_only_where_power_is_measured(panel: EarningsPanel, qtbot) -> None:
    panel.show_earnings(replace(EARNING, electricity_price_per_kwh=0.0))
    assert panel.nudge.isVisibleTo(panel)
    assert text(panel, "earn.nudge") == "Set your electricity price to see real net earnings."
    with qtbot.waitSignal(panel.settings_requested, timeout=500):
        panel.price_button.click()


def test_no_rate_from_minutes_and_no_projection_without_one(panel: EarningsPanel) -> None:
    panel.show_earnings(replace(EARNING, net_per_hour=None, projected_per_day=None))
    assert text(panel, "earn.per_hour") == "No hourly rate yet: it needs 15 minutes of serving in the last 24 hours"
    assert not seen(panel, "earn.projection")


def served(requests: int, connection: ConnectionState = "connected") -> NodeSnapshot:
    node = snapshots.serving()
    return replace(node, throughput=replace(node.throughput, requests=requests),
                   connection=ConnectionSnapshot(node.connection.coordinator_url, connection),
                   earnings=EarningsSnapshot())


def test_served_requests_beside_no_earnings_say_why(panel: EarningsPanel) -> None:
    panel.show_earnings(EarningsSnapshot(), served(0))
    assert text(panel, "earn.empty") == EMPTY
    panel.show_earnings(EarningsSnapshot(), served(12))
    assert text(panel, "earn.empty") == ("No earnings yet: 12 requests served, none paid so far — "
                                         "served requests earn once the network pays for them.")
    panel.show_earnings(EarningsSnapshot(), served(1, "disabled"))
    assert text(panel, "earn.empty") == (
        "No earnings: the 1 request served came from this computer's own apps, and only the network pays.")


def test_the_real_ledgers_losing_day_reads_red(panel: EarningsPanel, tmp_path: Path) -> None:
    """The ledger's own summary: an hour served on a card whose power is measured, 0.40 earned
    and 1.00 of electricity."""
    now = 1_764_064_800.0  # 10:00 UTC: the day does not turn
    with Ledger(tmp_path / "ledger.sqlite3") as ledger:
        ledger.record_batch([(now - 3600 + 60 * m, {SERVING_SERIES: 3.0}) for m in range(60)])
        ledger.record_request("r", "run", "m", 0, 1_000_000, Price(per_million_output_tokens=0.40), now - 60)
        ledger.record_energy(2 * 3_600_000, now - 60, 0.50, "USD")
        summary = ledger.summary(now, "USD", 0.50)
    panel.show_earnings(summary)
    assert text(panel, "earn.headline") == "−$0.60"
    assert text(panel, "earn.losing") == "Electricity costs more than this earns: −$0.60 today."
    assert colour(panel._values.labels["earn.headline"]) == theme.colours().error.upper()
    assert panel.chart.isVisibleTo(panel)
    assert text(panel, "earn.per_hour") == "−$0.60 per hour while serving (last 24 hours)"


def test_todays_words_say_net_only_where_power_is_measured() -> None:
    assert today_words(LOSING) == "−$0.50 net today"
    assert today_words(replace(EARNING, power_measured=False, energy_cost_today=0.0)) == "$2.84 earned today"


def test_measured_without_a_price_is_not_called_net(panel: EarningsPanel) -> None:
    unpriced = replace(EARNING, electricity_price_per_kwh=0.0, energy_cost_today=0.0, energy_cost_week=0.0,
                       energy_cost_all_time=0.0)
    panel.show_earnings(unpriced)
    assert text(panel, "earn.title") == "EARNINGS" and text(panel, "earn.headline.caption") == "earned today"
    assert not seen(panel, "earn.today.energy")  # no "$0.00" of electricity: it is not free, only unpriced
    assert text(panel, "energy_today") == "2.00 kWh used today"  # measured, so said
    assert panel.nudge.isVisibleTo(panel)
    assert today_words(unpriced) == "$2.84 earned today"


def test_a_loss_stays_red_when_the_scheme_changes(panel: EarningsPanel, qapp, scheme) -> None:
    panel.show_earnings(LOSING)
    other = "dark" if scheme == "light" else "light"
    theme.install(qapp, other)
    assert colour(panel._values.labels["earn.headline"]) == theme.SCHEMES[other].error.upper()
    theme.install(qapp, scheme)
