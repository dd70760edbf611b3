"""The switches a test sets (environment variables) to make the stand-in misbehave on purpose.

| variable | effect |
| --- | --- |
| `STANDIN_VERSION` | `0.33` (default: KV size and concurrency on one line) or `0.11` (two lines, older texts) |
| `STANDIN_MODEL_MAX_LEN` | the model's own context length, used when `--max-model-len` is absent (32768) |
| `STANDIN_KV_TOKENS` | KV cache tokens the "GPU" holds (445888); a `--max-model-len` above it is refused as vLLM does |
| `STANDIN_KV_GIB` | "Available KV cache memory" printed (61.23) |
| `STANDIN_OOM_ABOVE_MAX_MODEL_LEN` | CUDA out of memory while loading when the effective max model len is above this |
| `STANDIN_EXIT_AT_START` | exit with this status during start, after an engine-core traceback |
| `STANDIN_START_DELAY_S` | seconds spent "loading" before the port answers |
| `STANDIN_TOKEN_DELAY_S` | seconds between generated tokens |
| `STANDIN_CRASH_AFTER_REQUESTS` | the process exits (status 1) after finishing this many completions |
| `STANDIN_STALL_AFTER_REQUESTS` | completions after this many produce no token, ever (health still answers) |
| `STANDIN_FREEZE_AFTER_REQUESTS` | after this many completions, no endpoint answers any more |
| `STANDIN_IGNORE_SIGTERM` | `1`: ignore SIGTERM and SIGINT, so only SIGKILL stops it |
| `STANDIN_ENGINE_CORE` | `0`: no engine-core child process (default `1`, as vLLM runs one) |
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


def _int(env: Mapping[str, str], name: str, default: int | None) -> int | None:
    value = env.get(name)
    return int(value) if value not in (None, "") else default


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    value = env.get(name)
    return float(value) if value not in (None, "") else default


@dataclass(frozen=True)
class Behaviour:
    version: str = "0.33"
    model_max_len: int = 32768
    kv_tokens: int = 445888
    kv_gib: float = 61.23
    oom_above_max_model_len: int | None = None
    exit_at_start: int | None = None
    start_delay_s: float = 0.0
    token_delay_s: float = 0.0
    crash_after_requests: int | None = None
    stall_after_requests: int | None = None
    freeze_after_requests: int | None = None
    ignore_sigterm: bool = False
    engine_core: bool = True

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Behaviour:
        version = env.get("STANDIN_VERSION", "0.33")
        if version not in ("0.33", "0.11"):
            raise ValueError(f"STANDIN_VERSION must be 0.33 or 0.11, not {version!r}")
        return cls(
            version=version,
            model_max_len=_int(env, "STANDIN_MODEL_MAX_LEN", 32768) or 32768,
            kv_tokens=_int(env, "STANDIN_KV_TOKENS", 445888) or 0,
            kv_gib=_float(env, "STANDIN_KV_GIB", 61.23),
            oom_above_max_model_len=_int(env, "STANDIN_OOM_ABOVE_MAX_MODEL_LEN", None),
            exit_at_start=_int(env, "STANDIN_EXIT_AT_START", None),
            start_delay_s=_float(env, "STANDIN_START_DELAY_S", 0.0),
            token_delay_s=_float(env, "STANDIN_TOKEN_DELAY_S", 0.0),
            crash_after_requests=_int(env, "STANDIN_CRASH_AFTER_REQUESTS", None),
            stall_after_requests=_int(env, "STANDIN_STALL_AFTER_REQUESTS", None),
            freeze_after_requests=_int(env, "STANDIN_FREEZE_AFTER_REQUESTS", None),
            ignore_sigterm=env.get("STANDIN_IGNORE_SIGTERM") == "1",
            engine_core=env.get("STANDIN_ENGINE_CORE", "1") != "0",
        )
