"""Auto-tune on the real vLLM (its CPU build) through the app's own path, and its figures.

The model is assigned as `gpu-provider tune` assigns it (local mode's block for a model folder,
the baseline as its base arguments and no tiers), planned and provisioned as the node does, then
tuned by the node's tuner over `--max-num-seqs` and `--max-num-batched-tokens`: two trials, each
a real vLLM start through the supervisor, measured under load; then the best one, if it beat the
baseline, re-measured interleaved with it. What it prints is the report `gpu-provider tune --json`
prints, and one line per configuration: its aggregate tok/s at each concurrency beside the baseline's.

`python -m bench.tune_vllm` (about 5 minutes on 2 cores: five vLLM starts of ~45 s); writes
`bench/results/tune-vllm.json`. The model is tests/support/tiny_hf_model.py's random 1.5 MB
Llama, its chat tokens made plain text so its (noise) answers are visible and every streamed
chunk carries text, as a real model's do; the figures say what a tune costs and how it reports on
a real engine, not what a GPU gains.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import shlex
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.real_vllm import ensure_vllm, tiny_hf_model
from worker.contract import protocol
from worker.contract.events import DownloadProgress
from worker.engines.finding import Finder
from worker.hardware import detect
from worker.node.tune_command import assignment, shown
from worker.node.tuner import TrialFailed, Tuner, TunerSettings
from worker.plan.planner import Refusal, plan
from worker.provision.assignment import provision
from worker.system.config import Paths, Settings

RESULT = Path(__file__).resolve().parent / "results" / "tune-vllm.json"
# A cap on the share of RAM (the machine is shared); -O0: no torch.compile, so a start takes ~45 s
# and not twice that. vLLM's own --max-num-seqs on CPU (128) and graphs on (-O0 only skips the
# compile): the engine's seeds are the baseline itself and are not run. 4,096 tokens of context: the
# shipped long prompt is 3,431 tokens in the tiny model's 512-word vocabulary.
BASE_ARGS = "--max-model-len 4096 --gpu-memory-utilization 0.1 -O0"
SPACE = {"--max-num-seqs": {"values": [2]}, "--max-num-batched-tokens": {"values": [4096]}}
TRIALS = 2
LADDER_MAX = 4
# The tuner's budget: it starts a candidate only where that and a re-measure (twice `pairs` runs of
# a baseline-sized trial, by its own reckoning) still fit, so this leaves room for two on a loaded
# machine; the run itself takes about 4 minutes.
MINUTES = 10
# Lighter than a real tune: one run per level, four interleaved pairs on one start of each.
SETTINGS = TunerSettings(repeats=1, warmup=1, pairs=4, blocks=1, run_s=2.0, ready_timeout_s=480.0)


def visible_model(root: Path) -> Path:
    """The tiny model with its chat tokens (`<|assistant|>`, which its random weights repeat) as
    plain text, and positions for 4,096 tokens: a copy whose tokenizer no longer marks them special."""
    folder = root / "tiny-llama-visible"
    shutil.copytree(tiny_hf_model(), folder)
    config = folder / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text(encoding="utf-8")), "max_position_embeddings": 4096}),
                      encoding="utf-8")
    tokenizer = folder / "tokenizer.json"
    data = json.loads(tokenizer.read_text(encoding="utf-8"))
    for token in data["added_tokens"]:
        if token["content"].startswith("<|"):
            token["special"] = False
    tokenizer.write_text(json.dumps(data), encoding="utf-8")
    return folder


def tune_spec(run: Run) -> protocol.TuneSpec:
    spec = protocol.parse_tune({"budget": {"max_minutes": run.minutes, "max_trials": run.trials}, "min_gain_pct": 3,
                                "objective": {"ladder_max": run.ladder_max}, "space": run.space})
    assert isinstance(spec, protocol.TuneSpec), spec
    return spec


@dataclass(frozen=True)
class Run:
    """One tune: what is tuned, from where, within what (the defaults: the tiny model on this CPU)."""

    model: str | None = None  # None: the tiny random Llama
    vllm: str | None = None  # None: the cached CPU build
    base_args: str = BASE_ARGS
    space: dict[str, Any] = field(default_factory=lambda: dict(SPACE))
    trials: int = TRIALS
    minutes: float = MINUTES
    settings: TunerSettings = SETTINGS
    ladder_max: int = LADDER_MAX
    sweep: bool = False  # also measure every configuration of the space alone, for the tuner's choice to be judged


async def tune_real_vllm(root: Path, run: Run = Run()) -> dict[str, Any]:
    """One tune of the real vLLM as `gpu-provider tune` runs it; its report as `--json` prints it
    (with `sweep`: also each configuration's peak tok/s, measured alone with the baseline's settings)."""
    vllm = run.vllm or str(await asyncio.to_thread(ensure_vllm))
    model = run.model or str(await asyncio.to_thread(visible_model, root))
    paths, settings, bins = Paths.under(root / "data").ensure(), Settings(), {"vllm": vllm}
    machine = await asyncio.to_thread(detect, settings, Finder(bins))
    spec = tune_spec(run)
    planned = plan(machine, assignment(machine, model, "vllm", run.base_args, spec), settings)
    if isinstance(planned, Refusal):
        raise RuntimeError(f"the plan refused the model: {planned.reason}")
    engine_plan = (await provision(planned, machine, paths, settings, _quiet, engine_bins=bins))[0]
    tuner = Tuner(engine_plan, spec, machine, paths=paths, settings=run.settings)
    report = shown(planned.assignment_id, engine_plan.engine_id, engine_plan.args, await tuner.run())
    if run.sweep:
        report["sweep"] = await _sweep(tuner, run)
    return report


async def _sweep(tuner: Tuner, run: Run) -> list[dict[str, Any]]:
    """Every combination of the space's listed values, each started and measured alone (the
    exhaustive answer the tuner's choice is held to)."""
    flags = list(run.space)
    values = [[str(v) for v in run.space[flag].get("values", ())] for flag in flags]
    ladder = tuple(2**i for i in range(run.ladder_max.bit_length()) if 2**i <= run.ladder_max)
    out: list[dict[str, Any]] = []
    for combo in itertools.product(*values):
        tuned = tuple(part for flag, value in zip(flags, combo) for part in (flag, value))
        try:
            figures, _, _ = await tuner.measured(tuned, levels=ladder, repeats=run.settings.repeats, greedy=False)
        except TrialFailed as exc:
            out.append({"args": list(tuned), "peak_tok_s": None, "why": exc.result})
            continue
        out.append({"args": list(tuned), "peak_tok_s": figures.peak_tok_s})
    return out


def _quiet(event: DownloadProgress) -> None:
    del event


def lines(report: dict[str, Any]) -> list[str]:
    """Each configuration's aggregate tok/s per concurrency, beside the baseline's."""
    baseline = {level["concurrency"]: level["aggregate_tok_s"] for level in report["trials"][0]["levels"]}
    out = [f"outcome {report['outcome']}, {report['elapsed_s'] / 60:.1f} min, {len(report['trials']) - 1} trials"
           + (f", gain {report['gain_pct']:+.1f} % (noise {report['noise_pct']:.1f} %)"
              if report.get("gain_pct") is not None else "")]
    for trial in report["trials"]:
        figures = "  ".join(f"{lv['concurrency']}: {lv['aggregate_tok_s']:7.1f} "
                            f"(×{lv['aggregate_tok_s'] / max(baseline.get(lv['concurrency'], 0), 1e-9):.2f})"
                            for lv in trial["levels"])
        out.append(f"  {trial['result']:<22} {shlex.join(trial['args']) or '(baseline)':<32} {figures}")
    return out


def judged(report: dict[str, Any]) -> list[str]:
    """The tuner's pick against the sweep's best (the moonshot: within 5 % in at most 15 minutes)."""
    measured = [entry for entry in report.get("sweep", ()) if entry["peak_tok_s"]]
    if not measured:
        return []
    best = max(measured, key=lambda entry: entry["peak_tok_s"])
    picked = next(t for t in report["trials"] if t["result"] in ("adopted", "baseline")
                  and (t["result"] == "adopted" or report["outcome"] != "adopted"))
    mine = max(level["aggregate_tok_s"] for level in picked["levels"])
    lines = [f"  sweep {shlex.join(e['args']):<40} {e['peak_tok_s']:8.1f} tok/s" for e in measured]
    lines.append(f"sweep best: {shlex.join(best['args'])} at {best['peak_tok_s']:.1f} tok/s; the tuner's pick "
                 f"({shlex.join(picked['args']) or 'the baseline'}, {mine:.1f} tok/s as the tuner measured it) is "
                 f"{100 * (1 - mine / best['peak_tok_s']):.1f} % below it")
    return lines


def _parse(argv: list[str] | None) -> tuple[Run, Path]:
    parser = argparse.ArgumentParser(prog="python -m bench.tune_vllm", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model folder or Hugging Face repository (default: the tiny random Llama)")
    parser.add_argument("--vllm", help="the vllm executable (default: the cached CPU build)")
    parser.add_argument("--base-args", default=BASE_ARGS, help=f"the baseline (default: {BASE_ARGS!r})")
    parser.add_argument("--space", type=json.loads, default=SPACE, help="the tune block's space, as JSON")
    parser.add_argument("--trials", type=int, default=TRIALS)
    parser.add_argument("--minutes", type=float, default=MINUTES)
    parser.add_argument("--ladder-max", type=int, default=LADDER_MAX, help="the most concurrent requests measured")
    parser.add_argument("--full", action="store_true", help="measure as a real tune does (3 runs a level, 12 pairs)")
    parser.add_argument("--sweep", action="store_true", help="then measure every combination of the space's values")
    parser.add_argument("--json", type=Path, default=RESULT, help="where to write the report")
    args = parser.parse_args(argv)
    run = Run(args.model, args.vllm, args.base_args, args.space, args.trials, args.minutes,
              TunerSettings() if args.full else SETTINGS, args.ladder_max, args.sweep)
    return run, args.json


def main(argv: list[str] | None = None) -> int:
    import tempfile

    run, result = _parse(argv)
    with tempfile.TemporaryDirectory(prefix="tune-vllm-") as tmp:
        started = time.monotonic()
        report = asyncio.run(tune_real_vllm(Path(tmp), run))
    report["wall_s"] = round(time.monotonic() - started, 1)
    print("\n".join(lines(report) + judged(report)))
    result.parent.mkdir(parents=True, exist_ok=True)
    result.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return 0 if report["outcome"] in ("adopted", "kept_baseline") else 1


if __name__ == "__main__":
    sys.exit(main())
