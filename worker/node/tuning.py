"""Auto-tune in the node: which engine of an assignment is tuned, when it may be, what the node
shows and reports of it, and the measured arguments laid after an engine's tier.

The search itself is `worker.node.tuner`'s; this module decides around it, pure but for
`on_battery` (psutil), and `worker.node.autotune` carries its decisions out in the node. The
rules (the contract's "Tuning (optional)"):
- only where the coordinator offers `autotune` and the plan's engine block has an enabled `tune`
  block; a bad block (or a space naming what is never tuned) refuses the tuning only: the
  assignment serves untuned and `status.tuning.refused` says why;
- `when` lists what may start it: `on_assign` (after the first ready), `idle` (ready and no request
  for `IDLE_S`), `on_request` (a `tune` message);
- never while paused, outside serve hours or on battery (a game pauses the node, and a pause ends
  the running trial);
- tuned arguments go after the tier and are checked against the allowlist again; the tier's own
  arguments come first among the fallbacks, so an engine that cannot start with them starts
  without them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import psutil

from worker.contract import protocol
from worker.contract.events import EngineSnapshot, Tuned, TuningSnapshot, TuningState
from worker.hardware import Machine
from worker.node.view import tuned_words
from worker.measure.load import Endpoint, LevelFigures, fitting, ladder, measure, shipped_prompts
from worker.measure.tuned import Kept, TuneKey, machine_key
from worker.plan.planner import EnginePlan, Plan, running_version
from worker.plan.tuning import build_space
from worker.relay.forward import EngineTarget

if TYPE_CHECKING:
    from worker.node.tuner import TuneReport

log = logging.getLogger(__name__)

IDLE_S = 600.0  # `idle`: ready with no request for this long
Trigger = Literal["on_assign", "idle", "on_request"]


@dataclass(frozen=True)
class Target:
    """What one tuning measures: the plan's first engine, with the block's spec."""

    assignment_id: str
    engine_plan: EnginePlan
    spec: protocol.TuneSpec


def target(plan: Plan, features: Collection[str], machine: Machine) -> Target | protocol.TuneRefused | None:
    """The tuning `plan` asks for; its refusal where the block is bad; None where there is none
    (no block, a disabled one, or a coordinator that does not offer `autotune`)."""
    if protocol.AUTOTUNE_FEATURE not in features or not plan.engines:
        return None
    spec = protocol.parse_tune(plan.engine_model.tune)
    if spec is None or isinstance(spec, protocol.TuneRefused):
        return spec
    if not spec.enabled:
        return None
    first = plan.engines[0]
    try:
        build_space(plan.engine, spec, first.args, machine)
    except protocol.TuneRefused as exc:
        return exc
    return Target(plan.assignment_id, first, spec)


def key(machine: Machine, plan: Plan, engine_plan: EnginePlan) -> TuneKey:
    """What a kept result holds for: this machine, the model (its source and revision), the engine
    version and the tier's arguments."""
    source = plan.engine_model.source + (f"@{plan.engine_model.revision}" if plan.engine_model.revision else "")
    return TuneKey(machine=machine_key(machine), model=source, engine=plan.engine,
                   version=running_version(machine, plan.engine, plan.engine_model) or "",
                   baseline=tuple(engine_plan.args))


def same_assignment(plan: Plan, before: Plan) -> bool:
    """`plan` is `before` planned again (the same assignment, engine block and engines): its
    tuning, kept result and what is due stay."""
    return (plan.assignment_id, plan.engine, plan.engine_model, plan.engines) == (
        before.assignment_id, before.engine, before.engine_model, before.engines)


def blocked(*, paused: bool, in_serve_hours: bool, battery: bool) -> str | None:
    """Why the node may not tune now, in words for the log; None: it may."""
    if paused:
        return "the node is paused"
    if not in_serve_hours:
        return "it is outside serve hours"
    if battery:
        return "the computer runs on battery"
    return None


def on_battery() -> bool:
    """The computer runs on its battery (a desktop has none: False)."""
    try:
        battery = psutil.sensors_battery()
    except (OSError, RuntimeError, AttributeError):  # a platform psutil cannot read
        return False
    return battery is not None and battery.power_plugged is False


def with_tuned(engine_plan: EnginePlan, tuned: Sequence[str], *, allow_remote_code: bool,
               version: str | None = None) -> EnginePlan | None:
    """`engine_plan` with `tuned` after its tier (the last occurrence wins), its own arguments the
    first fallback; None where the allowlist (for the engine `version` the plan runs) refuses the
    whole: the tier then serves alone."""
    args = tuple(engine_plan.args) + tuple(tuned)
    problem = engine_plan.adapter.ALLOWED_ARGS.check(args, allow_remote_code=allow_remote_code,
                                                     where="the tuned arguments", version=version)
    if problem is not None:
        log.warning("engine %s: not using its tuned arguments: %s", engine_plan.engine_id, problem)
        return None
    fallbacks = ((engine_plan.tier, tuple(engine_plan.args)),) + tuple(engine_plan.fallbacks)
    return dataclasses.replace(engine_plan, args=args, fallbacks=fallbacks)


async def measure_peak(engine: EngineTarget, spec: protocol.TuneSpec, snap: EngineSnapshot | None, *,
                       run_s: float) -> float:
    """A ready engine's best aggregate tok/s over the objective's ladder (as far as its KV holds
    requests), on the shipped prompts, warm-up excluded: a start's check of a kept result."""
    ladder_max = (spec.objective or protocol.TuneObjective()).ladder_max
    slots = int(snap.max_concurrency) if snap and snap.max_concurrency and snap.max_concurrency >= 1 else None
    endpoint = Endpoint(engine.base_url, engine.api_key, engine.served_model_name, engine.socket_path)
    prompts = dataclasses.replace(fitting(shipped_prompts(), snap.context.servable if snap else None), probes=())
    figures = await measure(endpoint, ladder(ladder_max, slots), repeats=1, warmup=1, prompts=prompts,
                            long_prefill_beside=False, run_s=run_s)
    return figures.peak_tok_s


def regressed(kept: Kept, measured_tok_s: float) -> bool:
    """A kept result that no longer beats the tier: the aggregate measured at a start is below what
    the tier's arguments served when it was adopted (its figure less the gain), less twice the
    spread it was measured with."""
    tier_tok_s = kept.tok_s / (1 + kept.gain_pct / 100)
    return measured_tok_s < tier_tok_s * (1 - 2 * kept.noise_pct / 100)


def runs_with(argv: Sequence[str], tuned: Sequence[str]) -> bool:
    """Whether an engine's command line has `tuned` in it, in order: not where the supervisor fell
    back to the tier's arguments alone."""
    if not tuned:
        return True
    want, have = tuple(tuned), tuple(argv)
    first = want[0]
    return any(have[i:i + len(want)] == want for i, token in enumerate(have) if token == first)


def tuned(args: Sequence[str], baseline: Sequence[str], gain_pct: float, noise_pct: float) -> Tuned:
    """What the snapshot shows of adopted arguments: them, their gain, and what they do in words."""
    return Tuned(args=tuple(args), gain_pct=round(gain_pct, 1), noise_pct=round(noise_pct, 1),
                 words=tuned_words(args, baseline))


def progress(snapshot: TuningSnapshot, trial: int, trials_max: int, elapsed_s: float) -> TuningSnapshot:
    """A running search's snapshot at `trial` of `trials_max`."""
    return dataclasses.replace(snapshot, state="running", trial=trial, trials_max=trials_max, elapsed_s=elapsed_s,
                               refused=None)


def report_message(assignment_id: str, engine_id: str, baseline_args: Sequence[str],
                   report: TuneReport | None) -> protocol.TuneReport:
    """The `tune.report` the coordinator gets: each trial's arguments, figures per level and why
    it lost; within the contract's 64 KiB (no prompts or answers are in a report). None: the
    search failed before it could report."""
    if report is None:
        return protocol.TuneReport(assignment_id=assignment_id, engine_id=engine_id, outcome="failed")
    adopted = report.outcome == "adopted" and report.chosen is not None
    chosen_levels = next((t.levels for t in report.trials if t.result == "adopted"), ())
    return protocol.TuneReport(
        assignment_id=assignment_id,
        engine_id=engine_id,
        outcome=report.outcome,
        baseline=protocol.TuneFigures(args=list(baseline_args), levels=_levels(report.baseline.levels)),
        chosen=protocol.TuneFigures(args=list(report.chosen or ()), levels=_levels(chosen_levels),
                                    gain_pct=report.gain_pct, noise_pct=report.noise_pct) if adopted else None,
        trials=[protocol.TuneTrial(args=list(t.args), levels=_levels(t.levels), lost=_lost(t.result))
                for t in report.trials if t.result != "baseline"],
        elapsed_s=round(report.elapsed_s, 1),
    ).fitted()


def _lost(result: str) -> str | None:
    """A trial's result → the contract's reason it lost (None: it won)."""
    if result == "adopted":
        return None
    return result.removeprefix("lost:")


def _levels(levels: Sequence[LevelFigures]) -> list[protocol.TuneLevel]:
    return [protocol.TuneLevel(concurrency=f.concurrency, aggregate_tok_s=round(f.aggregate_tok_s, 2),
                               per_request_tok_s=round(f.per_request_tok_s, 2), ttft_p90_ms=round(f.ttft_p90_ms, 1),
                               failed=f.failed) for f in levels]


_ENDED: dict[str, TuningState] = {"adopted": "done", "kept_baseline": "done", "cancelled": "cancelled",
                                  "failed": "failed"}


def ended(report: TuneReport | None, trials_max: int, baseline: Sequence[str]) -> TuningSnapshot:
    """The snapshot once a search ended (None: it failed before it could report)."""
    if report is None:
        return TuningSnapshot(state="failed", trials_max=trials_max)
    state = _ENDED[report.outcome]
    chosen = None
    if report.outcome == "adopted" and report.chosen is not None:
        chosen = tuned(report.chosen, baseline, report.gain_pct or 0.0, report.noise_pct or 0.0)
    tried = sum(1 for t in report.trials if t.result != "baseline")
    return TuningSnapshot(state=state, trial=tried, trials_max=trials_max,
                          elapsed_s=report.elapsed_s, best_gain_pct=report.gain_pct, chosen=chosen)
