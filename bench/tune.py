"""Auto-tune on the real llama-server (CPU), the issue's figures side by side with the baseline:
tuned ÷ baseline aggregate tok/s, minutes spent, trials, and false adoptions where nothing can be
gained. Written to `bench/results/tune-llamacpp.json`.

- gain: baseline `-np 1 -c 4096 -t 1` (one slot, four concurrent requests at the ladder's top),
  the space `-np` 1-8 and `-t` 1-64 (threads held to the cores), `--trials` candidates, `--minutes`;
- no gain: the space `-b` 1,024 or 4,096 (every prompt is shorter than one batch: no change), run
  `--null-runs` times; each adoption there is a false one;
- `--sweep` also measures every candidate of the gain space once (screening figures) and prints
  how far the tuner's choice is from the best of them: the moonshot's "within 5 % of an exhaustive
  sweep", ready for when a GPU is lent (point `BASELINE`, `GAIN_SPACE` and the model at it).

    .venv/bin/python -m bench.tune [--trials 4] [--minutes 5] [--null-runs 1] [--sweep]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.support.engines import ensure_llama_server, free_port
from tests.support.tune_gguf import write_tune_gguf
from worker.contract import protocol
from worker.hardware.model import Machine
from worker.measure.load import read_prompts
from worker.node.tuner import TuneReport, Tuner, TunerSettings, peak
from worker.plan.planner import EnginePlan
from worker.plan.tuning import OomFrontier, build_space, candidates
from worker.system.config import Paths

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "tune-llamacpp.json"
PROMPTS = ROOT / "tests" / "fixtures" / "tune" / "prompts-bytes.json"
BASELINE = ("-np", "1", "-c", "4096", "-t", "1")
GAIN_SPACE: dict[str, Any] = {"-np": {"min": 1, "max": 8}, "-t": {"min": 1, "max": 64}}
NULL_SPACE: dict[str, Any] = {"-b": {"values": [1024, 4096]}}


def machine() -> Machine:
    return Machine(os="linux", runtime="cpu", arch=platform.machine(), cpu_model=platform.processor() or "CPU",
                   cpu_cores=os.cpu_count() or 1, ram_mib=8192)


def spec(space: dict[str, Any], trials: int, minutes: float) -> protocol.TuneSpec:
    tune = protocol.parse_tune({"budget": {"max_minutes": minutes, "max_trials": trials}, "min_gain_pct": 5,
                                "objective": {"ladder_max": 4}, "space": space})
    assert isinstance(tune, protocol.TuneSpec), tune
    return tune


def tuner(model: Path, tune: protocol.TuneSpec, folder: Path) -> Tuner:
    server = ensure_llama_server()
    plan = EnginePlan(engine_id="bench", engine="llamacpp", gpu_indices=(), layout="single", memory_mib=1024,
                      tier=None, args=BASELINE, fallbacks=(), port=free_port(), env={},
                      executable=(str(server.executable),), model=str(model), served_name="tune-llama")
    return Tuner(plan, tune, machine(), paths=Paths.under(folder).ensure(), prompts=read_prompts(PROMPTS),
                 settings=TunerSettings.for_budget(tune.budget.max_minutes), base_env=server.environment())


def remeasured(report: TuneReport) -> float:
    """Tuned ÷ baseline aggregate tok/s as the interleaved re-measure found it (1.0: baseline kept)."""
    return 1 + report.gain_pct / 100 if report.outcome == "adopted" and report.gain_pct is not None else 1.0


def screened(report: TuneReport) -> float:
    """Tuned ÷ baseline aggregate tok/s at the chosen config's best level in the screening runs
    (one start each, so noisier than the re-measure; 1.0 where none was chosen)."""
    chosen = next((t for t in report.trials if t.result == "adopted"), None)
    best = peak(chosen.levels) if chosen is not None else None
    if best is None:
        return 1.0
    base = next((lv for lv in report.baseline.levels if lv.concurrency == best.concurrency), None)
    return best.aggregate_tok_s / base.aggregate_tok_s if base and base.aggregate_tok_s else 1.0


def summary(report: TuneReport) -> dict[str, Any]:
    return {"outcome": report.outcome, "chosen": list(report.chosen or ()), "gain_pct": report.gain_pct,
            "noise_pct": report.noise_pct, "tuned_over_baseline": round(remeasured(report), 3),
            "screening_ratio": round(screened(report), 3),
            "minutes": round(report.elapsed_s / 60, 2), "trials": len(report.trials) - 1,
            "results": [[" ".join(t.args) or "(baseline)", t.result] for t in report.trials]}


async def sweep(model: Path, folder: Path) -> list[tuple[tuple[str, ...], float]]:
    """Every candidate of the gain space, measured once over the ladder: (args, best aggregate)."""
    tune = spec(GAIN_SPACE, 64, 600)
    space = build_space("llamacpp", tune, BASELINE, machine())
    runner = tuner(model, tune, folder)
    out = []
    for tuned in [(), *candidates(space, BASELINE, machine(), OomFrontier("llamacpp", machine()))]:
        figures, _, _ = await runner.measured(tuned, levels=(1, 2, 4), repeats=1, beside=False, greedy=False)
        best = peak(figures.levels)
        out.append((tuned, round(best.aggregate_tok_s if best else 0.0, 1)))
        print("sweep:", " ".join(tuned) or "(baseline)", out[-1][1], flush=True)
    return out


async def main(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = write_tune_gguf(folder / "tune.gguf")
        gain = await tuner(model, spec(GAIN_SPACE, args.trials, args.minutes), folder / "gain").run()
        print("gain:", json.dumps(summary(gain)), flush=True)
        nulls = []
        for i in range(args.null_runs):
            report = await tuner(model, spec(NULL_SPACE, 2, args.minutes), folder / f"null{i}").run()
            nulls.append(summary(report))
            print("no gain:", json.dumps(nulls[-1]), flush=True)
        swept = await sweep(model, folder / "sweep") if args.sweep else []
    result: dict[str, Any] = {
        "machine": {"cpu": platform.processor() or platform.machine(), "logical_cores": os.cpu_count()},
        "recorded": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "gain": summary(gain), "no_gain": nulls,
        "false_adoptions": sum(1 for n in nulls if n["outcome"] == "adopted"),
        "targets": {"tuned_over_baseline": "≥ 1.3", "minutes": "≤ 5", "false_adoptions": "0"},
    }
    if swept:
        best = max(value for _, value in swept)
        chosen = dict(swept).get(tuple(gain.chosen or ()), 0.0)
        result["sweep"] = {"configs": [[" ".join(a) or "(baseline)", v] for a, v in swept],
                           "chosen_within_pct_of_best": round(100 * (1 - chosen / best), 1) if best else None}
    return result


def table(result: dict[str, Any]) -> str:
    gain = result["gain"]
    rows = [("tuned ÷ baseline aggregate (re-measured)", f"{gain['tuned_over_baseline']:.2f}", "≥ 1.3",
             gain["tuned_over_baseline"] >= 1.3),
            ("minutes spent (gain case)", f"{gain['minutes']:.1f}", "≤ 5", gain["minutes"] <= 5),
            ("trials (gain case)", str(gain["trials"]), "", None),
            ("false adoptions (no-gain case)", f"{result['false_adoptions']} of {len(result['no_gain'])}", "0",
             result["false_adoptions"] == 0)]
    lines = [f"{name:<42} {value:>10}  {target:<6} {'' if ok is None else 'pass' if ok else 'MISS'}"
             for name, value, target, ok in rows]
    lines.append(f"chosen: {' '.join(gain['chosen']) or '(baseline kept)'}, re-measured gain {gain['gain_pct']} %")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--null-runs", type=int, default=1)
    parser.add_argument("--sweep", action="store_true")
    outcome = asyncio.run(main(parser.parse_args()))
    RESULTS.write_text(json.dumps(outcome, indent=1) + "\n", encoding="utf-8")
    print(table(outcome))
    print(f"wrote {RESULTS}")
