"""The dashboard: what this machine is doing, how fast, what it earned, and what went wrong.

Every figure comes from the latest `NodeSnapshot`; the window only lays out its parts (banner,
GPUs, engines, charts, earnings). In local mode the Connection card also shows the local
endpoint's address and key, with a button that copies the key. Rows of cards fold into one column below `NARROW_PX`, so a
large system font or a half-screen window cuts nothing off. Colours come from the app-wide theme
(`app.theme.install`); the window sets none of its own.
"""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import QSize, Qt, Signal
from PySide6.QtGui import QCloseEvent, QGuiApplication, QResizeEvent
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QMainWindow,
    QPushButton,
    QScrollArea,
    QVBoxLayout,
    QWidget,
)

from app.banner import ProblemBanner, UpdateBanner
from app.bridge import Bridge
from app.charts import LiveCharts
from app.downloads import DownloadsCard
from app import theme
from app.earnings_panel import EarningsPanel, tone
from app.engine_card import EngineCard
from app.format import (
    STATE_COLOURS,
    gib,
    groups_words,
    money,
    rate,
    tray_state,
    tuning_line,
)
from app.gpu_panel import GpuPanel
from app.widgets import PILL_HEIGHT, Reflow, Values, card, pill_style, set_dimmed, sync_rows
from worker.system.config import LocalEndpoint
from worker.contract.events import NodeSnapshot, Problem

NARROW_PX = 900  # below this width, rows of cards stack into one column
DEFAULT = QSize(1120, 680)  # fits a 1366×768 screen with its taskbar and the window's title bar
MINIMUM = QSize(480, 360)  # the content scrolls: a half-screen window still shows every part

CONNECTION_TITLES = {
    "disabled": "Local only",
    "connecting": "Connecting…",
    "connected": "Connected",
    "offline": "Offline",
    "signed_out": "Signed out",
    "banned": "Blocked by the network",
    "taken_over": "Replaced by another session",
    "update_required": "Update required",
}


class Dashboard(QMainWindow):
    setup_requested = Signal()
    sign_in_requested = Signal()
    settings_requested = Signal()
    logs_requested = Signal()
    retry_requested = Signal()
    update_requested = Signal()

    def __init__(self, bridge: Bridge, *, hide_on_close: bool = True,
                 local_endpoint: Callable[[], LocalEndpoint | None] = lambda: None) -> None:
        """`local_endpoint` reads local mode's endpoint (address and key) as the node wrote it."""
        super().__init__()
        self.bridge = bridge
        self.hide_on_close = hide_on_close
        self._read_local_endpoint = local_endpoint
        self._local_endpoint: LocalEndpoint | None = None
        self._local_endpoint_kept = False  # the node is connected to the coordinator it names: this run's
        self.values = Values()
        self.setWindowTitle("GPU Provider")
        self.resize(default_size(self.screen().availableGeometry().size()))
        self.setMinimumSize(MINIMUM)
        self._engine_cards: dict[str, EngineCard] = {}
        self.content = QWidget()
        self.content.setObjectName("content")
        self._layout = QVBoxLayout(self.content)
        self._layout.setContentsMargins(24, 20, 24, 24)
        self._layout.setSpacing(16)
        self.header = self._build_header()
        self.update_banner = UpdateBanner(self.values)
        self.update_banner.restart_requested.connect(self.update_requested.emit)
        self.banner = ProblemBanner(self.values)
        self.banner.action_requested.connect(self._problem_action)
        self.stats = self._build_stats()
        self.gpu_panel = GpuPanel(self.values)
        self.middle = Reflow([self.gpu_panel.frame, self._build_engines()])
        self.downloads = DownloadsCard(self.values, self.bridge)
        self.downloads_card = self.downloads.frame
        self.charts = LiveCharts(self.bridge.history)
        live, live_layout = card("Live")
        live_layout.addWidget(self.charts)
        self.earnings = EarningsPanel(self.values)
        self.earnings.settings_requested.connect(self.settings_requested.emit)
        self.bottom = Reflow([self.earnings, self._build_connection()], stretches=[3, 2])
        parts: tuple[QWidget, ...] = (self.header, self.update_banner, self.banner, self.stats, self.middle)
        for part in (*parts, self.downloads_card, live, self.bottom):
            self._layout.addWidget(part)
        self._layout.addStretch(1)
        self.rows = (self.header, self.stats, self.middle, self.bottom, self.charts.grid)
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QFrame.Shape.NoFrame)
        scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        scroll.setWidget(self.content)
        self.setCentralWidget(scroll)
        bridge.snapshot_changed.connect(self.show_snapshot)
        bridge.core_failed.connect(self._on_core_failed)
        self._core_problem: Problem | None = None
        self.show_snapshot(bridge.latest)

    def text(self, key: str) -> str:
        return self.values.text(key)

    @property
    def narrow(self) -> bool:
        return self.width() < NARROW_PX

    def resizeEvent(self, event: QResizeEvent) -> None:
        for row in self.rows:
            row.set_narrow(self.narrow)
        super().resizeEvent(event)

    # layout -------------------------------------------------------------------------------

    def _build_header(self) -> Reflow:
        titles = QWidget()
        column = QVBoxLayout(titles)
        column.setContentsMargins(0, 0, 0, 0)
        column.setSpacing(2)
        top = QHBoxLayout()
        top.setSpacing(12)
        top.addWidget(self.values.label("app_title", "appTitle", "GPU Provider"))
        top.addStretch(1)
        column.addLayout(top)
        # the headline's title in the state's colour, on its own line: a long one wraps, never cut off
        self.state_pill = self.values.label("state", "pill", wrap=True)
        self.state_pill.setMinimumHeight(PILL_HEIGHT)
        column.addWidget(self.state_pill)
        column.addWidget(self.values.label("subtitle", "subtitle", wrap=True))
        column.addWidget(self.values.label("not_earning", "warning", wrap=True))
        buttons = QWidget()
        row = QHBoxLayout(buttons)
        row.setContentsMargins(0, 0, 0, 0)
        row.addStretch(1)
        for text, signal in (("Logs", self.logs_requested), ("Settings", self.settings_requested)):
            button = QPushButton(text)
            button.clicked.connect(signal.emit)
            row.addWidget(button)
        self.pause_button = QPushButton()  # the headline's main action: Pause, Resume, or a failure's remedy
        self.pause_button.setObjectName("primary")
        self.pause_button.clicked.connect(self._main_action)
        row.addWidget(self.pause_button)
        return Reflow([titles, buttons], stretches=[1, 0])

    def _build_stats(self) -> Reflow:
        cards = []
        for key, title in (
            ("tokens_per_s", "Speed now, all requests"),
            ("in_flight", "Requests being answered"),
            ("earned_today", "Earnings today"),
            ("effective_vram", "Memory for models"),
        ):
            frame, layout = card(title)
            layout.addWidget(self.values.label(key, "statValue"))
            if key == "tokens_per_s":
                layout.addWidget(self.values.label("capacity", "rowTitle", wrap=True))
            layout.addWidget(self.values.label(f"{key}.detail", "caption", wrap=True))
            layout.addStretch(1)
            cards.append(frame)
        return Reflow(cards, narrow_columns=2)

    def _build_engines(self) -> QFrame:
        frame, layout = card("What it is running")
        layout.addWidget(self.values.label("plan", "muted", wrap=True))
        layout.addWidget(self.values.label("tuning", "caption", wrap=True))
        self._engine_layout = QVBoxLayout()
        layout.addLayout(self._engine_layout)
        layout.addStretch(1)
        return frame

    def _build_connection(self) -> QFrame:
        frame, layout = card("Connection")
        layout.addWidget(self.values.label("connection", "rowTitle", wrap=True))
        layout.addWidget(self.values.label("coordinator", "muted", wrap=True))
        layout.addWidget(self.values.label("connection.detail", "caption", wrap=True))
        layout.addWidget(self.values.label("local_api", "caption", wrap=True))
        self.copy_key_button = QPushButton("Copy key")
        self.copy_key_button.clicked.connect(self._copy_key)
        layout.addWidget(self.copy_key_button, 0, Qt.AlignmentFlag.AlignLeft)
        layout.addSpacing(8)
        layout.addWidget(self.values.label("node", "caption", wrap=True))
        layout.addStretch(1)
        return frame

    # rendering ----------------------------------------------------------------------------

    def show_snapshot(self, snapshot: NodeSnapshot) -> None:
        """Renders a snapshot (the bridge hands over only those that change what is seen)."""
        self._show_header(snapshot)
        self.update_banner.show_update(snapshot.update_ready)
        self.banner.show_problem(self._core_problem or snapshot.problem or snapshot.connection.problem)
        self._show_stats(snapshot)
        self.gpu_panel.show(snapshot)
        self.charts.set_gpus([g.index for g in snapshot.gpus])
        self._show_engines(snapshot)
        self.downloads.show(snapshot.downloads)
        self.earnings.show_earnings(snapshot.earnings)
        self._show_connection(snapshot)

    def _show_header(self, snapshot: NodeSnapshot) -> None:
        """The core's one headline: its title in the state chip, its detail under it, the one reason
        it earns nothing, and its action as the main button (hidden where there is none)."""
        h = snapshot.headline
        self.values.set("state", h.title)
        style = pill_style(STATE_COLOURS[tray_state(snapshot)])
        if self.state_pill.styleSheet() != style:  # re-polishing is costly: only on a change
            self.state_pill.setStyleSheet(style)
        self.values.set("subtitle", h.detail)
        self.values.labels["subtitle"].setVisible(bool(h.detail))
        not_earning = h.not_earning if h.not_earning not in (None, h.title) else None
        self.values.set("not_earning", f"Not earning: {not_earning}" if not_earning else "")
        self.values.labels["not_earning"].setVisible(bool(not_earning))
        self.pause_button.setText(h.action_label)
        self.pause_button.setAccessibleName(h.action_label)
        self.pause_button.setVisible(h.action != "none")

    def _show_stats(self, snapshot: NodeSnapshot) -> None:
        t = snapshot.throughput
        self.values.set("tokens_per_s", rate(t.live_tokens_per_s))
        capacity = self.values.labels["capacity"]
        if t.capacity_tokens_per_s is not None:
            capacity.setText(f"Best sustained {rate(t.capacity_tokens_per_s)}")
        elif snapshot.last_capacity is not None:
            capacity.setText(f"Last measured {rate(snapshot.last_capacity.tokens_per_s)}")
        capacity.setVisible(t.capacity_tokens_per_s is not None or snapshot.last_capacity is not None)
        set_dimmed(capacity, t.capacity_tokens_per_s is None)
        details = []
        if t.per_request_tokens_per_s is not None:
            details.append(f"each request gets {rate(t.per_request_tokens_per_s)}")
        if t.ttft_p50_s is not None:
            details.append(f"first word after {t.ttft_p50_s:.2f} s")
        idle = "the best speed of the last run" if snapshot.last_capacity else "measured while serving"
        self.values.set("tokens_per_s.detail", " · ".join(details) or idle)
        self.values.set("in_flight", str(snapshot.in_flight))
        self.values.set("in_flight.detail", f"{t.requests:,} answered · {t.run_tokens:,} tokens this run")
        e = snapshot.earnings
        self.values.set("earned_today", money(e.net_today, e.currency))
        tone(self.values.labels["earned_today"], e.net_today, theme.colours())  # a loss reads red
        per_hour = [] if e.net_per_hour is None else [f"{money(e.net_per_hour, e.currency)} per hour"]
        self.values.set("earned_today.detail", " · ".join([*per_hour, f"this week {money(e.net_week, e.currency)}"]))
        self.values.set("effective_vram", gib(snapshot.effective_vram_mib) if snapshot.gpus else "CPU")
        lent = sum(1 for g in snapshot.gpus if g.lent)
        together = groups_words(snapshot.groups)
        lent_words = f"{lent} of {len(snapshot.gpus)} GPUs lent" if snapshot.gpus else "serving on the CPU"
        self.values.set("effective_vram.detail", " · ".join(p for p in (lent_words, together) if p))

    def _show_engines(self, snapshot: NodeSnapshot) -> None:
        if snapshot.engines:
            self.values.set("plan", snapshot.model or "")
        elif snapshot.paused:
            self.values.set("plan", "Stopped while paused, so your GPU is all yours.")
        elif snapshot.model:
            self.values.set("plan", f"{snapshot.model}: starts once it is downloaded and loaded.")
        else:
            self.values.set("plan", "Waiting for the network to pick a model.")
        tuning = tuning_line(snapshot.tuning)
        self.values.set("tuning", tuning)
        self.values.labels["tuning"].setVisible(bool(tuning))
        sync_rows(
            self._engine_cards,
            {e.engine_id: e for e in snapshot.engines},
            lambda e: EngineCard(self.values, e),
            self._engine_layout,
            lambda c, e: c.show_engine(e),
        )

    def _show_connection(self, snapshot: NodeSnapshot) -> None:
        c = snapshot.connection
        title = CONNECTION_TITLES[c.state]
        if snapshot.headline.kind == "offline" and c.state != "offline":  # linked, yet a download can't get out
            title += " · downloads can't reach the internet"
        self.values.set("connection", title)
        self.values.set("coordinator", "This computer only" if c.coordinator_url == "local" else c.coordinator_url)
        detail = c.problem.message if c.problem else ""
        if c.retry_in_s is not None:
            detail = (detail + " " if detail else "") + f"Retrying in {c.retry_in_s:.0f} s."
        self.values.set("connection.detail", detail)
        self._show_local_endpoint(c.coordinator_url, c.state == "connected")
        self.values.set("node", f"Node {snapshot.node_id}")

    def _show_local_endpoint(self, coordinator_url: str, connected: bool) -> None:
        """Where programs on this computer reach the node in local mode, and the key they send.
        Read from the node's file until the node is connected to the coordinator it names (before,
        it may be the last run's), then kept."""
        endpoint = self._local_endpoint
        if not (self._local_endpoint_kept and endpoint is not None and endpoint.serves(coordinator_url)):
            endpoint = self._local_endpoint = self._read_local_endpoint()
        shown = endpoint is not None and endpoint.serves(coordinator_url)
        self._local_endpoint_kept = connected and shown
        self.values.labels["local_api"].setVisible(shown)
        self.copy_key_button.setVisible(shown)
        if endpoint is not None and shown:
            self.values.set("local_api", f"Programs on this computer can use {endpoint.url} "
                                         f"with the key {endpoint.key}")

    def _copy_key(self) -> None:
        if self._local_endpoint is not None:
            QGuiApplication.clipboard().setText(self._local_endpoint.key)

    def _on_core_failed(self, problem: Problem) -> None:
        self._core_problem = problem
        self.banner.show_problem(problem)

    # commands -----------------------------------------------------------------------------

    def _main_action(self) -> None:
        self._run_action(self.bridge.latest.headline.action)

    def _problem_action(self, action: str) -> None:
        self._run_action(action)

    def _run_action(self, action: str) -> None:
        """One dispatch for the main button and the banner's: a failure's remedy, Pause or Resume."""
        commands = {
            "finish_setup": self.setup_requested.emit,
            "retry": self.retry_requested.emit,
            "check_network": self.retry_requested.emit,
            "free_disk": self.retry_requested.emit,
            "sign_in": self.sign_in_requested.emit,
            "settings": self.settings_requested.emit,
            "update": self.update_requested.emit,
            "resume": self.bridge.resume,
            "pause": self.bridge.pause,
        }
        if action in commands:
            commands[action]()

    def bring_forward(self) -> None:
        self.show()
        self.setWindowState(self.windowState() & ~Qt.WindowState.WindowMinimized)
        self.raise_()
        self.activateWindow()

    def closeEvent(self, event: QCloseEvent) -> None:
        """With a tray, closing only hides the window (serving goes on); without one it quits."""
        if self.hide_on_close:
            event.ignore()
            self.hide()
        else:
            event.accept()


def default_size(available: QSize) -> QSize:
    """The window's first size: DEFAULT, made smaller where the screen's free area is (less 40 px
    for the title bar), never below MINIMUM."""
    return DEFAULT.boundedTo(QSize(available.width(), available.height() - 40)).expandedTo(MINIMUM)
