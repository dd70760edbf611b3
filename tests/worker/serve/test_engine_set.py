"""The node's engines as one set, with real engine processes (the toy engine): started together
on free consecutive ports, stopped together (until the cards' memory is free, where NVML reads
them), the person's Retry starting again only the engine that gave up, and the app's own processes.
The GPUs are a recorded NVML source, the lowest level there is to fake."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.support import toy_engine
from worker.engines import registry
from worker.hardware import NvmlSource, ReplaySource
from worker.measure.gpu_watch import GpuWatch
from worker.plan.planner import EnginePlan
from worker.serve import process as procs
from worker.serve.engine_set import EngineSet
from worker.serve.restart_policy import RestartBackoff, SupervisorTiming
from worker.system.config import Paths

READY_S = 30.0  # a Python engine starting on a loaded 2-core machine
TOY = (sys.executable, "-m", "tests.support.toy_engine")
TIMING = SupervisorTiming(poll_s=0.05, health_interval_s=0.5, output_settle_s=0.2, max_fast_failures=1,
                          stop=procs.StopTiming(grace_s=5.0, gone_s=5.0, gpu_release_s=20.0, poll_s=0.05))
CARD: dict[str, Any] = {"device_count": 1, "memory:0": {"total_mib": 24564, "free_mib": 23000, "used_mib": 1564},
                        "compute_processes:0": [], "graphics_processes:0": []}


def toy_plan(engine_id: str, port: int = 18300, executable: tuple[str, ...] = TOY) -> EnginePlan:
    return EnginePlan(engine_id=engine_id, engine=toy_engine.NAME, gpu_indices=(), layout="single", memory_mib=0,
                      tier=None, args=("--slots", "2"), fallbacks=(), port=port, env={}, executable=executable,
                      model="/m", served_name="m")


def broken_until_fixed(flag: Path) -> tuple[str, ...]:
    """The toy engine, which exits at once while `flag` exists (a problem the person then fixes)."""
    code = (f"import os, runpy, sys; os.path.exists({str(flag)!r}) and sys.exit('toy: broken'); "
            "runpy.run_module('tests.support.toy_engine', run_name='__main__')")
    return (sys.executable, "-c", code)


async def _same_share(_plan: EnginePlan) -> float | None:
    return None


Make = Callable[[NvmlSource | None], EngineSet]


@pytest.fixture
async def make(tmp_path: Path) -> AsyncIterator[Make]:
    registry.register(toy_engine)
    made: list[EngineSet] = []

    def build(nvml: NvmlSource | None = None) -> EngineSet:
        engines = EngineSet(Paths.under(tmp_path / f"data{len(made)}").ensure(), GpuWatch(nvml),
                            on_event=lambda _snap, _why: None, remeasure=_same_share)
        engines.timing, engines.backoff = TIMING, RestartBackoff(initial_s=0.01, maximum_s=0.05)
        made.append(engines)
        return engines

    try:
        yield build
    finally:
        for engines in made:
            await engines.stop_all()
            await engines.close()
        registry.unregister(toy_engine.NAME)


async def _state(engines: EngineSet, engine_id: str, *states: str) -> str:
    sup = engines.get(engine_id)
    assert sup is not None
    snap = await sup.wait_for_state(*states, timeout=READY_S)  # type: ignore[arg-type]
    return snap.state


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def test_engines_start_together_on_free_consecutive_ports_and_stop_together(make: Make) -> None:
    engines = make(None)
    with socket.socket() as held:  # another program listens on the plan's first port
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        await engines.launch([toy_plan("e1", taken), toy_plan("e2", taken)])
        ports = [sup.plan.port for sup in (engines.get("e1"), engines.get("e2")) if sup is not None]
    assert len(ports) == 2 and taken not in ports and ports[1] == ports[0] + 1
    assert [await _state(engines, e, "ready", "failed") for e in ("e1", "e2")] == ["ready", "ready"]
    assert len(engines) == 2 and engines.serving() and engines.problem() is None
    assert len(engines.ready_targets()) == 2
    pids = {snap.pid for snap in engines.snapshots()}
    assert None not in pids and engines.own_pids() >= pids | {os.getpid()}

    assert sorted(await engines.stop_all()) == ["e1", "e2"]
    assert len(engines) == 0 and not engines.serving() and engines.ready_targets() == []
    assert all(_gone(pid) for pid in pids if pid is not None)


async def test_retry_starts_again_only_the_engine_that_gave_up(make: Make, tmp_path: Path) -> None:
    flag = tmp_path / "broken"
    flag.touch()
    engines = make(None)
    await engines.launch([toy_plan("good"), toy_plan("bad", executable=broken_until_fixed(flag))])
    assert await _state(engines, "bad", "failed") == "failed"
    assert await _state(engines, "good", "ready", "failed") == "ready"
    problem = engines.problem()
    assert problem is not None and problem.action == "retry" and "then Retry" in problem.message
    assert engines.serving()  # one engine still serves
    good, bad = engines.get("good"), engines.get("bad")

    flag.unlink()  # the person fixed it
    assert await engines.restart_failed() == ["bad"]
    assert engines.get("good") is good and engines.get("bad") is not bad  # a fresh supervisor, failures reset
    assert await _state(engines, "bad", "ready", "failed") == "ready"
    assert engines.problem() is None and len(engines.ready_targets()) == 2
    assert await engines.restart_failed() == []  # nothing gave up now


async def test_a_stop_waits_until_the_card_lets_go_of_the_engines_memory(make: Make) -> None:
    calls = dict(CARD)
    engines = make(ReplaySource(calls))
    await engines.launch([toy_plan("e1")])
    assert await _state(engines, "e1", "ready", "failed") == "ready"
    [snap] = engines.snapshots()
    calls["compute_processes:0"] = [{"pid": snap.pid, "used_mib": 20000}]  # the engine holds the card

    async def driver_hands_it_back() -> None:
        await asyncio.sleep(1.0)
        calls["compute_processes:0"] = []

    started = time.monotonic()
    release = asyncio.create_task(driver_hands_it_back())
    assert await engines.stop_all() == ["e1"]
    took = time.monotonic() - started
    await release
    assert 1.0 <= took < TIMING.stop.gpu_release_s  # not before the memory was free, and not the whole wait
