"""What auto-tune may change in SGLang's arguments, the recipe the field notes found, and the log
lines that show a fast-looking candidate is broken.

Pure. Knobs are flags of `args.ALLOWLIST` only. Seed: note 004's winning 2,048-token prefill
chunk. Traps are SGLang 0.5.23's own warnings that a drafter lost its CUDA graph, which note 004
saw collapse decode from 109 to 19 tok/s while acceptance still looked healthy
(`speculative/dspark_components/dspark_worker_v2.py`, `speculative/dflash_worker_v2.py`,
`speculative/multi_layer_eagle_worker_v2.py`). A switch SGLang cannot turn back off
(`--disable-cuda-graph`) is no knob: tuned arguments are appended, and could never undo it.
"""

from __future__ import annotations

import re

from worker.engines.base import EngineTuning, Knob
from worker.engines.sglang.args import MAX_BATCH_TOKENS, MAX_DRAFT_TOKENS, MAX_REQUESTS

KNOBS = (
    Knob("--max-running-requests", "int", 1, MAX_REQUESTS, grows_memory=True),
    Knob("--chunked-prefill-size", "int", 1, MAX_BATCH_TOKENS, grows_memory=True),
    Knob("--max-prefill-tokens", "int", 1, MAX_BATCH_TOKENS, default="16384", grows_memory=True),
    Knob("--cuda-graph-max-bs-decode", "int", 1, MAX_REQUESTS, grows_memory=True),
    Knob("--num-continuous-decode-steps", "int", 1, 64, default="1"),
    # with one candidate per step SGLang drafts steps + 1 tokens itself (`arg_groups/speculative_hook.py`)
    Knob("--speculative-num-steps", "int", 1, MAX_DRAFT_TOKENS, scale="linear", grows_memory=True,
         needs=("--speculative-algorithm",)),
)

# Context, weights' and KV's precision, and remote code: never tuned.
NEVER = frozenset({"--context-length", "--kv-cache-dtype", "--dtype", "--quantization", "--trust-remote-code"})

SEEDS = (("--chunked-prefill-size", "2048"),)

DRAFTER_GRAPH_OFF = "trap:drafter_graph_off"
TRAPS = (
    (re.compile(r"Disable (?:DSpark|DFLASH) draft cuda graph because"), DRAFTER_GRAPH_OFF),
    (re.compile(r"can't use cuda graph for draft extend"), DRAFTER_GRAPH_OFF),
)

TUNING = EngineTuning(knobs=KNOBS, never=NEVER, seeds=SEEDS, traps=TRAPS)
