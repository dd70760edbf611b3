"""The earnings card, earnings first: today's net as the headline figure (red, with a plain
warning, when electricity costs more than serving earns), the hourly rate and a day's projection,
today / this week / all time, and the last 30 days as a chart.

"Net of electricity" is said only where this machine's serving power is measured (NVML on its
cards) and charged at a price the person set; elsewhere (a Mac, a CPU node) the card says
electricity is not measured, shows what was earned, and does not ask for an electricity price it
could not use."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QFrame, QGridLayout, QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from app import theme
from app.charts import EarningsChart
from app.format import money
from app.widgets import Values, caption
from worker.contract.events import EarningsSnapshot, NodeSnapshot
from worker.measure.ledger import RATE_MIN_SERVED_MIN

PERIODS = {"today": "Today", "week": "This week", "all_time": "All time"}
EMPTY = "No earnings yet — they appear after your first served request."
NOT_MEASURED = "Electricity is not measured on this computer, so these are earnings before its cost."
NUDGE = "Set your electricity price to see real net earnings."


class EarningsPanel(QFrame):
    settings_requested = Signal()

    def __init__(self, values: Values) -> None:
        super().__init__()
        self.setObjectName("card")
        self._values = values
        self._shown: EarningsSnapshot | None = None  # recoloured when the theme changes
        layout = QVBoxLayout(self)
        layout.setContentsMargins(18, 14, 18, 16)
        layout.setSpacing(10)
        title = values.label("earn.title", "cardTitle", "EARNINGS", wrap=True)
        layout.addWidget(title)
        figure = QHBoxLayout()
        figure.addWidget(values.label("earn.headline", "statValue"))
        figure.addWidget(values.label("earn.headline.caption", "caption", "today"), 1)
        layout.addLayout(figure)
        self.losing, self.stop_button = self._banner(
            "earn.losing", "error", "Open settings", "Open settings: stop serving when it does not pay")
        layout.addWidget(self.losing)
        layout.addWidget(values.label("earn.per_hour", "rowTitle", wrap=True))
        layout.addWidget(values.label("earn.projection", "", wrap=True))
        self._columns: dict[str, list[QWidget]] = {"energy": [], "net": []}
        layout.addLayout(self._table())
        layout.addWidget(values.label("energy_today", "caption", wrap=True))
        self.nudge, self.price_button = self._banner(
            "earn.nudge", "warning", "Set price", "Set your electricity price", NUDGE)
        layout.addWidget(self.nudge)
        layout.addWidget(values.label("earn.empty", "muted", EMPTY, wrap=True))
        layout.addWidget(values.label("earn.chart_title", "caption", wrap=True))
        self.chart = EarningsChart()
        layout.addWidget(self.chart)
        theme.notifier().changed.connect(self._recolour)

    def _banner(self, key: str, kind: str, button_text: str, name: str, text: str = "") -> tuple[QFrame, QPushButton]:
        """A line in the banner style with a button that opens Settings (the price, or the stop
        when serving does not pay)."""
        banner = QFrame()
        banner.setObjectName("banner")
        banner.setProperty("kind", kind)
        row = QHBoxLayout(banner)
        row.setContentsMargins(12, 8, 12, 8)
        row.addWidget(self._values.label(key, kind, text, wrap=True), 1)
        button = QPushButton(button_text)
        button.setAccessibleName(name)
        button.clicked.connect(self.settings_requested.emit)
        row.addWidget(button)
        banner.hide()
        return banner, button

    def _table(self) -> QGridLayout:
        grid = QGridLayout()
        grid.setHorizontalSpacing(18)
        for col, (part, title) in enumerate((("", ""), ("gross", "Earned"), ("energy", "Electricity"),
                                             ("net", "Net")), start=0):
            heading = caption(title)
            grid.addWidget(heading, 0, col)
            if part in self._columns:
                self._columns[part].append(heading)
        for r, (period, name) in enumerate(PERIODS.items(), start=1):
            grid.addWidget(caption(name), r, 0)
            for col, part in enumerate(("gross", "energy", "net"), start=1):
                label = self._values.label(f"earn.{period}.{part}", "rowTitle" if part == "net" else "")
                grid.addWidget(label, r, col)
                if part in self._columns:
                    self._columns[part].append(label)
        grid.setColumnStretch(4, 1)  # columns packed to the left, also with the electricity ones hidden
        return grid

    def show_earnings(self, e: EarningsSnapshot, node: NodeSnapshot | None = None) -> None:
        """`node`, where given, says what was served and why it earned nothing (local only)."""
        self._shown = e
        measured, netted = e.power_measured, net_of_electricity(e)
        self._values.set("earn.title", "EARNINGS, NET OF ELECTRICITY" if netted else "EARNINGS")
        self._values.set("earn.headline", money(e.net_today, e.currency))
        self._values.set("earn.headline.caption", "today, net of electricity" if netted else "earned today")
        self._show_table(e)
        self._show_rate(e)
        losing = _losing_words(e)
        self._values.set("earn.losing", losing or "")
        self.losing.setVisible(losing is not None)
        price = "" if not e.electricity_price_per_kwh else f" at {money(e.electricity_price_per_kwh, e.currency)}/kWh"
        self._values.set("energy_today", f"{e.energy_kwh_today:.2f} kWh used today{price}" if measured else NOT_MEASURED)
        self.nudge.setVisible(measured and e.electricity_price_per_kwh == 0)
        earned = any(d.gross or d.energy_cost for d in e.days)
        self._values.set("earn.empty", _empty_words(node))
        self._values.labels["earn.empty"].setVisible(not earned)
        self._values.labels["earn.chart_title"].setVisible(earned)
        what = "Net" if netted else "Earned"
        self._values.set("earn.chart_title", f"{what} per day, last 30 days ({e.currency})")
        self.chart.setVisible(earned)
        if earned:
            self.chart.show_days(e.days, e.currency)
        self._recolour()

    def _show_table(self, e: EarningsSnapshot) -> None:
        """Earned, electricity and net per period; only what was earned where electricity is not
        charged (an electricity column of zeros would read as "it costs nothing")."""
        rows = {
            "today": (e.today, e.energy_cost_today, e.net_today),
            "week": (e.week, e.energy_cost_week, e.net_week),
            "all_time": (e.all_time, e.energy_cost_all_time, e.net_all_time),
        }
        for period, figures in rows.items():
            for part, amount in zip(("gross", "energy", "net"), figures, strict=True):
                shown = money(-amount if part == "energy" and amount else amount, e.currency)
                self._values.set(f"earn.{period}.{part}", shown)
        for widgets in self._columns.values():
            for widget in widgets:
                widget.setVisible(net_of_electricity(e))

    def _show_rate(self, e: EarningsSnapshot) -> None:
        """The rate and projection are net where the card's title says so, gross where it does not."""
        self._values.set(
            "earn.per_hour",
            f"No hourly rate yet: it needs {RATE_MIN_SERVED_MIN} minutes of serving in the last 24 hours"
            if e.net_per_hour is None
            else f"{money(e.net_per_hour, e.currency)} per hour while serving (last 24 hours)",
        )
        projection = self._values.labels["earn.projection"]
        projection.setVisible(e.projected_per_day is not None)
        if e.projected_per_day is not None:
            projection.setText(f"At this rate: about {money(e.projected_per_day, e.currency)} a day")

    def _recolour(self) -> None:
        """Figures below zero in the theme's error colour (again when the theme changes)."""
        e = self._shown
        if e is None:
            return
        c = theme.colours()
        figures = {
            "earn.headline": e.net_today,
            "earn.today.net": e.net_today,
            "earn.week.net": e.net_week,
            "earn.all_time.net": e.net_all_time,
            "earn.per_hour": e.net_per_hour or 0.0,
            "earn.projection": e.projected_per_day or 0.0,
        }
        for key, amount in figures.items():
            tone(self._values.labels[key], amount, c)


def tone(label: QLabel, amount: float, c: theme.Colours) -> None:
    """A money figure in the theme's error colour below zero, the label's own colour otherwise
    (the dashboard's stat card uses it too: a loss reads red wherever it is shown)."""
    style = f"color: {c.error};" if amount < 0 else ""
    if label.styleSheet() != style:  # re-polishing is costly: only on a change
        label.setStyleSheet(style)


def net_of_electricity(e: EarningsSnapshot) -> bool:
    """The figures are net of electricity: this machine's serving power is measured and charged
    at the person's price (measured but no price set: they are what was earned, and a nudge asks)."""
    return e.power_measured and e.electricity_price_per_kwh > 0


def today_words(e: EarningsSnapshot) -> str:
    """Today's figure in a few words for the tray and the stat card: "net" only where it is
    (`net_of_electricity`): "$2.23 net today", "$2.84 earned today"."""
    return f"{money(e.net_today, e.currency)} {'net' if net_of_electricity(e) else 'earned'} today"


def _losing_words(e: EarningsSnapshot) -> str | None:
    """The plain warning while electricity costs more than serving earns: today's net, else the
    rate's while today has not lost yet."""
    if not net_of_electricity(e):
        return None
    if e.net_today < 0:
        return f"Electricity costs more than this earns: {money(e.net_today, e.currency)} today."
    if e.net_per_hour is not None and e.net_per_hour < 0:
        return (f"Electricity costs more than this earns: {money(e.net_per_hour, e.currency)} per hour "
                "while serving.")
    return None


def _empty_words(node: NodeSnapshot | None) -> str:
    """Why nothing is earned yet, never "No earnings yet" beside a count of served requests without
    the reason: requests on this computer's own API earn nothing; the network's earn once it pays."""
    served = node.throughput.requests if node is not None else 0
    if node is None or not served:
        return EMPTY
    requests = f"{served:,} request{'s' if served != 1 else ''} served"
    if node.connection.state == "disabled":
        return f"No earnings: the {requests} came from this computer's own apps, and only the network pays."
    return f"No earnings yet: {requests}, none paid so far — served requests earn once the network pays for them."
