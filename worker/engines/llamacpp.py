"""llama.cpp's `llama-server`: its command line, environment, endpoints and the facts in its log.

Pure. Strings and flags follow `shared/reference/engines.md` part B; log lines are read from
stderr, with or without `--log-prefix`/`--log-timestamps`.
"""

from __future__ import annotations

import re
from typing import Mapping, Sequence

from worker.engines.base import (
    ContextSize,
    Endpoint,
    EngineVersion,
    KvCacheSize,
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
ALLOWS_ABBREVIATIONS = False  # common/arg.cpp matches options exactly
ORDINARY_FLAGS: frozenset[str] = frozenset()

# /health and /v1/models are public; /metrics, /props and /slots need the key once one is set (B4).
ENDPOINTS: Mapping[str, Endpoint] = {
    "health": Endpoint("/health", needs_api_key=False),
    "models": Endpoint("/v1/models", needs_api_key=False),
    "metrics": Endpoint("/metrics", needs_api_key=True),
    "props": Endpoint("/props", needs_api_key=True),
    "slots": Endpoint("/slots", needs_api_key=True),
}

APP_OWNED_FLAGS = frozenset({"--host", "--port", "--api-key", "--api-key-file", "--alias", "-a"})
# Never allowed: other models or remote backends behind the source check, files exposed or written,
# listeners beyond what the app binds.
FORBIDDEN_FLAGS = frozenset(
    {
        "-m", "--model", "-mu", "--model-url", "-hf", "-hfr", "--hf-repo", "-hff", "--hf-file", "-hfv",
        "--hf-repo-v", "-hffv", "--hf-file-v", "-hft", "--hf-token", "-dr", "--docker-repo", "--rpc",
        "--path", "--api-prefix", "--reuse-port", "--media-path", "--slot-save-path", "--ssl-key-file",
        "--ssl-cert-file", "--ui-mcp-proxy",
    }
)
FORBIDDEN_FLAG_SUFFIXES: tuple[str, ...] = ("-default",)  # presets such as --fim-qwen-7b-default download weights
CODE_EXECUTION_FLAGS = frozenset({"--tools", "--agent", "--mcp-servers-config", "--mcp-servers-json"})
_SECRET_FLAGS = frozenset({"--api-key"})

_PREFIX = re.compile(r"^(?:\d+\.\d+\.\d+\.\d+ )?(?:[IWED] )?")
_BUILD = re.compile(r"^build: (\d+) \((\w+)\)")
_LOADING = re.compile(r"loading model '")
_N_CTX = re.compile(r"llama_context: n_ctx\s+=\s+(\d+)")
_SLOTS = re.compile(r"n_slots = (\d+), n_ctx_slot = (\d+)(?:, kv_unified = '(true|false)')?")
_KV_SIZE = re.compile(r"size =\s*([\d.]+) MiB \(\s*(\d+) cells")
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
) -> list[str]:
    """`llama-server -m MODEL ARGS…` with the app-owned flags last; it splits layers over the GPUs
    it sees by itself, so `tensor_parallel` needs no flag."""
    return [
        *executable, "-m", model, *args,
        "--host", "127.0.0.1", "--port", str(port), "--api-key", api_key, "--alias", served_name, "--metrics",
    ]


def environment(base: Mapping[str, str], gpu_indices: Sequence[int]) -> dict[str, str]:
    """No inherited `LLAMA_ARG_*` or `LLAMA_API_KEY`: only the command line configures the server."""
    return {
        k: v
        for k, v in cuda_environment(base, gpu_indices).items()
        if not k.startswith("LLAMA_ARG_") and k != "LLAMA_API_KEY"
    }


def mask_argv(argv: Sequence[str]) -> list[str]:
    return mask_values(argv, _SECRET_FLAGS, many=False)


def code_execution_reason(args: Sequence[str]) -> str | None:
    """llama.cpp has no code in model repos; its code-running surfaces are all plain flags."""
    return None


def parse_line(line: str) -> LogFact | None:
    """The fact one line of llama-server's stderr carries, or None."""
    message = _PREFIX.sub("", clean_line(line), count=1)
    if _OOM.search(message):
        return OutOfMemory(message.strip())
    if _FAILED.search(message):
        return StartFailed(message.strip())
    if match := _KV_SIZE.search(message):
        return KvCacheSize(tokens=int(match.group(2)), mib=float(match.group(1)))
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
