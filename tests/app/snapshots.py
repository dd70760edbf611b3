"""Snapshots of each main state, shared by the app tests and the screenshot script."""

from __future__ import annotations

import datetime as dt
from dataclasses import replace
from typing import Any

from tests.worker.hardware.recorded import replay
from worker.contract import protocol
from worker.hardware import Machine
from worker.plan.planner import EnginePlan, Plan, plan
from worker.system.config import Settings

from worker.node.provision_failure import offline_problem
from worker.serve.diagnosis import engine_problem
from worker.contract.events import (
    ConnectionSnapshot,
    ContextNumbers,
    DayEarnings,
    DownloadProgress,
    EarningsSnapshot,
    EngineSnapshot,
    GpuSnapshot,
    MeasuredCapacity,
    NodeSnapshot,
    Problem,
    ThroughputSnapshot,
)
from worker.serve.restart_policy import Ended

NOW = 1_800_000_000.0
MODEL = "Qwen/Qwen3-8B"


def _assign(weights_mib: int, *engines: str) -> protocol.Assign:
    """An assignment of MODEL as a coordinator sends it, for the engines named."""
    model: dict[str, Any] = {"name": MODEL}
    if "vllm" in engines:
        model["vllm"] = {"source": MODEL, "revision": "main", "engine_version": "0.33.0", "weights_mib": weights_mib,
                         "base_args": ["--max-model-len", "32768"], "tiers": {"40000": ["--max-num-seqs", "128"]}}
    if "llamacpp" in engines:
        model["llamacpp"] = {"source": "https://example.org/qwen3-0.6b-Q4_K_M.gguf", "sha256": "ab" * 32,
                             "weights_mib": weights_mib, "base_args": ["--ctx-size", "8192"], "tiers": {}}
    return protocol.Assign.model_validate({"type": "assign", "assignment_id": "as-91", "model": model})


def _planned(fixture: str, assign: protocol.Assign) -> tuple[Machine, EnginePlan]:
    """A recorded machine and the real planner's first engine for it: the screens show only what the
    planner does (two 4090s work as one on the 27B-class weights; a CPU computer runs a small GGUF)."""
    machine = replay(fixture)
    result = plan(machine, assign, Settings())
    assert isinstance(result, Plan), result
    return machine, result.engines[0]


MACHINE, PLANNED = _planned("rtx4090x2-no-p2p.json", _assign(17_800, "vllm", "llamacpp"))
CPU_MACHINE, CPU_PLANNED = _planned("no-gpu.json", _assign(470, "llamacpp"))

_READINGS = ((21_980, 87.0, 66.0, 338.0), (20_860, 84.0, 71.0, 301.0))  # used MiB, busy %, °C, W
GPUS = tuple(GpuSnapshot(g.index, g.name, g.memory_total_mib, g.usable_mib, *_READINGS[g.index], g.power_limit_w)
             for g in MACHINE.gpus)

ENGINE = EngineSnapshot(
    engine_id="engine-0",
    engine=PLANNED.engine,
    gpu_indices=PLANNED.gpu_indices,
    layout=PLANNED.layout,
    state="ready",
    argv=tuple(PLANNED.argv()),
    tier=PLANNED.tier,
    memory_mib=PLANNED.memory_mib,
    phase="ready",
    kv_cache_tokens=284_512,
    kv_cache_gib=19.5,
    max_concurrency=8.7,
    context=ContextNumbers(requested=32_768, declared=32_768, physical=284_512),
    restarts=0,
    pid=48211,
    port=PLANNED.port,
    kv_usage_pct=37.0,
    requests_running=3,
    requests_waiting=0,
)


def _days() -> tuple[DayEarnings, ...]:
    """30 local days ending on NOW's: nothing for 18 days, then twelve days of serving."""
    today = dt.date.fromtimestamp(NOW)
    days = []
    for back in range(29, -1, -1):
        gross = 0.0 if back >= 12 else round(2.2 + 0.9 * ((back * 7) % 5) / 4, 2)
        days.append(DayEarnings((today - dt.timedelta(days=back)).isoformat(), gross, round(gross * 0.22, 2)))
    return tuple(days)


EARNINGS = EarningsSnapshot(
    currency="USD",
    today=2.84,
    week=17.40,
    all_time=96.12,
    energy_cost_today=0.61,
    energy_cost_week=3.92,
    energy_cost_all_time=22.05,
    energy_kwh_today=2.03,
    days=_days(),
    net_per_hour=0.19,
    electricity_price_per_kwh=0.30,
    power_measured=True,  # NVML reads these cards' power
)
CAPACITY = MeasuredCapacity(912.0, MODEL, NOW - 600)

CONNECTED = ConnectionSnapshot("wss://coordinator.example.net/v1/node", "connected")


def idle() -> NodeSnapshot:
    return NodeSnapshot(
        at=NOW,
        state="idle",
        node_id="node-7f3a",
        runtime="native",
        gpus=tuple(replace(g, memory_used_mib=610, util_pct=0.0, power_w=24.0, temperature_c=38.0) for g in GPUS),
        groups=tuple(g.gpu_indices for g in MACHINE.groups),
        effective_vram_mib=MACHINE.effective_vram_mib,
        earnings=EARNINGS,
        connection=CONNECTED,
    )


def starting() -> NodeSnapshot:
    engine = replace(
        ENGINE,
        state="starting",
        phase="compiling",
        kv_cache_tokens=None,
        kv_cache_gib=None,
        max_concurrency=None,
        context=ContextNumbers(requested=32_768),
        kv_usage_pct=None,
        requests_running=None,
    )
    download = DownloadProgress(f"model {MODEL}", 12_400_000_000, 16_400_000_000, 95_000_000, 42.0)
    return replace(
        idle(), state="starting", model=MODEL, assignment_id="as-91", engines=(engine,), downloads=(download,)
    )


def serving() -> NodeSnapshot:
    return replace(
        idle(),
        state="ready",
        model=MODEL,
        assignment_id="as-91",
        gpus=GPUS,
        engines=(ENGINE,),
        in_flight=3,
        last_capacity=CAPACITY,
        throughput=ThroughputSnapshot(
            tokens_per_s=812.4,
            live_tokens_per_s=846.0,
            capacity_tokens_per_s=912.0,
            per_request_tokens_per_s=71.2,
            ttft_p50_s=0.21,
            run_tokens=1_204_330,
            run_seconds=3_310.0,
            requests=1_842,
            roofline_share=0.62,
        ),
    )


def paused_for_game() -> NodeSnapshot:
    return replace(idle(), state="paused", paused=True, pause_reason="game", model=MODEL, last_capacity=CAPACITY)


def paused_for_named_game() -> NodeSnapshot:
    """As the core reports it when it saw the game's process on the card."""
    return replace(paused_for_game(), pause_detail="Cyberpunk2077.exe")


def paused_until(until: float) -> NodeSnapshot:
    return replace(idle(), state="paused", paused=True, pause_reason="timed", pause_until=until, model=MODEL)


def degraded() -> NodeSnapshot:
    engine = replace(ENGINE, state="degraded", restarts=2, last_error="health check timed out after 10 s")
    return replace(serving(), state="degraded", engines=(engine,))


def failed() -> NodeSnapshot:
    problem = Problem(
        "The engine ran out of GPU memory",
        "vLLM could not fit Qwen/Qwen3-8B even at the lowest memory tier. Close other GPU apps or lend another GPU.",
        "settings",
    )
    engine = replace(
        ENGINE, state="failed", restarts=3, last_error="torch.OutOfMemoryError: CUDA out of memory", pid=None
    )
    return replace(idle(), state="failed", model=MODEL, engines=(engine,), problem=problem)


def signed_out() -> NodeSnapshot:
    problem = Problem("Signed out", "The network no longer accepts this node's token.", "sign_in")
    return replace(idle(), connection=ConnectionSnapshot(CONNECTED.coordinator_url, "signed_out", problem))


TRACEBACK = (
    "Traceback (most recent call last):",
    '  File "vllm/entrypoints/openai/api_server.py", line 1121, in run_server',
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
)


def restarting() -> NodeSnapshot:
    """The engine failed three quick starts in a row and waits a minute before the fourth."""
    engine = replace(
        ENGINE,
        state="starting",
        phase="launching",
        restarts=3,
        failures_in_a_row=3,
        restart_limit=5,
        retry_at=NOW + 60,
        last_error="\n".join(TRACEBACK),
        pid=None,
        kv_usage_pct=None,
        requests_running=None,
    )
    return replace(idle(), state="starting", model=MODEL, assignment_id="as-91", engines=(engine,))


def failed_with_retry() -> NodeSnapshot:
    """A crash loop that gave up (out of GPU memory), worded by the core's own diagnosis: a plain
    cause, Retry, the engine's log under Details."""
    ended = Ended("oom", "\n".join(TRACEBACK), uptime_s=4.0, was_ready=False, lines=TRACEBACK)
    problem = engine_problem("vllm", ended, gave_up=True)
    engine = replace(
        ENGINE, state="failed", restarts=4, failures_in_a_row=5, last_error="\n".join(TRACEBACK), pid=None,
        kv_usage_pct=None, requests_running=None,
    )
    return replace(idle(), state="failed", model=MODEL, engines=(engine,), problem=problem)


def offline() -> NodeSnapshot:
    """Offline while fetching the engine: the core tries again by itself and says when."""
    cause = Problem("Can't download the engine", "GET https://github.com/ggml-org/llama.cpp/releases: "
                    "[Errno -3] Temporary failure in name resolution")
    problem = offline_problem(cause, NOW + 120)
    return replace(idle(), state="configured", model=MODEL, problem=problem)


def update_ready() -> NodeSnapshot:
    return replace(serving(), update_ready="0.4.0")


def cpu_serving() -> NodeSnapshot:
    """A computer without a GPU serving a small model on its CPU."""
    engine = replace(ENGINE, engine=CPU_PLANNED.engine, gpu_indices=CPU_PLANNED.gpu_indices, layout=CPU_PLANNED.layout,
                     argv=tuple(CPU_PLANNED.argv()), tier=CPU_PLANNED.tier, memory_mib=CPU_PLANNED.memory_mib,
                     port=CPU_PLANNED.port, kv_cache_tokens=16_384, kv_cache_gib=0.19, max_concurrency=2.0,
                     context=ContextNumbers(requested=8_192, declared=8_192, physical=16_384))
    return replace(serving(), runtime="cpu", gpus=(), groups=(), effective_vram_mib=0, engines=(engine,))


def detecting() -> NodeSnapshot:
    return replace(idle(), gpus=(), groups=(), effective_vram_mib=0, detecting=True)


def new_user() -> NodeSnapshot:
    """Nothing earned yet and no electricity price set."""
    return replace(idle(), earnings=EarningsSnapshot(days=tuple(replace(d, gross=0.0, energy_cost=0.0)
                                                                 for d in EARNINGS.days), power_measured=True))


def setup_needed() -> NodeSnapshot:
    """A new install whose first-run flow was closed with Later: the node waits, doing nothing."""
    return replace(idle(), setup_needed=True, earnings=new_user().earnings)


def downloading() -> NodeSnapshot:
    """The model coming down for a new assignment (Steam-like: percent, speed, time left)."""
    download = DownloadProgress(f"model {MODEL}", 6_100_000_000, 17_800 * 2**20, 38_000_000, 330.0)
    return replace(idle(), state="configured", model=MODEL, assignment_id="as-91", downloads=(download,))


def download_held_for_game() -> NodeSnapshot:
    held = replace(downloading().downloads[0], held="game", held_detail="Cyberpunk2077.exe", rate_bps=None,
                   eta_s=None)
    return replace(paused_for_named_game(), assignment_id="as-91", downloads=(held,))


def losing_money() -> NodeSnapshot:
    """Serving where electricity costs more than it earns: today's net below zero."""
    losing = replace(EARNINGS, today=0.42, energy_cost_today=0.96, net_per_hour=-0.05)
    return replace(serving(), earnings=losing)


MAIN_STATES = {
    "setup": setup_needed,
    "downloading": downloading,
    "download-held": download_held_for_game,
    "idle": idle,
    "starting": starting,
    "serving": serving,
    "paused": paused_for_named_game,
    "failed": failed_with_retry,
    "offline": offline,
    "update": update_ready,
    "signed-out": signed_out,
    "losing": losing_money,
    "cpu": cpu_serving,
}
