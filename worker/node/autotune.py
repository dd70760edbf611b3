"""Auto-tune's orchestration in the node: the tuning state of the held plan, when a search runs,
the kept result laid on each engine launch and checked at each start, and what is told of it.

`tuning` decides around the search (pure), `tuner` searches; `AutoTune` holds the state between
them and carries a search out through the node's hooks (its engines lock, its engines, its relay
and its news), so that the node keeps only the order of things: it tells `AutoTune` of launches,
engine changes, messages, pauses and each second, and asks it what to show.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sqlite3
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Literal

import httpx
from pydantic import BaseModel

from worker.contract import protocol
from worker.contract.events import EngineSnapshot, Tuned, TuningSnapshot
from worker.hardware import Machine
from worker.measure.tuned import Kept, TuneKey, TunedStore
from worker.node import autopause, policy, tuning
from worker.node.tasks import LoopTasks
from worker.node.tuner import TuneReport, Tuner, TunerSettings
from worker.plan.planner import EnginePlan, Plan, running_version
from worker.serve.engine_set import EngineSet
from worker.system.config import Paths, Settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Hooks:
    """What auto-tune needs of the node: what it holds, its engines and their lock, and how it
    tells the coordinator."""

    held: Callable[[], policy.State]
    settings: Callable[[], Settings]
    lock: Callable[[], asyncio.Lock | None]  # the engines lock (made when the node runs)
    engines: EngineSet
    requests: Callable[[], int]  # requests metered so far: a new one ends `idle`
    in_flight: Callable[[], int]
    drain: Callable[[], Awaitable[object]]  # the relay drained, requests answered 503 `tuning`
    stop_engines: Callable[[Literal["draining", "tuning"]], Awaitable[None]]  # drained, then stopped
    launch: Callable[[list[EnginePlan]], Awaitable[None]]  # the node's launch (which calls `launching`)
    send: Callable[[BaseModel], Awaitable[bool]]
    send_status: Callable[[bool], Coroutine[Any, Any, bool]]  # `force`


class AutoTune:
    """The held plan's tuning: its target, the kept result, the running search and what each
    running engine runs after its tier. Loop-bound, like the node."""

    def __init__(self, paths: Paths, hooks: Hooks, tasks: LoopTasks, *, settings: TunerSettings | None,
                 monotonic: Callable[[], float]) -> None:
        """`settings`: how hard a search measures; None: as its budget allows (`TunerSettings.for_budget`)."""
        self._paths = paths
        self._hooks = hooks
        self._tasks = tasks
        self._settings = settings
        self._monotonic = monotonic
        self._machine: Machine | None = None  # known once the node detected it (the first launch)
        self._target: tuning.Target | None = None
        self._plan: Plan | None = None  # the plan the target was read from
        self._snapshot: TuningSnapshot | None = None
        self._since = 0.0  # monotonic start of the running search
        self._pending: tuning.Trigger | None = None  # due, or cut short: runs when nothing blocks it
        self._trigger: tuning.Trigger = "on_assign"  # what started the running search
        self._tuner: Tuner | None = None  # the running search, if any
        self.measuring = False  # trial engines hold the card: the relay answers 503 `tuning`
        self._launched: list[EnginePlan] = []  # the provisioned plans, without tuned arguments
        self.tuned: dict[str, Tuned] = {}  # by engine id: what each running engine runs after its tier
        self._kept: Kept | None = None  # the result tuning kept for the target on this machine
        self._recheck: set[str] = set()  # engines started with a kept result: measured again once ready
        self._unproven: set[str] = set()  # engines started with a kept result, not yet ready with it
        self._just_tuned = False  # the launch right after a search
        self._store: TunedStore | None = None  # opened when first needed
        self._requests_seen = 0
        self._last_request_at = monotonic()

    # --- what the node tells it --------------------------------------------------------------

    async def launching(self, machine: Machine | None, features: list[str],
                        engine_plans: list[EnginePlan]) -> list[EnginePlan]:
        """The plans the node is about to start, each with the arguments tuning kept for it after
        its tier; what the held plan asks to tune is read first, once per plan."""
        self._machine = machine
        self._launched = list(engine_plans)
        await self._retarget(features, engine_plans)
        return [self._with_kept(p) for p in engine_plans]

    def stopped(self, engine_id: str) -> None:
        """An engine the node stopped runs nothing any more."""
        self.tuned.pop(engine_id, None)

    def _measuring(self, spec: protocol.TuneSpec) -> TunerSettings:
        return self._settings or TunerSettings.for_budget(spec.budget.max_minutes)

    def engine_changed(self, snap: EngineSnapshot, started: bool) -> None:
        """An engine's new state (`started`: ready with a run): a kept result it fails with goes,
        one it came up with is measured again, and a search that is due starts."""
        if snap.state == "ready":
            self._unproven.discard(snap.engine_id)
        elif snap.engine_id in self._unproven and (snap.failures_in_a_row or snap.state == "failed"):
            self._unproven.discard(snap.engine_id)  # it fails to start with them: the tier alone, at once
            self._tasks.spawn(self._untune(f"engine {snap.engine_id} failed to start with them"))
        if started:
            self._check_tuned(snap)
            if snap.engine_id in self._recheck:
                self._recheck.discard(snap.engine_id)
                self._tasks.spawn(self._measure_kept(snap.engine_id))
            self._when_due()
        if snap.state == "failed" and snap.engine_id in self.tuned and self._tasks.loop:
            self._tasks.spawn(self._untune(f"engine {snap.engine_id} failed with them"))

    def on_message(self, message: protocol.Tune) -> None:
        """The coordinator's `tune`: start (where `when` has `on_request`), cancel, or forget."""
        target = self._target
        if target is None or target.assignment_id != message.assignment_id:
            log.warning("tune %s for assignment %s ignored: it is not one this node tunes",
                        message.action, message.assignment_id)
            return
        if message.action == "start":
            if "on_request" not in target.spec.when:
                log.warning("tune start ignored: the assignment's tune block does not list on_request")
                return
            self._pending = "on_request"
            self._when_due()
            return
        self.cancel(resume=False)
        if message.action == "forget":
            self._snapshot = TuningSnapshot()
            self._tasks.spawn(self._untune("the coordinator asked to forget them"))

    def unassigned(self) -> None:
        """The assignment ended: a search it cuts short starts no engine for it again."""
        self.cancel(resume=False)
        self._target = None

    def cancel(self, resume: bool = True) -> None:
        """The running search ends at once (its trial engine stopped); `resume`: it runs again
        once nothing blocks it (a pause, a game; from its journal), else not until asked."""
        if self._tuner is not None:
            self._tuner.cancel()
            self._pending = self._trigger if resume else None
        elif not resume:
            self._pending = None

    def each_second(self) -> None:
        """`idle`: ready, no request for `tuning.IDLE_S`; and a search that waits for what blocked it."""
        requests = self._hooks.requests()
        now = self._monotonic()
        if self._hooks.in_flight() or requests != self._requests_seen:
            self._requests_seen, self._last_request_at = requests, now
        target = self._target
        if target is None or self._tuner is not None or not self._hooks.engines.ready_targets():
            return
        if self._pending is not None:
            self._when_due()
        elif ("idle" in target.spec.when and now - self._last_request_at >= tuning.IDLE_S
              and self._snapshot is not None and self._snapshot.state in ("idle", "cancelled")):
            self._tasks.spawn(self._tune("idle"))

    # --- what the node asks of it ------------------------------------------------------------

    def view(self) -> TuningSnapshot | None:
        """The tuning snapshot of the held plan, a running search's time as of now."""
        if self._hooks.held().plan is not self._plan:
            return None
        if self._snapshot is None or self._snapshot.state != "running":
            return self._snapshot
        return dataclasses.replace(self._snapshot, elapsed_s=self._monotonic() - self._since)

    def own_pids(self) -> set[int]:
        """The running search's trial engine's processes (auto-pause does not take them for a game)."""
        return self._tuner.own_pids() if self._tuner is not None else set()

    # --- the target and its kept result ----------------------------------------------------

    async def _retarget(self, features: list[str], engine_plans: list[EnginePlan]) -> None:
        """What the held plan asks to tune, read once per plan (a bad block: refused, shown),
        and the result kept for it on this machine."""
        plan, before = self._hooks.held().plan, self._plan
        if plan is before or self._machine is None:
            return
        if plan is not None and before is not None and tuning.same_assignment(plan, before):
            self._plan = plan  # planned again (a reconnect): the same tuning, its state kept
            return
        self._plan, self._target, self._pending, self._kept = plan, None, None, None
        found = tuning.target(plan, features, self._machine) if plan is not None else None
        if isinstance(found, protocol.TuneRefused):
            log.warning("assignment %s: not tuning: %s", plan.assignment_id if plan else "?", found.reason)
            self._snapshot = TuningSnapshot(state="refused", refused=found.reason)
            return
        if found is None or plan is None:
            self._snapshot = None
            return
        provisioned = next((p for p in engine_plans if p.engine_id == found.engine_plan.engine_id), found.engine_plan)
        self._target = dataclasses.replace(found, engine_plan=provisioned)
        self._kept = await self._read_kept(self._target)
        chosen = self._kept_words(self._target)
        self._snapshot = TuningSnapshot(state="done", chosen=chosen) if chosen else TuningSnapshot()
        if self._kept is None and "on_assign" in found.spec.when:
            self._pending = "on_assign"

    def _key(self, target: tuning.Target) -> TuneKey:
        assert self._machine is not None and self._plan is not None
        return tuning.key(self._machine, self._plan, target.engine_plan)

    def _tuned_store(self) -> TunedStore:
        if self._store is None:
            self._store = TunedStore(self._paths.data_dir)
        return self._store

    async def _read_kept(self, target: tuning.Target) -> Kept | None:
        """The result a tuning on this machine kept for this model, engine version and tier."""
        try:
            return await asyncio.to_thread(self._tuned_store().kept, self._key(target))
        except (OSError, sqlite3.Error) as exc:
            log.error("could not read the kept tuning results (%s); serving untuned", exc)
            return None

    def _kept_words(self, target: tuning.Target) -> Tuned | None:
        kept = self._kept
        return tuning.tuned(kept.args, target.engine_plan.args, kept.gain_pct, kept.noise_pct) if kept else None

    async def _forget_kept(self, why: str) -> None:
        """The kept result dropped (the coordinator's `forget`, or arguments an engine failed with)."""
        target, self._kept = self._target, None
        if target is None:
            return
        log.info("forgetting the tuned arguments of %s: %s", target.assignment_id, why)
        try:
            await asyncio.to_thread(self._tuned_store().forget, self._key(target))
        except (OSError, sqlite3.Error) as exc:
            log.error("could not drop the kept tuning result (%s)", exc)

    def _with_kept(self, engine_plan: EnginePlan) -> EnginePlan:
        """`engine_plan` with the arguments tuning kept for its engine, where there are some."""
        self.tuned.pop(engine_plan.engine_id, None)
        self._recheck.discard(engine_plan.engine_id)
        self._unproven.discard(engine_plan.engine_id)
        target, kept = self._target, self._kept
        if target is None or kept is None or engine_plan.engine != target.engine_plan.engine:
            return engine_plan
        held = self._plan
        version = running_version(self._machine, held.engine, held.engine_model) if held and self._machine else None
        remote_code = self._hooks.settings().allow_remote_code
        tuned_plan = tuning.with_tuned(engine_plan, kept.args, allow_remote_code=remote_code, version=version)
        words = self._kept_words(target)
        if tuned_plan is None or words is None:
            return engine_plan
        self.tuned[engine_plan.engine_id] = words
        self._unproven.add(engine_plan.engine_id)
        if not self._just_tuned:
            self._recheck.add(engine_plan.engine_id)
        return tuned_plan

    def _check_tuned(self, snap: EngineSnapshot) -> None:
        """An engine that could start only without its tuned arguments (a fallback) serves without
        them: the kept result goes, and the snapshot stops claiming them."""
        kept = self.tuned.get(snap.engine_id)
        if kept is None or tuning.runs_with(snap.argv, kept.args):
            return
        del self.tuned[snap.engine_id]
        if self._snapshot is not None and self._snapshot.state == "done":
            self._snapshot = TuningSnapshot()
        self._tasks.spawn(self._forget_kept(f"engine {snap.engine_id} started only without them"))

    async def _measure_kept(self, engine_id: str) -> None:
        """The kept result checked at this start: the engine measured (requests get 503 `tuning`
        meanwhile) and the result dropped where it no longer beats what the tier served."""
        kept, target, lock = self._kept, self._target, self._hooks.lock()
        if kept is None or target is None or lock is None:
            return
        async with lock:
            sup = self._hooks.engines.get(engine_id)
            engine = sup.target() if sup is not None else None
            if engine is None or self._kept is not kept or self._hooks.held().pause is not None:
                return
            self.measuring = True
            try:
                await self._hooks.drain()
                measured = await tuning.measure_peak(engine, target.spec, sup.snapshot() if sup else None,
                                                     run_s=self._measuring(target.spec).run_s)
            except (OSError, httpx.HTTPError) as exc:
                log.warning("could not measure engine %s's tuned arguments at this start: %s", engine_id, exc)
                return
            finally:
                self.measuring = False
        log.info("engine %s with its tuned arguments: %.1f tok/s at this start (adopted at %.1f)", engine_id,
                 measured, kept.tok_s)
        if tuning.regressed(kept, measured):
            await self._untune(f"{measured:.1f} tok/s at this start is no faster than the tier served")

    async def _untune(self, why: str) -> None:
        """The kept result dropped, and engines that run with it started again without it."""
        lock = self._hooks.lock()
        assert lock is not None
        await self._forget_kept(why)
        async with lock:
            if not self.tuned:
                return
            await self._hooks.stop_engines("draining")
            held = self._hooks.held()
            if held.pause is None and not held.stopping and self._launched:
                await self._hooks.launch(self._launched)

    # --- the search ----------------------------------------------------------------------

    def _blocked(self) -> str | None:
        hours = autopause.in_serve_hours(self._hooks.settings().serve_hours, autopause.local_hour_now())
        return tuning.blocked(paused=self._hooks.held().pause is not None, in_serve_hours=hours,
                              battery=tuning.on_battery())

    def _when_due(self) -> None:
        """A search that is due (after the first ready, after an interrupted one) starts now,
        unless something blocks it: then it waits for the next ready or idle second."""
        if self._pending is not None and self._tuner is None and self._tasks.loop:
            self._tasks.spawn(self._tune(self._pending))

    async def _tune(self, trigger: tuning.Trigger) -> None:
        """One search, under the engines lock: the relay drains and answers 503 `tuning`, the
        engines stop, the tuner's trial engines measure, then the engines start again with what
        it adopted (unless a pause or a new assignment came meanwhile)."""
        target, lock = self._target, self._hooks.lock()
        if target is None or self._tuner is not None or lock is None or self._machine is None:
            return
        if why := self._blocked():
            log.info("tuning waits: %s", why)
            self._pending = trigger
            return
        async with lock:
            held = self._hooks.held()
            if self._target is not target or self._tuner is not None or held.pause or held.stopping:
                return
            self._pending, self._trigger = None, trigger
            self._tuner = Tuner(target.engine_plan, target.spec, self._machine, paths=self._paths,
                                store=self._tuned_store(), key=self._key(target), progress=self._on_progress,
                                settings=self._measuring(target.spec))
            self.measuring, self._since = True, self._monotonic()
            self._snapshot = tuning.progress(self._snapshot or TuningSnapshot(), 0, self._tuner.trials_max, 0.0)
            log.info("tuning %s (%s): up to %d trials in %.0f minutes", target.assignment_id, trigger,
                     self._tuner.trials_max, target.spec.budget.max_minutes)
            report: TuneReport | None = None
            try:
                await self._hooks.send_status(True)
                await self._hooks.stop_engines("tuning")
                report = await self._tuner.run()
            except Exception:
                log.exception("tuning %s failed", target.assignment_id)
            finally:
                self._tuner, self.measuring = None, False
            await self._ended(target, report)
            held = self._hooks.held()
            if self._target is target and held.pause is None and not held.stopping:
                self._just_tuned = True  # what it adopted was measured moments ago: no check at this start
                try:
                    await self._hooks.launch(self._launched)
                finally:
                    self._just_tuned = False

    def _on_progress(self, trial: int, trials_max: int) -> None:
        """The tuner's trial count: shown, and told to the coordinator."""
        if self._snapshot is not None:
            self._snapshot = tuning.progress(self._snapshot, trial, trials_max, self._monotonic() - self._since)
        self._tasks.spawn(self._hooks.send_status(False))

    async def _ended(self, target: tuning.Target, report: TuneReport | None) -> None:
        """What a search found: shown, kept where it adopted (the tuner kept it), and reported."""
        baseline = target.engine_plan.args
        self._snapshot = tuning.ended(report, target.spec.budget.max_trials, baseline)
        if report is not None and report.outcome == "adopted":
            self._kept = await self._read_kept(target)  # as the tuner kept it
        chosen = self._snapshot.chosen
        log.info("tuning %s ended: %s%s", target.assignment_id, report.outcome if report else "failed",
                 f", {' '.join(chosen.args)} ({chosen.gain_pct:+.1f} %)" if chosen else "")
        await self._hooks.send(tuning.report_message(target.assignment_id, target.engine_plan.engine_id, baseline,
                                                     report))
        await self._hooks.send_status(True)
