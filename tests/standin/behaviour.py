"""The switches a test sets (environment variables) to make the stand-in misbehave on purpose.

| variable | effect |
| --- | --- |
| `STANDIN_VERSION` | `0.33` (default: KV size and concurrency on one line) or `0.11` (two lines, older texts) |
| `STANDIN_MODEL_MAX_LEN` | the model's own context length, used when `--max-model-len` is absent (32768) |
| `STANDIN_KV_TOKENS` | KV cache tokens the default card holds (445888); a `--max-model-len` above it is refused as vLLM does |
| `STANDIN_KV_GIB` | "Available KV cache memory" on the default card (61.23) |
| `STANDIN_GPU_TOTAL_MIB` | the card's total memory: one figure for every card, or one per GPU index (`24564,24564`); setting this or the next makes the KV budget follow from memory (see memory.py) instead of `STANDIN_KV_*` |
| `STANDIN_GPU_FREE_MIB` | the card's free memory at start (default: all of it), the same way; vLLM refuses when `--gpu-memory-utilization` × total is more |
| `STANDIN_WEIGHTS_MIB` | the weights' size (default: the model folder's `*.safetensors`) |
| `STANDIN_KV_BYTES_PER_TOKEN` | KV bytes one token costs over all layers (147456: Qwen3-8B in bf16) |
| `CUDA_VISIBLE_DEVICES` | which of those GPUs this process sees, as for vLLM (default: all) |
| `STANDIN_OOM_ABOVE_MAX_MODEL_LEN` | CUDA out of memory while loading when the effective max model len is above this |
| `STANDIN_EXIT_AT_START` | exit with this status during start, after an engine-core traceback |
| `STANDIN_START_DELAY_S` | seconds spent "loading" before the port answers |
| `STANDIN_TOKEN_DELAY_S` | seconds between generated tokens |
| `STANDIN_CRASH_AFTER_REQUESTS` | the process exits (status 1) after finishing this many completions |
| `STANDIN_STALL_AFTER_REQUESTS` | completions after this many produce no token, ever (health still answers) |
| `STANDIN_FREEZE_AFTER_REQUESTS` | after this many completions, no endpoint answers any more |
| `STANDIN_IGNORE_SIGTERM` | `1`: ignore SIGTERM and SIGINT, so only SIGKILL stops it |
| `STANDIN_ENGINE_CORE` | `0`: no engine-core child process (default `1`, as vLLM runs one) |
| `STANDIN_PERF_SCALE` | paces tokens by the field notes' speeds (performance.py), this many times faster; unset: no pacing |
| `VLLM_LOG_STATS_INTERVAL` | vLLM's own: seconds between its stats lines (10), scaled with `STANDIN_PERF_SCALE` |
| `STANDIN_DRAFTER_GRAPH_CHUNK` | the `--max-num-batched-tokens` from which the drafter's CUDA graph fails (8192) |
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TOTAL_MIB = 81559  # an idle 80 GB card: every share fits, and the KV budget is STANDIN_KV_*
KV_BYTES_PER_TOKEN = 147456  # Qwen3-8B, bf16: 36 layers × 8 KV heads × 128 × 2 (K and V) × 2 bytes
ACTIVATION_MIB = 1536  # peak activations, CUDA graphs and non-torch memory, held out of the KV cache


def _int(env: Mapping[str, str], name: str, default: int | None) -> int | None:
    value = env.get(name)
    return int(value) if value not in (None, "") else default


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    value = env.get(name)
    return float(value) if value not in (None, "") else default


def _mib_list(env: Mapping[str, str], name: str) -> tuple[int, ...] | None:
    value = env.get(name)
    if value in (None, ""):
        return None
    return tuple(int(part) for part in value.split(","))


def _perf_scale(env: Mapping[str, str]) -> float | None:
    value = env.get("STANDIN_PERF_SCALE")
    if value in (None, ""):
        return None
    scale = float(value)
    if not 0 < scale <= 10_000:
        raise ValueError(f"STANDIN_PERF_SCALE must be above 0 and at most 10000, not {value}")
    return scale


@dataclass(frozen=True)
class Card:
    """One GPU as the stand-in pretends to see it when it starts."""

    total_mib: int
    free_mib: int


def _machine(env: Mapping[str, str]) -> tuple[Card, ...] | None:
    """The cards STANDIN_GPU_* describe, by GPU index; None when the test set neither."""
    totals, frees = _mib_list(env, "STANDIN_GPU_TOTAL_MIB"), _mib_list(env, "STANDIN_GPU_FREE_MIB")
    if totals is None and frees is None:
        return None
    totals = totals or (DEFAULT_TOTAL_MIB,)
    frees = frees or totals
    count = max(len(totals), len(frees))
    if {len(totals), len(frees)} - {1, count}:
        raise ValueError("STANDIN_GPU_TOTAL_MIB and STANDIN_GPU_FREE_MIB list different numbers of GPUs")
    cards = tuple(Card(totals[i % len(totals)], frees[i % len(frees)]) for i in range(count))
    if any(card.free_mib > card.total_mib for card in cards):
        raise ValueError("STANDIN_GPU_FREE_MIB is more than STANDIN_GPU_TOTAL_MIB")
    return cards


def _visible(env: Mapping[str, str], machine: tuple[Card, ...]) -> tuple[Card, ...]:
    """The cards CUDA_VISIBLE_DEVICES names, in its order (a single card stands for every index)."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return machine
    indices = [int(part) for part in visible.split(",") if part.strip()]
    if len(machine) > 1 and any(i >= len(machine) for i in indices):
        raise ValueError(f"CUDA_VISIBLE_DEVICES={visible} names a GPU STANDIN_GPU_* does not list")
    return tuple(machine[i if len(machine) > 1 else 0] for i in indices)


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
    cards: tuple[Card, ...] = (Card(DEFAULT_TOTAL_MIB, DEFAULT_TOTAL_MIB),)  # as visible to this process
    gpu_given: bool = False  # STANDIN_GPU_* set: the KV budget follows from memory
    weights_override_mib: int | None = None
    kv_bytes_per_token: int = KV_BYTES_PER_TOKEN
    activation_mib: int = ACTIVATION_MIB
    perf_scale: float | None = None
    drafter_graph_chunk: int = 8192
    log_stats_interval_s: float = 10.0

    def weights_bytes(self, model: str) -> int:
        """STANDIN_WEIGHTS_MIB, else the size of the model folder's safetensors (0 for a name)."""
        if self.weights_override_mib is not None:
            return self.weights_override_mib << 20
        folder = Path(model)
        return sum(f.stat().st_size for f in folder.glob("*.safetensors")) if folder.is_dir() else 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Behaviour:
        version = env.get("STANDIN_VERSION", "0.33")
        if version not in ("0.33", "0.11"):
            raise ValueError(f"STANDIN_VERSION must be 0.33 or 0.11, not {version!r}")
        machine = _machine(env)
        if machine is not None and (env.get("STANDIN_KV_TOKENS") or env.get("STANDIN_KV_GIB")):
            raise ValueError("STANDIN_KV_* fix the KV budget of the default card; with STANDIN_GPU_* it follows "
                             "from memory (set STANDIN_KV_BYTES_PER_TOKEN or STANDIN_WEIGHTS_MIB instead)")
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
            cards=_visible(env, machine or cls.cards),
            gpu_given=machine is not None,
            weights_override_mib=_int(env, "STANDIN_WEIGHTS_MIB", None),
            kv_bytes_per_token=_int(env, "STANDIN_KV_BYTES_PER_TOKEN", KV_BYTES_PER_TOKEN) or KV_BYTES_PER_TOKEN,
            perf_scale=_perf_scale(env),
            drafter_graph_chunk=_int(env, "STANDIN_DRAFTER_GRAPH_CHUNK", 8192) or 8192,
            log_stats_interval_s=_float(env, "VLLM_LOG_STATS_INTERVAL", 10.0),
        )
