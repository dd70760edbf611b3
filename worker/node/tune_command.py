"""`gpu-provider tune`: the tuner on this machine with no coordinator.

The model is assigned as local mode assigns it (`link.local.sizing`), with `--base-args` as the
engine block's base arguments and no tiers (the baseline it must beat, as base args plus tier
would be), planned and provisioned as the node does (model download, engine install), then
tuned under the data folder's lock: nothing else may start engines from the folder meanwhile.

`--space` is a coordinator's `tune.space`, checked by the contract's own parser (the same bounds
and refusals), and `--minutes` sets how hard each measurement works (`TunerSettings.for_budget`).
"""

from __future__ import annotations

import asyncio
import json
import shlex
import sys
from collections.abc import Mapping
from typing import Any

from worker.contract import protocol
from worker.contract.events import DownloadProgress
from worker.engines import registry
from worker.engines.finding import Finder
from worker.hardware import PynvmlSource, detect
from worker.hardware.nvml import find_wsl_nvml_library
from worker.hardware.model import Machine
from worker.link.local.sizing import LocalModelError, local_assignment
from worker.measure.gpu_watch import GpuWatch
from worker.measure.tuned import TunedStore, TuneKey, machine_key
from worker.node.tuner import TuneReport, Tuner, TunerSettings
from worker.node.tuning import report_message
from worker.plan.planner import EnginePlan, Plan, Refusal, plan
from worker.provision.assignment import provision
from worker.provision.errors import ProvisionError
from worker.system.config import Paths, Settings
from worker.system.datalock import DataFolderLock

MAX_SPACE_CHARS = 64 * 1024  # a space's JSON text (a coordinator's whole tune block fits in its frame)


class TuneInputError(Exception):
    """The model, engine or arguments given cannot be tuned here; the message says why."""


def tune_spec(minutes: float, trials: int, space: str | None) -> protocol.TuneSpec:
    """The tune block `--minutes`, `--trials` and `--space` make, checked as a coordinator's is:
    `protocol.TuneRefused` (or `TuneInputError` for text that is no JSON object) says why not."""
    raw: dict[str, Any] = {"budget": {"max_minutes": minutes, "max_trials": trials}}
    if space is not None:
        if len(space) > MAX_SPACE_CHARS:
            raise TuneInputError(f"--space is over {MAX_SPACE_CHARS} characters")
        try:
            raw["space"] = json.loads(space)
        except (ValueError, RecursionError) as exc:
            raise TuneInputError(f"--space is not JSON: {str(exc)[:200]}") from None
        if not isinstance(raw["space"], dict):
            raise TuneInputError('--space must be a JSON object, as {"-np": {"min": 1, "max": 8}}')
    parsed = protocol.parse_tune(raw)
    if isinstance(parsed, protocol.TuneRefused):
        raise parsed
    assert parsed is not None
    return parsed


def assignment(machine: Machine, model: str, engine: str | None, base_args: str | None,
               spec: protocol.TuneSpec) -> protocol.Assign:
    """Local mode's assignment of `model`, for `engine` where named, with `base_args` alone where given."""
    try:
        assign = local_assignment(machine.runtime, model)
    except LocalModelError as exc:
        raise TuneInputError(str(exc)) from None
    name, block = next(iter((assign.model.__pydantic_extra__ or {}).items()))
    if engine is not None and engine != name:
        if engine not in registry.names() or registry.get(engine) not in registry.for_runtime(machine.runtime):
            raise TuneInputError(f"--engine {engine!r}: this machine runs "
                                 f"{', '.join(a.NAME for a in registry.for_runtime(machine.runtime))}")
        defaults = registry.get(engine).LOCAL_DEFAULTS
        block = block.model_copy(update={"base_args": list(defaults.base_args),
                                         "tiers": {k: list(v) for k, v in defaults.tiers.items()}})
        name = engine
    if base_args is not None:
        block = block.model_copy(update={"base_args": shlex.split(base_args), "tiers": {}})
    block = block.model_copy(update={"tune": spec.model_dump(mode="json")})
    return protocol.Assign(assignment_id=assign.assignment_id,
                           model=protocol.ModelSpec(name=assign.model.name, **{name: block}))


async def tune_here(paths: Paths, settings: Settings, model: str, *, engine: str | None, base_args: str | None,
                    minutes: float, trials: int, engine_bins: Mapping[str, str], as_json: bool,
                    space: str | None = None) -> int:
    """Tune `model` here and print the report; the exit status."""
    spec = tune_spec(minutes, trials, space)
    paths.ensure()
    lock = DataFolderLock(paths)
    lock.acquire()
    try:
        machine = await asyncio.to_thread(detect, settings, Finder(dict(engine_bins)))
        assign = await asyncio.to_thread(assignment, machine, model, engine, base_args, spec)
        planned = plan(machine, assign, settings)
        if isinstance(planned, Refusal):
            raise TuneInputError(planned.reason)
        try:
            engine_plans = await provision(planned, machine, paths, settings, _progress, engine_bins=engine_bins)
        except ProvisionError as exc:
            raise TuneInputError(str(exc)) from None
        report = await _tune(planned, engine_plans[0], spec, machine, paths, settings)
    finally:
        lock.release()
    print(json.dumps(report) if as_json else _table(report))
    return 0 if report["outcome"] in ("adopted", "kept_baseline") else 1


async def _tune(planned: Plan, engine_plan: EnginePlan, spec: protocol.TuneSpec, machine: Machine,
                paths: Paths, settings: Settings) -> dict[str, Any]:
    installed = machine.engines.get(planned.engine)
    key = TuneKey(machine_key(machine), planned.engine_model.source, planned.engine,
                  (installed.version if installed else None) or "", tuple(engine_plan.args))
    gpus = GpuWatch(PynvmlSource(library=find_wsl_nvml_library() if machine.runtime == "wsl2" else None)
                    if machine.gpus else None)

    async def share(ep: EnginePlan) -> float | None:
        return await gpus.memory_share(machine, ep, settings)
    measuring = TunerSettings.for_budget(spec.budget.max_minutes)
    tuner = Tuner(engine_plan, spec, machine, paths=paths, store=TunedStore(paths.data_dir), key=key,
                  progress=lambda trial, most: print(f"trial {trial} of {most}", file=sys.stderr, flush=True),
                  settings=measuring, gpu_released=gpus.released if gpus.nvml is not None else None,
                  remeasure=share)
    return shown(planned.assignment_id, engine_plan.engine_id, engine_plan.args, await tuner.run(), measuring)


def shown(assignment_id: str, engine_id: str, baseline: tuple[str, ...], report: TuneReport,
          measuring: TunerSettings | None = None) -> dict[str, Any]:
    """The `tune.report` as the coordinator would get it, with the gain, the time, each trial's
    arguments, result and figures (the baseline's first), and how hard it measured."""
    out: dict[str, Any] = report_message(assignment_id, engine_id, baseline, report).model_dump(mode="json")
    if measuring is not None:
        out["measuring"] = {"repeats": measuring.repeats, "pairs": measuring.pairs, "blocks": measuring.blocks,
                            "run_s": measuring.run_s}
    out.update(gain_pct=report.gain_pct, noise_pct=report.noise_pct, elapsed_s=round(report.elapsed_s, 1),
               trials=[{"args": list(t.args), "result": t.result,
                        "levels": [vars(level) for level in t.levels]} for t in report.trials])
    return out


def _table(report: dict[str, Any]) -> str:
    lines = [f"outcome: {report['outcome']}   elapsed: {report['elapsed_s']:.0f} s"
             + (f"   gain: {report['gain_pct']:+.1f} % (noise {report['noise_pct']:.1f} %)"
                if report.get("gain_pct") is not None else "")]
    for trial in report["trials"]:
        best = max((lv["aggregate_tok_s"] for lv in trial["levels"]), default=0.0)
        lines.append(f"  {trial['result']:<24} {best:8.1f} tok/s  {' '.join(trial['args']) or '(baseline)'}")
    return "\n".join(lines)


def _progress(event: DownloadProgress) -> None:
    print(f"{event.what}: {event.done_bytes // 2**20} MiB", file=sys.stderr, flush=True)

