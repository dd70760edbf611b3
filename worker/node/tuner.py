"""The tuning runner: trial engines through the app's own supervisor, measured under load, each
candidate checked against the baseline before its speed counts, and the best one adopted only
if it still wins re-measured interleaved with the baseline.

Order (the contract's "Tuning"): the baseline first; then the candidates `plan.tuning.candidates`
draws (seeds, then steps), each started alone with the baseline's arguments and its own after
them, no fallback: a start that runs out of memory is `oom_start` and rules out every config at or
above it; one that starts is measured over the ladder, its log read for the engine's traps, and
checked (`measure.gates`); the fastest that passes and beats the baseline by `min_gain_pct` is
measured again in blocks interleaved with the baseline (`measure.adoption.decide`).

Bounded: at most `max_trials` candidates and `max_minutes` (candidates stop early enough for the
re-measure to fit). `cancel()` (a game, a pause, the person) ends the trial at once, its engine
stopped; each finished trial is in the journal (`measure.tuned`), so the next run resumes after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from worker.contract import protocol
from worker.contract.events import EngineSnapshot
from worker.hardware.model import Machine
from worker.measure import adoption, gates
from worker.measure.load import (Endpoint, LevelFigures, Measurement, PromptSet, fitting, kv_slots, ladder, measure,
                                 shipped_prompts)
from worker.measure.tuned import Kept, TrialRecord, TunedStore, TuneKey
from worker.plan.planner import EnginePlan
from worker.plan.tuning import OomFrontier, Space, build_space, candidates
from worker.serve.restart_policy import SupervisorTiming
from worker.serve.process import GpuReleased
from worker.serve.supervisor import EngineSupervisor, Remeasure
from worker.system.config import Paths
from worker.system.ports import free_first_port

__all__ = ["TrialRecord", "TuneReport", "Tuner", "TunerSettings"]

log = logging.getLogger(__name__)

OOM_ENDS = frozenset({"oom", "context"})  # a start that did not fit: the frontier learns from it
LOG_TAIL_BYTES = 4 << 20  # the most of a trial's log read for trap lines
MIN_TOK_S = 1e-3  # a run that produced nothing, as a positive figure for the adoption rule
BUDGET_MINUTES = 15.0  # the budget `TunerSettings`' defaults are for
MIN_BLOCKS = 3  # engine starts per config in a re-measure: two cannot tell a start's shift from a gain
MAX_PAIRS = 24
PASSED = "passed"  # the journal's mark of a candidate that passed its checks (its fate decided at the end)


@dataclass(frozen=True)
class TunerSettings:
    """How hard one tuning measures (tests and small machines shrink it)."""

    repeats: int = 3  # runs per level while screening a candidate (their median counts)
    warmup: int | None = None  # warm-up requests per start; None: one per load prompt
    pairs: int = adoption.REPEATS  # interleaved baseline/candidate runs of the re-measure
    blocks: int = 4  # engine starts per config during the re-measure (pairs are split among them)
    run_s: float = 3.0  # a run of one level lasts at least this long
    ready_timeout_s: float = 1800.0

    @classmethod
    def for_budget(cls, minutes: float) -> TunerSettings:
        """How hard a tuning of `minutes` measures, the defaults at `BUDGET_MINUTES`: a longer
        budget buys more pairs and blocks in the re-measure and longer runs (a decision less at
        the mercy of one start or one busy second), a shorter one cheaper trials, so that some
        candidates still fit; never under `MIN_BLOCKS` blocks, which a start's shift needs."""
        scale = minutes / BUDGET_MINUTES
        pairs = min(MAX_PAIRS, max(2 * MIN_BLOCKS, round(adoption.REPEATS * scale)))
        repeats = 1 if scale < 1 / 3 else 2 if scale < 2 / 3 else 3
        return cls(repeats=repeats, pairs=pairs, blocks=max(MIN_BLOCKS, pairs // 3),
                   run_s=round(min(2 * cls.run_s, max(cls.run_s / 2, cls.run_s * scale ** 0.5)), 2))


@dataclass(frozen=True)
class TuneReport:
    outcome: Literal["adopted", "kept_baseline", "cancelled", "failed"]
    baseline: Measurement
    chosen: tuple[str, ...] | None
    gain_pct: float | None
    noise_pct: float | None
    elapsed_s: float
    trials: tuple[TrialRecord, ...]


class TrialFailed(Exception):
    """A trial engine did not become ready: why (`oom_start` or `lost:failed`)."""

    def __init__(self, result: str, message: str) -> None:
        super().__init__(message)
        self.result = result


class Tuner:
    """One tuning of `plan`'s engine on this machine; `run()` once."""

    def __init__(self, plan: EnginePlan, spec: protocol.TuneSpec | None, machine: Machine, *, paths: Paths,
                 store: TunedStore | None = None, key: TuneKey | None = None,
                 progress: Callable[[int, int], None] = lambda trial, trials_max: None,
                 prompts: PromptSet | None = None, settings: TunerSettings = TunerSettings(),
                 timing: SupervisorTiming | None = None, base_env: Mapping[str, str] | None = None,
                 gpu_released: GpuReleased | None = None, remeasure: Remeasure | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`base_env`, `gpu_released` and `remeasure` go to each trial's supervisor as the engine
        set gives them (the environment engines start from; whether the cards' memory is free
        after a stop, so the next trial never meets the last one's memory; vLLM's fresh share)."""
        self._plan = plan
        self._spec = spec or protocol.TuneSpec()
        self._machine = machine
        self._paths = paths
        self._store = store
        self._key = key
        self.progress = progress
        self._prompts = prompts or shipped_prompts()
        self._settings = settings
        self._timing = timing or dataclasses.replace(SupervisorTiming(), ready_timeout_s=settings.ready_timeout_s)
        self._base_env = base_env
        self._gpu_released = gpu_released
        self._remeasure = remeasure
        self._clock = clock
        self._task: asyncio.Task[TuneReport] | None = None
        self._trial: EngineSupervisor | None = None
        self._cancelled = False

    @property
    def trials_max(self) -> int:
        return self._spec.budget.max_trials

    def cancel(self) -> None:
        """End the running trial at once (its engine stopped); `run()` returns `cancelled`."""
        self._cancelled = True
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def own_pids(self) -> set[int]:
        """The trial engine's process (the app's own, for the foreign-GPU-process check)."""
        pid = self._trial.snapshot().pid if self._trial is not None else None
        return {pid} if pid is not None else set()

    async def run(self) -> TuneReport:
        """The whole tuning; raises `protocol.TuneRefused` for a space that may not be tuned."""
        space = build_space(self._plan.engine, self._spec, self._plan.args, self._machine)
        search = _Search(self, space, self._clock())
        self._task = asyncio.create_task(search.run())
        try:
            return await asyncio.shield(self._task)
        except asyncio.CancelledError:
            if not self._task.done():  # the caller's own task was cancelled: end the search too
                self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            raise

    # --- one engine, measured ----------------------------------------------------------------

    async def measured(self, tuned: Sequence[str], *, levels: Sequence[int], repeats: int, beside: bool = True,
                       greedy: bool = True) -> tuple[Measurement, tuple[str, ...], EngineSnapshot]:
        """Start the engine with `tuned` after the baseline's arguments, measure it, stop it:
        (its figures, the traps its log showed, its snapshot when ready). Raises `TrialFailed`."""
        plan = dataclasses.replace(self._plan, engine_id=f"{self._plan.engine_id}-tune",
                                   args=(*self._plan.args, *tuned), fallbacks=(),
                                   port=free_first_port(self._plan.port, 1))
        changed = asyncio.Event()
        sup = EngineSupervisor(plan, paths=self._paths, timing=self._timing, base_env=self._base_env,
                               gpu_released=self._gpu_released, remeasure=self._remeasure,
                               on_event=lambda snap, reason: changed.set())
        self._trial = sup
        try:
            await sup.start()
            snap = await _ready(sup, changed, self._timing.ready_timeout_s)
            target = sup.target()
            assert target is not None
            endpoint = Endpoint(target.base_url, target.api_key, target.served_model_name, target.socket_path)
            warmup = self._settings.warmup if self._settings.warmup is not None else len(self._prompts.load)
            prompts = fitting(self._prompts, snap.context.servable)  # a prompt past the context fails, whatever the arguments
            prompts = prompts if greedy else dataclasses.replace(prompts, probes=())
            figures = await measure(endpoint, levels, repeats=repeats, warmup=warmup, prompts=prompts,
                                    long_prefill_beside=beside, run_s=self._settings.run_s)
            figures = dataclasses.replace(figures, kv_tokens=sup.snapshot().kv_cache_tokens)
            return figures, _traps_in(self._plan, sup.snapshot().log_path), snap
        finally:
            self._trial = None
            await asyncio.shield(sup.stop("tuning trial ended"))


async def _ready(sup: EngineSupervisor, changed: asyncio.Event, timeout_s: float) -> EngineSnapshot:
    """The snapshot once ready; `TrialFailed` once an attempt ended (no retries in a trial)."""
    async with asyncio.timeout(timeout_s):
        while True:
            snap = sup.snapshot()
            if snap.state in ("ready", "degraded"):
                return snap
            ended = sup.last_ended
            if snap.state == "failed" or ended is not None:
                kind = ended.kind if ended is not None else "crashed"
                result = "oom_start" if kind in OOM_ENDS else "lost:failed"
                raise TrialFailed(result, ended.message if ended is not None else snap.last_error or "")
            changed.clear()
            await changed.wait()


def _traps_in(plan: EnginePlan, log_path: str | None) -> tuple[str, ...]:
    """The reason keys of the engine's traps its log shows (its last `LOG_TAIL_BYTES`)."""
    if log_path is None:
        return ()
    try:
        with open(log_path, "rb") as file:
            file.seek(0, 2)
            file.seek(max(0, file.tell() - LOG_TAIL_BYTES))
            text = file.read().decode("utf-8", "replace")
    except OSError:
        return ()
    found: list[str] = []
    for line in text.splitlines():
        key = plan.adapter.TUNING.trap(line)
        if key is not None and key not in found:
            found.append(key)
    return tuple(found)


def _rounded(blocks: Sequence[Sequence[float]]) -> list[list[float]]:
    return [[round(run, 1) for run in block] for block in blocks]


def peak(levels: Sequence[LevelFigures]) -> LevelFigures | None:
    """The level with the most aggregate tok/s (where the config serves best)."""
    return max(levels, key=lambda lv: lv.aggregate_tok_s, default=None)


class _Search:
    """One run's state: the trials so far, the budget, the best candidate."""

    def __init__(self, tuner: Tuner, space: Space, started: float) -> None:
        self.t = tuner
        self.space = space
        self.started = started
        self.trials: list[TrialRecord] = []
        self.frontier = OomFrontier(tuner._plan.engine, tuner._machine)
        spec = tuner._spec
        ladder_max = spec.objective.ladder_max if spec.objective is not None else protocol.TuneObjective().ladder_max
        self.ladder = ladder(ladder_max)
        self.deadline = started + spec.budget.max_minutes * 60
        self.baseline: Measurement | None = None
        self.trial_s = 0.0  # one start and one run of a level, as the baseline took

    def elapsed(self) -> float:
        return self.t._clock() - self.started

    async def run(self) -> TuneReport:
        t = self.t
        journal = t._store.journal(t._key) if t._store is not None and t._key is not None else []
        try:
            if t._cancelled:
                raise asyncio.CancelledError
            began = t._clock()
            self.baseline, _, _ = await t.measured((), levels=self.ladder, repeats=t._settings.repeats)
            self.trial_s = (t._clock() - began) / max(1, len(self.ladder) * t._settings.repeats)
            self.ladder = ladder(self.ladder[-1], kv_slots(self.baseline.kv_tokens, t._prompts))
            self.baseline = dataclasses.replace(self.baseline, levels=tuple(
                level for level in self.baseline.levels if level.concurrency in self.ladder))
            self.trials.append(TrialRecord((), "baseline", self.baseline.levels))
            if failed := sum(level.failed for level in self.baseline.levels):
                log.warning("tuning: the baseline failed %d requests (a prompt longer than its context?): "
                            "nothing to compare candidates with", failed)
                return self._report("failed")
            await self._screen(journal)
            return await self._adopt()
        except asyncio.CancelledError:
            return self._report("cancelled")
        except TrialFailed as exc:  # the baseline itself did not start
            log.warning("tuning: the baseline did not start: %s", exc)
            return self._report("failed")

    async def _screen(self, journal: Sequence[TrialRecord]) -> None:
        t = self.t
        done = {record.args: record for record in journal}
        for record in journal:
            if record.result == "oom_start":
                self.frontier.note_oom([*t._plan.args, *record.args])
        for tuned in candidates(self.space, t._plan.args, t._machine, self.frontier):
            if len(self.trials) - 1 >= t.trials_max or not self._time_for_another():
                return
            t.progress(len(self.trials), t.trials_max)
            record = done.get(tuned) or await self._trial(tuned)
            if tuned not in done and t._store is not None and t._key is not None:
                t._store.note(t._key, record)
            if record.result == "oom_start":
                self.frontier.note_oom([*t._plan.args, *tuned])
            self.trials.append(record)

    def _time_for_another(self) -> bool:
        """Room for one more candidate and the re-measure after it."""
        s = self.t._settings
        one = self.trial_s * len(self.ladder) * s.repeats
        remeasure = self.trial_s * 2 * s.pairs
        return self.t._clock() + one + remeasure <= self.deadline

    async def _trial(self, tuned: tuple[str, ...]) -> TrialRecord:
        assert self.baseline is not None
        try:
            figures, traps, _ = await self.t.measured(tuned, levels=self.ladder, repeats=self.t._settings.repeats)
        except TrialFailed as exc:
            log.info("tuning: %s did not start (%s): %s", " ".join(tuned), exc.result, str(exc)[:200])
            return TrialRecord(tuned, exc.result, ())
        lost = gates.check(self.baseline, figures, self.t._spec.objective, traps)
        log.info("tuning: %s → %s", " ".join(tuned), lost or f"passed, {self._score(figures.levels):.1f} tok/s")
        return TrialRecord(tuned, f"lost:{lost}" if lost else PASSED, figures.levels)

    def _score(self, levels: Sequence[LevelFigures]) -> float:
        best = peak(levels)
        return best.aggregate_tok_s if best is not None else 0.0

    async def _adopt(self) -> TuneReport:
        """The fastest candidate that passed, re-measured interleaved with the baseline."""
        assert self.baseline is not None
        t = self.t
        floor = self._score(self.baseline.levels) * (1 + t._spec.min_gain_pct / 100)
        passed = [r for r in self.trials if r.result == PASSED]
        best = max(passed, key=lambda r: self._score(r.levels), default=None)
        if best is None or self._score(best.levels) < floor:
            self._settle(best, None)
            return self._finished("kept_baseline")
        t.progress(len(self.trials) - 1, t.trials_max)
        at = peak(best.levels)
        assert at is not None
        before, after, decision = await self._interleaved(best.args, at.concurrency)
        log.info("tuning: %s re-measured in %d blocks: %+.1f %% (noise %.1f %%) → %s; baseline %s, candidate %s",
                 " ".join(best.args), len(before), decision.gain_pct, decision.noise_pct,
                 "adopted" if decision.adopted else decision.reason, _rounded(before), _rounded(after))
        self._settle(best, decision)
        if not decision.adopted:
            return self._finished("kept_baseline", decision)
        if t._store is not None and t._key is not None:
            runs = [run for block in after for run in block]
            t._store.keep(t._key, Kept(best.args, decision.gain_pct, decision.noise_pct, statistics.median(runs)))
        return self._finished("adopted", decision, best.args)

    async def _interleaved(self, tuned: tuple[str, ...], concurrency: int
                           ) -> tuple[list[list[float]], list[list[float]], adoption.Decision]:
        """`pairs` runs of each at `concurrency`, in blocks: baseline then candidate, each block a
        fresh start of each, so slow drift falls on both alike and a start's shift shows as the
        blocks' disagreement. While that leaves the result `unstable` and the budget has room,
        one more block (up to twice as many) tells a gain from a lucky start."""
        s = self.t._settings
        blocks = max(1, min(s.blocks, s.pairs))
        sizes = [s.pairs // blocks + (1 if b < s.pairs % blocks else 0) for b in range(blocks)]
        before: list[list[float]] = []
        after: list[list[float]] = []
        while True:
            size = sizes[len(before) % len(sizes)]
            for tuned_args, out in (((), before), (tuned, after)):
                out.append(await self._runs(tuned_args, concurrency, size))
            if len(before) < len(sizes):
                continue
            decision = adoption.decide_blocks(before, after, self.t._spec.min_gain_pct)
            if (decision.reason != adoption.UNSTABLE or len(before) >= 2 * len(sizes)
                    or not self._time_for_block(size)):
                return before, after, decision
            log.info("tuning: %s unstable after %d blocks (%+.1f %%, noise %.1f %%): one more",
                     " ".join(tuned), len(before), decision.gain_pct, decision.noise_pct)

    def _time_for_block(self, size: int) -> bool:
        """Room for one more block of `size` runs of each config within the budget."""
        return self.t._clock() + self.trial_s * 2 * (size + 1) <= self.deadline

    async def _runs(self, tuned: Sequence[str], concurrency: int, count: int) -> list[float]:
        """`count` runs at `concurrency` on one start of the engine: each run's aggregate tok/s."""
        m, _, _ = await self.t.measured(tuned, levels=[concurrency] * count, repeats=1, beside=False, greedy=False)
        return [max(level.aggregate_tok_s, MIN_TOK_S) for level in m.levels]

    def _settle(self, best: TrialRecord | None, decision: adoption.Decision | None) -> None:
        """Each trial's final result: the adopted one, the re-measured one that lost, the rest."""
        for i, record in enumerate(self.trials):
            if record.result != PASSED:
                continue
            if record is best and decision is not None:
                result = "adopted" if decision.adopted else f"lost:{decision.reason}"
            else:
                result = f"lost:{adoption.BELOW_THRESHOLD}"
            self.trials[i] = dataclasses.replace(record, result=result)

    def _finished(self, outcome: Literal["adopted", "kept_baseline"], decision: adoption.Decision | None = None,
                  chosen: tuple[str, ...] | None = None) -> TuneReport:
        if self.t._store is not None and self.t._key is not None:
            self.t._store.finish(self.t._key)
        return self._report(outcome, decision, chosen)

    def _report(self, outcome: Literal["adopted", "kept_baseline", "cancelled", "failed"],
                decision: adoption.Decision | None = None, chosen: tuple[str, ...] | None = None) -> TuneReport:
        baseline = self.baseline or Measurement((), (), None)
        return TuneReport(outcome, baseline, chosen, decision.gain_pct if decision else None,
                          decision.noise_pct if decision else None, self.elapsed(), tuple(self.trials))
