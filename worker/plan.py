"""Decide how this machine serves an assignment: engine, layout, tier, argv — or refuse, with why.

Pure: the rules of the protocol's Assignment section, applied to a `Machine`.

- Engine by runtime: vLLM on `native`/`wsl2` (NVIDIA, compute capability ≥ 7.5), llama.cpp on
  `apple-silicon`, `windows` and `cpu`.
- Layout, per vLLM group (best first): a model that fits one card (weights ≤ 90 % of its usable
  memory) but takes at least half of it runs tensor-parallel over a group of 2 or 4; otherwise one
  replica per card (groups of 8 or more always). A model too big for one card runs tensor-parallel
  over the smallest power-of-two subset that holds it, as many subsets as the group has room for.
  llama.cpp runs one engine over a whole group (it splits by layers), or one over the Mac's GPU
  working set, or one over RAM on a CPU machine.
- Tier: each engine process is judged by the memory it sees (one card, or the sum for a
  multi-GPU engine); the highest cleared threshold's args follow `base_args`. The next lower tier,
  then `base_args` alone, are kept as fallbacks for an out-of-memory start.
- Safety: every argument of every tier is checked before anything starts; the app-owned flags
  are appended last by the engine adapter, and nothing ever goes through a shell.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from worker import protocol
from worker.config import Settings
from worker.engines import EngineAdapter, get_adapter
from worker.engines.base import option_name
from worker.hardware.detect import runs_vllm
from worker.hardware.model import GpuGroup, Machine
from worker.provision.sources import BadSource, parse_source

FIT_SHARE = 0.9  # weights may take at most 90 % of the usable memory
TENSOR_GROUP_SIZES = (2, 4)  # a model that fits one card goes tensor-parallel only here; 8+ stay replicas
DEFAULT_FIRST_PORT = 18100
API_KEY_SHOWN = "***"

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_SHELL = re.compile(r"[;&|`$<>]")
_ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")

Fallback = tuple[str | None, tuple[str, ...]]


@dataclass(frozen=True)
class Refusal:
    """The assignment is not started at all; `reason` is shown to the person and the coordinator."""

    reason: str

    def to_json(self) -> dict[str, str]:
        return {"error": self.reason}


@dataclass(frozen=True)
class EnginePlan:
    engine_id: str
    engine: protocol.EngineName
    gpu_indices: tuple[int, ...]
    layout: protocol.Layout
    memory_mib: int  # what this engine process is judged by
    tier: str | None  # the threshold applied ("24000"), None for base_args alone
    args: tuple[str, ...]  # base_args + the tier's args
    fallbacks: tuple[Fallback, ...]  # (tier, args) to retry after an out-of-memory start, in order
    port: int
    env: Mapping[str, str]  # what the plan sets on top of the adapter's environment
    executable: tuple[str, ...]
    model: str
    served_name: str

    @property
    def tensor_parallel(self) -> int:
        return len(self.gpu_indices) if self.engine == "vllm" and self.layout == "tensor" else 1

    @property
    def adapter(self) -> EngineAdapter:
        return get_adapter(self.engine)

    def argv(self, api_key: str, args: Sequence[str] | None = None) -> list[str]:
        """The command line for this engine (with `args` from a fallback when retrying)."""
        return self.adapter.command(
            self.executable,
            self.model,
            self.args if args is None else args,
            port=self.port,
            api_key=api_key,
            served_name=self.served_name,
            tensor_parallel=self.tensor_parallel,
        )

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        return self.adapter.environment(base, self.gpu_indices)

    def to_json(self) -> dict[str, Any]:
        return {
            "engine_id": self.engine_id,
            "gpu_indices": list(self.gpu_indices),
            "layout": self.layout,
            "memory_mib": self.memory_mib,
            "argv": self.argv(API_KEY_SHOWN),
        }


@dataclass(frozen=True)
class Plan:
    engine: protocol.EngineName
    model_name: str
    engine_model: protocol.EngineModel
    engines: tuple[EnginePlan, ...]
    assignment_id: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"engine": self.engine, "engines": [e.to_json() for e in self.engines]}


@dataclass(frozen=True)
class _Unit:
    """One engine process to be: its GPUs, its layout and the memory it is judged by."""

    gpu_indices: tuple[int, ...]
    layout: protocol.Layout
    memory_mib: int


def engine_for_runtime(runtime: protocol.Runtime) -> protocol.EngineName:
    return "vllm" if runtime in ("native", "wsl2") else "llamacpp"


def plan(
    machine: Machine,
    assign: protocol.Assign,
    settings: Settings,
    *,
    first_port: int = DEFAULT_FIRST_PORT,
    model_path: str | None = None,
    executable: Sequence[str] | None = None,
) -> Plan | Refusal:
    """The plan for `assign` on `machine`, or a Refusal that says why nothing will start.

    `model_path` is where provisioning put the model (default: the source as given, which is what a
    fleet operator sees from `gpu-provider plan`); ports are `first_port`, `first_port + 1`, ….
    """
    engine = engine_for_runtime(machine.runtime)
    engine_model = assign.model.for_engine(engine)
    if engine_model is None:
        return Refusal(
            f"model {assign.model.name!r} has no {engine} build, and this machine's runtime "
            f"({machine.runtime}) runs only {engine}"
        )
    try:
        source = parse_source(engine_model.source)
    except BadSource as exc:
        return Refusal(str(exc))
    adapter = get_adapter(engine)
    problem = check_all_args(engine_model, adapter, settings)
    if problem:
        return Refusal(problem)
    weights = engine_model.weights_mib
    units = vllm_units(machine, weights) if engine == "vllm" else llamacpp_units(machine, weights)
    if isinstance(units, Refusal):
        return units
    if not units:
        return Refusal(_fits_nowhere(machine, assign.model.name, weights, engine))
    model = model_path or (source.file_name if source.kind == "https" else source.value)
    exe = tuple(executable) if executable else _installed_executable(machine, engine, adapter)
    engines = tuple(
        _engine_plan(i, unit, engine, engine_model, first_port + i, exe, model, assign.model.name)
        for i, unit in enumerate(units)
    )
    return Plan(engine, assign.model.name, engine_model, engines, assign.assignment_id)


def _installed_executable(machine: Machine, engine: str, adapter: EngineAdapter) -> tuple[str, ...]:
    """The engine detection found (a path), else the engine's plain command name."""
    found = machine.engines.get(engine)
    if found and found.path and found.path != "wsl":
        return (found.path,)
    return adapter.DEFAULT_EXECUTABLE


def _engine_plan(
    number: int,
    unit: _Unit,
    engine: protocol.EngineName,
    engine_model: protocol.EngineModel,
    port: int,
    executable: tuple[str, ...],
    model: str,
    served_name: str,
) -> EnginePlan:
    tier, args, fallbacks = choose_tier(engine_model, unit.memory_mib)
    return EnginePlan(
        engine_id=f"e{number}",
        engine=engine,
        gpu_indices=unit.gpu_indices,
        layout=unit.layout,
        memory_mib=unit.memory_mib,
        tier=tier,
        args=args,
        fallbacks=fallbacks,
        port=port,
        env={"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in unit.gpu_indices)},
        executable=executable,
        model=model,
        served_name=served_name,
    )


def choose_tier(
    engine_model: protocol.EngineModel, memory_mib: int
) -> tuple[str | None, tuple[str, ...], tuple[Fallback, ...]]:
    """The highest threshold `memory_mib` clears (tiers are not cumulative), and the fallbacks."""
    base = tuple(engine_model.base_args)
    cleared = [(t, args) for t, args in engine_model.tier_thresholds() if memory_mib >= t]
    if not cleared:
        return None, base, ()
    threshold, tier_args = cleared[-1]
    fallbacks: list[Fallback] = []
    if len(cleared) > 1:
        lower, lower_args = cleared[-2]
        fallbacks.append((str(lower), base + tuple(lower_args)))
    fallbacks.append((None, base))
    return str(threshold), base + tuple(tier_args), tuple(fallbacks)


def _fits(weights_mib: int, memory_mib: int) -> bool:
    return weights_mib <= FIT_SHARE * memory_mib


def vllm_units(machine: Machine, weights_mib: int) -> list[_Unit] | Refusal:
    groups = [g for g in machine.groups if runs_vllm(g)]
    if not groups:
        return Refusal("no lent NVIDIA GPU here has compute capability 7.5 or newer, which vLLM needs")
    units = [unit for group in groups for unit in _group_units(group, weights_mib)]
    if len(units) == 1 and len(units[0].gpu_indices) == 1:
        return [_Unit(units[0].gpu_indices, "single", units[0].memory_mib)]
    return units


def _group_units(group: GpuGroup, weights_mib: int) -> list[_Unit]:
    per_gpu, indices = group.usable_mib_per_gpu, group.gpu_indices
    if _fits(weights_mib, per_gpu):
        if weights_mib >= per_gpu / 2 and len(indices) in TENSOR_GROUP_SIZES:
            return [_Unit(indices, "tensor", per_gpu * len(indices))]
        return [_Unit((i,), "replica", per_gpu) for i in indices]
    size = 2
    while size <= len(indices) and not _fits(weights_mib, per_gpu * size):
        size *= 2
    if size > len(indices):
        return []
    return [
        _Unit(indices[start : start + size], "tensor", per_gpu * size)
        for start in range(0, len(indices) - size + 1, size)
    ]


def llamacpp_units(machine: Machine, weights_mib: int) -> list[_Unit]:
    if machine.runtime == "apple-silicon":
        candidates = [_Unit((), "single", machine.effective_vram_mib)]
    elif machine.runtime == "cpu" or not machine.groups:
        candidates = [_Unit((), "single", machine.ram_mib)]
    else:
        candidates = [
            _Unit(g.gpu_indices, "tensor" if len(g.gpu_indices) > 1 else "single", g.usable_mib_total)
            for g in machine.groups
        ]
    return [unit for unit in candidates if _fits(weights_mib, unit.memory_mib)]


def _fits_nowhere(machine: Machine, name: str, weights_mib: int, engine: str) -> str:
    if engine == "vllm" and machine.groups:
        best = machine.groups[0]
        where = f"{len(best.gpu_indices)} × {best.name} with {best.usable_mib_per_gpu:,} MiB usable each"
    elif machine.runtime == "apple-silicon":
        where = f"the GPU working set of {machine.effective_vram_mib:,} MiB"
    elif machine.groups:
        where = f"{machine.groups[0].usable_mib_total:,} MiB usable on {machine.groups[0].name}"
    else:
        where = f"{machine.ram_mib:,} MiB of RAM"
    return (
        f"model {name!r} does not fit on this machine: its weights take {weights_mib:,} MiB, more than "
        f"{FIT_SHARE:.0%} of what any engine here could use ({where}); it was not started"
    )


def check_all_args(engine_model: protocol.EngineModel, adapter: EngineAdapter, settings: Settings) -> str | None:
    """The first unsafe argument in base_args or any tier, as a reason; None when all are safe."""
    for label, args in [("base_args", engine_model.base_args)] + [
        (f"tier {key}", list(values)) for key, values in sorted(engine_model.tiers.items())
    ]:
        problem = unsafe_args(args, adapter, settings)
        if problem:
            return f"refused {label}: {problem}"
    return None


def unsafe_args(args: Sequence[str], adapter: EngineAdapter, settings: Settings) -> str | None:
    for arg in args:
        problem = _unsafe_text(arg) or _unsafe_flag(arg, adapter, settings)
        if problem:
            return problem
    if not settings.allow_remote_code:
        hidden = adapter.code_execution_reason(args)
        if hidden:
            return f"{hidden}; allow remote code in settings to run it"
    return None


def _unsafe_text(arg: str) -> str | None:
    if _CONTROL.search(arg):
        return f"argument {arg!r} contains a newline or control character"
    if _SHELL.search(arg):
        return f"argument {arg!r} contains shell characters (; & | ` $ < >), which no engine argument needs"
    if _ENV_ASSIGNMENT.match(arg):
        return f"argument {arg!r} looks like an environment variable; the app sets the engine's environment itself"
    return None


def _unsafe_flag(arg: str, adapter: EngineAdapter, settings: Settings) -> str | None:
    name = option_name(arg)
    if name is None:
        return None
    if _matches(name, adapter.FORBIDDEN_FLAGS, adapter) or any(
        name.endswith(suffix) for suffix in adapter.FORBIDDEN_FLAG_SUFFIXES
    ):
        return (
            f"{arg} is never allowed: it would open the engine beyond 127.0.0.1, read options or models "
            "from elsewhere, or serve something other than the assigned model"
        )
    if not settings.allow_app_owned_args and _matches(name, adapter.APP_OWNED_FLAGS, adapter):
        return (
            f"{arg} would change what the app owns (host, port, API key, served model name, parallelism); "
            "allow app-owned arguments in settings to accept it (the app's own values still win)"
        )
    if not settings.allow_remote_code and _matches(name, adapter.CODE_EXECUTION_FLAGS, adapter):
        return f"{arg} would run code from the model repository or a plugin; allow remote code in settings to run it"
    return None


def _matches(name: str, flags: frozenset[str], adapter: EngineAdapter) -> bool:
    """Exact match, or (where the engine's parser accepts abbreviations) an unambiguous-looking prefix."""
    if name in flags:
        return True
    if name in adapter.ORDINARY_FLAGS or not adapter.ALLOWS_ABBREVIATIONS:
        return False
    return name.startswith("--") and len(name) > 3 and any(
        flag.startswith(name) for flag in flags if flag.startswith("--")
    )
