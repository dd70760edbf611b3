"""SGLang (`python -m sglang.launch_server`, through the app's `launcher.py`): the adapter. Its
command line, environment and endpoints are here; its log (`log.py`), arguments (`args.py`),
planning rules and memory share (`planning.py`), /metrics names (`metrics.py`), shipped release
(`releases.py`), finding (`find.py`), installer (`install.py`), failure hints (`hints.py`) and launcher (`launcher.py`)
beside it.

Pure. Strings and flags are SGLang 0.5.23's (read from its wheel; each module names the file).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from worker.contract.events import EngineSnapshot
from worker.engines.base import (
    Endpoint, Launch, LocalDefaults, ModelFormat, Slots, VersionRunner, cuda_environment, run_environment,
)
from worker.engines.sglang import args as sglang_args
from worker.engines.sglang.find import find_sglang
from worker.engines.sglang.hints import FAILURE_HINTS
from worker.engines.sglang.install import install
from worker.engines.sglang.launcher import KEY_VARIABLE
from worker.engines.sglang.log import parse_line
from worker.engines.sglang.metrics import NAMES as METRIC_NAMES
from worker.engines.sglang.metrics import PREFIX as METRICS_PREFIX
from worker.engines.sglang.metrics import derive_metrics
from worker.engines.sglang.planning import (
    capacity,
    runtime_environment,
    serves_group,
    static_fraction,
    tier_warning,
    units,
)
from worker.engines.sglang.releases import RUNTIMES
from worker.engines.sglang.releases import SHIPPED as RELEASES
from worker.engines.sglang.tuning import TUNING

if TYPE_CHECKING:
    from worker.hardware.model import EngineInstall

NAME = "sglang"
DISPLAY_NAME = "SGLang"
ARGS_TITLE = "SGLang 0.5.23 (`python -m sglang.launch_server`)"
FALLBACK_RUNTIMES: frozenset[str] = frozenset()
MODEL_FORMAT: ModelFormat = "folder"
UNIX_SOCKET = False  # no Unix socket listener: 127.0.0.1 and its key
MEMORY_SHARE = True  # told `--mem-fraction-static`: the measured usable share less its activation headroom
DEFAULT_EXECUTABLE: tuple[str, ...] = ("python3",)  # the Python of SGLang's venv, which runs `LAUNCHER`
ALLOWED_ARGS = sglang_args.ALLOWLIST  # the only arguments an assignment may set (contract rule 4)
READY_READS: tuple[str, ...] = ()  # its log and /v1/models say all there is to know
# Local mode on a GPU machine asks vLLM first (registration order), so this is read only where vLLM is not.
LOCAL_DEFAULTS = LocalDefaults(("--context-length", "8192"))
# The launcher reads this run's key from it (SGLang itself takes a key only as `--api-key`); and no
# child inherits an `SGLANG_*` variable: they override SGLang's checks and limits.
PRIVATE_ENV_PREFIXES: tuple[str, ...] = ("SGLANG_",)
LAUNCHER = Path(__file__).with_name("launcher.py")

# `utils/auth.py`: /health*, /ready* and /metrics* are never authenticated; everything else is once
# a key is set.
ENDPOINTS: Mapping[str, Endpoint] = {
    "health": Endpoint("/health", needs_api_key=False),
    "models": Endpoint("/v1/models", needs_api_key=True),
    "metrics": Endpoint("/metrics", needs_api_key=False),
}
TCP_ONLY = "SGLang serves HTTP on a TCP port only (it has no Unix socket listener); start it on 127.0.0.1"


def command(launch: Launch) -> list[str]:
    """`PYTHON launcher.py --model-path MODEL ARGS…` with the app-owned flags last, so they win.

    `--tp-size`/`--dp-size` are the plan's layout (one process per replica, so `--dp-size 1`);
    `--mem-fraction-static` is the share measured usable less SGLang's activation headroom
    (`planning.static_fraction`); `--enable-metrics` serves /metrics. SGLang listens on TCP only, so
    a Unix socket is refused (ValueError). The API key is not here: the launcher reads it from
    the environment (`environment`)."""
    if launch.socket_path is not None:
        raise ValueError(TCP_ONLY)
    share = launch.memory_utilization
    memory = [] if share is None else ["--mem-fraction-static", f"{static_fraction(share):g}"]
    return [*launch.executable, str(LAUNCHER), "--model-path", launch.model, *launch.args,
            "--tp-size", str(launch.tensor_parallel), "--dp-size", "1", *memory, "--host", "127.0.0.1",
            "--port", str(launch.port), "--served-model-name", launch.served_name, "--enable-metrics"]


def environment(base: Mapping[str, str], gpu_indices: Sequence[int], *, api_key: str | None = None,
                config_home: str | None = None) -> dict[str, str]:
    """Nothing inherited that sets SGLang behind its command line (`PRIVATE_ENV_PREFIXES`), no
    colour, unbuffered logs; this run's key as the launcher's `KEY_VARIABLE`, and user config under
    `config_home` rather than `~/.config`."""
    env = {k: v for k, v in cuda_environment(base, gpu_indices).items()
           if k != KEY_VARIABLE and not k.startswith(PRIVATE_ENV_PREFIXES)}
    env.update({"NO_COLOR": "1", "PYTHONUNBUFFERED": "1", "DO_NOT_TRACK": "1"})
    return run_environment(env, KEY_VARIABLE, api_key, config_home)


def ready_snapshot(reads: Mapping[str, Any], snapshot: EngineSnapshot, slots: Slots | None) -> EngineSnapshot:
    """Nothing to add: SGLang's log and /v1/models said it all (`READY_READS` is empty)."""
    return snapshot


def find_installed(system: str, where: str | None, run: VersionRunner) -> EngineInstall:
    return find_sglang(system, where, run)


__all__ = [
    "ALLOWED_ARGS", "ARGS_TITLE", "DEFAULT_EXECUTABLE", "DISPLAY_NAME", "ENDPOINTS", "FAILURE_HINTS",
    "FALLBACK_RUNTIMES", "KEY_VARIABLE", "LOCAL_DEFAULTS", "LAUNCHER", "MEMORY_SHARE", "UNIX_SOCKET",
    "METRICS_PREFIX", "METRIC_NAMES", "MODEL_FORMAT", "NAME", "PRIVATE_ENV_PREFIXES", "READY_READS", "RELEASES",
    "RUNTIMES", "TUNING", "capacity", "command", "derive_metrics", "environment", "find_installed", "install",
    "parse_line", "ready_snapshot", "runtime_environment", "serves_group", "tier_warning", "units",
]
