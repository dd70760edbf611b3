"""llama-server's log: the facts one line of its stderr carries.

Pure. Strings follow `shared/reference/engines.md` part B; lines are read with or without
`--log-prefix`/`--log-timestamps`.
"""

from __future__ import annotations

import re

from worker.engines.base import (
    ContextSize,
    EngineVersion,
    KvCachePart,
    Listening,
    LogFact,
    OutOfMemory,
    PhaseReached,
    Slots,
    StartFailed,
    clean_line,
)

_PREFIX = re.compile(r"^(?:\d+\.\d+\.\d+\.\d+ )?(?:[IWED] )?")
_BUILD = re.compile(r"^build: (\d+) \((\w+)\)")
_LOADING = re.compile(r"loading model '")
_N_CTX = re.compile(r"llama_context: n_ctx\s+=\s+(\d+)")
_SLOTS = re.compile(r"n_slots = (\d+), n_ctx_slot = (\d+)(?:, kv_unified = '(true|false)')?")
# A cache's total, told apart by the function that prints it (B2): `llama_kv_cache` (older builds:
# `llama_kv_cache_unified`, up to b5400 as "KV self size" without cells) is a KV cache;
# `llama_memory_recurrent`, whose cells count sequences of recurrent state, is not. The per-buffer
# "KV buffer size" lines repeat the same memory.
_KV_SIZE = re.compile(r"^llama_kv_cache(?:_unified)?:\s+(?:KV self )?size\s*=\s*([\d.]+) MiB(?: \(\s*(\d+) cells)?")
_MODEL_LOADED = re.compile(r"llama_server: model loaded|main: model loaded")
_LISTENING = re.compile(r"listening on (\S+)")
# A buffer on a card (`CUDA0`, never the host's `CUDA_Host`): the weights, a KV or recurrent cache,
# the compute buffer (engines.md B2). Their sum per card is what it allocated there.
_DEVICE_BUFFER = re.compile(r"\bCUDA(\d+) +(?:model|KV|RS|compute) buffer size\s*=\s*([\d.]+) MiB")
_OOM = re.compile(r"cudaMalloc failed: out of memory|failed to allocate \S+ buffer|failed to allocate compute")
_FAILED = re.compile(
    r"exiting due to|failed to load model|failed to create_context|couldn't bind HTTP server socket|"
    r"error: invalid argument|error while handling argument"
)


def parse_line(line: str) -> LogFact | None:
    """The fact one line of llama-server's stderr carries, or None."""
    message = _PREFIX.sub("", clean_line(line), count=1)
    if _OOM.search(message):
        return OutOfMemory(message.strip())
    if _FAILED.search(message):
        return StartFailed(message.strip())
    if match := _KV_SIZE.search(message):
        return KvCachePart(float(match.group(1)), int(match.group(2)) if match.group(2) else None)
    if match := _N_CTX.search(message):
        return ContextSize(int(match.group(1)))
    if match := _SLOTS.search(message):
        unified = None if match.group(3) is None else match.group(3) == "true"
        return Slots(int(match.group(1)), int(match.group(2)), unified)
    if match := _LISTENING.search(message):
        return Listening(match.group(1))
    if match := _BUILD.search(message):
        return EngineVersion(f"b{match.group(1)}")
    if _LOADING.search(message):
        return PhaseReached("loading")
    if _MODEL_LOADED.search(message):
        return PhaseReached("warming")
    return None


def device_buffer(line: str) -> tuple[int, float] | None:
    """(CUDA device number, MiB) where `line` says llama-server allocated a buffer on a card,
    else None: what it holds on each card, to compare with what the card's memory grew by."""
    match = _DEVICE_BUFFER.search(clean_line(line))
    return (int(match.group(1)), float(match.group(2))) if match else None
