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

import asyncio
import json
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from tests.support.real_vllm import ensure_vllm, tiny_hf_model
from worker.contract import protocol
from worker.contract.events import DownloadProgress
from worker.engines.finding import Finder
from worker.hardware import detect
from worker.node.tune_command import assignment, shown
from worker.node.tuner import Tuner, TunerSettings
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


def tune_spec() -> protocol.TuneSpec:
    spec = protocol.parse_tune({"budget": {"max_minutes": MINUTES, "max_trials": TRIALS}, "min_gain_pct": 3,
                                "objective": {"ladder_max": 4}, "space": SPACE})
    assert isinstance(spec, protocol.TuneSpec), spec
    return spec


async def tune_real_vllm(root: Path) -> dict[str, Any]:
    """One tune of the real vLLM as `gpu-provider tune` runs it; its report as `--json` prints it."""
    vllm = await asyncio.to_thread(ensure_vllm)
    model = await asyncio.to_thread(visible_model, root)
    paths, settings, bins = Paths.under(root / "data").ensure(), Settings(), {"vllm": str(vllm)}
    machine = await asyncio.to_thread(detect, settings, Finder(bins))
    spec = tune_spec()
    planned = plan(machine, assignment(machine, str(model), "vllm", BASE_ARGS, spec), settings)
    if isinstance(planned, Refusal):
        raise RuntimeError(f"the plan refused the tiny model: {planned.reason}")
    engine_plan = (await provision(planned, machine, paths, settings, _quiet, engine_bins=bins))[0]
    tuner = Tuner(engine_plan, spec, machine, paths=paths, settings=SETTINGS)
    return shown(planned.assignment_id, engine_plan.engine_id, engine_plan.args, await tuner.run())


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


def main() -> int:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="tune-vllm-") as tmp:
        started = time.monotonic()
        report = asyncio.run(tune_real_vllm(Path(tmp)))
    report["wall_s"] = round(time.monotonic() - started, 1)
    print("\n".join(lines(report)))
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return 0 if report["outcome"] in ("adopted", "kept_baseline") else 1


if __name__ == "__main__":
    sys.exit(main())
