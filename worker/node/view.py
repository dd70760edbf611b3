"""What the node shows and reports, pure: its state from its engines', the `status` message for
the coordinator, the `NodeSnapshot` for the app, and the chart points. Functions of their inputs:
the node gathers the inputs, these make the picture."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from worker import __version__
from worker.contract import protocol
from worker.engines import published_args
from worker.contract.events import (
    ConnectionSnapshot,
    DownloadProgress,
    EarningsSnapshot,
    EngineSnapshot,
    GpuSnapshot,
    LimitsSnapshot,
    MeasuredCapacity,
    NodeSnapshot,
    NodeState,
    Problem,
    RoutingNotice,
    ThroughputSnapshot,
    Tuned,
    TuningSnapshot,
)
from worker.node.headline import headline
from worker.hardware import Gpu, GpuSample, Machine
from worker.measure.ledger import SERVING_SERIES
from worker.measure.metrics import EngineMetrics

MIB = 1024 * 1024


@dataclass(frozen=True)
class Pause:
    """Why and until when the node is paused."""

    reason: str
    until: float | None  # wall-clock seconds; None = until resumed
    detail: str | None = None  # the game auto-pause saw


def summarise(states: Sequence[NodeState]) -> NodeState:
    """The node's state from its engines', as the protocol defines it."""
    if not states:
        return "configured"
    serving = [s for s in states if s in ("ready", "degraded")]
    if serving and len(serving) == len(states) and all(s == "ready" for s in states):
        return "ready"
    if serving:
        return "degraded"
    if all(s == "failed" for s in states):
        return "failed"
    if any(s == "starting" for s in states):
        return "starting"
    if all(s == "stopped" for s in states):
        return "stopped"
    return "configured"


def build_hello(node_id: str, machine: Machine, *, paused: bool, allow_remote_code: bool,
                limits: LimitsSnapshot = LimitsSnapshot()) -> protocol.Hello:
    """The `hello` this node introduces itself with: the machine as detected, the engine arguments
    it accepts, whether it is paused, the lender's limits."""
    return protocol.Hello(
        node_id=node_id,
        app_version=__version__,
        paused=paused,
        engine_args=published_args(allow_remote_code=allow_remote_code),
        limits=limits_status(limits),
        **machine.to_detect_json(),
    )


def limits_status(limits: LimitsSnapshot) -> protocol.Limits | None:
    """The contract's `limits`; None where the lender set none and none is taken now."""
    shares = {str(index): pct for index, pct in limits.memory_share_pct if pct < 100}
    if limits.max_requests is None and not shares and limits.reason is None:
        return None
    return protocol.Limits(max_requests=limits.max_requests, memory_share_pct=shares, reason=limits.reason)


def download_status(downloads: Iterable[DownloadProgress]) -> protocol.DownloadStatus | None:
    """The contract's `status.download`: the first download in progress (a held one is `paused`)."""
    active = next((d for d in downloads if not d.finished and not d.error), None)
    if active is None:
        return None
    rate = active.rate_bps / MIB if active.rate_bps is not None and active.held is None else None
    return protocol.DownloadStatus(
        what=active.kind, done_mib=active.done_bytes // MIB,
        total_mib=active.total_bytes // MIB if active.total_bytes is not None else None,
        mib_per_s=round(rate, 2) if rate is not None else None, paused=active.held is not None)


def node_state(*, paused: bool, assigned: bool, planned: bool, problem: bool,
               engines: Sequence[NodeState]) -> NodeState:
    """The node's state: paused, idle or failed before any engine counts; else its engines'."""
    if paused:
        return "paused"
    if not assigned:
        return "failed" if problem else "idle"
    if not planned or (problem and not engines):
        return "failed"
    if not engines:
        return "configured"
    return summarise(engines)


def build_status(
    *,
    state: NodeState,
    assignment: protocol.Assign | None,
    problem: Problem | None,
    refused: protocol.Refused | None,
    engines: Iterable[EngineSnapshot],
    figures: ThroughputSnapshot,
    gpus: Iterable[GpuSample],
    in_flight: int,
    tuning: TuningSnapshot | None = None,
    limits: LimitsSnapshot = LimitsSnapshot(),
    downloads: Iterable[DownloadProgress] = (),
) -> protocol.Status:
    """The `status` message: what the coordinator learns of this node (`engines` with the
    measured arguments each runs with laid over them: `engine_views`), the lender's limits now
    and the download in progress (the node is `configured` meanwhile, as the contract says, even
    before the assignment it fetches for is adopted)."""
    download = download_status(downloads)
    return protocol.Status(
        state="configured" if state == "idle" and download is not None else state,
        assignment_id=assignment.assignment_id if assignment else None,
        model=assignment.model.name if assignment else None,
        last_error=problem.message if problem else None,
        refused=refused,
        engines=[
            protocol.EngineStatus(
                engine_id=e.engine_id,
                gpu_indices=list(e.gpu_indices),
                layout=e.layout,
                argv=list(e.argv),
                state=e.state,
                kv_cache_tokens=e.kv_cache_tokens,
                kv_cache_gib=e.kv_cache_gib,
                max_model_len=e.context.declared,
                max_concurrency=e.max_concurrency,
                restarts=e.restarts,
                last_error=e.last_error,
                tuned=protocol.Tuned(args=list(e.tuned.args), gain_pct=e.tuned.gain_pct, noise_pct=e.tuned.noise_pct)
                if e.tuned is not None else None,
            )
            for e in engines
        ],
        throughput=protocol.Throughput(
            tokens_per_s=figures.tokens_per_s,
            per_request_tokens_per_s=figures.per_request_tokens_per_s,
            run_tokens=figures.run_tokens,
            run_seconds=round(figures.run_seconds, 3),
            requests=figures.requests,
        ),
        gpus=[
            protocol.GpuStatus(
                index=s.index,
                util_pct=s.util_pct,
                memory_used_mib=s.memory_used_mib,
                power_w=s.power_w,
                temperature_c=s.temperature_c,
            )
            for s in gpus
        ],
        in_flight=in_flight,
        tuning=tuning_status(tuning),
        limits=limits_status(limits),
        download=download,
    )


def tuning_status(tuning: TuningSnapshot | None) -> protocol.TuningStatus | None:
    """`status.tuning`: the snapshot's part the contract names (a refusal's reason as an object)."""
    if tuning is None:
        return None
    return protocol.TuningStatus(
        state=tuning.state, trial=tuning.trial, trials_max=tuning.trials_max, elapsed_s=round(tuning.elapsed_s, 1),
        best_gain_pct=tuning.best_gain_pct,
        refused=protocol.TuneRefusal(reason=tuning.refused) if tuning.refused is not None else None,
    )


def status_key(status: protocol.Status) -> tuple[Any, ...]:
    """What makes a `status` worth sending before the next heartbeat: a change in the node's or an
    engine's state, an engine's restarts or tuned arguments, the error, the refusal, or tuning's
    state and trial, the lender's limits, a download starting, ending, held or going on (figures,
    the time tuning took and a download's bytes move every second)."""
    tuning = (status.tuning.state, status.tuning.trial, status.tuning.refused) if status.tuning else None
    download = (status.download.what, status.download.paused) if status.download else None
    return (status.state, tuple((e.engine_id, e.state, e.restarts, e.tuned) for e in status.engines),
            status.last_error, status.refused, tuning, status.limits, download)


def engine_views(engines: Iterable[EngineSnapshot], metrics: Mapping[str, EngineMetrics],
                 tuned: Mapping[str, Tuned] | None = None) -> tuple[EngineSnapshot, ...]:
    """The supervisors' snapshots with the latest /metrics figures laid over the serving ones, and
    the measured arguments each runs with (`tuned`, by engine id)."""
    views = []
    for snap in engines:
        if tuned and snap.engine_id in tuned:
            snap = dataclasses.replace(snap, tuned=tuned[snap.engine_id])
        latest = metrics.get(snap.engine_id)
        if latest is not None and snap.state in ("ready", "degraded"):
            snap = dataclasses.replace(
                snap,
                kv_usage_pct=100.0 * latest.kv_usage if latest.kv_usage is not None else None,
                requests_running=latest.requests_running,
                requests_waiting=latest.requests_waiting,
            )
        views.append(snap)
    return tuple(views)


def gpu_view(gpu: Gpu, sample: GpuSample | None, lent: Collection[int] | None) -> GpuSnapshot:
    """Detection's facts with the latest telemetry sample laid over them (when there is one)."""
    live: Gpu | GpuSample = sample or gpu
    return GpuSnapshot(
        index=gpu.index,
        name=gpu.name,
        memory_total_mib=gpu.memory_total_mib,
        memory_usable_mib=gpu.usable_mib,
        memory_used_mib=live.memory_used_mib,
        util_pct=live.util_pct,
        temperature_c=live.temperature_c,
        power_w=live.power_w,
        power_limit_w=gpu.power_limit_w,
        lent=lent is None or gpu.index in lent,
    )


def build_snapshot(
    *,
    at: float,
    state: NodeState,
    node_id: str,
    machine: Machine | None,
    lent: Collection[int] | None,
    gpu_samples: Mapping[int, GpuSample],
    pause: Pause | None,
    assignment: protocol.Assign | None,
    problem: Problem | None,
    engines: Iterable[EngineSnapshot],
    metrics: Mapping[str, EngineMetrics],
    throughput: ThroughputSnapshot,
    connection: ConnectionSnapshot,
    downloads: Iterable[DownloadProgress],
    in_flight: int,
    notices: Iterable[str],
    earnings: EarningsSnapshot | None,
    last_capacity: MeasuredCapacity | None = None,
    stopping: bool = False,
    update_ready: str | None = None,
    game_detection: str | None = None,
    tuning: TuningSnapshot | None = None,
    tuned: Mapping[str, Tuned] | None = None,
    setup_needed: bool = False,
    routing: RoutingNotice | None = None,
    limits: LimitsSnapshot = LimitsSnapshot(),
) -> NodeSnapshot:
    """The `NodeSnapshot` the app renders, with its one headline. `lent`: the cards the user lends
    (None: all); `earnings` None until the ledger was first read; `last_capacity` the latest run's
    measured capacity, kept while nothing serves; `machine` None while it is being detected;
    `tuning` where the tier's arguments are being (or were) measured against others, `tuned` by
    engine id; `setup_needed` while the first-run flow waits; `routing` the network's latest notice."""
    lent_set = set(lent) if lent is not None else None
    kwargs: dict[str, Any] = {}
    if earnings is not None:
        kwargs["earnings"] = earnings
    snap = NodeSnapshot(
        at=at,
        state=state,
        node_id=node_id,
        runtime=machine.runtime if machine else "cpu",
        paused=pause is not None,
        pause_reason=pause.reason if pause else None,  # type: ignore[arg-type]
        pause_until=pause.until if pause else None,
        pause_detail=pause.detail if pause else None,
        assignment_id=assignment.assignment_id if assignment else None,
        model=assignment.model.name if assignment else None,
        problem=problem,
        gpus=tuple(gpu_view(g, gpu_samples.get(g.index), lent_set) for g in (machine.gpus if machine else ())),
        groups=tuple(tuple(g.gpu_indices) for g in (machine.groups if machine else ())),
        effective_vram_mib=machine.effective_vram_mib if machine else 0,
        engines=engine_views(engines, metrics, tuned),
        throughput=throughput,
        connection=connection,
        downloads=tuple(downloads),
        in_flight=in_flight,
        notices=tuple(notices),
        last_capacity=last_capacity,
        detecting=machine is None,
        stopping=stopping,
        update_ready=update_ready,
        game_detection=game_detection,
        tuning=tuning,
        setup_needed=setup_needed,
        routing=routing,
        limits=limits,
        **kwargs,
    )
    return dataclasses.replace(snap, headline=headline(snap, at))


def chart_points(throughput: ThroughputSnapshot, kv_usage_pct: float | None,
                 gpu_samples: Iterable[GpuSample]) -> list[tuple[str, float | None]]:
    """This second's chart points by series; None where there is nothing to plot.

    `tokens_per_s` plots the live rate (it falls to 0 when the load stops; None without an engine
    run, which the ledger reads as not serving). Each card has its own series, `gpu{index}.util_pct`,
    `.power_w` and `.temperature_c`: two cards merged into one line hide which one is busy or hot.
    """
    rows: list[tuple[str, float | None]] = [
        (SERVING_SERIES, throughput.live_tokens_per_s), ("kv_usage", kv_usage_pct)]
    for sample in sorted(gpu_samples, key=lambda s: s.index):
        rows += [(f"gpu{sample.index}.util_pct", sample.util_pct), (f"gpu{sample.index}.power_w", sample.power_w),
                 (f"gpu{sample.index}.temperature_c", sample.temperature_c)]
    return rows


# --- tuned arguments in a person's words ---------------------------------------------------------

_VALUE_WORDS: dict[str, str] = {
    "--max-num-seqs": "serves up to {} requests at once",
    "--max-running-requests": "serves up to {} requests at once",
    "-np": "serves {} requests at once",
    "--parallel": "serves {} requests at once",
    "--max-num-batched-tokens": "reads prompts {} tokens at a time",
    "--chunked-prefill-size": "reads prompts {} tokens at a time",
    "-b": "reads prompts {} tokens at a time",
    "--batch-size": "reads prompts {} tokens at a time",
    "-ub": "works on {} prompt tokens per step",
    "--ubatch-size": "works on {} prompt tokens per step",
    "-t": "uses {} processor threads",
    "--threads": "uses {} processor threads",
    "-tb": "uses {} processor threads to read prompts",
    "--threads-batch": "uses {} processor threads to read prompts",
    "--num-speculative-tokens": "guesses {} words ahead",
    "--cuda-graph-max-bs": "prepares the GPU's work ahead for up to {} requests at once",
}
_SWITCH_WORDS: dict[str, str] = {
    "--enforce-eager": "skips preparing the GPU's work ahead",
    "--no-enforce-eager": "prepares the GPU's work ahead",
    "--disable-cuda-graph": "skips preparing the GPU's work ahead",
    "-cb": "lets requests share each step",
    "--cont-batching": "lets requests share each step",
}
_UNSAID = frozenset({"-c", "--ctx-size"})  # llama.cpp's context follows its slots: each request keeps its own


def tuned_words(chosen: Sequence[str], baseline: Sequence[str]) -> tuple[str, ...]:
    """What the chosen arguments change, one phrase each ("serves 8 requests at once instead of
    1"), where `baseline` is what they are laid after. Linear in the arguments."""
    before = _flag_values(baseline)
    words = []
    for flag, value in _flag_values(chosen).items():
        if flag in _UNSAID or before.get(flag, _NOTHING) == value:
            continue
        if value is None and flag in _SWITCH_WORDS:
            words.append(_SWITCH_WORDS[flag])
        elif value is not None and flag in _VALUE_WORDS:
            phrase = _VALUE_WORDS[flag].format(value)
            old = before.get(flag)
            words.append(f"{phrase} instead of {old}" if isinstance(old, str) else phrase)
        else:
            words.append(f"sets {flag} to {value}" if value is not None else f"turns on {flag}")
    return tuple(words)


_NOTHING = object()


def _flag_values(args: Sequence[str]) -> dict[str, str | None]:
    """Each flag's last value (None: a switch); `--flag=value` and `--flag value` alike."""
    values: dict[str, str | None] = {}
    i = 0
    while i < len(args):
        flag, eq, value = args[i].partition("=")
        if eq:
            values[flag] = value
        elif i + 1 < len(args) and not _is_flag(args[i + 1]):
            values[flag], i = args[i + 1], i + 1
        else:
            values[flag] = None
        i += 1
    return values


def _is_flag(token: str) -> bool:
    return token.startswith("-") and not token[1:2].isdigit()
