"""Decode speed of a real engine, started the way the app starts it, against the roofline.

For a machine with an NVIDIA GPU. Detects with NVML, plans the given assignment, puts the model
in place (`ensure_model`, so a local folder or a download), starts the first planned engine with
the app's supervisor (the app's argv, tier, environment, readiness), then streams one answer and
reads single-stream decode tok/s = (tokens − 1) ÷ (last token − first token). The ceiling is
memory bandwidth ÷ weight bytes (one full weight read per token; `worker.measure.runs.roofline`).
The reading is printed and written to `bench/results/gpu-decode.json`.

    python -m bench.gpu_decode --assignment assign.json [--engine-bin vllm=/opt/vllm/bin/vllm]
        [--data-dir DIR] [--tokens 256] [--ready-timeout 1800] [--hardware DETECT.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from bench.report import RESULTS, machine_description
from worker.contract import protocol
from worker.node.cli import parse_engine_bins
from worker.system.config import Paths, Settings, load_settings
from worker.engines import registry
from worker.engines.finding import Finder
from worker.hardware import Machine, detect
from worker.measure.runs import roofline
from worker.plan.planner import EnginePlan, Refusal, plan
from worker.provision.models import ensure_model
from worker.serve.restart_policy import SupervisorTiming
from worker.relay.forward import EngineTarget
from worker.serve.supervisor import EngineSupervisor

OUT = RESULTS.parent / "gpu-decode.json"
DRY_RUN_OUT = RESULTS.parent / "gpu-decode-dry-run.json"  # a --hardware run never passes for a reading
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def weight_bytes(model: Path, declared_mib: int) -> int:
    """The weights on disk (what each decoded token reads); the assignment's figure otherwise."""
    files = [model] if model.is_file() else [p for p in model.rglob("*") if p.suffix in WEIGHT_SUFFIXES]
    on_disk = sum(p.stat().st_size for p in files if p.is_file())
    return on_disk or declared_mib * 2**20


async def decode_rate(target: EngineTarget, tokens: int) -> dict[str, Any]:
    """One streamed completion; the time of each content event is one token's arrival."""
    base_url, api_key, model = target.base_url, target.api_key, target.served_model_name
    body = {"model": model, "prompt": "Write a long story about a lighthouse keeper.", "max_tokens": tokens,
            "stream": True, "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True}}
    arrivals: list[float] = []
    usage: dict[str, Any] = {}
    async with (
        httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=target.socket_path), trust_env=False,
                          timeout=httpx.Timeout(None, connect=10)) as client,
        client.stream("POST", f"{base_url}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {api_key}"}) as response,
    ):
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            if any(choice.get("text") for choice in event.get("choices") or []):
                arrivals.append(time.perf_counter())
    completion = int(usage.get("completion_tokens") or len(arrivals))
    span = arrivals[-1] - arrivals[0] if len(arrivals) > 1 else 0.0
    return {"completion_tokens": completion, "events": len(arrivals),
            "decode_tokens_per_s": (completion - 1) / span if span > 0 else None}


def _machine(args: argparse.Namespace, settings: Settings) -> Machine:
    """NVML's view of this machine; `--hardware` (a `detect` output) for a dry run without a GPU."""
    if args.hardware:
        return Machine.from_detect_json(json.loads(Path(args.hardware).read_text(encoding="utf-8")))
    return detect(settings, Finder(parse_engine_bins(args.engine_bin)))


async def run(args: argparse.Namespace) -> dict[str, Any]:
    paths = Paths.resolve(args.data_dir).ensure()
    settings = load_settings(paths)
    machine = await asyncio.to_thread(_machine, args, settings)
    assign = protocol.Assign.model_validate_json(Path(args.assignment).read_text(encoding="utf-8"),
                                                 context={protocol.ENGINE_NAMES: registry.names()})
    chosen = plan(machine, assign, settings)
    if isinstance(chosen, Refusal):
        raise SystemExit(f"the app would refuse this assignment: {chosen.reason}")
    model_path = await ensure_model(chosen.engine_model, chosen.engine, paths, settings, lambda _: None)
    engine: EnginePlan = chosen.engines[0]
    engine = replace(engine, model=str(model_path))
    supervisor = EngineSupervisor(engine, paths=paths, timing=SupervisorTiming(ready_timeout_s=args.ready_timeout))
    await supervisor.start()
    try:
        await supervisor.wait_for_state("ready", "failed", timeout=args.ready_timeout + 60)
        target = supervisor.target()
        if target is None:
            raise SystemExit(f"the engine did not become ready: {supervisor.snapshot().last_error}")
        await decode_rate(target, 16)  # warm-up
        reading = await decode_rate(target, args.tokens)
    finally:
        await supervisor.stop()
    bandwidths = [g.memory_bandwidth_gbps or 0.0 for g in machine.gpus if g.index in engine.gpu_indices]
    weights = weight_bytes(model_path, chosen.engine_model.weights_mib)
    ceiling = roofline(reading["decode_tokens_per_s"], bandwidths, weights)
    return {
        "machine": machine_description() | {"gpus": [g.name for g in machine.gpus if g.index in engine.gpu_indices]},
        "engine": chosen.engine, "argv": engine.argv(), "tier": engine.tier, "layout": engine.layout,
        "model": assign.model.name, "weight_bytes": weights, "memory_bandwidth_gbps": bandwidths, **reading,
        "roofline_tokens_per_s": ceiling.ceiling_tokens_per_s if ceiling else None,
        "share_of_roofline": ceiling.share if ceiling else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_decode", description=__doc__.splitlines()[0])
    parser.add_argument("--assignment", required=True, help="an `assign` message (JSON file)")
    parser.add_argument("--engine-bin", action="append", default=[], metavar="NAME=PATH")
    parser.add_argument("--data-dir", default=None, help="the app's data folder (models are cached there)")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--ready-timeout", type=float, default=1800.0)
    parser.add_argument("--hardware", help="a `gpu-provider detect` output instead of NVML (a dry run, e.g. "
                        "with the vLLM stand-in on PATH as `vllm`)")
    args = parser.parse_args(argv)
    reading = asyncio.run(run(args)) | {"dry_run": bool(args.hardware)}
    out = DRY_RUN_OUT if args.hardware else OUT
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(reading, indent=2) + "\n", encoding="utf-8")
    rate, ceiling, share = reading["decode_tokens_per_s"], reading["roofline_tokens_per_s"], reading["share_of_roofline"]
    print(f"{reading['engine']} {reading['model']} on {', '.join(reading['machine']['gpus'])}: "
          f"decode {rate if rate is None else f'{rate:.1f}'} tok/s, roofline "
          f"{ceiling if ceiling is None else f'{ceiling:.1f}'} tok/s, share "
          f"{share if share is None else f'{share:.0%}'}; written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
