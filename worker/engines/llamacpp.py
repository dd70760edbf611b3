"""llama.cpp's `llama-server`: its command line, environment, endpoints and the facts in its log.

Pure. Strings and flags follow `shared/reference/engines.md` part B; log lines are read from
stderr, with or without `--log-prefix`/`--log-timestamps`.
"""

from __future__ import annotations

import re
from typing import Mapping, Sequence

from worker.engines import llamacpp_args
from worker.engines.base import (
    ContextSize,
    Endpoint,
    EngineVersion,
    KvCachePart,
    Listening,
    LogFact,
    OutOfMemory,
    PhaseReached,
    Slots,
    StartFailed,
    clean_line,
    cuda_environment,
    mask_values,
)

NAME = "llamacpp"
DEFAULT_EXECUTABLE: tuple[str, ...] = ("llama-server",)
ALLOWED_ARGS = llamacpp_args.ALLOWLIST  # the only arguments an assignment may set (contract rule 4)

# /health and /v1/models are public; /metrics, /props and /slots need the key once one is set (B4).
ENDPOINTS: Mapping[str, Endpoint] = {
    "health": Endpoint("/health", needs_api_key=False),
    "models": Endpoint("/v1/models", needs_api_key=False),
    "metrics": Endpoint("/metrics", needs_api_key=True),
    "props": Endpoint("/props", needs_api_key=True),
    "slots": Endpoint("/slots", needs_api_key=True),
}

_SECRET_FLAGS = frozenset({"--api-key"})

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
_OOM = re.compile(r"cudaMalloc failed: out of memory|failed to allocate \S+ buffer|failed to allocate compute")
_FAILED = re.compile(
    r"exiting due to|failed to load model|failed to create_context|couldn't bind HTTP server socket|"
    r"error: invalid argument|error while handling argument"
)


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
    """`llama-server -m MODEL ARGS…` with the app-owned flags last; it splits layers over the GPUs
    it sees by itself, so `tensor_parallel` needs no flag, and it has no memory share to be told,
    so `memory_utilization` is unused.

    `--fit off` (contract, Assignment rule 3): with fit on, a context that does not fit is silently
    shrunk or moved off the GPU; off, it fails to allocate, which the supervisor sees and answers
    with a lower tier. A `--host` value ending in `.sock` is a Unix socket (the port is then unused).
    The API key is not here: any local user can read a command line, so it travels in the
    environment (`environment`); `api_key` is accepted so that callers need not change."""
    listen = ["--host", socket_path] if socket_path is not None else ["--host", "127.0.0.1", "--port", str(port)]
    return [*executable, "-m", model, *args, "--fit", "off", *listen, "--alias", served_name, "--metrics"]


def environment(base: Mapping[str, str], gpu_indices: Sequence[int], *, api_key: str | None = None,
                config_home: str | None = None) -> dict[str, str]:
    """Only the app configures the server: no inherited `LLAMA_ARG_*`, `LLAMA_API_KEY` or Vertex AI
    `AIP_*` (they move the port); this run's key as `LLAMA_API_KEY`; and the user-level
    `config.ini` looked up under `config_home`, a folder the app owns, so a file planted in
    `~/.config/llama.cpp/` cannot set `host = 0.0.0.0` (`XDG_CONFIG_HOME`; `APPDATA` on Windows)."""
    env = {k: v for k, v in cuda_environment(base, gpu_indices).items() if not k.startswith("AIP_")}
    if api_key is not None:
        env["LLAMA_API_KEY"] = api_key
    if config_home is not None:
        env["XDG_CONFIG_HOME"] = config_home
        if "APPDATA" in env:
            env["APPDATA"] = config_home
    return env


def mask_argv(argv: Sequence[str]) -> list[str]:
    return mask_values(argv, _SECRET_FLAGS, many=False)


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
