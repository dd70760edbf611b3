"""Detect + plan wall time: in this process (warm and first call) and as `gpu-provider detect`."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from typing import Any

from bench.report import Figure, at_most
from worker.contract import protocol
from worker.system.config import Settings

SECTION = "detect+plan"
TARGET_S = 0.5
ASSIGN = protocol.Assign.model_validate({"assignment_id": "bench-1", "model": {
    "name": "qwen3.8-27b",
    "vllm": {"source": "org/Qwen3.8-27B-W4A16", "weights_mib": 17800, "base_args": ["--max-model-len", "32768"],
             "tiers": {"24000": ["--max-num-seqs", "128"]}},
    "llamacpp": {"source": "https://example.org/qwen3.8-27b-Q4_K_M.gguf", "weights_mib": 16500,
                 "base_args": ["--ctx-size", "32768"]},
}})


def _detect_and_plan() -> float:
    from worker.engines.finding import Finder
    from worker.hardware import detect
    from worker.plan.planner import plan

    started = time.perf_counter()
    settings = Settings()
    plan(detect(settings, Finder()), ASSIGN, settings)
    return time.perf_counter() - started


def _subprocess_s(command: str) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "worker", command], check=True, capture_output=True, timeout=60)
    return time.perf_counter() - started


def measure(quick: bool) -> tuple[list[Figure], dict[str, Any]]:
    repeats = 3 if quick else 10
    first = _detect_and_plan()  # imports, NVML library load: what a fresh start pays
    warm = [_detect_and_plan() for _ in range(repeats)]
    detect_cli = [_subprocess_s("detect") for _ in range(repeats)]
    figures = [
        at_most(SECTION, "in-process, first call", first, "s", TARGET_S, "imports and NVML load included"),
        at_most(SECTION, "in-process, median", statistics.median(warm), "s", TARGET_S, f"max {max(warm):.3f} s"),
        at_most(SECTION, "`gpu-provider detect`, median", statistics.median(detect_cli), "s", TARGET_S,
                f"a whole process; max {max(detect_cli):.3f} s"),
    ]
    return figures, {"first_s": first, "warm_s": warm, "detect_subprocess_s": detect_cli}
