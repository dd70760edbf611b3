"""Typed snapshots the core hands out (to the Qt app, the CLI and the status file).

Frozen dataclasses only: readers can keep them, pass them across threads and compare them. The
core computes every figure; the app only renders these.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from worker.contract.protocol import EngineName, LimitReason, Layout, RoutingReason, State

NodeState = State  # one list of states: the protocol's
PauseReason = Literal["user", "timed", "game", "schedule", "coordinator", "battery", "too_hot", "costs"]
ConnectionState = Literal[
    "disabled", "connecting", "connected", "offline", "signed_out", "banned", "taken_over", "update_required"
]
LIVE_WINDOW_S = 10.0  # the live tok/s figure's sliding window
StartPhase = Literal["provisioning", "launching", "loading", "compiling", "capturing", "warming", "ready"]
TuningState = Literal["idle", "running", "done", "cancelled", "refused", "failed"]
HeadlineKind = Literal[
    "setup", "detecting", "stopping", "signed_out", "offline", "failed", "paused", "downloading", "tuning",
    "starting", "degraded", "serving", "idle",
]
MainAction = Literal["finish_setup", "sign_in", "retry", "check_network", "free_disk", "settings", "update",
                     "resume", "pause", "none"]


@dataclass(frozen=True)
class Problem:
    """A failure a person must act on: a short title, what happened and what to do."""

    title: str
    message: str
    action: Literal["sign_in", "update", "check_network", "free_disk", "settings", "retry", "none"] = "none"
    details: tuple[str, ...] = ()  # the log lines behind it, folded under "Details" (never the title)
    retry_at: float | None = None  # wall-clock seconds when the app tries again by itself; None = it will not


@dataclass(frozen=True)
class GpuSnapshot:
    index: int
    name: str
    memory_total_mib: int
    memory_usable_mib: int
    memory_used_mib: int | None = None
    util_pct: float | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    lent: bool = True


@dataclass(frozen=True)
class ContextNumbers:
    """Requested (argv), declared (/v1/models max_model_len), physical (KV tokens)."""

    requested: int | None = None
    declared: int | None = None
    physical: int | None = None

    @property
    def servable(self) -> int | None:
        known = [n for n in (self.declared, self.physical) if n is not None]
        return min(known) if known else None


@dataclass(frozen=True)
class Tuned:
    """Arguments this machine measured to be faster than the tier's, laid after them."""

    args: tuple[str, ...]
    gain_pct: float  # the measured gain over the tier's arguments
    noise_pct: float  # the run-to-run spread it was measured against
    words: tuple[str, ...] = ()  # what the arguments do, in a person's words ("serves 8 requests at once")


@dataclass(frozen=True)
class TuningSnapshot:
    """Where the search for this machine's own arguments stands (the contract's `status.tuning`)."""

    state: TuningState = "idle"
    trial: int = 0
    trials_max: int = 0
    elapsed_s: float = 0.0
    best_gain_pct: float | None = None
    refused: str | None = None  # why the assignment's `tune` block was refused (it serves untuned)
    chosen: Tuned | None = None  # what the last search adopted

    @property
    def progress(self) -> str | None:
        """ "Tuning… (trial 4 of 12)" while a search runs, for the tray and `gpu-provider status`."""
        if self.state != "running":
            return None
        if not self.trials_max:
            return "Tuning…"
        return f"Tuning… (trial {max(1, self.trial)} of {self.trials_max})"


@dataclass(frozen=True)
class EngineSnapshot:
    engine_id: str
    engine: EngineName
    gpu_indices: tuple[int, ...]
    layout: Layout
    state: NodeState
    argv: tuple[str, ...] = ()  # the API key's value shown as ***
    tier: str | None = None  # the threshold applied ("24000"), None for base_args alone
    memory_mib: int = 0  # what this engine process is judged by
    phase: StartPhase | None = None
    kv_cache_tokens: int | None = None
    kv_cache_gib: float | None = None
    max_concurrency: float | None = None
    context: ContextNumbers = ContextNumbers()
    restarts: int = 0
    last_error: str | None = None
    pid: int | None = None
    port: int | None = None
    log_path: str | None = None
    kv_usage_pct: float | None = None
    requests_running: int | None = None
    requests_waiting: int | None = None
    failures_in_a_row: int = 0  # quick failures of this start so far ("Restarting (3 of 5)")
    restart_limit: int = 5  # quick failures in a row after which the supervisor gives up
    retry_at: float | None = None  # wall-clock seconds of the next start while waiting to restart
    tuned: Tuned | None = None  # the measured arguments it runs with after its tier's, if any


@dataclass(frozen=True)
class ThroughputSnapshot:
    """The current run only (this engine, this model, since ready); `None` = nothing to measure."""

    tokens_per_s: float | None = None  # the run's average (what the coordinator is told)
    live_tokens_per_s: float | None = None  # the last LIVE_WINDOW_S, 0.0 when serving and idle
    capacity_tokens_per_s: float | None = None  # the best sustained rate of this run so far
    per_request_tokens_per_s: float | None = None
    ttft_p50_s: float | None = None
    run_tokens: int = 0
    run_seconds: float = 0.0
    requests: int = 0
    roofline_share: float | None = None
    roofline_comparable: bool = True
    spec_acceptance_rate: float | None = None
    tokens_per_forward: float | None = None


@dataclass(frozen=True)
class DayEarnings:
    """One local day of the ledger: what was earned and what its electricity cost."""

    day: str  # ISO date, local time
    gross: float
    energy_cost: float

    @property
    def net(self) -> float:
        return self.gross - self.energy_cost


@dataclass(frozen=True)
class MeasuredCapacity:
    """The best sustained rate an earlier run measured, kept while nothing serves (paused)."""

    tokens_per_s: float
    model: str | None
    measured_at: float  # wall-clock seconds


@dataclass(frozen=True)
class EarningsSnapshot:
    currency: str = "USD"
    today: float = 0.0
    week: float = 0.0
    all_time: float = 0.0
    energy_cost_today: float = 0.0
    energy_cost_week: float = 0.0
    energy_cost_all_time: float = 0.0
    energy_kwh_today: float = 0.0
    days: tuple[DayEarnings, ...] = ()  # the last 30 local days, oldest first, today last
    net_per_hour: float | None = None  # net over the serving hours of the last 24 h; None = under 15 minutes served
    electricity_price_per_kwh: float = 0.0  # 0 = not set: net equals gross, the app nudges
    power_measured: bool = False  # this machine's power draw is measured (NVML): "net of electricity" means something
    projected_per_day: float | None = None  # net per day at the current net rate; None = nothing to project from

    @property
    def net_today(self) -> float:
        return self.today - self.energy_cost_today

    @property
    def net_week(self) -> float:
        return self.week - self.energy_cost_week

    @property
    def net_all_time(self) -> float:
        return self.all_time - self.energy_cost_all_time


DownloadHold = Literal["paused_by_you", "paused", "game", "budget", "setup"]


@dataclass(frozen=True)
class DownloadProgress:
    what: str  # "model qwen3.8-27b" / "engine vllm 0.33.0"
    done_bytes: int
    total_bytes: int | None
    rate_bps: float | None = None
    eta_s: float | None = None
    finished: bool = False
    error: str | None = None
    step: str | None = None  # what an install is doing when there are no bytes to count
    held: DownloadHold | None = None  # why it waits (no bytes move): the person's pause, the node's, a game, the budget
    held_detail: str | None = None  # e.g. the game's name, or "until 1 January" for the monthly budget
    kind: Literal["model", "engine"] = "model"  # what `status.download.what` says

    @property
    def fraction(self) -> float | None:
        if not self.total_bytes:
            return None
        return min(1.0, self.done_bytes / self.total_bytes)


@dataclass(frozen=True)
class RoutingNotice:
    """The network's latest word on how much traffic it sends this node and why not more."""

    share: float
    reason: RoutingReason | None
    message: str  # the network's own words, one plain line (shown as theirs)
    at: float  # wall-clock seconds it arrived


@dataclass(frozen=True)
class LimitsSnapshot:
    """The lender's limits as they hold now (the contract's `limits`, and the steps taken)."""

    max_requests: int | None = None  # requests at once now (lowered while too hot); None = no limit
    memory_share_pct: tuple[tuple[int, int], ...] = ()  # (GPU index, % of its memory an engine may use)
    reason: LimitReason | None = None
    words: str | None = None  # the step taken, in a person's words ("GPU 0 at 84 °C: serving 2 requests at once")


@dataclass(frozen=True)
class Headline:
    """The node's one state in a person's words: the same in tray, dashboard, notifications and
    `gpu-provider status` (computed once, by `worker/node/headline.py`)."""

    kind: HeadlineKind
    title: str  # "Downloading the model · 42 %", "Paused for Cyberpunk2077.exe until 14:30"
    detail: str = ""  # one line under it: the cause, the time left, the model
    action: MainAction = "none"  # the main button: a failure's remedy, never Pause
    action_label: str = ""  # "Finish setting up", "Sign in", "Try again", "Resume", "Pause serving"
    not_earning: str | None = None  # the one live reason this node earns nothing now; None while it earns


@dataclass(frozen=True)
class ConnectionSnapshot:
    coordinator_url: str
    state: ConnectionState
    problem: Problem | None = None
    retry_in_s: float | None = None


@dataclass(frozen=True)
class NodeSnapshot:
    """Everything the app shows, at one instant."""

    at: float
    state: NodeState
    node_id: str
    runtime: str
    paused: bool = False
    pause_reason: PauseReason | None = None
    pause_until: float | None = None
    pause_detail: str | None = None  # what a game pause is for ("Cyberpunk2077.exe", "a full-screen app")
    assignment_id: str | None = None
    model: str | None = None
    problem: Problem | None = None
    gpus: tuple[GpuSnapshot, ...] = ()
    groups: tuple[tuple[int, ...], ...] = ()
    effective_vram_mib: int = 0
    engines: tuple[EngineSnapshot, ...] = ()
    throughput: ThroughputSnapshot = ThroughputSnapshot()
    earnings: EarningsSnapshot = EarningsSnapshot()
    connection: ConnectionSnapshot = ConnectionSnapshot("local", "disabled")
    downloads: tuple[DownloadProgress, ...] = ()
    in_flight: int = 0
    notices: tuple[str, ...] = field(default=())  # one-off lines for notifications, newest last
    detecting: bool = False  # the machine is still being detected: GPU fields are not known yet
    stopping: bool = False  # quitting: draining `in_flight` requests, then stopping the engines
    update_ready: str | None = None  # a downloaded, verified update's version, applied on restart
    last_capacity: MeasuredCapacity | None = None  # the latest run's measured capacity, kept across pauses
    game_detection: str | None = None  # where not every game can be seen: what auto-pause sees, in words
    tuning: TuningSnapshot | None = None  # None: nothing to tune (no `tune` block, or not offered)
    setup_needed: bool = False  # the desktop app's first-run flow is not finished: nothing downloads, starts or connects
    routing: RoutingNotice | None = None
    limits: LimitsSnapshot = LimitsSnapshot()
    headline: Headline = Headline("idle", "Idle")

    def without_clock(self) -> NodeSnapshot:
        """The snapshot with the fields that move every tick zeroed: equal ones look the same."""
        tuning = replace(self.tuning, elapsed_s=0.0) if self.tuning is not None else None
        return replace(self, at=0.0, throughput=replace(self.throughput, run_seconds=0.0), tuning=tuning)

