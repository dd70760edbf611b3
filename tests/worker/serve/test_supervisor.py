"""The supervisor: what it reads from recorded engine logs, its sockets and private folder, and
the fresh memory reading the node gives it. Its decisions are tested in `test_restart_policy.py`."""

from __future__ import annotations

import dataclasses
import os
import shutil
import stat
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.fake_engine import FakeEngine
from worker.system.config import Paths, Settings, private_dir
from worker.hardware import Gpu, Machine, ReplaySource
from worker.node.node import Node
from worker.plan.planner import EnginePlan
from worker.serve.restart_policy import SupervisorTiming
from worker.relay.forward import EngineTarget
from worker.serve.supervisor import (
    SOCKET_PATH_MAX_BYTES,
    EngineSupervisor,
    engine_home,
    socket_path_for,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


def plan(engine: str = "vllm", *, tier: str | None = "40000", fallbacks: tuple = ()) -> EnginePlan:
    return EnginePlan(engine_id="e0", engine=engine, gpu_indices=(0,), layout="single", memory_mib=48000, tier=tier,
                      args=("--a", "40"), fallbacks=fallbacks, port=18100, env={}, executable=("vllm",),
                      model="/m", served_name="m")


@pytest.mark.parametrize(("fixture", "tokens", "gib", "concurrency", "requested"), [
    ("startup-0.33.log", 445888, 61.23, 13.61, 32768),
    ("startup-0.11.log", 44880, 5.48, 0.34, 131072),
])
def test_vllm_startup_log_fills_the_snapshot(tmp_path: Path, fixture: str, tokens: int, gib: float,
                                             concurrency: float, requested: int) -> None:
    sup = EngineSupervisor(plan(), paths=Paths.under(tmp_path))
    for line in (FIXTURES / "vllm" / fixture).read_text().splitlines():
        sup.observe_line(line)
    snap = sup.snapshot()
    assert (snap.kv_cache_tokens, snap.kv_cache_gib, snap.max_concurrency) == (tokens, gib, concurrency)
    assert snap.context.requested == requested and snap.context.physical == tokens
    assert snap.state == "configured"


def test_llamacpp_startup_log_gives_cells_and_slots(tmp_path: Path) -> None:
    sup = EngineSupervisor(plan("llamacpp"), paths=Paths.under(tmp_path))
    for line in (FIXTURES / "llamacpp" / "startup.log").read_text().splitlines():
        sup.observe_line(line)
    snap = sup.snapshot()
    assert (snap.kv_cache_tokens, snap.kv_cache_gib, snap.max_concurrency) == (2048, round(2 / 1024, 3), 4.0)
    assert snap.context.requested == 2048


@pytest.mark.parametrize(("fixture", "tokens", "mib"), [
    ("startup-iswa.log", 8192, 512.0),  # the full-attention cache, not the last (0 MiB, sliding-window) one
    ("startup-hybrid.log", 131072, 2048.0),  # never the recurrent state's 4 "cells" (they count sequences)
])
def test_llamacpp_kv_budget_is_the_full_attention_cells_and_the_memory_of_every_cache(
        tmp_path: Path, fixture: str, tokens: int, mib: float) -> None:
    sup = EngineSupervisor(plan("llamacpp"), paths=Paths.under(tmp_path))
    for line in (FIXTURES / "llamacpp" / fixture).read_text().splitlines():
        sup.observe_line(line)
    snap = sup.snapshot()
    assert (snap.kv_cache_tokens, snap.kv_cache_gib, snap.context.physical) == (tokens, round(mib / 1024, 3), tokens)


SWA_START = [
    "llama_kv_cache_iswa: creating non-SWA KV cache, size = 8192 cells",
    "llama_kv_cache: size =   68.00 MiB (  8192 cells,   8 layers,  4/1 seqs), K (q8_0):   34.00 MiB, V (q8_0):   34.00 MiB",
    "llama_kv_cache_iswa: creating     SWA KV cache, size = 4608 cells",
    "llama_kv_cache: size =  765.00 MiB (  4608 cells,  40 layers,  4/1 seqs), K (q8_0):  382.50 MiB, V (q8_0):  382.50 MiB",
]


def test_llamacpp_caches_of_a_start_add_up_in_memory_but_not_in_tokens(tmp_path: Path) -> None:
    sup = EngineSupervisor(plan("llamacpp"), paths=Paths.under(tmp_path))
    for line in SWA_START:
        sup.observe_line(line)
    assert (sup.snapshot().kv_cache_tokens, sup.snapshot().kv_cache_gib) == (8192, round(833 / 1024, 3))


def test_llamacpp_oldest_kv_line_gives_memory_and_leaves_the_tokens_to_the_slots(tmp_path: Path) -> None:
    sup = EngineSupervisor(plan("llamacpp"), paths=Paths.under(tmp_path))
    sup.observe_line("llama_kv_cache_unified: KV self size  =  448.00 MiB, K (f16):  224.00 MiB, V (f16):  224.00 MiB")
    assert (sup.snapshot().kv_cache_tokens, sup.snapshot().kv_cache_gib) == (None, round(448 / 1024, 3))


def script(path: Path, body: str) -> Path:
    """A stand-in executable: this Python running `body`."""
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(0o755)
    return path


async def test_llamacpp_kv_figures_are_counted_per_start_not_over_restarts(tmp_path: Path) -> None:
    """Each start prints its caches again; a restart must not add them to the last start's."""
    printed = "\n".join(SWA_START) + "\n"
    crashing = script(tmp_path / "llama-server", f"import sys\nsys.stderr.write({printed!r})\nsys.exit(1)\n")

    async def no_wait(_seconds: float) -> None:
        return None

    sup = EngineSupervisor(dataclasses.replace(plan("llamacpp"), executable=(str(crashing),)),
                           paths=Paths.under(tmp_path).ensure(), sleep=no_wait,
                           timing=SupervisorTiming(max_fast_failures=2, poll_s=0.05, output_settle_s=2.0))
    await sup.start()
    snap = await sup.wait_for_state("failed", timeout=10)
    await sup.stop()
    assert snap.restarts == 1 and "status 1" in (snap.last_error or "")
    assert (snap.kv_cache_tokens, snap.kv_cache_gib) == (8192, round(833 / 1024, 3))


def test_phases_are_events_while_starting(tmp_path: Path) -> None:
    events: list[tuple[str, str | None, str]] = []
    sup = EngineSupervisor(plan(), paths=Paths.under(tmp_path),
                           on_event=lambda snap, reason: events.append((snap.state, snap.phase, reason)))
    sup._set("starting", "starting", phase="launching")
    for line in (FIXTURES / "vllm" / "startup-0.33.log").read_text().splitlines():
        sup.observe_line(line)
    assert [phase for _, phase, _ in events] == ["launching", "loading", "compiling", "capturing", "warming"]
    assert all(state == "starting" for state, _, _ in events)


def test_in_flight_counts_requests_and_never_goes_below_zero(tmp_path: Path) -> None:
    sup = EngineSupervisor(plan(), paths=Paths.under(tmp_path))
    sup.request_started()
    sup.request_started()
    sup.request_finished()
    assert sup.in_flight == 1
    sup.request_finished()
    sup.request_finished()
    assert sup.in_flight == 0


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_engine_sockets_live_in_a_folder_only_the_user_can_open(tmp_path: Path) -> None:
    home = engine_home(Paths.under(tmp_path))
    path, temporary = socket_path_for(home, "e0")
    assert (path, temporary) == (tmp_path / "run" / "engines" / "e0.sock", None)
    assert mode(home) == 0o700


def test_a_socket_path_too_long_for_sun_path_moves_to_a_private_temporary_folder(tmp_path: Path) -> None:
    home = private_dir(tmp_path / ("d" * 120))
    path, temporary = socket_path_for(home, "e0")
    try:
        assert temporary is not None and path == temporary / "e0.sock"
        assert len(os.fsencode(path)) <= SOCKET_PATH_MAX_BYTES and mode(temporary) == 0o700
    finally:
        if temporary is not None:
            shutil.rmtree(temporary)


async def test_the_supervisors_client_reaches_what_listens_on_the_engines_socket(tmp_path: Path) -> None:
    missing = dataclasses.replace(plan(), executable=(str(tmp_path / "no-such-vllm"),))
    sup = EngineSupervisor(missing, paths=Paths.under(tmp_path))
    await sup.start()
    await sup.wait_for_state("failed", timeout=5)
    socket_path = tmp_path / "run" / "engines" / "e0.sock"
    try:
        async with FakeEngine(served_name="m", socket_path=str(socket_path)) as engine:
            answer = await sup.http.get("http://localhost/v1/models",
                                        headers={"Authorization": f"Bearer {engine.api_key}"})
    finally:
        await sup.stop()
    assert answer.json()["data"][0]["id"] == "m"


def test_a_target_made_the_old_way_has_no_socket() -> None:
    assert EngineTarget("e0", "http://127.0.0.1:1", "k", "m").socket_path is None


# --- what the node gives a supervisor to measure again with ------------------------------------

TWO_CARDS = {"device_count": 2,
             "memory:0": {"total_mib": 24564, "free_mib": 23000, "used_mib": 1564},
             "memory:1": {"total_mib": 24564, "free_mib": 12000, "used_mib": 12564}}  # a game holds 12 GB here


def node_on(tmp_path: Path, calls: dict[str, Any] | None) -> Node:
    node = Node(Paths.under(tmp_path), Settings(), coordinator_url="ws://127.0.0.1:9",
                nvml=ReplaySource(calls) if calls is not None else None)
    cards = tuple(Gpu(index=i, uuid=f"GPU-{i}", name="NVIDIA GeForce RTX 4090", memory_total_mib=24564,
                      memory_free_mib=23000, usable_mib=20188) for i in (0, 1))
    node.machine = Machine(os="linux", runtime="native", arch="x86_64", cpu_model="cpu", cpu_cores=8,
                           ram_mib=65536, gpus=cards)
    return node


async def test_the_node_measures_a_plans_cards_again_by_the_rules_of_detection_and_planning(tmp_path: Path) -> None:
    tensor = dataclasses.replace(plan(), gpu_indices=(0, 1), layout="tensor")
    # card 1: 12,000 MiB free × 0.90 − 512 = 10,288 usable, ÷ 24,564 = 0.4188… → 0.418 (card 0 gives more)
    assert await node_on(tmp_path / "a", TWO_CARDS)._remeasure_memory(tensor) == 0.418
    assert await node_on(tmp_path / "b", TWO_CARDS)._remeasure_memory(dataclasses.replace(plan(), gpu_indices=(0,))) \
        == 0.821
    capped = dataclasses.replace(tensor, memory_cap=0.3)  # the assignment's cap still holds
    assert await node_on(tmp_path / "c", TWO_CARDS)._remeasure_memory(capped) == 0.3


async def test_the_node_gives_no_figure_where_the_cards_cannot_be_read(tmp_path: Path) -> None:
    unread = {"device_count": 2, "memory:0": TWO_CARDS["memory:0"]}  # card 1's memory query failed
    tensor = dataclasses.replace(plan(), gpu_indices=(0, 1), layout="tensor")
    assert await node_on(tmp_path / "a", unread)._remeasure_memory(tensor) is None
    assert await node_on(tmp_path / "b", None)._remeasure_memory(tensor) is None  # no NVML on this machine


# --- restarts a person can follow ------------------------------------------------------------


async def test_a_crash_loop_counts_its_failures_and_dates_each_restart(tmp_path: Path) -> None:
    """"Restarting (2 of 3) at 14:02": the quick failures so far, the limit, and the wall-clock
    time of the next start while the supervisor waits; the count stays on the failed snapshot."""
    crashing = script(tmp_path / "vllm", "import sys\nprint('CUDA error: device lost')\nsys.exit(3)\n")
    waiting: list[tuple[int, int, float | None]] = []
    sup: EngineSupervisor

    async def record_the_wait(seconds: float) -> None:
        snap = sup.snapshot()
        waiting.append((snap.failures_in_a_row, snap.restart_limit, snap.retry_at))

    sup = EngineSupervisor(dataclasses.replace(plan(), executable=(str(crashing),)),
                           paths=Paths.under(tmp_path).ensure(), sleep=record_the_wait, wall_clock=lambda: 1000.0,
                           timing=SupervisorTiming(max_fast_failures=3, poll_s=0.05, output_settle_s=2.0))
    assert sup.snapshot().restart_limit == 3
    await sup.start()
    failed = await sup.wait_for_state("failed", timeout=10)
    await sup.stop()
    assert waiting == [(1, 3, 1002.0), (2, 3, 1004.0)]  # the default backoff: 2 s, then 4 s
    assert (failed.failures_in_a_row, failed.retry_at) == (3, None)
    assert sup.last_ended is not None and sup.last_ended.kind == "crashed"
    assert "device lost" in sup.last_ended.message


async def test_a_llamacpp_start_that_spilled_into_shared_memory_ends_as_out_of_memory(tmp_path: Path) -> None:
    """Windows' sysmem fallback: the card read before the start and once ready grew by less than
    llama-server logged it put there, so the attempt ends as `oom` and the lower tier is tried."""
    from tests.worker.serve.test_restart_policy import SPILLED_START
    from worker.serve.restart_policy import CardMemory

    readings = iter([{0: CardMemory(1_850, 24_564)}, {0: CardMemory(24_310, 24_564)}])
    asked: list[tuple[int, ...]] = []

    async def read_cards(indices: Any) -> dict[int, CardMemory]:
        asked.append(tuple(indices))
        return next(readings)

    sup = EngineSupervisor(plan("llamacpp"), paths=Paths.under(tmp_path), read_cards=read_cards)
    before = await sup._cards()
    for line in SPILLED_START:
        sup.observe_line(line)
    ended = await sup._spilled(before, 0.0) if before is not None else None

    assert ended is not None and ended.kind == "oom" and not ended.was_ready
    assert asked == [(0,), (0,)]
    assert await EngineSupervisor(plan("vllm"), paths=Paths.under(tmp_path), read_cards=read_cards)._cards() is None
