"""vLLM (`vllm serve`): its command line, environment, endpoints and the facts in its log.

Pure. Strings and flags follow `shared/reference/engines.md` part A (0.33.0, with the older
0.11/0.20 variants still recognised).
"""

from __future__ import annotations

import re
from typing import Mapping, Sequence

from worker.engines import vllm_args
from worker.engines.base import (
    CompileFinished,
    ContextTooLong,
    Endpoint,
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
    cuda_environment,
    mask_values,
)

NAME = "vllm"
DEFAULT_EXECUTABLE: tuple[str, ...] = ("vllm",)
ALLOWED_ARGS = vllm_args.ALLOWLIST  # the only arguments an assignment may set (contract rule 4)

# /health, /metrics and /version are never authenticated; every /v1 path is (A4).
ENDPOINTS: Mapping[str, Endpoint] = {
    "health": Endpoint("/health", needs_api_key=False),
    "models": Endpoint("/v1/models", needs_api_key=True),
    "metrics": Endpoint("/metrics", needs_api_key=False),
    "version": Endpoint("/version", needs_api_key=False),
}

_SECRET_FLAGS = frozenset({"--api-key"})
# Inherited variables that would change the API key, the log format we parse, or open dev endpoints.
_DROPPED_ENV = frozenset(
    {"VLLM_API_KEY", "VLLM_PORT", "VLLM_LOGGING_PREFIX", "VLLM_LOGGING_CONFIG_PATH", "VLLM_CONFIGURE_LOGGING",
     "VLLM_SERVER_DEV_MODE"}
)

_PREFIX = re.compile(
    r"^.*?\((?:\w+) pid=\d+\) (?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]+:\d+\] )?"
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
_FREE_MEMORY = re.compile(r"Free memory on device .*? on startup is less than desired GPU memory utilization")
_FAILED = re.compile(r"EngineCore failed to start|Engine core initialization failed")


def command(
    executable: Sequence[str],
    model: str,
    args: Sequence[str],
    *,
    port: int,
    api_key: str,
    served_name: str,
    tensor_parallel: int = 1,
    socket_path: str | None = None,
    memory_utilization: float | None = None,
) -> list[str]:
    """`vllm serve MODEL ARGS…` with the app-owned flags last, so they win over anything before.

    `--gpu-memory-utilization` is the share of each card the plan measured as usable (contract,
    Assignment rule 3): vLLM's default (0.92 of total) fails its own start-up check on a card whose
    desktop holds more than 8 %. `--uds PATH` (a Unix socket) replaces the port where the platform
    has one; `--host 127.0.0.1` stays either way, as vLLM's default host is every interface. The API
    key is not here: any local user can read a command line, so it travels in the environment
    (`environment`); `api_key` is accepted so that callers need not change."""
    parallel = ["--tensor-parallel-size", str(tensor_parallel)] if tensor_parallel > 1 else []
    memory = [] if memory_utilization is None else ["--gpu-memory-utilization", f"{memory_utilization:g}"]
    listen = ["--uds", socket_path] if socket_path is not None else ["--port", str(port)]
    return [*executable, "serve", model, *args, *parallel, *memory, "--host", "127.0.0.1", *listen,
            "--served-model-name", served_name]


def environment(base: Mapping[str, str], gpu_indices: Sequence[int], *, api_key: str | None = None,
                config_home: str | None = None) -> dict[str, str]:
    """No usage stats, no colour, unbuffered logs, nothing inherited that changes keys or log format;
    this run's key as `VLLM_API_KEY` (read when `--api-key` is absent), and user config read from
    `config_home` (a folder the app owns) rather than `~/.config`."""
    env = {k: v for k, v in cuda_environment(base, gpu_indices).items() if k not in _DROPPED_ENV}
    env.update(
        {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_LOGGING_COLOR": "0", "NO_COLOR": "1",
         "PYTHONUNBUFFERED": "1"}
    )
    if api_key is not None:
        env["VLLM_API_KEY"] = api_key
    if config_home is not None:
        env["XDG_CONFIG_HOME"] = config_home
    return env


def mask_argv(argv: Sequence[str]) -> list[str]:
    """The command line as shown in status and logs: `--api-key` takes one or more values (nargs +)."""
    return mask_values(argv, _SECRET_FLAGS, many=True)


def parse_line(line: str) -> LogFact | None:
    """The fact one line of vLLM output carries (stdout or stderr), or None."""
    message = _PREFIX.sub("", clean_line(line), count=1)
    if match := _TOO_LONG.search(message):
        estimate = _ESTIMATED.search(message)
        return ContextTooLong(int(match.group(1)), int(estimate.group(1)) if estimate else None)
    if _FREE_MEMORY.search(message):
        return FreeMemoryShort(message.strip())
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
