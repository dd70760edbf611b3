"""The earnings card: today, this week and all time (earned, electricity, net), the hourly rate,
the last 30 days as a chart, and a nudge while no electricity price is set (net would be gross)."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QFrame, QGridLayout, QHBoxLayout, QLabel, QPushButton, QVBoxLayout

from app.charts import EarningsChart
from app.format import money
from app.widgets import Values, caption
from worker.contract.events import EarningsSnapshot

PERIODS = {"today": "Today", "week": "This week", "all_time": "All time"}
EMPTY = "No earnings yet — they appear after your first served request."


class EarningsPanel(QFrame):
    settings_requested = Signal()

    def __init__(self, values: Values) -> None:
        super().__init__()
        self.setObjectName("card")
        self._values = values
        layout = QVBoxLayout(self)
        layout.setContentsMargins(18, 14, 18, 16)
        layout.setSpacing(10)
        title = QLabel("EARNINGS, NET OF ELECTRICITY")
        title.setObjectName("cardTitle")
        title.setWordWrap(True)
        layout.addWidget(title)
        layout.addWidget(values.label("earn.per_hour", "rowTitle", wrap=True))
        layout.addLayout(self._table())
        layout.addWidget(values.label("energy_today", "caption", wrap=True))
        self.nudge = QFrame()
        self.nudge.setObjectName("banner")
        self.nudge.setProperty("kind", "warning")
        nudge = QHBoxLayout(self.nudge)
        nudge.setContentsMargins(12, 8, 12, 8)
        nudge.addWidget(
            values.label("earn.nudge", "warning", "Set your electricity price to see real net earnings.", wrap=True), 1
        )
        self.price_button = QPushButton("Set price")
        self.price_button.clicked.connect(self.settings_requested.emit)
        nudge.addWidget(self.price_button)
        layout.addWidget(self.nudge)
        layout.addWidget(values.label("earn.empty", "muted", EMPTY, wrap=True))
        layout.addWidget(values.label("earn.chart_title", "caption", wrap=True))
        self.chart = EarningsChart()
        layout.addWidget(self.chart)

    def _table(self) -> QGridLayout:
        grid = QGridLayout()
        grid.setHorizontalSpacing(18)
        for col, title in enumerate(("", "Earned", "Electricity", "Net")):
            grid.addWidget(caption(title), 0, col)
        for r, (period, name) in enumerate(PERIODS.items(), start=1):
            grid.addWidget(caption(name), r, 0)
            for col, part in enumerate(("gross", "energy", "net"), start=1):
                grid.addWidget(self._values.label(f"earn.{period}.{part}", "rowTitle" if part == "net" else ""), r, col)
        return grid

    def show_earnings(self, e: EarningsSnapshot) -> None:
        rows = {
            "today": (e.today, e.energy_cost_today, e.net_today),
            "week": (e.week, e.energy_cost_week, e.net_week),
            "all_time": (e.all_time, e.energy_cost_all_time, e.net_all_time),
        }
        for period, figures in rows.items():
            for part, amount in zip(("gross", "energy", "net"), figures, strict=True):
                shown = money(-amount if part == "energy" and amount else amount, e.currency)
                self._values.set(f"earn.{period}.{part}", shown)
        self._values.set(
            "earn.per_hour",
            "Nothing served in the last 24 hours"
            if e.net_per_hour is None
            else f"{money(e.net_per_hour, e.currency)} per hour while serving (last 24 hours)",
        )
        price = "" if not e.electricity_price_per_kwh else f" at {money(e.electricity_price_per_kwh, e.currency)}/kWh"
        self._values.set("energy_today", f"{e.energy_kwh_today:.2f} kWh used today{price}")
        self.nudge.setVisible(e.electricity_price_per_kwh == 0)
        earned = any(d.gross or d.energy_cost for d in e.days)
        self._values.labels["earn.empty"].setVisible(not earned)
        self._values.labels["earn.chart_title"].setVisible(earned)
        self._values.set("earn.chart_title", f"Net per day, last 30 days ({e.currency})")
        self.chart.setVisible(earned)
        if earned:
            self.chart.show_days(e.days, e.currency)
