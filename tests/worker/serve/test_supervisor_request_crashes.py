"""The supervisor with a real engine process (the toy engine) that dies while it serves: a crash
with requests in flight is the caller's doing, restarted at once and never counted toward giving
up; three within ten minutes and the node's targets refuse constrained decoding. The decisions
themselves are tested in `test_restart_policy.py`."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support import toy_engine
from worker.system.config import Paths
from worker.serve.engine_set import EngineSet
from worker.engines import registry
from worker.measure.gpu_watch import GpuWatch
from worker.contract.events import EngineSnapshot
from worker.plan.planner import EnginePlan
from worker.serve.restart_policy import RequestCrashes, SupervisorTiming
from worker.serve.supervisor import EngineSupervisor

READY_S = 30.0  # a Python engine starting on a loaded 2-core machine


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Crashing:
    """A supervisor of the toy engine, the waits it took between attempts, and the node's count
    of the crashes requests caused (on a clock the test moves)."""

    def __init__(self, tmp_path: Path) -> None:
        self.waits: list[float] = []
        self.clock = Clock()
        self.crashes = RequestCrashes(clock=self.clock)
        plan = EnginePlan(engine_id="e0", engine="toy", gpu_indices=(), layout="single", memory_mib=0, tier=None,
                          args=("--slots", "2"), fallbacks=(), port=18100, env={},
                          executable=(sys.executable, "-m", "tests.support.toy_engine"), model="/m", served_name="m")

        async def sleep(seconds: float) -> None:
            self.waits.append(seconds)

        timing = SupervisorTiming(poll_s=0.05, health_interval_s=0.2, output_settle_s=0.5, max_fast_failures=2)
        self.sup = EngineSupervisor(plan, paths=Paths.under(tmp_path).ensure(), sleep=sleep, timing=timing,
                                    request_crashes=self.crashes)

    async def ready(self) -> EngineSnapshot:
        return await self.sup.wait_for_state("ready", "failed", timeout=READY_S)

    async def kill(self, *, in_flight: bool) -> EngineSnapshot:
        """SIGSEGV to the serving engine, with a request on it or none; the snapshot once it is
        back (or has failed)."""
        target = self.sup.target()
        pid = self.sup.snapshot().pid
        assert target is not None and target.on_load is not None and pid is not None
        if in_flight:
            target.on_load(1)  # the relay handed a request to the engine
        os.kill(pid, signal.SIGSEGV)
        await self.sup.wait_for_state("starting", timeout=READY_S)
        if in_flight:
            target.on_load(-1)  # the relay's 502 to that request
        return await self.ready()


@pytest.fixture
async def crashing(tmp_path: Path) -> AsyncIterator[Crashing]:
    registry.register(toy_engine)
    made = Crashing(tmp_path)
    try:
        await made.sup.start()
        yield made
    finally:
        await made.sup.stop()
        registry.unregister(toy_engine.NAME)


async def test_a_crash_with_a_request_in_flight_restarts_at_once_and_is_no_failure_to_start(
        crashing: Crashing) -> None:
    first = await crashing.ready()
    assert first.state == "ready", first.last_error
    back = await crashing.kill(in_flight=True)
    assert back.state == "ready" and back.pid != first.pid
    assert crashing.waits == [0.0]  # at once: no backoff
    assert (back.restarts, back.failures_in_a_row) == (1, 0)  # the give-up counter untouched
    ended = crashing.sup.last_ended
    assert ended is not None and ended.by_request and "a request crashed the engine" in ended.message
    assert "a request crashed the engine" in (back.last_error or "")
    target = crashing.sup.target()
    assert target is not None and target.constraints_refused is None and target.context == 1024


async def test_the_same_crash_with_nothing_in_flight_counts_toward_giving_up(crashing: Crashing) -> None:
    assert (await crashing.ready()).state == "ready"
    back = await crashing.kill(in_flight=False)
    assert back.state == "ready"
    assert crashing.waits == [2.0]  # the first restart's backoff
    assert back.failures_in_a_row == 1
    assert crashing.sup.last_ended is not None and not crashing.sup.last_ended.by_request


async def test_three_request_crashes_in_ten_minutes_refuse_constrained_decoding_and_never_give_up(
        crashing: Crashing) -> None:
    """More crashes than `max_fast_failures` (2) would allow, all caused by requests: the engine
    serves on; from the third within ten minutes its target carries the node's refusal."""
    assert (await crashing.ready()).state == "ready"
    for crash in range(1, 4):
        back = await crashing.kill(in_flight=True)
        assert back.state == "ready" and back.failures_in_a_row == 0
        target = crashing.sup.target()
        assert target is not None
        assert (target.constraints_refused is not None) is (crash == 3)
        crashing.clock.now += 240  # the third comes 480 s after the first
    assert crashing.waits == [0.0, 0.0, 0.0]
    assert target.constraints_refused is not None and "3 times within 10 minutes" in target.constraints_refused


async def test_the_refusal_holds_for_the_nodes_whole_run_whatever_engine_serves(tmp_path: Path) -> None:
    """The count is the node's (`EngineSet`), not one supervisor's: an engine started later (a
    Retry, a new assignment) carries the refusal too."""

    async def same_share(_plan: EnginePlan) -> float | None:
        return None

    registry.register(toy_engine)
    engines = EngineSet(Paths.under(tmp_path).ensure(), GpuWatch(None), on_event=lambda _snap, _why: None,
                        remeasure=same_share)
    try:
        for _ in range(3):
            engines.request_crashes.record()  # three crashes within a moment, under an earlier engine
        await engines.launch([EnginePlan(
            engine_id="e1", engine="toy", gpu_indices=(), layout="single", memory_mib=0, tier=None, args=(),
            fallbacks=(), port=18200, env={}, executable=(sys.executable, "-m", "tests.support.toy_engine"),
            model="/m", served_name="m")])
        sup = engines.get("e1")
        assert sup is not None and (await sup.wait_for_state("ready", "failed", timeout=READY_S)).state == "ready"
        [target] = engines.ready_targets()
        assert target.constraints_refused == engines.request_crashes.refusal is not None
    finally:
        await engines.stop_all()
        await engines.close()
        registry.unregister(toy_engine.NAME)
