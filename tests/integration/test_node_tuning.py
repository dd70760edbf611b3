"""Auto-tune in the whole node, with the reference coordinator offering `autotune` and a real
llama-server: a bad `tune` block serves untuned and says why; a `tune` message runs a search whose
trials the relay answers with 503 `tuning`; the engine comes back with what it adopted, shown in
`status`; a pause ends the running trial at once and the search resumes later; a person's local run
that asks for tuning tunes through the local coordinator's assignment."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_node import STATE_TIMEOUT_S, free_ports, hardware_file, processes_mentioning, running_node
from tests.support.engines import LlamaServer
from tests.worker.hardware.recorded import replay
from worker.contract import protocol
from worker.contract.events import NodeSnapshot
from worker.hardware import Machine
from worker.link.local import local_tune_block
from worker.measure.tuned import Kept, TunedStore, TuneKey
from worker.node import tuning
from worker.node.node import Node
from worker.node.tuner import TunerSettings
from worker.plan.planner import Plan, plan
from worker.system.config import Paths, Settings

pytestmark = pytest.mark.integration

QUICK = TunerSettings(repeats=1, warmup=1, pairs=2, blocks=1, run_s=0.5, ready_timeout_s=60.0)  # a few seconds a trial
SEARCH_S = 240.0
ASK = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
Battery = namedtuple("Battery", "percent secsleft power_plugged")  # what psutil.sensors_battery reads


def tuned_assign(model: Path, tune: Any, base_args: list[str] | None = None) -> protocol.Assign:
    spec = protocol.EngineModel(source=str(model), weights_mib=1, tune=tune,
                                base_args=base_args or ["--ctx-size", "2048", "--threads", "1", "-np", "1"])
    return protocol.Assign(assignment_id="t-1", model=protocol.ModelSpec(name="tiny-llama", llamacpp=spec))


def tuning_is(*states: str) -> Any:
    def test(message: Any) -> bool:
        return isinstance(message, protocol.Status) and message.tuning is not None and message.tuning.state in states

    return test


async def test_a_bad_tune_block_serves_untuned_and_status_says_why(
    llama_server_bin: LlamaServer, tiny_gguf: Path, tmp_path: Path
) -> None:
    bins = {"llamacpp": str(llama_server_bin.executable)}
    bad = {"when": ["on_assign"], "space": {"--ctx-size": {"min": 512, "max": 4096}}}  # context is never tuned
    async with running_node(tmp_path, bins, fixture="no-gpu.json", assign=tuned_assign(tiny_gguf, bad)) as run:
        ready = await run.status("ready", "failed")
        assert ready.state == "ready", ready.last_error
        assert ready.tuning is not None and ready.tuning.state == "refused"
        assert ready.tuning.refused is not None and "--ctx-size" in ready.tuning.refused.reason
        assert ready.engines[0].tuned is None and ready.refused is None
        whole = await run.ask({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2})
        assert whole.error is None and whole.end is not None  # it serves
        assert run.node.snapshot().tuning is not None and run.node.snapshot().tuning.state == "refused"
        await run.coordinator.tune("t-1")  # asking does not make a refused block good
        again = await run.coordinator.wait_for(lambda m: isinstance(m, protocol.Status), after=run.mark(),
                                               timeout=STATE_TIMEOUT_S)
        assert again.tuning is not None and again.tuning.state == "refused"


def on_request(max_trials: int) -> dict[str, Any]:
    return {"when": ["on_request"], "budget": {"max_trials": max_trials, "max_minutes": 3},
            "objective": {"ladder_max": 2}, "space": {"-np": {"min": 1, "max": 4}}}


async def test_a_tune_message_runs_a_search_while_requests_get_503_tuning_then_serves_with_what_it_found(
    llama_server_bin: LlamaServer, tiny_gguf: Path, tmp_path: Path
) -> None:
    bins = {"llamacpp": str(llama_server_bin.executable)}
    async with running_node(tmp_path, bins, fixture="no-gpu.json", assign=tuned_assign(tiny_gguf, on_request(1)),
                            tuner_settings=QUICK) as run:
        ready = await run.status("ready", "failed")
        assert ready.state == "ready", ready.last_error
        assert ready.tuning == protocol.TuningStatus(state="idle")  # on_request only: nothing until asked
        mark = run.mark()
        await run.coordinator.tune("t-1")
        running = await run.coordinator.wait_for(tuning_is("running"), after=mark, timeout=STATE_TIMEOUT_S)
        assert running.tuning is not None and running.tuning.trials_max == 1
        refused = await run.ask(ASK)
        assert refused.error is not None and (refused.error.status, refused.error.code) == (503, "tuning")
        assert run.node.snapshot().tuning is not None

        report = await run.coordinator.wait_for("tune.report", after=mark, timeout=SEARCH_S)
        assert (report.assignment_id, report.engine_id) == ("t-1", "e0")
        assert report.outcome in ("adopted", "kept_baseline") and report.elapsed_s > 0
        assert report.baseline is not None
        assert report.baseline.args == ["--ctx-size", "2048", "--threads", "1", "-np", "1"]
        assert [lv.concurrency for lv in report.baseline.levels] == [1]  # one slot holds one request at a time
        assert len(report.trials) == 1 and report.trials[0].args[:2] == ["-np", "2"]
        done = await run.coordinator.wait_for(
            lambda m: tuning_is("done")(m) and m.state == "ready", after=mark, timeout=STATE_TIMEOUT_S)
        [engine] = done.engines
        if report.outcome == "adopted":
            assert report.chosen is not None and report.chosen.gain_pct is not None
            assert report.trials[0].lost is None
            assert engine.tuned is not None and engine.tuned.args == report.chosen.args
            assert " ".join(report.chosen.args) in " ".join(engine.argv)
        else:
            assert report.chosen is None and report.trials[0].lost
            assert engine.tuned is None and "-np 2" not in " ".join(engine.argv)
        served = await run.ask(ASK)
        assert served.error is None and served.end is not None


@pytest.mark.parametrize("reason", ["user", "game"])
async def test_a_pause_or_a_game_ends_the_running_trial_at_once_and_the_search_carries_on_after(
    llama_server_bin: LlamaServer, tiny_gguf: Path, tmp_path: Path, reason: str
) -> None:
    bins = {"llamacpp": str(llama_server_bin.executable)}
    async with running_node(tmp_path, bins, fixture="no-gpu.json", assign=tuned_assign(tiny_gguf, on_request(3)),
                            tuner_settings=QUICK) as run:
        ready = await run.status("ready", "failed")
        assert ready.state == "ready", ready.last_error
        mark = run.mark()
        await run.coordinator.tune("t-1")
        await run.coordinator.wait_for(tuning_is("running"), after=mark, timeout=STATE_TIMEOUT_S)
        mark = run.mark()
        run.node.pause(reason=reason, detail="Cyberpunk2077.exe" if reason == "game" else None)  # as auto-pause does
        paused = await run.coordinator.wait_for(lambda m: tuning_is("cancelled")(m) and m.state == "paused",
                                                after=mark, timeout=15.0)  # at once, not after the trial
        assert paused.engines == []
        report = await run.coordinator.wait_for("tune.report", after=mark, timeout=5.0)
        assert report.outcome == "cancelled"
        assert processes_mentioning(str(tiny_gguf)) == []  # the trial engine is gone too

        mark = run.mark()
        run.node.resume()
        again = await run.coordinator.wait_for(tuning_is("running"), after=mark, timeout=STATE_TIMEOUT_S)
        assert again.tuning is not None and again.tuning.trials_max == 3
        mark = run.mark()
        await run.coordinator.tune("t-1", "cancel")
        back = await run.coordinator.wait_for(lambda m: tuning_is("cancelled")(m) and m.state == "ready",
                                              after=mark, timeout=STATE_TIMEOUT_S)
        assert back.engines[0].tuned is None
        assert (await run.ask(ASK)).error is None


def key_of(assign: protocol.Assign) -> TuneKey:
    """What the node keeps a result of `assign` under on the recorded CPU-only machine."""
    machine = Machine.from_detect_json(replay("no-gpu.json").to_detect_json())  # as the node reads its override
    accepted = plan(machine, assign, Settings())
    assert isinstance(accepted, Plan), accepted
    return tuning.key(machine, accepted, accepted.engines[0])


def store(tmp_path: Path) -> TunedStore:
    """The node's store of tuning results (its data folder)."""
    return TunedStore(Paths.under(tmp_path / "node").ensure().data_dir)


def keep(tmp_path: Path, assign: protocol.Assign, args: tuple[str, ...], tok_s: float = 100.0) -> None:
    """A result an earlier tuning on this machine kept for this model, engine version and tier,
    adopted at `tok_s` (the tiny model serves well over a thousand here)."""
    store(tmp_path).keep(key_of(assign), Kept(args, 12.5, 1.5, tok_s))


async def test_a_kept_result_goes_after_the_tier_at_each_start_and_a_forget_drops_it(
    llama_server_bin: LlamaServer, tiny_gguf: Path, tmp_path: Path
) -> None:
    bins = {"llamacpp": str(llama_server_bin.executable)}
    assign = tuned_assign(tiny_gguf, on_request(1))
    keep(tmp_path, assign, ("-np", "2", "-c", "4096"))
    async with running_node(tmp_path, bins, fixture="no-gpu.json", assign=assign, tuner_settings=QUICK) as run:
        ready = await run.status("ready", "failed")
        assert ready.state == "ready", ready.last_error
        [engine] = ready.engines
        assert engine.tuned == protocol.Tuned(args=["-np", "2", "-c", "4096"], gain_pct=12.5, noise_pct=1.5)
        argv = " ".join(engine.argv)
        assert "--ctx-size 2048 --threads 1 -np 1 -np 2 -c 4096" in argv  # after the tier: the last one wins
        assert engine.kv_cache_tokens == 4096 and engine.max_concurrency == 2.0
        assert ready.tuning == protocol.TuningStatus(state="done")
        shown = run.node.snapshot()
        assert shown.tuning is not None and shown.tuning.chosen is not None
        assert shown.tuning.chosen.words == ("serves 2 requests at once instead of 1",)

        mark = run.mark()
        await run.coordinator.tune("t-1", "forget")
        untuned = await run.coordinator.wait_for(
            lambda m: isinstance(m, protocol.Status) and m.state == "ready" and m.engines
            and m.engines[0].tuned is None, after=mark, timeout=STATE_TIMEOUT_S)
        assert "-np 2" not in " ".join(untuned.engines[0].argv) and untuned.engines[0].max_concurrency == 1.0
        assert untuned.tuning == protocol.TuningStatus(state="idle")
        assert (await run.ask(ASK)).error is None
    assert store(tmp_path).kept(key_of(assign)) is None


async def test_kept_arguments_the_allowlist_refuses_now_are_not_used(
    llama_server_bin: LlamaServer, tiny_gguf: Path, tmp_path: Path
) -> None:
    bins = {"llamacpp": str(llama_server_bin.executable)}
    assign = tuned_assign(tiny_gguf, on_request(1))
    keep(tmp_path, assign, ("--rpc", "10.0.0.1:50052"))  # kept by another version, say: not on this one's list
    async with running_node(tmp_path, bins, fixture="no-gpu.json", assign=assign) as run:
        ready = await run.status("ready", "failed")
        assert ready.state == "ready", ready.last_error
        assert ready.engines[0].tuned is None and "--rpc" not in ready.engines[0].argv


async def test_a_kept_result_that_measures_slower_than_the_tier_did_is_dropped_at_start(
    llama_server_bin: LlamaServer, tiny_gguf: Path, tmp_path: Path
) -> None:
    bins = {"llamacpp": str(llama_server_bin.executable)}
    assign = tuned_assign(tiny_gguf, on_request(1))
    keep(tmp_path, assign, ("-np", "2", "-c", "4096"), tok_s=1e9)  # adopted on a machine far faster than this
    async with running_node(tmp_path, bins, fixture="no-gpu.json", assign=assign, tuner_settings=QUICK) as run:
        ready = await run.status("ready", "failed")
        assert ready.state == "ready", ready.last_error
        assert ready.engines[0].tuned is not None  # started with it, then measured
        untuned = await run.coordinator.wait_for(
            lambda m: isinstance(m, protocol.Status) and m.state == "ready" and m.engines
            and m.engines[0].tuned is None, timeout=STATE_TIMEOUT_S)
        assert "-np 2" not in " ".join(untuned.engines[0].argv)
        assert (await run.ask(ASK)).error is None
    assert store(tmp_path).kept(key_of(assign)) is None


async def test_on_assign_tunes_after_the_first_ready_and_then_serves(
    llama_server_bin: LlamaServer, tiny_gguf: Path, tmp_path: Path
) -> None:
    bins = {"llamacpp": str(llama_server_bin.executable)}
    tune = {**on_request(1), "when": ["on_assign"]}
    async with running_node(tmp_path, bins, fixture="no-gpu.json", assign=tuned_assign(tiny_gguf, tune),
                            tuner_settings=QUICK) as run:
        running = await run.coordinator.wait_for(tuning_is("running"), timeout=STATE_TIMEOUT_S)
        assert running.tuning is not None and running.tuning.trials_max == 1
        report = await run.coordinator.wait_for("tune.report", timeout=SEARCH_S)
        assert report.outcome in ("adopted", "kept_baseline")
        done = await run.coordinator.wait_for(lambda m: tuning_is("done")(m) and m.state == "ready",
                                              timeout=STATE_TIMEOUT_S)
        assert done.tuning is not None and done.tuning.trial == 1
        assert (await run.ask(ASK)).error is None


async def test_on_battery_a_search_waits_and_starts_once_the_computer_is_plugged_in(
    llama_server_bin: LlamaServer, tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bins = {"llamacpp": str(llama_server_bin.executable)}
    plugged = [False]
    monkeypatch.setattr("psutil.sensors_battery", lambda: Battery(57, 5400, plugged[0]))
    async with running_node(tmp_path, bins, fixture="no-gpu.json", assign=tuned_assign(tiny_gguf, on_request(1)),
                            tuner_settings=QUICK, settings=Settings(pause_on_battery=False)) as run:
        ready = await run.status("ready", "failed")  # the lender lets it serve on battery
        assert ready.state == "ready", ready.last_error
        mark = run.mark()
        await run.coordinator.tune("t-1")
        await asyncio.sleep(3.0)  # three of the node's seconds
        assert not [m for m in run.coordinator.received[mark:] if tuning_is("running")(m)]
        assert (await run.ask(ASK)).error is None  # it serves meanwhile
        plugged[0] = True
        await run.coordinator.wait_for(tuning_is("running"), after=mark, timeout=STATE_TIMEOUT_S)
        await run.coordinator.wait_for("tune.report", after=mark, timeout=SEARCH_S)


async def test_idle_tunes_after_ten_minutes_without_a_request(
    llama_server_bin: LlamaServer, tiny_gguf: Path, tmp_path: Path
) -> None:
    bins = {"llamacpp": str(llama_server_bin.executable)}
    later = [0.0]
    tune = {**on_request(1), "when": ["idle"]}
    async with running_node(tmp_path, bins, fixture="no-gpu.json", assign=tuned_assign(tiny_gguf, tune),
                            tuner_settings=QUICK, monotonic=lambda: time.monotonic() + later[0]) as run:
        ready = await run.status("ready", "failed")
        assert ready.state == "ready", ready.last_error
        assert (await run.ask(ASK)).error is None
        await asyncio.sleep(2.0)  # the node's seconds count it before the clock moves on
        mark = run.mark()
        later[0] = tuning.IDLE_S - 30.0  # nine and a half minutes on: not yet
        await asyncio.sleep(2.5)
        assert not [m for m in run.coordinator.received[mark:] if tuning_is("running")(m)]
        later[0] = tuning.IDLE_S + 1.0
        await run.coordinator.wait_for(tuning_is("running"), after=mark, timeout=STATE_TIMEOUT_S)
        await run.coordinator.wait_for("tune.report", after=mark, timeout=SEARCH_S)


async def test_an_unassign_during_a_search_ends_it_and_starts_nothing_again(
    llama_server_bin: LlamaServer, tiny_gguf: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="worker.serve.supervisor")
    bins = {"llamacpp": str(llama_server_bin.executable)}
    async with running_node(tmp_path, bins, fixture="no-gpu.json", assign=tuned_assign(tiny_gguf, on_request(3)),
                            tuner_settings=QUICK) as run:
        ready = await run.status("ready", "failed")
        assert ready.state == "ready", ready.last_error
        mark = run.mark()
        await run.coordinator.tune("t-1")
        await run.coordinator.wait_for(tuning_is("running"), after=mark, timeout=STATE_TIMEOUT_S)
        mark = run.mark()
        await run.coordinator.send(protocol.Unassign(assignment_id="t-1"))
        idle = await run.status("idle", after=mark, timeout=15.0)
        assert idle.engines == [] and idle.tuning is None
        report = await run.coordinator.wait_for("tune.report", after=mark, timeout=5.0)
        assert report.outcome == "cancelled"
        await asyncio.sleep(1.5)
        since = next(i for i, m in enumerate(run.coordinator.received) if m is idle)
        assert not [m for m in run.coordinator.received[since:] if isinstance(m, protocol.Status) and m.engines]
        stops = [r for r in caplog.records if r.getMessage().startswith("engine e0: stopped")]
        assert len(stops) == 1  # for the search; none started again for the assignment it ended, to stop
        assert processes_mentioning(str(tiny_gguf)) == []


async def test_an_engine_that_cannot_start_with_its_kept_arguments_serves_without_them_and_drops_them(
    llama_server_bin: LlamaServer, tiny_gguf: Path, tmp_path: Path
) -> None:
    bins = {"llamacpp": str(llama_server_bin.executable)}
    assign = tuned_assign(tiny_gguf, on_request(1))
    keep(tmp_path, assign, ("-ub", "1", "-b", "1"))  # this llama-server aborts at its first decode with them
    async with running_node(tmp_path, bins, fixture="no-gpu.json", assign=assign, tuner_settings=QUICK) as run:
        ready = await run.status("ready", "failed")
        assert ready.state == "ready", ready.last_error
        [engine] = ready.engines
        assert "-ub 1" not in " ".join(engine.argv) and engine.tuned is None
        assert (await run.ask(ASK)).error is None
    assert store(tmp_path).kept(key_of(assign)) is None


async def test_a_reconnect_during_a_search_lets_it_finish_and_starts_the_engine_once(
    llama_server_bin: LlamaServer, tiny_gguf: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="worker.serve.supervisor")
    bins = {"llamacpp": str(llama_server_bin.executable)}
    async with running_node(tmp_path, bins, fixture="no-gpu.json", assign=tuned_assign(tiny_gguf, on_request(2)),
                            tuner_settings=QUICK) as run:
        ready = await run.status("ready", "failed")
        assert ready.state == "ready", ready.last_error
        mark = run.mark()
        await run.coordinator.tune("t-1")
        await run.coordinator.wait_for(tuning_is("running"), after=mark, timeout=STATE_TIMEOUT_S)
        run.coordinator.drop_node()  # the node reconnects, and the coordinator sends the assignment again
        await run.coordinator.wait_for_connections(2, timeout=STATE_TIMEOUT_S)
        report = await run.coordinator.wait_for("tune.report", after=mark, timeout=SEARCH_S)
        assert report.outcome in ("adopted", "kept_baseline")
        await run.coordinator.wait_for(lambda m: tuning_is("done")(m) and m.state == "ready", after=mark,
                                       timeout=STATE_TIMEOUT_S)
        await asyncio.sleep(2.0)
        readies = [r for r in caplog.records if r.getMessage().startswith("engine e0: ready")]
        assert len(readies) == 2  # before the search, and once after it: never planned and started anew
        assert (await run.ask(ASK)).error is None


async def test_a_search_a_pause_cut_short_carries_on_after_a_reconnect_planned_the_assignment_again(
    llama_server_bin: LlamaServer, tiny_gguf: Path, tmp_path: Path
) -> None:
    bins = {"llamacpp": str(llama_server_bin.executable)}
    async with running_node(tmp_path, bins, fixture="no-gpu.json", assign=tuned_assign(tiny_gguf, on_request(3)),
                            tuner_settings=QUICK) as run:
        ready = await run.status("ready", "failed")
        assert ready.state == "ready", ready.last_error
        mark = run.mark()
        await run.coordinator.tune("t-1")
        await run.coordinator.wait_for(tuning_is("running"), after=mark, timeout=STATE_TIMEOUT_S)
        run.node.pause(reason="game", detail="Cyberpunk2077.exe")
        await run.coordinator.wait_for(lambda m: tuning_is("cancelled")(m) and m.state == "paused", after=mark,
                                       timeout=15.0)
        run.coordinator.drop_node()  # while paused: the assignment sent again is planned again, not started
        await run.coordinator.wait_for_connections(2, timeout=STATE_TIMEOUT_S)
        mark = run.mark()
        await run.status("paused", after=mark)
        run.node.resume()  # the game ended
        await run.coordinator.wait_for(tuning_is("running"), after=mark, timeout=STATE_TIMEOUT_S)
        report = await run.coordinator.wait_for("tune.report", after=mark, timeout=SEARCH_S)
        assert report.outcome in ("adopted", "kept_baseline")


async def test_a_local_run_that_asks_for_tuning_gets_the_block_and_tunes_after_the_first_ready(
    llama_server_bin: LlamaServer, tiny_gguf: Path, tmp_path: Path
) -> None:
    """`--coordinator local` with the person's `tune` block: the local coordinator's assignment
    carries it, the node reads it (the local welcome offers `autotune`), and the search runs after
    the first ready, then the engine serves again."""
    block = {**local_tune_block(minutes=3, trials=1), "objective": {"ladder_max": 2},
             "space": {"-np": {"min": 1, "max": 4}}}
    first = free_ports(2)
    node = Node(Paths.under(tmp_path / "node"), Settings(), coordinator_url="local", model=str(tiny_gguf),
                openai_port=first, first_port=first + 1, hardware_override=hardware_file(tmp_path, "no-gpu.json"),
                engine_bins={"llamacpp": str(llama_server_bin.executable)}, tuner_settings=QUICK, local_tune=block)
    seen: list[NodeSnapshot] = []
    node.subscribe(seen.append)
    task = asyncio.create_task(node.run())

    async def shown(test: Any, timeout: float) -> NodeSnapshot:
        async with asyncio.timeout(timeout):
            while not any(test(snap) for snap in seen):
                assert not task.done(), task
                await asyncio.sleep(0.05)
        return next(snap for snap in seen if test(snap))

    try:
        running = await shown(lambda snap: snap.tuning is not None and snap.tuning.state == "running", STATE_TIMEOUT_S)
        assert running.tuning is not None and running.tuning.trials_max == 1  # the person's budget
        assert running.assignment_id == "local-1"
        await shown(lambda snap: snap.tuning is not None and snap.tuning.state == "done" and snap.state == "ready",
                    SEARCH_S)
    finally:
        node.shutdown()
        async with asyncio.timeout(STATE_TIMEOUT_S):
            await task
    assert processes_mentioning(str(tmp_path)) == []
