"""vLLM's log: the facts one line of its output carries.

Pure. Strings follow `shared/reference/engines.md` part A (0.33.0, with the older 0.11/0.20
variants still recognised).
"""

from __future__ import annotations

import re

from worker.engines.base import (
    CompileFinished,
    ContextTooLong,
    EngineVersion,
    FreeMemoryShort,
    GraphsCaptured,
    KvCacheMemory,
    KvCacheSize,
    Listening,
    LogFact,
    MaxConcurrency,
    MaxModelLen,
    ModelLoaded,
    OutOfMemory,
    PhaseReached,
    StartFailed,
    StartupComplete,
    clean_line,
)

_PREFIX = re.compile(
    r"^.*?\((?:[\w-]+) pid=\d+\) (?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]+:\d+\] )?"
)
_VERSION = re.compile(r"vLLM (?:API )?server version (\d+\.\d+\.\d+[^\s,]*)|\s{2}version (\d+\.\d+\.\d+\S*)\s*$")
_MAX_MODEL_LEN = re.compile(r"Using max model len (\d+)")
_LOADING = re.compile(r"Starting to load model|Loading model from scratch")
_MODEL_LOADED = re.compile(r"Model loading took ([\d.]+) GiB(?: memory)? and ([\d.]+) seconds")
_COMPILING = re.compile(r"Starting torch\.compile|Dynamo bytecode transform time")
_COMPILED = re.compile(
    r"torch\.compile (?:and initial profiling/warmup run together )?(?:takes|took) ([\d.]+) s in total"
)
_KV_MEMORY = re.compile(r"Available KV cache memory: ([\d.]+) GiB")
_KV_SIZE = re.compile(r"[A-Z]+(?: \+ host)? KV cache size: ([\d,]+) tokens")
_CONCURRENCY = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")
_CAPTURING = re.compile(r"Capturing CUDA graphs")
_CAPTURED = re.compile(r"Graph capturing finished in (\d+) secs?, took ([\d.]+) GiB")
_WARMED = re.compile(r"init engine \(profile, create kv cache, warmup model\) took")
_LISTENING = re.compile(r"Starting vLLM (?:API )?server(?: \d+)? on (\S+)")
_STARTUP_COMPLETE = re.compile(r"Application startup complete\.")
_TOO_LONG = re.compile(r"max seq len \((\d+)\)")
_ESTIMATED = re.compile(r"estimated maximum model length is (\d+)")
_OOM = re.compile(
    r"CUDA out of memory|cudaMalloc failed: out of memory|CUDA error: out of memory|"
    r"No available memory for the cache blocks|not enough GPU memory|Cannot auto-fit max_model_len"
)
# The refusal only (A3); a healthy start's INFO hint "Free memory on device (…) on startup. Desired …" is not one.
# The CPU build's (0.32, `v1/worker/cpu_worker.py`) measures its NUMA node's RAM, at start-up and again
# when it allocates the KV cache.
_FREE_MEMORY = re.compile(r"Free memory on device .*? on startup is less than desired GPU memory utilization")
_FREE_RAM = re.compile(
    r"Available memory on node \d+ .*? is less than (?:desired CPU memory utilization|requested memory for kv)"
)
_FAILED = re.compile(r"EngineCore failed to start|Engine core initialization failed")



def parse_line(line: str) -> LogFact | None:
    """The fact one line of vLLM output carries (stdout or stderr), or None."""
    message = _PREFIX.sub("", clean_line(line), count=1)
    if match := _TOO_LONG.search(message):
        estimate = _ESTIMATED.search(message)
        return ContextTooLong(int(match.group(1)), int(estimate.group(1)) if estimate else None)
    if _FREE_MEMORY.search(message):
        return FreeMemoryShort(message.strip())
    if _FREE_RAM.search(message):
        return FreeMemoryShort(message.strip(), in_ram=True)
    if _OOM.search(message):
        return OutOfMemory(message.strip())
    if _FAILED.search(message):
        return StartFailed(message.strip())
    return _startup_fact(message)


def _startup_fact(message: str) -> LogFact | None:
    if match := _KV_SIZE.search(message):
        concurrency = _CONCURRENCY.search(message)
        return KvCacheSize(
            tokens=_count(match.group(1)),
            concurrency=MaxConcurrency(_count(concurrency.group(1)), float(concurrency.group(2)))
            if concurrency
            else None,
        )
    if match := _CONCURRENCY.search(message):
        return MaxConcurrency(_count(match.group(1)), float(match.group(2)))
    if match := _KV_MEMORY.search(message):
        return KvCacheMemory(float(match.group(1)))
    if match := _MODEL_LOADED.search(message):
        return ModelLoaded(float(match.group(1)), float(match.group(2)))
    if match := _COMPILED.search(message):
        return CompileFinished(float(match.group(1)))
    if match := _CAPTURED.search(message):
        return GraphsCaptured(float(match.group(1)), float(match.group(2)))
    if match := _MAX_MODEL_LEN.search(message):
        return MaxModelLen(int(match.group(1)))
    if match := _LISTENING.search(message):
        return Listening(match.group(1))
    if match := _VERSION.search(message):
        return EngineVersion(match.group(1) or match.group(2))
    return _phase(message)


def _phase(message: str) -> LogFact | None:
    if _STARTUP_COMPLETE.search(message):
        return StartupComplete()
    for pattern, phase in ((_LOADING, "loading"), (_COMPILING, "compiling"), (_CAPTURING, "capturing"),
                           (_WARMED, "warming")):
        if pattern.search(message):
            return PhaseReached(phase)  # type: ignore[arg-type]
    return None


def _count(text: str) -> int:
    return int(text.replace(",", ""))
