"""SGLang's log: the facts one line of its output carries.

Pure. Every pattern is a line SGLang 0.5.23 itself writes (file in the wheel named beside it); its
lines start `[2026-12-02 10:00:00 TP0] ` (a scheduler process) or `[2026-12-02 10:00:00] `, so each
is searched for, not anchored.
"""

from __future__ import annotations

import re

from worker.engines.base import (
    ContextTooLong,
    GraphsCaptured,
    KvCacheSize,
    Listening,
    LogFact,
    MaxConcurrency,
    ModelLoaded,
    OutOfMemory,
    PhaseReached,
    StartFailed,
    StartupComplete,
    clean_line,
)

# model_executor/model_runner.py
_LOADING = re.compile(r"Load weight begin\.")
_LOADED = re.compile(r"Load weight end\. elapsed=([\d.]+) s, .*mem usage=([\d.]+) GB")
# mem_cache/memory_pool.py ("KV Cache is allocated. dtype: …, #tokens: N, K size: …") and
# model_runner_components/kv_pool_runtime.py ("Post-capture KV sizing: KV cache allocated. …").
_KV_ALLOCATED = re.compile(r"KV [Cc]ache (?:is )?allocated\. dtype: \S+, #tokens: (\d+)")
# managers/scheduler.py: the pool the scheduler serves from, with the context on the same line.
_SCHEDULER = re.compile(r"max_total_num_tokens=(\d+), .*context_len=(\d+)")
# model_runner_components/cuda_graph_setup.py
_CAPTURING = re.compile(r"Capture .+ graph begin\.")
_CAPTURED = re.compile(r"Capture .+ graph end\. (?:bs=\[[^\]]*\], )?elapsed=([\d.]+) s, mem usage=([\d.]+) GB")
# uvicorn, which SGLang's http_server runs; then SGLang's own warm-up and its ready line.
_LISTENING = re.compile(r"Uvicorn running on (\S+)")
_STARTUP_COMPLETE = re.compile(r"Application startup complete\.")
_READY = re.compile(r"The server is fired up and ready to roll!")
# configs/model_config.py: a context longer than the model's own is refused at start.
_TOO_LONG = re.compile(r"context_length \((\d+)\) is greater than the derived context_length \((\d+)\)")
# model_executor/pool_configurator.py (no room for a KV cache in the static share), and PyTorch's.
_OOM = re.compile(
    r"Not enough memory\. Please try to increase --mem-fraction-static|CUDA out of memory|"
    r"torch\.OutOfMemoryError|CUDA error: out of memory|leaves no room for the full KV pool"
)
# managers/scheduler.py, entrypoints/engine.py, entrypoints/http_server.py
_FAILED = re.compile(r"Scheduler hit an exception|Received sigquit from a child process|Initialization failed\.")


def parse_line(line: str) -> LogFact | None:
    """The fact one line of SGLang output carries (stdout or stderr), or None."""
    message = clean_line(line)
    if match := _TOO_LONG.search(message):
        return ContextTooLong(int(match.group(1)), int(match.group(2)), flag="--context-length", model_max=True)
    if _OOM.search(message):
        return OutOfMemory(message.strip())
    if _FAILED.search(message):
        return StartFailed(message.strip())
    return _startup_fact(message)


def _startup_fact(message: str) -> LogFact | None:
    if match := _SCHEDULER.search(message):
        tokens, context = int(match.group(1)), int(match.group(2))
        return KvCacheSize(tokens, MaxConcurrency(context, round(tokens / context, 2)) if context else None)
    if match := _KV_ALLOCATED.search(message):
        return KvCacheSize(int(match.group(1)))
    if match := _LOADED.search(message):
        return ModelLoaded(float(match.group(2)), float(match.group(1)))
    if match := _CAPTURED.search(message):
        return GraphsCaptured(float(match.group(1)), float(match.group(2)))
    if match := _LISTENING.search(message):
        return Listening(match.group(1))
    if _READY.search(message):
        return StartupComplete()
    for pattern, phase in ((_LOADING, "loading"), (_CAPTURING, "capturing"), (_STARTUP_COMPLETE, "warming")):
        if pattern.search(message):
            return PhaseReached(phase)  # type: ignore[arg-type]
    return None
