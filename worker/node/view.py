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
    MeasuredCapacity,
    NodeSnapshot,
    NodeState,
    Problem,
    ThroughputSnapshot,
)
from worker.hardware import Gpu, GpuSample, Machine
from worker.measure.ledger import SERVING_SERIES
from worker.measure.metrics import EngineMetrics


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


def build_hello(node_id: str, machine: Machine, *, paused: bool, allow_remote_code: bool) -> protocol.Hello:
    """The `hello` this node introduces itself with: the machine as detected, the engine arguments
    it accepts, whether it is paused."""
    return protocol.Hello(
        node_id=node_id,
        app_version=__version__,
        paused=paused,
        engine_args=published_args(allow_remote_code=allow_remote_code),
        **machine.to_detect_json(),
    )


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
) -> protocol.Status:
    """The `status` message: what the coordinator learns of this node."""
    return protocol.Status(
        state=state,
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
    )


def status_key(status: protocol.Status) -> tuple[Any, ...]:
    """What makes a `status` worth sending before the next heartbeat: a change in the node's or an
    engine's state, an engine's restarts, the error or the refusal (figures move every second)."""
    return (status.state, tuple((e.engine_id, e.state, e.restarts) for e in status.engines), status.last_error,
            status.refused)


def engine_views(engines: Iterable[EngineSnapshot], metrics: Mapping[str, EngineMetrics]) -> tuple[EngineSnapshot, ...]:
    """The supervisors' snapshots with the latest /metrics figures laid over the serving ones."""
    views = []
    for snap in engines:
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
) -> NodeSnapshot:
    """The `NodeSnapshot` the app renders. `lent`: the cards the user lends (None: all);
    `earnings` None until the ledger was first read; `last_capacity` the latest run's measured
    capacity, kept while nothing serves; `machine` None while it is being detected."""
    lent_set = set(lent) if lent is not None else None
    kwargs: dict[str, Any] = {}
    if earnings is not None:
        kwargs["earnings"] = earnings
    return NodeSnapshot(
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
        engines=engine_views(engines, metrics),
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
        **kwargs,
    )


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
