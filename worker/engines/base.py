"""What every engine adapter shares: typed log facts, endpoints, and argument helpers.

Pure. Each engine package (`vllm/`, `llamacpp/`) exposes the same functions and constants;
`EngineAdapter` is that shape, so no module outside an engine's own package branches on its name.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Mapping, Protocol, Sequence, Union, runtime_checkable

from worker.engines import registry
from worker.engines.allowlist import Allowlist
from worker.contract.events import EngineSnapshot, StartPhase

if TYPE_CHECKING:  # the hardware and provision packages import the engines, never the other way
    from worker.engines.layout import Unit
    from worker.engines.releases import Releases
    from worker.hardware.model import EngineInstall, GpuGroup, Machine

ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@dataclass(frozen=True)
class PhaseReached:
    """The engine entered a start phase (for the GUI's progress)."""

    phase: StartPhase


@dataclass(frozen=True)
class EngineVersion:
    version: str


@dataclass(frozen=True)
class MaxModelLen:
    tokens: int


@dataclass(frozen=True)
class ModelLoaded:
    gib: float
    seconds: float | None = None


@dataclass(frozen=True)
class CompileFinished:
    seconds: float


@dataclass(frozen=True)
class GraphsCaptured:
    seconds: float
    gib: float


@dataclass(frozen=True)
class KvCacheMemory:
    gib: float


@dataclass(frozen=True)
class MaxConcurrency:
    tokens_per_request: int
    times: float


@dataclass(frozen=True)
class KvCacheSize:
    """vLLM's KV capacity in tokens; ≥ 0.2x prints the concurrency on the same line."""

    tokens: int
    concurrency: MaxConcurrency | None = None


@dataclass(frozen=True)
class KvCachePart:
    """One `llama_kv_cache` of a llama.cpp start: a sliding-window model has two, and a hybrid
    recurrent one a recurrent state besides, which is no KV cache. The budget is the sum of the
    parts' MiB and the largest `cells` (the full-attention cache); None where the oldest builds
    printed no cells."""

    mib: float
    cells: int | None


@dataclass(frozen=True)
class ContextTooLong:
    """The engine refused the context asked for: more KV cache than there is memory for (vLLM), or
    more than the model itself takes (`model_max`: SGLang). `flag` is the engine's context flag."""

    max_seq_len: int
    estimated_max_len: int | None
    flag: str = "--max-model-len"
    model_max: bool = False


@dataclass(frozen=True)
class OutOfMemory:
    message: str


@dataclass(frozen=True)
class FreeMemoryShort:
    """vLLM refused to start: the card (or, for its CPU build, the RAM: `in_ram`) has less free
    than its memory share asks for, because another process holds some. No lower tier helps;
    measuring again and waiting does."""

    message: str
    in_ram: bool = False


@dataclass(frozen=True)
class StartFailed:
    message: str


@dataclass(frozen=True)
class ContextSize:
    n_ctx: int


@dataclass(frozen=True)
class Slots:
    n_slots: int
    n_ctx_slot: int
    kv_unified: bool | None = None  # one KV buffer shared by all slots (llama-server's default)


@dataclass(frozen=True)
class Listening:
    url: str


@dataclass(frozen=True)
class StartupComplete:
    pass


LogFact = Union[
    PhaseReached, EngineVersion, MaxModelLen, ModelLoaded, CompileFinished, GraphsCaptured, KvCacheMemory,
    KvCacheSize, KvCachePart, MaxConcurrency, ContextTooLong, OutOfMemory, FreeMemoryShort, StartFailed,
    ContextSize, Slots, Listening, StartupComplete,
]


@dataclass(frozen=True)
class Endpoint:
    path: str
    needs_api_key: bool


ModelFormat = Literal["folder", "gguf"]  # a model folder (config.json) or Hugging Face repo; one GGUF file
SeriesLabels = Callable[[str], list[Mapping[str, str]]]  # the label sets of one /metrics family, by name
# A bounded version probe: (argv, timeout in seconds, environment or None for the app's) → its output, or None.
VersionRunner = Callable[[list[str], float, Union[Mapping[str, str], None]], Union[str, None]]


@dataclass(frozen=True)
class LocalDefaults:
    """What local mode (`--coordinator local --model M`, no network) asks this engine for, as an
    assignment would: its base arguments and tiers (threshold MiB → arguments)."""

    base_args: tuple[str, ...]
    tiers: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class Launch:
    """What one engine process is started with; each adapter turns it into its own command line.
    The API key is not here: it travels in the environment, never on a command line."""

    executable: tuple[str, ...]
    model: str
    args: tuple[str, ...]
    served_name: str
    port: int
    tensor_parallel: int = 1
    socket_path: str | None = None  # listen on this Unix socket instead of the port
    memory_utilization: float | None = None  # the share of each card the plan measured as usable


@dataclass(frozen=True)
class Knob:
    """One tunable flag of an engine and how a search steps it: an `int` between bounds the engine
    accepts (one step doubles or halves it, or adds or takes one: `scale`), a `choice` among its
    ordered `choices` (one step: the next or the one before), or a `switch` (`choices` ("on", "off");
    on is `flag`, off is `off`, or the flag left out where `off` is None).

    `default`: the engine's own value where the arguments leave the flag out (None: not known, so
    the search tries the space's values). `grows_memory`: a larger value (later choice) never takes
    less memory, so a start that ran out of memory rules out every config at or above it."""

    flag: str
    kind: Literal["int", "choice", "switch"]
    low: int | None = None
    high: int | None = None
    scale: Literal["linear", "pow2"] = "pow2"
    choices: tuple[str, ...] = ()
    off: str | None = None
    default: str | None = None
    grows_memory: bool = False
    needs: tuple[str, ...] = ()  # it applies only where the baseline sets one of these (a drafter's tokens)


# An engine's constraints on tuned arguments (baseline, tuned, machine) → the tuned ones made
# consistent with the baseline and this machine, or None where they cannot be.
TuningFix = Callable[[Sequence[str], Sequence[str], "Machine"], Union[tuple[str, ...], None]]


def _unchanged(baseline: Sequence[str], tuned: Sequence[str], machine: Machine) -> tuple[str, ...] | None:
    return tuple(tuned)


def _no_defaults(machine: Machine) -> Mapping[str, str]:
    return {}


@dataclass(frozen=True)
class EngineTuning:
    """What auto-tune may change for one engine (only flags its allowlist has), what it never may
    (context, memory share, dtype/quantization, layout, remote code: every spelling), the field
    notes' recipes that apply (`seeds`, tuned arguments), and the log lines that show a
    fast-looking candidate is broken (`traps`: pattern → the reason key its trial loses with)."""

    knobs: tuple[Knob, ...]
    never: frozenset[str]
    seeds: tuple[tuple[str, ...], ...] = ()
    traps: tuple[tuple[re.Pattern[str], str], ...] = ()
    constrain: TuningFix = _unchanged
    defaults: Callable[[Machine], Mapping[str, str]] = _no_defaults  # the engine's own values on this machine

    def fix(self, baseline: Sequence[str], tuned: Sequence[str], machine: Machine) -> tuple[str, ...] | None:
        """`tuned` (appended after `baseline`, last occurrence winning) within the engine's
        constraints on this machine, or None where no such arguments exist."""
        return self.constrain(baseline, tuned, machine)

    def knob(self, flag: str) -> Knob | None:
        return next((knob for knob in self.knobs if knob.flag == flag), None)

    def trap(self, line: str) -> str | None:
        """The reason key of the first trap `line` shows, or None."""
        return next((key for pattern, key in self.traps if pattern.search(line)), None)


def argument_values(args: Sequence[str], allowlist: Allowlist) -> dict[str, str]:
    """Each allowlisted flag's value in `args` (checked ones), last occurrence winning as the engines
    parse, by the flag's first spelling (`--parallel 4` → `{"-np": "4"}`); a switch reads "on" or
    "off" (a negation). One pass, so a tuning's arguments are read as the engine would."""
    spellings = {spelling: flag for flag in allowlist.flags for spelling in flag.all_spellings()}
    values: dict[str, str] = {}
    i = 0
    while i < len(args):
        spelling, equals, inline = args[i].partition("=") if args[i].startswith("--") else (args[i], "", "")
        flag = spellings.get(spelling)
        if flag is None:
            i += 1
        elif not flag.takes_value:
            values[flag.name] = "off" if spelling in flag.negations else "on"
            i += 1
        elif equals:
            values[flag.name] = inline
            i += 1
        else:
            if i + 1 < len(args):
                values[flag.name] = args[i + 1]
            i += 2
    return values


_SUFFIXED = re.compile(r"([0-9]{1,12})([kKmM]?)")
_FACTORS = {"": 1, "k": 10**3, "m": 10**6, "K": 2**10, "M": 2**20}


def whole_number(text: str) -> int | None:
    """An argument's whole number (`32k`: ×1000, `32K`: ×1024, as vLLM reads them), or None for a
    word (`auto`, `-1`)."""
    match = _SUFFIXED.fullmatch(text)
    return None if match is None else int(match.group(1)) * _FACTORS[match.group(2)]


def set_arguments(args: Sequence[str], values: Mapping[str, str], allowlist: Allowlist) -> tuple[str, ...]:
    """`args` with each flag of `values` (by first spelling) given that value instead, at the end:
    every earlier spelling of it dropped, so a tuned list names each flag once. A switch's "on" is
    its first spelling, "off" its first negation (or, for a switch with none, the flag left out)."""
    index = {spelling: flag for flag in allowlist.flags for spelling in flag.all_spellings()}
    kept: list[str] = []
    i = 0
    while i < len(args):
        spelling, equals, _ = args[i].partition("=") if args[i].startswith("--") else (args[i], "", "")
        flag = index.get(spelling)
        width = 2 if flag is not None and flag.takes_value and not equals else 1
        if flag is None or flag.name not in values:
            kept.extend(args[i : i + width])
        i += width
    for name, value in values.items():
        flag = index[name]
        if flag.takes_value:
            kept += [name, value]
        elif value == "on" or flag.negations:
            kept.append(name if value == "on" else flag.negations[0])
    return tuple(kept)


class EngineAdapter(Protocol):
    """What every engine package provides: how it is started and read, where it runs, how it lays
    out GPUs, what its /metrics and log say, how it is found, which releases it ships with, and the
    variables that are its secrets. One that can install itself is an `installing.Installer` too."""

    NAME: str  # the engine's key on the wire (`assign.model.<NAME>`) and in `hello.engines`
    DISPLAY_NAME: str  # for people: "vLLM"
    ARGS_TITLE: str  # its heading in docs/engine-args.md
    RUNTIMES: frozenset[str]  # the machine runtimes (`protocol.Runtime`) it serves
    # Of those, the ones it serves only for a model with no block for another engine there (vLLM's
    # CPU build on `cpu`, after llama.cpp); empty for most.
    FALLBACK_RUNTIMES: frozenset[str]
    MODEL_FORMAT: ModelFormat
    MEMORY_SHARE: bool  # told the share of each card it may use (`EnginePlan.memory_utilization`)
    UNIX_SOCKET: bool  # can listen on a Unix socket (else it serves on 127.0.0.1 with its key everywhere)
    DEFAULT_EXECUTABLE: tuple[str, ...]
    ENDPOINTS: Mapping[str, Endpoint]
    ALLOWED_ARGS: Allowlist
    METRICS_PREFIX: str  # every series of its /metrics starts so (tells an unnamed page's engine)
    METRIC_NAMES: Mapping[str, tuple[str, ...]]  # `EngineMetrics` quantity → series names, newest first
    READY_READS: tuple[str, ...]  # paths read once ready, for `ready_snapshot`
    # Its failure lines and their causes, the first that matches winning (`hints.py`).
    FAILURE_HINTS: tuple[FailureHint, ...]
    LOCAL_DEFAULTS: LocalDefaults  # local mode's block for a model of its `MODEL_FORMAT`
    KEY_VARIABLE: str  # the environment variable it reads this run's API key from; no child inherits one
    PRIVATE_ENV_PREFIXES: tuple[str, ...]  # variables that configure it behind its command line; never inherited
    TUNING: EngineTuning  # what auto-tune may search (`plan.tuning`)

    @property
    def RELEASES(self) -> Releases:  # noqa: N802 (a constant, as the others: read-only, so each engine's own kind)
        """The releases this app ships with, the only ones it installs and runs."""

    def command(self, launch: Launch) -> list[str]: ...

    def environment(self, base: Mapping[str, str], gpu_indices: Sequence[int], *, api_key: str | None = None,
                    config_home: str | None = None) -> dict[str, str]: ...

    def parse_line(self, line: str) -> LogFact | None: ...

    def units(self, machine: Machine, weights_mib: int, cap: float | None) -> list[Unit] | str:
        """The engine processes for a model of `weights_mib` (judged under the memory `cap`), or
        why this machine can run none at all."""

    def capacity(self, machine: Machine, cap: float | None) -> str:
        """What the best process here could use, for the refusal of a model that fits nowhere."""

    def runtime_environment(self, machine: Machine, version: str | None) -> dict[str, str]:
        """What the engine needs set on this runtime, at this version (the assignment's or None)."""

    def tier_warning(self, machine: Machine, gpu_indices: Sequence[int], tier: str | None, args: Sequence[str],
                     base_args: Sequence[str]) -> str | None:
        """A warning to log for a tier that starts but is known to run badly, or None."""

    def derive_metrics(self, values: dict[str, float | None], labels: SeriesLabels) -> dict[str, float | None]:
        """The quantities read through `METRIC_NAMES`, completed from what only this engine exports."""

    def ready_snapshot(self, reads: Mapping[str, Any], snapshot: EngineSnapshot,
                       slots: Slots | None) -> EngineSnapshot:
        """The snapshot completed from the `READY_READS` documents (path → JSON) once ready."""

    def find_installed(self, system: str, where: str | None, run: VersionRunner) -> EngineInstall:
        """The install on this machine (at `where`, from `--engine-bin`, when given)."""


Run = tuple[str, Sequence[str]]  # one argument list an engine may start with, and where it came from ("tier 24000")

# What an engine's own failure line says went wrong, which `serve.diagnosis` words for people.
FailureCause = Literal["out_of_memory", "port_taken", "gpu_too_old", "driver_too_old", "wsl_too_old",
                       "model_unreadable"]


@dataclass(frozen=True)
class FailureHint:
    """A line this engine prints when it fails (`pattern`, searched in its last lines) and its cause."""

    pattern: re.Pattern[str]
    cause: FailureCause


@dataclass(frozen=True)
class Room:
    """What one engine process may take, measured just before it starts: the memory the plan
    judged it by (its cards, or the Mac's working set; None where it serves from RAM), the RAM
    free now judged as a card's usable memory is (never more than the machine has), and the CPU's
    logical cores (threads), which is what llama.cpp's `-t` counts."""

    device_mib: int | None
    ram_mib: int
    cores: int


@runtime_checkable
class StartCheck(Protocol):
    """An adapter that can tell from the provisioned model and the arguments, before anything
    starts, that a start would not fit this machine (an engine that allocates its whole cache at
    start, as llama.cpp does); the node then refuses the assignment with that reason."""

    def start_problem(self, model_path: str, runs: Sequence[Run], room: Room) -> str | None:
        """Why one of `runs` would not fit `room` (what, and by how much), or None."""


@runtime_checkable
class GpuGroups(Protocol):
    """An adapter serving NVIDIA cards on Linux (`native`, `wsl2` in its `RUNTIMES`) that can use
    only some of them (vLLM: compute capability 7.5 or newer); the groups it serves name the
    machine's runtime (`finding.drives`). One without this serves every group."""

    def serves_group(self, group: GpuGroup) -> bool: ...


def clean_line(line: str) -> str:
    """A log line without colour codes, carriage returns or the trailing newline."""
    return ANSI_ESCAPE.sub("", line).replace("\r", "").rstrip("\n")


def child_environment(base: Mapping[str, str]) -> dict[str, str]:
    """`base` without what no child of the app (engine or version probe) may inherit: the provider's
    token, an engine key that would stand in for this run's (each engine's `KEY_VARIABLE`), and what
    configures an engine behind its command line (its `PRIVATE_ENV_PREFIXES`)."""
    adapters = registry.adapters()
    secret = {"GPU_PROVIDER_TOKEN", *(adapter.KEY_VARIABLE for adapter in adapters)}
    prefixes = tuple(prefix for adapter in adapters for prefix in adapter.PRIVATE_ENV_PREFIXES)
    return {k: v for k, v in base.items() if k not in secret and not k.startswith(prefixes)}


def run_environment(env: dict[str, str], key_variable: str, api_key: str | None,
                    config_home: str | None) -> dict[str, str]:
    """`env` with this run's key in the engine's own variable (never on its command line) and user
    configuration under `config_home` (a folder the app owns) rather than `~/.config`."""
    if api_key is not None:
        env[key_variable] = api_key
    if config_home is not None:
        env["XDG_CONFIG_HOME"] = config_home
    return env


def cuda_environment(base: Mapping[str, str], gpu_indices: Sequence[int]) -> dict[str, str]:
    """The child sees exactly its GPUs, numbered as NVML numbers them, and never the provider token
    or an inherited engine key."""
    env = child_environment(base)
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in gpu_indices)
    return env
