"""The supervisor's decisions (pure) and what it reads from recorded engine logs."""

from __future__ import annotations

import dataclasses
import os
import shutil
import stat
from pathlib import Path

import pytest

from tests.support.fake_engine import FakeEngine
from worker.config import Paths, private_dir
from worker.engines.base import ContextTooLong
from worker.plan import EnginePlan
from worker.supervise import (
    SOCKET_PATH_MAX_BYTES,
    Backoff,
    Ended,
    EngineSupervisor,
    SupervisorTiming,
    Target,
    context_refusal,
    engine_home,
    next_step,
    socket_path_for,
    start_options,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TIMING = SupervisorTiming(max_fast_failures=3)
BACKOFF = Backoff()


def plan(engine: str = "vllm", *, tier: str | None = "40000", fallbacks: tuple = ()) -> EnginePlan:
    return EnginePlan(engine_id="e0", engine=engine, gpu_indices=(0,), layout="single", memory_mib=48000, tier=tier,
                      args=("--a", "40"), fallbacks=fallbacks, port=18100, env={}, executable=("vllm",),
                      model="/m", served_name="m")


def step(ended: Ended, *, option: int = 0, options: int = 1, fast: int = 1):
    return next_step(ended, option=option, options=options, fast_failures=fast, tier="40000", next_tier="24000",
                     timing=TIMING, backoff=BACKOFF)


def test_backoff_doubles_from_two_seconds_to_five_minutes() -> None:
    assert [Backoff().delay(n) for n in (1, 2, 3, 4, 8, 9, 30)] == [2, 4, 8, 16, 256, 300, 300]


def test_start_options_are_the_plan_then_the_next_tier_then_base() -> None:
    fallbacks = (("24000", ("--a", "24")), ("16000", ("--a", "16")), (None, ()))
    assert start_options(plan(fallbacks=fallbacks)) == (("40000", ("--a", "40")), ("24000", ("--a", "24")), (None, ()))
    assert start_options(plan(fallbacks=((None, ()),))) == (("40000", ("--a", "40")), (None, ()))
    assert start_options(plan(tier=None)) == ((None, ("--a", "40")),)


def test_out_of_memory_at_start_falls_back_then_fails() -> None:
    oom = Ended("oom", "CUDA out of memory", 3.0, was_ready=False)
    fallback = step(oom, option=0, options=3)
    assert fallback.action == "fallback" and fallback.delay_s == 0
    assert fallback.reason == "out of memory while starting on tier 40000; retrying on tier 24000"
    last = step(oom, option=2, options=3)
    assert last.action == "fail" and "CUDA out of memory" in last.reason and "Free GPU memory" in last.reason


def test_out_of_memory_after_serving_is_a_crash_not_a_fallback() -> None:
    later = step(Ended("oom", "CUDA out of memory", 600.0, was_ready=True), option=0, options=3)
    assert later.action == "retry"


def test_crashes_restart_with_backoff_until_too_many_fast_ones() -> None:
    crash = Ended("crashed", "the engine exited with status 1", 1.0, was_ready=False)
    assert [(s.action, s.delay_s) for s in (step(crash, fast=1), step(crash, fast=2))] == [("retry", 2), ("retry", 4)]
    given_up = step(crash, fast=3)
    assert given_up.action == "fail" and "3 times in a row" in given_up.reason and "status 1" in given_up.reason


def test_refusals_fail_at_once() -> None:
    refusal = context_refusal(ContextTooLong(131072, 34480))
    assert "131072" in refusal and "34480" in refusal and "--max-model-len" in refusal
    assert step(Ended("context", refusal, 1.0, False)).action == "fail"
    assert step(Ended("unstartable", "Could not start vllm", 0.0, False)).action == "fail"


def test_context_refusal_without_an_estimate_still_says_what_to_do() -> None:
    refusal = context_refusal(ContextTooLong(131072, None))
    assert "131072" in refusal and "Lower --max-model-len, or free GPU memory" in refusal


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


def test_phases_are_events_while_starting(tmp_path: Path) -> None:
    events: list[tuple[str, str | None, str]] = []
    sup = EngineSupervisor(plan(), paths=Paths.under(tmp_path),
                           on_event=lambda snap, reason: events.append((snap.state, snap.phase, reason)))
    sup._set("starting", "starting", phase="launching")
    for line in (FIXTURES / "vllm" / "startup-0.33.log").read_text().splitlines():
        sup.observe_line(line)
    assert [phase for _, phase, _ in events] == ["launching", "loading", "compiling", "capturing", "warming"]
    assert all(state == "starting" for state, _, _ in events)


def test_stall_needs_requests_in_flight_and_no_progress(tmp_path: Path) -> None:
    now = [100.0]
    sup = EngineSupervisor(plan(), paths=Paths.under(tmp_path), timing=SupervisorTiming(stall_s=30),
                           clock=lambda: now[0])
    now[0] += 1000
    assert sup.stall_reason() is None  # idle for long: nothing in flight, nothing stalled
    sup.request_started()
    now[0] += 20
    sup.note_progress()
    now[0] += 25
    assert sup.stall_reason() is None and sup.in_flight == 1
    now[0] += 10
    assert "no token for 35 s with 1 request(s) in flight" == sup.stall_reason()
    sup.request_finished()
    assert sup.stall_reason() is None and sup.in_flight == 0


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
    assert Target("http://127.0.0.1:1", "k", "m", "e0").socket_path is None
