"""vLLM (`vllm serve`): the adapter. Its command line, environment and endpoints are here; its log
(`log.py`), arguments (`args.py`), planning rules (`planning.py`), /metrics names (`metrics.py`),
shipped builds (`releases.py`) and installer (`install.py`) beside it.

Pure. Strings and flags follow `shared/reference/engines.md` part A (0.33.0, with the older
0.11/0.20 variants still recognised).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence

from worker.engines.base import (
    Endpoint, Launch, LocalDefaults, ModelFormat, Slots, VersionRunner, cuda_environment, run_environment,
)
from worker.engines.vllm.find import find_vllm
from worker.engines.vllm.hints import FAILURE_HINTS
from worker.engines.vllm import args as vllm_args
from worker.engines.vllm.install import install
from worker.engines.vllm.log import parse_line
from worker.engines.vllm.metrics import NAMES as METRIC_NAMES
from worker.engines.vllm.metrics import PREFIX as METRICS_PREFIX
from worker.engines.vllm.metrics import derive_metrics
from worker.engines.vllm.planning import capacity, runtime_environment, serves_group, tier_warning, units
from worker.engines.vllm.releases import SHIPPED as RELEASES
from worker.engines.vllm.tuning import TUNING
from worker.contract.events import EngineSnapshot

if TYPE_CHECKING:
    from worker.hardware.model import EngineInstall

NAME = "vllm"
DISPLAY_NAME = "vLLM"
ARGS_TITLE = "vLLM 0.33 (`vllm serve`)"
# NVIDIA on Linux, or inside WSL2 on Windows; its CPU build on `cpu`, where it is installed.
RUNTIMES: frozenset[str] = frozenset({"native", "wsl2", "cpu"})
# Runtimes it serves only for a model with no block for the others (contract: llama.cpp first on `cpu`).
FALLBACK_RUNTIMES: frozenset[str] = frozenset({"cpu"})
MODEL_FORMAT: ModelFormat = "folder"
UNIX_SOCKET = True  # `--uds`
MEMORY_SHARE = True  # `--gpu-memory-utilization`: its start-up check fails on a card the desktop holds
DEFAULT_EXECUTABLE: tuple[str, ...] = ("vllm",)
ALLOWED_ARGS = vllm_args.ALLOWLIST  # the only arguments an assignment may set (contract rule 4)
READY_READS: tuple[str, ...] = ()  # its log and /v1/models say all there is to know
LOCAL_DEFAULTS = LocalDefaults(("--max-model-len", "8192"))
KEY_VARIABLE = "VLLM_API_KEY"  # read when `--api-key` is absent
PRIVATE_ENV_PREFIXES: tuple[str, ...] = ()

# /health, /metrics and /version are never authenticated; every /v1 path is (A4).
ENDPOINTS: Mapping[str, Endpoint] = {
    "health": Endpoint("/health", needs_api_key=False),
    "models": Endpoint("/v1/models", needs_api_key=True),
    "metrics": Endpoint("/metrics", needs_api_key=False),
    "version": Endpoint("/version", needs_api_key=False),
}

# Inherited variables that would change the API key, the log format we parse, or open dev endpoints.
_DROPPED_ENV = frozenset(
    {KEY_VARIABLE, "VLLM_PORT", "VLLM_LOGGING_PREFIX", "VLLM_LOGGING_CONFIG_PATH", "VLLM_CONFIGURE_LOGGING",
     "VLLM_SERVER_DEV_MODE", "VLLM_CPU_KVCACHE_SPACE"}  # the last: a KV size that skips the CPU build's memory check
)


def command(launch: Launch) -> list[str]:
    """`vllm serve MODEL ARGS…` with the app-owned flags last, so they win over anything before.

    `--gpu-memory-utilization` is the share of each card the plan measured as usable (contract,
    Assignment rule 3): vLLM's default (0.92 of total) fails its own start-up check on a card whose
    desktop holds more than 8 %. `--uds PATH` (a Unix socket) replaces the port where the platform
    has one; `--host 127.0.0.1` stays either way, as vLLM's default host is every interface. The API
    key is not here: any local user can read a command line, so it travels in the environment
    (`environment`)."""
    parallel = ["--tensor-parallel-size", str(launch.tensor_parallel)] if launch.tensor_parallel > 1 else []
    share = launch.memory_utilization
    memory = [] if share is None else ["--gpu-memory-utilization", f"{share:g}"]
    listen = ["--uds", launch.socket_path] if launch.socket_path is not None else ["--port", str(launch.port)]
    return [*launch.executable, "serve", launch.model, *launch.args, *parallel, *memory, "--host", "127.0.0.1",
            *listen, "--served-model-name", launch.served_name]


def environment(base: Mapping[str, str], gpu_indices: Sequence[int], *, api_key: str | None = None,
                config_home: str | None = None) -> dict[str, str]:
    """No usage stats, no colour, unbuffered logs, nothing inherited that changes keys or log format;
    this run's key as `KEY_VARIABLE` (read when `--api-key` is absent), and user config read from
    `config_home` (a folder the app owns) rather than `~/.config`."""
    env = {k: v for k, v in cuda_environment(base, gpu_indices).items() if k not in _DROPPED_ENV}
    env.update(
        {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_LOGGING_COLOR": "0", "NO_COLOR": "1",
         "PYTHONUNBUFFERED": "1"}
    )
    return run_environment(env, KEY_VARIABLE, api_key, config_home)


def ready_snapshot(reads: Mapping[str, Any], snapshot: EngineSnapshot, slots: Slots | None) -> EngineSnapshot:
    """Nothing to add: vLLM's log and /v1/models said it all (`READY_READS` is empty)."""
    return snapshot


def find_installed(system: str, where: str | None, run: VersionRunner) -> EngineInstall:
    return find_vllm(system, where, run)


__all__ = [
    "ALLOWED_ARGS", "ARGS_TITLE", "DEFAULT_EXECUTABLE", "DISPLAY_NAME", "ENDPOINTS", "FAILURE_HINTS",
    "FALLBACK_RUNTIMES", "KEY_VARIABLE", "LOCAL_DEFAULTS", "MEMORY_SHARE", "UNIX_SOCKET", "METRICS_PREFIX",
    "METRIC_NAMES", "MODEL_FORMAT", "NAME", "PRIVATE_ENV_PREFIXES", "READY_READS", "RELEASES", "RUNTIMES", "TUNING",
    "capacity", "command", "derive_metrics", "environment", "find_installed", "install", "parse_line",
    "ready_snapshot", "runtime_environment", "serves_group", "tier_warning", "units",
]
