"""llama.cpp's `llama-server`: the adapter. Its command line, environment, endpoints and planning
are here; its log (`log.py`, and what it allocated on each card: `device_buffer`), arguments
(`args.py`), /metrics names (`metrics.py`), what it says once ready (`ready.py`), whether a start
fits the machine (`memory.py`, reading the model's header through `gguf.py`), its pinned builds
(`releases.py`) and installer (`install.py`, reading a macOS build's files through `macho.py`)
beside it.

Pure. Strings and flags follow `shared/reference/engines.md` part B; log lines are read from
stderr, with or without `--log-prefix`/`--log-timestamps`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Mapping, Sequence

from worker.engines import layout
from worker.engines.base import (
    Endpoint, Launch, LocalDefaults, ModelFormat, Room, Run, VersionRunner, cuda_environment, run_environment,
)
from worker.engines.layout import Unit
from worker.engines.llamacpp import args as llamacpp_args
from worker.engines.llamacpp.install import install
from worker.engines.llamacpp import memory
from worker.engines.llamacpp.find import find_llama_server
from worker.engines.llamacpp.hints import FAILURE_HINTS
from worker.engines.llamacpp.log import device_buffer, parse_line
from worker.engines.llamacpp.metrics import NAMES as METRIC_NAMES
from worker.engines.llamacpp.metrics import PREFIX as METRICS_PREFIX
from worker.engines.llamacpp.metrics import derive_metrics
from worker.engines.llamacpp.ready import READS as READY_READS
from worker.engines.llamacpp.ready import ready_snapshot
from worker.engines.llamacpp.releases import SHIPPED as RELEASES
from worker.engines.llamacpp.tuning import TUNING

if TYPE_CHECKING:
    from worker.hardware.model import EngineInstall, Machine

NAME = "llamacpp"
DISPLAY_NAME = "llama.cpp"
ARGS_TITLE = "llama.cpp (`llama-server`)"
RUNTIMES: frozenset[str] = frozenset({"apple-silicon", "windows", "cpu"})
FALLBACK_RUNTIMES: frozenset[str] = frozenset()  # first wherever it runs
MODEL_FORMAT: ModelFormat = "gguf"
UNIX_SOCKET = True  # `--host PATH.sock`
MEMORY_SHARE = False  # `--fit off` instead: a context that does not fit fails, and a lower tier is tried
DEFAULT_EXECUTABLE: tuple[str, ...] = ("llama-server",)
ALLOWED_ARGS = llamacpp_args.ALLOWLIST  # the only arguments an assignment may set (contract rule 4)
KEY_VARIABLE = "LLAMA_API_KEY"
LOCAL_DEFAULTS = LocalDefaults(("--ctx-size", "4096"), {"8000": ("--ctx-size", "8192"),
                                                    "16000": ("--ctx-size", "16384")})
PRIVATE_ENV_PREFIXES: tuple[str, ...] = ("LLAMA_ARG_",)  # any of its flags, set behind the command line
# On Windows a start that does not fit spills into shared system memory instead of failing (CUDA's
# sysmem fallback, driver 536.40 on), and the desktop's own use of the card grows while it serves:
# each card is planned with this much more kept free there.
WINDOWS_SPARE_MIB = 1024

# /health and /v1/models are public; /metrics, /props and /slots need the key once one is set (B4).
ENDPOINTS: Mapping[str, Endpoint] = {
    "health": Endpoint("/health", needs_api_key=False),
    "models": Endpoint("/v1/models", needs_api_key=False),
    "metrics": Endpoint("/metrics", needs_api_key=True),
    "props": Endpoint("/props", needs_api_key=True),
    "slots": Endpoint("/slots", needs_api_key=True),
}



def command(launch: Launch) -> list[str]:
    """`llama-server -m MODEL ARGS…` with the app-owned flags last; it splits layers over the GPUs
    it sees by itself, so `tensor_parallel` needs no flag, and it has no memory share to be told.

    `--fit off` (contract, Assignment rule 3): with fit on, a context that does not fit is silently
    shrunk or moved off the GPU; off, it fails to allocate, which the supervisor sees and answers
    with a lower tier. A `--host` value ending in `.sock` is a Unix socket (the port is then unused).
    The API key is not here: any local user can read a command line, so it travels in the
    environment (`environment`)."""
    listen = (["--host", launch.socket_path] if launch.socket_path is not None
              else ["--host", "127.0.0.1", "--port", str(launch.port)])
    return [*launch.executable, "-m", launch.model, *launch.args, "--fit", "off", *listen,
            "--alias", launch.served_name, "--metrics"]


def environment(base: Mapping[str, str], gpu_indices: Sequence[int], *, api_key: str | None = None,
                config_home: str | None = None) -> dict[str, str]:
    """Only the app configures the server: no inherited `LLAMA_ARG_*`, `LLAMA_API_KEY` or Vertex AI
    `AIP_*` (they move the port); this run's key as `KEY_VARIABLE`; and the user-level
    `config.ini` looked up under `config_home`, a folder the app owns, so a file planted in
    `~/.config/llama.cpp/` cannot set `host = 0.0.0.0` (`XDG_CONFIG_HOME`; `APPDATA` on Windows)."""
    env = {k: v for k, v in cuda_environment(base, gpu_indices).items() if not k.startswith("AIP_")}
    if config_home is not None and "APPDATA" in env:
        env["APPDATA"] = config_home  # Windows looks there, not under XDG_CONFIG_HOME
    return run_environment(env, KEY_VARIABLE, api_key, config_home)


def units(machine: Machine, weights_mib: int, cap: float | None) -> list[Unit] | str:
    """One process over a whole group (it splits by layers), the Mac's working set, or RAM; no
    memory share to be held to, so `cap` is unused."""
    return layout.whole_group_units(_as_planned(machine), weights_mib)


def capacity(machine: Machine, cap: float | None) -> str:
    return layout.whole_group_capacity(_as_planned(machine))


def _as_planned(machine: Machine) -> Machine:
    """The machine as llama.cpp is planned on it: on Windows each card keeps `WINDOWS_SPARE_MIB`
    more free than measured usable (a start that does not fit there runs slowly, it does not fail)."""
    if machine.runtime != "windows":
        return machine
    groups = tuple(dataclasses.replace(g, usable_mib_per_gpu=max(0, g.usable_mib_per_gpu - WINDOWS_SPARE_MIB))
                   for g in machine.groups)
    return dataclasses.replace(machine, groups=groups)


def runtime_environment(machine: Machine, version: str | None) -> dict[str, str]:
    """Nothing per runtime: the release built for the platform needs no more."""
    return {}


def tier_warning(machine: Machine, gpu_indices: Sequence[int], tier: str | None, args: Sequence[str],
                 base_args: Sequence[str]) -> str | None:
    """No tier setting is known to slow llama-server down."""
    return None


def start_problem(model_path: str, runs: Sequence[Run], room: Room) -> str | None:
    """llama-server allocates its whole KV cache at start: a context, slot count, cache type,
    prompt cache or thread count the machine cannot hold is refused before it starts (`memory.py`)."""
    return memory.start_problem(model_path, runs, room)


def find_installed(system: str, where: str | None, run: VersionRunner) -> EngineInstall:
    return find_llama_server(where, run)


__all__ = [
    "ALLOWED_ARGS", "ARGS_TITLE", "DEFAULT_EXECUTABLE", "DISPLAY_NAME", "ENDPOINTS", "FAILURE_HINTS",
    "FALLBACK_RUNTIMES", "KEY_VARIABLE", "LOCAL_DEFAULTS", "MEMORY_SHARE", "UNIX_SOCKET", "METRICS_PREFIX",
    "METRIC_NAMES", "MODEL_FORMAT", "NAME", "PRIVATE_ENV_PREFIXES", "READY_READS", "RELEASES", "RUNTIMES", "TUNING",
    "WINDOWS_SPARE_MIB", "capacity", "command", "derive_metrics", "device_buffer", "environment",
    "find_installed", "install", "parse_line", "ready_snapshot", "runtime_environment", "start_problem",
    "tier_warning", "units",
]
