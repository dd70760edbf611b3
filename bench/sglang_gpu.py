"""SGLang on a lent GPU, started through the app: its KV report, time to ready, and a short tok/s.

For a machine with an NVIDIA GPU of compute capability 8.0 or newer and SGLang 0.5.23 installed in a
venv (`--sglang-venv`, the folder or its Python). Detects with NVML, plans an assignment with an
SGLang block only (a small model by default), puts the model in place (`ensure_model`), starts
the engine with the app's supervisor (the app's launcher, argv, memory share, environment and
readiness: /health, /v1/models, a real completion), then prints the KV line SGLang wrote, the
seconds from start to ready, and single-stream decode tok/s over `--tokens` tokens. The reading is
also written to `bench/results/sglang-gpu.json`.

    python -m bench.sglang_gpu --sglang-venv /opt/sglang [--model Qwen/Qwen2.5-0.5B-Instruct]
        [--weights-mib 1000] [--args "--context-length 8192"] [--data-dir DIR] [--tokens 128]
        [--ready-timeout 1200]

`--hardware DETECT.json --engine-env PYTHONPATH=…` runs it without a GPU against the stand-in
(tests/standin/sglang_site on PYTHONPATH, `--sglang-venv` the test venv): a dry run of this script.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.gpu_decode import decode_rate
from bench.report import RESULTS, machine_description
from worker.contract import protocol
from worker.engines import registry
from worker.engines.finding import Finder
from worker.hardware import Machine, detect
from worker.plan.planner import EnginePlan, Refusal, plan
from worker.provision.models import ensure_model
from worker.serve.restart_policy import SupervisorTiming
from worker.serve.supervisor import EngineSupervisor
from worker.system.config import Paths, load_settings

OUT = RESULTS.parent / "sglang-gpu.json"
DRY_RUN_OUT = RESULTS.parent / "sglang-gpu-dry-run.json"
KV_LINE = re.compile(r"KV Cache is allocated\..*|max_total_num_tokens=\d+.*")


def assignment(model: str, weights_mib: int, args: list[str]) -> protocol.Assign:
    block = {"source": model, "weights_mib": weights_mib, "engine_version": "0.5.23", "base_args": args, "tiers": {}}
    return protocol.Assign.model_validate({"assignment_id": "bench-sglang", "model": {"name": "bench", "sglang": block}},
                                          context={protocol.ENGINE_NAMES: registry.names()})


def _machine(args: argparse.Namespace) -> Machine:
    if args.hardware:
        machine = Machine.from_detect_json(json.loads(Path(args.hardware).read_text(encoding="utf-8")))
    else:
        machine = detect(load_settings(Paths.resolve(args.data_dir)), Finder({"sglang": args.sglang_venv}))
    found = registry.get("sglang").find_installed("Linux", args.sglang_venv, lambda *_: None)
    if found.version is None or found.path is None:
        raise SystemExit(f"no SGLang found in {args.sglang_venv} (a venv with sglang {'0.5.23'} installed)")
    return replace(machine, engines={**machine.engines, "sglang": found})


async def run(args: argparse.Namespace) -> dict[str, Any]:
    paths = Paths.resolve(args.data_dir).ensure()
    settings = load_settings(paths)
    machine = await asyncio.to_thread(_machine, args)
    chosen = plan(machine, assignment(args.model, args.weights_mib, shlex.split(args.args)), settings)
    if isinstance(chosen, Refusal):
        raise SystemExit(f"the app would refuse this assignment: {chosen.reason}")
    model_path = await ensure_model(chosen.engine_model, chosen.engine, paths, settings, lambda _: None)
    extra = dict(item.split("=", 1) for item in args.engine_env)
    engine: EnginePlan = replace(chosen.engines[0], model=str(model_path), env={**chosen.engines[0].env, **extra},
                                 executable=(machine.engines["sglang"].path or "python3",))
    supervisor = EngineSupervisor(engine, paths=paths, timing=SupervisorTiming(ready_timeout_s=args.ready_timeout),
                                  unix_socket=False)  # SGLang listens on TCP only
    started = time.perf_counter()
    await supervisor.start()
    try:
        snap = await supervisor.wait_for_state("ready", "failed", timeout=args.ready_timeout + 60)
        ready_s = time.perf_counter() - started
        target = supervisor.target()
        if target is None:
            raise SystemExit(f"SGLang did not become ready: {snap.last_error}")
        await decode_rate(target, 8)  # warm-up
        reading = await decode_rate(target, args.tokens)
    finally:
        await supervisor.stop()
    log = Path(snap.log_path).read_text(encoding="utf-8", errors="replace") if snap.log_path else ""
    return {
        "machine": machine_description() | {"gpus": [g.name for g in machine.gpus if g.index in engine.gpu_indices]},
        "argv": engine.argv(), "kv_lines": KV_LINE.findall(log), "kv_cache_tokens": snap.kv_cache_tokens,
        "max_concurrency": snap.max_concurrency, "ready_s": round(ready_s, 1), **reading,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sglang_gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--sglang-venv", required=True, help="the venv SGLang 0.5.23 is installed in, or its Python")
    parser.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct", help="a Hugging Face repo id or a folder")
    parser.add_argument("--weights-mib", type=int, default=1000)
    parser.add_argument("--args", default="--context-length 8192", help="the SGLang block's base_args")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--ready-timeout", type=float, default=1200.0)
    parser.add_argument("--hardware", help="a `gpu-provider detect` output instead of NVML (a dry run)")
    parser.add_argument("--engine-env", action="append", default=[], metavar="KEY=VALUE",
                        help="set for the engine (a dry run's PYTHONPATH to the stand-in)")
    args = parser.parse_args(argv)
    reading = asyncio.run(run(args)) | {"dry_run": bool(args.hardware)}
    out = DRY_RUN_OUT if args.hardware else OUT
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(reading, indent=2) + "\n", encoding="utf-8")
    rate = reading["decode_tokens_per_s"]
    print("\n".join(reading["kv_lines"]) or "(no KV line in the log)")
    print(f"SGLang ready in {reading['ready_s']} s; KV cache {reading['kv_cache_tokens']} tokens; decode "
          f"{rate if rate is None else f'{rate:.1f}'} tok/s over {reading['completion_tokens']} tokens; written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
