"""What auto-tune may change in vLLM's arguments, the recipes the field notes found, and the log
lines that show a fast-looking candidate is broken.

Pure. Knobs are flags of `args.ALLOWLIST` only. Seeds: note 000's CUDA graphs on a card with room
(`--no-enforce-eager`, alone and with its tier's `--max-num-seqs 128`); note 004's drafter with one
more token is the `--spec-tokens` knob's step up. Traps are vLLM 0.32.0's own warnings: a capture
size the engine cut down (`config/vllm.py`), and a drafter run without graphs
(`v1/worker/gpu/spec_decode/dflash/speculator.py`).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Mapping, Sequence

from worker.engines.base import EngineTuning, Knob, argument_values, whole_number
from worker.engines.vllm.args import ALLOWLIST, MAX_BATCH_TOKENS, MAX_DRAFT_TOKENS, MAX_SEQS

if TYPE_CHECKING:
    from worker.hardware.model import Machine

KNOBS = (
    Knob("--max-num-seqs", "int", 1, MAX_SEQS, grows_memory=True),
    Knob("--max-num-batched-tokens", "int", 1, MAX_BATCH_TOKENS, grows_memory=True),
    # on: eager (no CUDA graphs); off: graphs, which take memory
    Knob("--enforce-eager", "switch", choices=("on", "off"), off="--no-enforce-eager", default="off",
         grows_memory=True),
    Knob("--max-cudagraph-capture-size", "int", 1, MAX_SEQS, grows_memory=True),
    # a drafter set through --spec-method; one in --speculative-config keeps its count (vLLM refuses both at once)
    Knob("--spec-tokens", "int", 1, MAX_DRAFT_TOKENS, scale="linear", grows_memory=True, needs=("--spec-method",)),
)

# Context, the memory share, weights' and KV's precision, and remote code: never tuned.
NEVER = frozenset({
    "--max-model-len", "--gpu-memory-utilization", "--device-memory-utilization", "--dtype", "--quantization", "-q",
    "--kv-cache-dtype", "--trust-remote-code", "--no-trust-remote-code",
})

SEEDS = (
    ("--no-enforce-eager",),
    ("--no-enforce-eager", "--max-num-seqs", "128"),
)

CAPTURE_TRUNCATED = "trap:capture_truncated"
DRAFTER_GRAPH_OFF = "trap:drafter_graph_off"
TRAPS = (
    (re.compile(r"Truncating max_cudagraph_capture_size to \d+"), CAPTURE_TRUNCATED),
    (re.compile(r"cudagraph_capture_sizes specified in compilation_config .* is overridden by config"),
     CAPTURE_TRUNCATED),
    (re.compile(r"draft attention \(.*\) does not support full CUDA graphs; running the draft eagerly"),
     DRAFTER_GRAPH_OFF),
)


def fix(baseline: Sequence[str], tuned: Sequence[str], machine: Machine) -> tuple[str, ...] | None:
    """None where one step's token budget would be below the requests it runs at once, which vLLM
    refuses to start with (`config/scheduler.py`)."""
    merged = {**defaults(machine), **argument_values(baseline, ALLOWLIST), **argument_values(tuned, ALLOWLIST)}
    seqs = whole_number(merged["--max-num-seqs"])
    tokens = whole_number(merged["--max-num-batched-tokens"])
    if seqs is not None and tokens is not None and tokens < seqs:
        return None
    return tuple(tuned)


def defaults(machine: Machine) -> Mapping[str, str]:
    """vLLM's own `--max-num-seqs` and `--max-num-batched-tokens` for its API server on this
    machine (`engine/arg_utils.py`, `_get_default_max_num_seqs_and_batched_tokens`)."""
    gpu = machine.gpus[0] if machine.gpus else None
    if gpu is None or machine.runtime == "cpu":  # its CPU build
        seqs, tokens = 128, 2048
    elif gpu.memory_total_mib >= 160 * 1024:
        seqs, tokens = 1024, 16384
    elif gpu.memory_total_mib >= 70 * 1024 and "a100" not in gpu.name.lower():
        seqs, tokens = 1024, 8192
    else:
        seqs, tokens = 256, 2048
    return {"--max-num-seqs": str(seqs), "--max-num-batched-tokens": str(tokens), "--enforce-eager": "off"}


TUNING = EngineTuning(knobs=KNOBS, never=NEVER, seeds=SEEDS, traps=TRAPS, constrain=fix, defaults=defaults)
