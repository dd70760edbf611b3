"""The dashboard: what this machine measured it can do, what it is doing, and what it earned.

Every figure comes from the latest `NodeSnapshot`; the window only lays them out. Rows for GPUs,
engines and downloads are kept by key and updated in place, so a toggle (the engine's command
line) survives the next snapshot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QCloseEvent
from PySide6.QtWidgets import (
    QFrame,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QScrollArea,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.bridge import Bridge
from app.charts import EarningsChart, LiveCharts
from app.format import (
    PHASE_STEPS,
    STATE_COLOURS,
    gib,
    money,
    number,
    pause_line,
    rate,
    state_title,
    tray_state,
)
from worker.engines import registry
from worker.events import (
    DownloadProgress,
    EngineSnapshot,
    GpuSnapshot,
    NodeSnapshot,
    Problem,
)

K = TypeVar("K")
T = TypeVar("T")
W = TypeVar("W", bound=QWidget)

STYLE = """
QMainWindow, QScrollArea, #content { background: #F4F6F9; }
QFrame#card { background: #FFFFFF; border: 1px solid #E2E6EC; border-radius: 10px; }
QLabel { color: #1F2937; }
QLabel#cardTitle { color: #6B7280; font-size: 11px; font-weight: 600; letter-spacing: 1px; }
QLabel#appTitle { font-size: 20px; font-weight: 700; }
QLabel#subtitle, QLabel#caption, QLabel#muted { color: #6B7280; }
QLabel#caption { font-size: 11px; }
QLabel#statValue { font-size: 22px; font-weight: 700; }
QLabel#rowTitle { font-weight: 600; }
QFrame#banner { border-radius: 10px; }
QProgressBar { border: none; background: #E8EBF0; border-radius: 4px; max-height: 8px; }
QProgressBar::chunk { background: #2563EB; border-radius: 4px; }
QPushButton { padding: 6px 14px; border-radius: 6px; border: 1px solid #CBD2DC; background: #FFFFFF; }
QPushButton#primary { background: #2563EB; color: white; border: none; font-weight: 600; }
QPlainTextEdit { font-family: monospace; font-size: 11px; background: #F8FAFC; border: 1px solid #E2E6EC; }
"""

ENGINE_COLOURS = {
    "ready": STATE_COLOURS["serving"],
    "starting": STATE_COLOURS["starting"],
    "degraded": STATE_COLOURS["degraded"],
    "failed": STATE_COLOURS["failed"],
    "paused": STATE_COLOURS["paused"],
}
PILL_HEIGHT = 24  # Qt drops a border radius larger than half the height

_ACTION_BUTTONS = {"sign_in": "Sign in again", "settings": "Open settings"}


def pill_style(colour: str) -> str:
    return f"background: {colour}; color: white; border-radius: 10px; padding: 2px 12px; font-weight: 600;"


def card(title: str) -> tuple[QFrame, QVBoxLayout]:
    frame = QFrame()
    frame.setObjectName("card")
    layout = QVBoxLayout(frame)
    layout.setContentsMargins(18, 14, 18, 16)
    layout.setSpacing(10)
    heading = QLabel(title.upper())
    heading.setObjectName("cardTitle")
    layout.addWidget(heading)
    return frame, layout


def caption(text: str = "") -> QLabel:
    label = QLabel(text)
    label.setObjectName("caption")
    label.setWordWrap(True)
    return label


class Values:
    """Named labels, so tests (and the code) address figures by meaning rather than position."""

    def __init__(self) -> None:
        self.labels: dict[str, QLabel] = {}

    def label(self, key: str, object_name: str = "", text: str = "—") -> QLabel:
        label = QLabel(text)
        if object_name:
            label.setObjectName(object_name)
        label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.labels[key] = label
        return label

    def set(self, key: str, text: str) -> None:
        self.labels[key].setText(text)

    def text(self, key: str) -> str:
        return self.labels[key].text()


class GpuRow(QWidget):
    def __init__(self, values: Values, gpu: GpuSnapshot) -> None:
        super().__init__()
        self.key = f"gpu{gpu.index}"
        grid = QGridLayout(self)
        grid.setContentsMargins(0, 4, 0, 4)
        grid.setHorizontalSpacing(18)
        grid.addWidget(values.label(f"{self.key}.name", "rowTitle"), 0, 0)
        grid.addWidget(values.label(f"{self.key}.memory", "muted"), 0, 1, Qt.AlignmentFlag.AlignRight)
        self.memory_bar = QProgressBar()
        self.memory_bar.setTextVisible(False)
        grid.addWidget(self.memory_bar, 1, 0, 1, 2)
        grid.addWidget(values.label(f"{self.key}.live", "caption"), 2, 0, 1, 2)
        self._values = values

    def show_gpu(self, gpu: GpuSnapshot) -> None:
        lent = "" if gpu.lent else "  (not lent)"
        self._values.set(f"{self.key}.name", f"GPU {gpu.index} · {gpu.name}{lent}")
        used = "" if gpu.memory_used_mib is None else f"{gib(gpu.memory_used_mib)} used · "
        self._values.set(
            f"{self.key}.memory", f"{used}{gib(gpu.memory_usable_mib)} usable of {gib(gpu.memory_total_mib)}"
        )
        self.memory_bar.setRange(0, max(1, gpu.memory_total_mib))
        self.memory_bar.setValue(gpu.memory_used_mib or 0)
        power = number(gpu.power_w, "W")
        if gpu.power_limit_w is not None and gpu.power_w is not None:
            power += f" of {gpu.power_limit_w:,.0f} W"
        self._values.set(
            f"{self.key}.live",
            f"Utilisation {number(gpu.util_pct, '%')}   ·   {number(gpu.temperature_c, '°C')}   ·   {power}",
        )


class EngineCard(QFrame):
    def __init__(self, values: Values, engine: EngineSnapshot) -> None:
        super().__init__()
        self.key = f"engine:{engine.engine_id}"
        self._values = values
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 6, 0, 6)
        layout.setSpacing(6)
        head = QHBoxLayout()
        head.addWidget(values.label(f"{self.key}.title", "rowTitle"))
        head.addStretch(1)
        self.state_chip = values.label(f"{self.key}.state", "pill")
        self.state_chip.setFixedHeight(PILL_HEIGHT)
        head.addWidget(self.state_chip)
        layout.addLayout(head)
        self.phase_bar = QProgressBar()
        self.phase_bar.setRange(0, len(PHASE_STEPS) - 1)
        self.phase_bar.setTextVisible(False)
        layout.addWidget(self.phase_bar)
        layout.addWidget(values.label(f"{self.key}.phase", "caption"))
        grid = QGridLayout()
        grid.setHorizontalSpacing(18)
        grid.setVerticalSpacing(4)
        for row, (name, title) in enumerate(
            (("kv", "KV budget"), ("context", "Context"), ("memory", "Memory"), ("health", "Restarts"))
        ):
            title_label = caption(title)
            title_label.setWordWrap(False)
            grid.addWidget(title_label, row, 0, Qt.AlignmentFlag.AlignTop)
            value = values.label(f"{self.key}.{name}")
            value.setWordWrap(True)
            grid.addWidget(value, row, 1)
        grid.setColumnStretch(1, 1)
        layout.addLayout(grid)
        self.error = values.label(f"{self.key}.error")
        self.error.setStyleSheet("color: #B91C1C;")
        self.error.setWordWrap(True)
        layout.addWidget(self.error)
        self.argv_toggle = QToolButton()
        self.argv_toggle.setText("Show command line")
        self.argv_toggle.setCheckable(True)
        self.argv_toggle.toggled.connect(self._toggle_argv)
        layout.addWidget(self.argv_toggle)
        self.argv = QPlainTextEdit()
        self.argv.setReadOnly(True)
        self.argv.setMaximumHeight(90)
        self.argv.hide()
        layout.addWidget(self.argv)

    def _toggle_argv(self, shown: bool) -> None:
        self.argv.setVisible(shown)
        self.argv_toggle.setText("Hide command line" if shown else "Show command line")

    def show_engine(self, engine: EngineSnapshot) -> None:
        key = self.key
        engine_name = registry.display_name(engine.engine)
        where = f"GPU {', '.join(str(i) for i in engine.gpu_indices)}" if engine.gpu_indices else "the CPU"
        tier = f" · tier {engine.tier} MiB" if engine.tier else " · base settings"
        self._values.set(f"{key}.title", f"{engine.engine_id} · {engine_name} · {engine.layout} on {where}{tier}")
        self._values.set(f"{key}.state", engine.state.capitalize())
        chip = pill_style(ENGINE_COLOURS.get(engine.state, STATE_COLOURS["idle"]))
        if self.state_chip.styleSheet() != chip:
            self.state_chip.setStyleSheet(chip)
        starting = engine.phase is not None and engine.phase != "ready" and engine.state == "starting"
        self.phase_bar.setVisible(starting)
        self._values.labels[f"{key}.phase"].setVisible(starting)
        if engine.phase is not None:
            step = PHASE_STEPS.index(engine.phase)
            self.phase_bar.setValue(step)
            self._values.set(f"{key}.phase", f"{engine.phase.capitalize()} (step {step + 1} of {len(PHASE_STEPS)})")
        self._values.set(f"{key}.kv", kv_text(engine))
        self._values.set(f"{key}.context", context_text(engine))
        usage = "" if engine.kv_usage_pct is None else f" · KV {engine.kv_usage_pct:.0f}% in use"
        self._values.set(f"{key}.memory", f"{gib(engine.memory_mib)} budget{usage}")
        self._values.set(f"{key}.health", f"{engine.restarts}" + (f" · pid {engine.pid}" if engine.pid else ""))
        self.error.setVisible(bool(engine.last_error))
        self._values.set(f"{key}.error", f"Last error: {engine.last_error}" if engine.last_error else "")
        self.argv.setPlainText(" ".join(engine.argv) if engine.argv else "(not started)")


def kv_text(engine: EngineSnapshot) -> str:
    if engine.kv_cache_tokens is None:
        return "— (measured once the engine has loaded)"
    parts = [f"{engine.kv_cache_tokens:,} tokens"]
    if engine.kv_cache_gib is not None:
        parts.append(f"{engine.kv_cache_gib:.1f} GiB")
    if engine.max_concurrency is not None:
        parts.append(f"{engine.max_concurrency:.1f}× max concurrency")
    return " · ".join(parts)


def context_text(engine: EngineSnapshot) -> str:
    c = engine.context
    return (
        f"servable {number(c.servable)}  (requested {number(c.requested)} · "
        f"declared {number(c.declared)} · physical {number(c.physical)})"
    )


class Dashboard(QMainWindow):
    sign_in_requested = Signal()
    settings_requested = Signal()
    logs_requested = Signal()

    def __init__(self, bridge: Bridge, *, hide_on_close: bool = True) -> None:
        super().__init__()
        self.bridge = bridge
        self.hide_on_close = hide_on_close
        self.values = Values()
        self.setWindowTitle("GPU Provider")
        self.setStyleSheet(STYLE)
        self.resize(1120, 900)
        self._gpu_rows: dict[int, GpuRow] = {}
        self._engine_cards: dict[str, EngineCard] = {}
        self._download_rows: dict[str, tuple[QLabel, QProgressBar]] = {}
        self.content = QWidget()
        self.content.setObjectName("content")
        self._layout = QVBoxLayout(self.content)
        self._layout.setContentsMargins(24, 20, 24, 24)
        self._layout.setSpacing(16)
        self._build_header()
        self._build_banner()
        self._build_stats()
        self._build_capacity()
        self._build_charts()
        self._build_money_and_link()
        self._layout.addStretch(1)
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QFrame.Shape.NoFrame)
        scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        scroll.setWidget(self.content)
        self.setCentralWidget(scroll)
        bridge.snapshot_changed.connect(self.show_snapshot)
        bridge.core_failed.connect(self._on_core_failed)
        self._core_problem: Problem | None = None
        self._shown: NodeSnapshot | None = None  # the last snapshot rendered, clock fields zeroed
        self.show_snapshot(bridge.latest)

    def text(self, key: str) -> str:
        return self.values.text(key)

    # layout -------------------------------------------------------------------------------

    def _build_header(self) -> None:
        row = QHBoxLayout()
        titles = QVBoxLayout()
        titles.setSpacing(2)
        top = QHBoxLayout()
        top.setSpacing(12)
        top.addWidget(self.values.label("app_title", "appTitle", "GPU Provider"))
        self.state_pill = self.values.label("state", "pill")
        self.state_pill.setFixedHeight(PILL_HEIGHT)
        top.addWidget(self.state_pill)
        top.addStretch(1)
        titles.addLayout(top)
        titles.addWidget(self.values.label("subtitle", "subtitle"))
        row.addLayout(titles, 1)
        for text, signal in (("Logs", self.logs_requested), ("Settings", self.settings_requested)):
            button = QPushButton(text)
            button.clicked.connect(signal.emit)
            row.addWidget(button)
        self.pause_button = QPushButton()
        self.pause_button.setObjectName("primary")
        self.pause_button.clicked.connect(self._toggle_pause)
        row.addWidget(self.pause_button)
        self._layout.addLayout(row)

    def _build_banner(self) -> None:
        self.banner = QFrame()
        self.banner.setObjectName("banner")
        layout = QHBoxLayout(self.banner)
        layout.setContentsMargins(16, 12, 16, 12)
        text = QVBoxLayout()
        title = self.values.label("problem_title", "rowTitle")
        message = self.values.label("problem_message")
        message.setWordWrap(True)
        text.addWidget(title)
        text.addWidget(message)
        layout.addLayout(text, 1)
        self.banner_action = QPushButton()
        self.banner_action.clicked.connect(self._problem_action)
        layout.addWidget(self.banner_action)
        self._banner_problem: Problem | None = None
        self._layout.addWidget(self.banner)

    def _build_stats(self) -> None:
        row = QHBoxLayout()
        row.setSpacing(16)
        for key, title in (
            ("tokens_per_s", "Throughput"),
            ("in_flight", "Requests in flight"),
            ("earned_today", "Net earnings today"),
            ("effective_vram", "Effective VRAM"),
        ):
            frame, layout = card(title)
            layout.addWidget(self.values.label(key, "statValue"))
            detail = self.values.label(f"{key}.detail", "caption")
            detail.setWordWrap(True)
            layout.addWidget(detail)
            layout.addStretch(1)
            row.addWidget(frame, 1)
        self._layout.addLayout(row)

    def _build_capacity(self) -> None:
        row = QHBoxLayout()
        row.setSpacing(16)
        gpus, self._gpu_layout = card("Measured capacity")
        self._gpu_layout.addWidget(self.values.label("groups", "muted"))
        self._gpu_layout.addWidget(self.values.label("no_gpus", "muted", "No GPU detected: serving runs on the CPU."))
        self._gpu_rows_layout = QVBoxLayout()
        self._gpu_layout.addLayout(self._gpu_rows_layout)
        self._gpu_layout.addStretch(1)
        row.addWidget(gpus, 1)
        engines, engine_layout = card("Plan and engines")
        plan = self.values.label("plan", "muted")
        plan.setWordWrap(True)
        engine_layout.addWidget(plan)
        self._engine_layout = QVBoxLayout()
        engine_layout.addLayout(self._engine_layout)
        engine_layout.addStretch(1)
        row.addWidget(engines, 1)
        self._layout.addLayout(row)
        downloads, self._download_layout = card("Downloads")
        self.downloads_card = downloads
        self._layout.addWidget(downloads)

    def _build_charts(self) -> None:
        frame, layout = card("Live")
        self.charts = LiveCharts(self.bridge.history)
        layout.addWidget(self.charts)
        roofline = QHBoxLayout()
        roofline.addWidget(caption("Roofline share"))
        roofline.addWidget(self.values.label("roofline", "rowTitle"))
        roofline.addStretch(1)
        layout.addLayout(roofline)
        caveat = self.values.label("roofline.caveat", "caption")
        caveat.setWordWrap(True)
        layout.addWidget(caveat)
        self._layout.addWidget(frame)

    def _build_money_and_link(self) -> None:
        row = QHBoxLayout()
        row.setSpacing(16)
        money_card, layout = card("Earnings, net of electricity")
        grid = QGridLayout()
        grid.setHorizontalSpacing(18)
        for col, title in enumerate(("", "Earned", "Electricity", "Net")):
            grid.addWidget(caption(title), 0, col)
        for r, period in enumerate(("today", "week", "all_time"), start=1):
            grid.addWidget(caption({"today": "Today", "week": "This week", "all_time": "All time"}[period]), r, 0)
            for col, part in enumerate(("gross", "energy", "net"), start=1):
                grid.addWidget(self.values.label(f"earn.{period}.{part}", "rowTitle" if part == "net" else ""), r, col)
        layout.addLayout(grid)
        layout.addWidget(self.values.label("energy_today", "caption"))
        self.earnings_chart = EarningsChart()
        layout.addWidget(self.earnings_chart)
        row.addWidget(money_card, 3)
        link, layout = card("Connection")
        layout.addWidget(self.values.label("connection", "rowTitle"))
        url = self.values.label("coordinator", "muted")
        url.setWordWrap(True)
        layout.addWidget(url)
        detail = self.values.label("connection.detail", "caption")
        detail.setWordWrap(True)
        layout.addWidget(detail)
        layout.addSpacing(8)
        layout.addWidget(self.values.label("node", "caption"))
        layout.addStretch(1)
        row.addWidget(link, 2)
        self._layout.addLayout(row)

    # rendering ----------------------------------------------------------------------------

    def show_snapshot(self, snapshot: NodeSnapshot) -> None:
        """Renders a snapshot, unless all it changes is the clock (an idle node ticks each second)."""
        visible = snapshot.without_clock()
        if visible == self._shown:
            return
        self._shown = visible
        self._show_header(snapshot)
        self._show_problem(self._core_problem or snapshot.problem or snapshot.connection.problem)
        self._show_stats(snapshot)
        self._show_gpus(snapshot)
        self._show_engines(snapshot)
        self._show_downloads(snapshot.downloads)
        self._show_roofline(snapshot)
        self._show_earnings(snapshot)
        self._show_connection(snapshot)

    def _show_header(self, snapshot: NodeSnapshot) -> None:
        self.values.set("state", state_title(snapshot))
        style = pill_style(STATE_COLOURS[tray_state(snapshot)])
        if self.state_pill.styleSheet() != style:  # re-polishing is costly: only on a change
            self.state_pill.setStyleSheet(style)
        parts = [pause_line(snapshot)] if snapshot.paused else []
        parts.append(snapshot.model or "No model assigned yet")
        parts.append(f"runtime {snapshot.runtime}")
        self.values.set("subtitle", "   ·   ".join(parts))
        self.pause_button.setText("Resume serving" if snapshot.paused else "Pause serving")

    def _show_problem(self, problem: Problem | None) -> None:
        self._banner_problem = problem
        self.banner.setVisible(problem is not None)
        if problem is None:
            return
        self.values.set("problem_title", problem.title)
        self.values.set("problem_message", problem.message)
        self.banner.setStyleSheet("QFrame#banner { background: #FEF2F2; border: 1px solid #FCA5A5; }")
        label = _ACTION_BUTTONS.get(problem.action)
        self.banner_action.setVisible(label is not None)
        self.banner_action.setText(label or "")

    def _show_stats(self, snapshot: NodeSnapshot) -> None:
        t = snapshot.throughput
        self.values.set("tokens_per_s", rate(t.tokens_per_s))
        details = []
        if t.per_request_tokens_per_s is not None:
            details.append(f"{rate(t.per_request_tokens_per_s)} per request")
        if t.ttft_p50_s is not None:
            details.append(f"first token {t.ttft_p50_s:.2f} s (median)")
        self.values.set("tokens_per_s.detail", " · ".join(details) or "measured while an engine serves")
        self.values.set("in_flight", str(snapshot.in_flight))
        self.values.set("in_flight.detail", f"{t.requests:,} served · {t.run_tokens:,} tokens this run")
        e = snapshot.earnings
        self.values.set("earned_today", money(e.net_today, e.currency))
        self.values.set(
            "earned_today.detail",
            f"week {money(e.net_week, e.currency)} · all time {money(e.net_all_time, e.currency)}",
        )
        self.values.set("effective_vram", gib(snapshot.effective_vram_mib))
        lent = sum(1 for g in snapshot.gpus if g.lent)
        self.values.set(
            "effective_vram.detail", f"{lent} of {len(snapshot.gpus)} GPUs lent · {len(snapshot.groups)} group(s)"
        )

    def _show_gpus(self, snapshot: NodeSnapshot) -> None:
        self.values.labels["no_gpus"].setVisible(not snapshot.gpus)
        groups = " + ".join("[" + ", ".join(f"GPU {i}" for i in g) + "]" for g in snapshot.groups)
        self.values.set("groups", f"Groups {groups} → {gib(snapshot.effective_vram_mib)} effective" if groups else "")
        _sync_rows(
            self._gpu_rows,
            {g.index: g for g in snapshot.gpus},
            lambda g: GpuRow(self.values, g),
            self._gpu_rows_layout,
            lambda row, g: row.show_gpu(g),
        )

    def _show_engines(self, snapshot: NodeSnapshot) -> None:
        if snapshot.engines:
            layouts = ", ".join(sorted({e.layout for e in snapshot.engines}))
            self.values.set("plan", f"{len(snapshot.engines)} engine(s) · layout {layouts} · {snapshot.model or ''}")
        elif snapshot.paused:
            self.values.set("plan", "Engines are stopped while paused, so the GPU is free for you.")
        else:
            self.values.set("plan", "No plan yet: waiting for an assignment from the network.")
        _sync_rows(
            self._engine_cards,
            {e.engine_id: e for e in snapshot.engines},
            lambda e: EngineCard(self.values, e),
            self._engine_layout,
            lambda c, e: c.show_engine(e),
        )

    def _show_downloads(self, downloads: tuple[DownloadProgress, ...]) -> None:
        active = [d for d in downloads if not d.finished or d.error]
        self.downloads_card.setVisible(bool(active))
        for what in [w for w in self._download_rows if w not in {d.what for d in active}]:
            label, bar = self._download_rows.pop(what)
            label.deleteLater()
            bar.deleteLater()
        for d in active:
            if d.what not in self._download_rows:
                label = self.values.label(f"download:{d.what}", "muted")
                bar = QProgressBar()
                bar.setTextVisible(False)
                self._download_layout.addWidget(label)
                self._download_layout.addWidget(bar)
                self._download_rows[d.what] = (label, bar)
            label, bar = self._download_rows[d.what]
            label.setText(download_text(d))
            bar.setRange(0, 0 if d.fraction is None else 1000)
            bar.setValue(int((d.fraction or 0) * 1000))

    def _show_roofline(self, snapshot: NodeSnapshot) -> None:
        t = snapshot.throughput
        share = t.roofline_share
        self.values.set("roofline", "—" if share is None else f"{share * 100:.0f}%")
        if not t.roofline_comparable:
            caveat = "Not comparable for this run: speculative decoding or batching changes tokens per weight read."
        else:
            caveat = (
                "Measured tokens per second as a share of this GPU's memory-bandwidth ceiling for this model. "
                "An estimate from the spec sheet, not a benchmark score."
            )
        self.values.set("roofline.caveat", caveat)

    def _show_earnings(self, snapshot: NodeSnapshot) -> None:
        e = snapshot.earnings
        rows = {
            "today": (e.today, e.energy_cost_today, e.net_today),
            "week": (e.week, e.energy_cost_week, e.net_week),
            "all_time": (e.all_time, e.energy_cost_all_time, e.net_all_time),
        }
        for period, figures in rows.items():
            for part, amount in zip(("gross", "energy", "net"), figures, strict=True):
                shown = money(-amount if part == "energy" and amount else amount, e.currency)
                self.values.set(f"earn.{period}.{part}", shown)
        self.values.set("energy_today", f"{e.energy_kwh_today:.2f} kWh used today")
        self.earnings_chart.show_earnings(e)

    def _show_connection(self, snapshot: NodeSnapshot) -> None:
        c = snapshot.connection
        titles = {
            "disabled": "Local only",
            "connecting": "Connecting…",
            "connected": "Connected",
            "offline": "Offline",
            "signed_out": "Signed out",
            "banned": "Blocked by the network",
            "taken_over": "Replaced by another session",
            "update_required": "Update required",
        }
        self.values.set("connection", titles[c.state])
        self.values.set("coordinator", c.coordinator_url)
        detail = c.problem.message if c.problem else ""
        if c.retry_in_s is not None:
            detail = (detail + " " if detail else "") + f"Retrying in {c.retry_in_s:.0f} s."
        self.values.set("connection.detail", detail)
        self.values.set("node", f"Node {snapshot.node_id} · runtime {snapshot.runtime}")

    def _on_core_failed(self, problem: Problem) -> None:
        self._core_problem = problem
        self._show_problem(problem)

    # commands -----------------------------------------------------------------------------

    def _toggle_pause(self) -> None:
        if self.bridge.latest.paused:
            self.bridge.resume()
        else:
            self.bridge.pause()

    def _problem_action(self) -> None:
        action = self._banner_problem.action if self._banner_problem else "none"
        if action == "sign_in":
            self.sign_in_requested.emit()
        elif action == "settings":
            self.settings_requested.emit()

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


def download_text(d: DownloadProgress) -> str:
    if d.error:
        return f"{d.what}: failed — {d.error}"
    if d.step:
        return f"{d.what}: {d.step}"
    size = f"{d.done_bytes / 2**30:.1f}"
    size += f" of {d.total_bytes / 2**30:.1f} GiB" if d.total_bytes else " GiB"
    extra = ""
    if d.rate_bps:
        extra += f" · {d.rate_bps / 2**20:.0f} MiB/s"
    if d.eta_s is not None:
        extra += f" · {d.eta_s / 60:.0f} min left" if d.eta_s >= 60 else f" · {d.eta_s:.0f} s left"
    return f"{d.what}: {size}{extra}"


def _sync_rows(
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
