"""Decide how this machine serves an assignment: engine, layout, tier, argv — or refuse, with why.

Pure: the rules of the protocol's Assignment section, applied to a `Machine`.

- Engine by runtime: each engine's adapter (`worker.engines.registry`) names the runtimes it
  serves — vLLM `native`/`wsl2` (NVIDIA, compute capability ≥ 7.5), llama.cpp `apple-silicon`,
  `windows` and `cpu`; where several serve one, the first the assignment has a block for.
- Sizes first (Assignment rule 4): at most 256 arguments in `base_args` and in each tier, 32
  tiers, no argument over 64 KiB (a JSON value's limit; no other value comes near it), in every
  engine block, before any other check; every later step is then linear in the frame's size (a
  tier's args are joined to `base_args` only for the tier chosen and its fallbacks).
- Safety first: every argument of `base_args` and of every tier must be on the engine's
  allowlist (`worker/engines/<engine>/args.py`), with a value of its type, and known to the engine
  version the plan will run (a spelling or value the table says came later is refused: vLLM's CPU
  build is 0.32), before anything else is decided; then the engine version must be one the app
  ships for this machine's runtime, and the source one it may load. The app-owned flags are appended last by the engine
  adapter, and nothing ever goes through a shell.
- Memory cap: a `--gpu-memory-utilization` (or `--device-memory-utilization`) in the assignment
  leaves the args and becomes `EnginePlan.memory_cap` (the last one wins); fit and tier are then
  judged by min(usable, cap × total) of the process's cards.
- Layout (the adapter picks a rule of `worker.engines.layout`), per vLLM group (best first): a
  model that fits one card (weights ≤ 90 % of its usable memory) but takes at least half of it
  runs tensor-parallel over a group of 2 or 4; otherwise one replica per card (groups of 8 or more
  always). A model too big for one card runs tensor-parallel over the smallest power-of-two subset
  that holds it, as many subsets as the group has room for. llama.cpp runs one engine over a whole
  group (layout `layers`: it splits by layers), or one over the Mac's GPU working set, or one over
  RAM on a CPU machine.
- Tier: each engine process is judged by the memory it sees (one card, or the sum for a
  multi-GPU engine); the highest cleared threshold's args follow `base_args`. The next lower tier,
  then `base_args` alone, are kept as fallbacks for an out-of-memory start; they run under the
  chosen tier's memory cap.
- Memory share (contract, Assignment rule 3): an engine whose adapter says `MEMORY_SHARE` (vLLM)
  is told `--gpu-memory-utilization` = the smallest usable ÷ total over the process's cards (on a
  CPU unit, vLLM's CPU build: usable ÷ total RAM as measured), rounded down to 3 decimals and held
  to the cap, so its start-up check passes on a card whose desktop holds memory, or in RAM other
  programs hold; fallbacks use the same. llama.cpp runs with `--fit off` (its adapter), so
  a context that does not fit fails instead.
- Runtime: the adapter's environment for the runtime (vLLM under WSL2: what keeps it starting
  there, engines.md A8).
- Nothing escapes: an exception inside planning is logged and becomes a Refusal with its reason,
  so a coordinator always hears why (the node runs `plan` in a thread, off its event loop).
- Warnings (`Plan.warnings`, for the log): the adapter's, per tier (vLLM: a speculative-decoding
  tier that raises `--max-num-batched-tokens` above base, which a field report saw cut decode from
  109 to 19 tok/s).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from worker.contract import protocol
from worker.system.config import Settings
from worker.engines import EngineAdapter, get_adapter, registry
from worker.engines.allowlist import MAX_JSON_BYTES, Allowlist, utf8_length
from worker.engines.base import Launch
from worker.engines.layout import FIT_SHARE, Unit, fits
from worker.hardware.model import IN_WSL, Machine
from worker.engines.releases import version_problem
from worker.plan.sources import BadSource, check_source

log = logging.getLogger(__name__)

SHARE_STEPS = 1000  # vLLM's memory share is rounded down to 3 decimals
DEFAULT_FIRST_PORT = 18100
MAX_ARGS = 256  # in `base_args` and in each tier (contract, Assignment rule 4)
MAX_TIERS = 32
MAX_ARG_BYTES = MAX_JSON_BYTES  # the longest value any type takes is a JSON object
MAX_NAME_BYTES = 256  # the model's name is the engine's served name: argv, /v1/models, every status

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
    memory_cap: float | None = None  # the assignment's memory-utilization cap, taken out of `args`
    memory_utilization: float | None = None  # vLLM's `--gpu-memory-utilization` (all retries); None: llama.cpp
    # Set by provisioning: `executable` (and `model`) are a Linux command line and path inside the
    # WSL2 distribution `wsl_distro`, started through `wsl.exe` (an engine on a Windows machine
    # that does not run on Windows itself).
    in_wsl: bool = False
    wsl_distro: str | None = None

    @property
    def tensor_parallel(self) -> int:
        return len(self.gpu_indices) if self.layout == "tensor" else 1

    @property
    def adapter(self) -> EngineAdapter:
        return get_adapter(self.engine)

    def argv(self, args: Sequence[str] | None = None, *, socket_path: str | None = None) -> list[str]:
        """The command line for this engine (with `args` from a fallback when retrying; listening on
        `socket_path` instead of the port where the supervisor gives one). No key: that travels in
        the environment."""
        return self.adapter.command(Launch(
            self.executable, self.model, tuple(self.args if args is None else args), self.served_name, self.port,
            tensor_parallel=self.tensor_parallel, socket_path=socket_path, memory_utilization=self.memory_utilization,
        ))

    def environment(
        self, base: Mapping[str, str], *, api_key: str | None = None, config_home: str | None = None
    ) -> dict[str, str]:
        return self.adapter.environment(base, self.gpu_indices, api_key=api_key, config_home=config_home)

    def to_json(self) -> dict[str, Any]:
        return {
            "engine_id": self.engine_id,
            "gpu_indices": list(self.gpu_indices),
            "layout": self.layout,
            "memory_mib": self.memory_mib,
            "argv": self.argv(),
        }


@dataclass(frozen=True)
class Plan:
    engine: protocol.EngineName
    model_name: str
    engine_model: protocol.EngineModel
    engines: tuple[EnginePlan, ...]
    assignment_id: str = ""
    warnings: tuple[str, ...] = ()  # the plan starts, but a person should read these (the node logs them)

    def to_json(self) -> dict[str, Any]:
        return {"engine": self.engine, "engines": [e.to_json() for e in self.engines], "warnings": list(self.warnings)}


@dataclass(frozen=True)
class _Option:
    """`base_args` alone (threshold None) or with one tier's args, with the memory cap taken out.
    The two lists stay apart until `args` is asked for (only the tiers a plan keeps), so planning
    many tiers never copies `base_args` once per tier."""

    threshold: int | None
    base: tuple[str, ...]
    extra: tuple[str, ...]
    cap: float | None

    @property
    def args(self) -> tuple[str, ...]:
        return self.base + self.extra

    @property
    def tier(self) -> str | None:
        return None if self.threshold is None else str(self.threshold)

    def fallback(self) -> Fallback:
        return self.tier, self.args


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
    Never raises: whatever goes wrong inside planning is a Refusal that names it.
    """
    try:
        return _plan(machine, assign, settings, first_port=first_port, model_path=model_path, executable=executable)
    except Exception as exc:  # a bug must not cost the coordinator its answer, nor the node its task
        log.exception("planning assignment %.80r failed", assign.assignment_id)
        return Refusal(f"this app could not plan the assignment ({type(exc).__name__}); nothing was started")


def _plan(
    machine: Machine,
    assign: protocol.Assign,
    settings: Settings,
    *,
    first_port: int,
    model_path: str | None,
    executable: Sequence[str] | None,
) -> Plan | Refusal:
    if too_big := size_problem(assign.model):
        return Refusal(too_big)
    chosen = choose_engine(machine, assign.model, assign.model.prefer)
    if isinstance(chosen, Refusal):
        return chosen
    adapter, engine_model = chosen
    engine = adapter.NAME
    problem = check_args(engine_model, adapter.ALLOWED_ARGS, allow_remote_code=settings.allow_remote_code,
                         version=running_version(machine, engine, engine_model))
    problem = problem or version_problem(engine, engine_model.engine_version, runtime=machine.runtime)
    if problem:
        return Refusal(problem)
    try:
        source = check_source(engine_model.source, engine_model.sha256, engine)
    except BadSource as exc:
        return Refusal(str(exc))
    weights = engine_model.weights_mib
    options = _options(engine_model, adapter.ALLOWED_ARGS)
    base_cap = options[0].cap
    units = adapter.units(machine, weights, base_cap)
    if isinstance(units, str):
        return Refusal(units)
    if not units:
        return Refusal(_fits_nowhere(assign.model.name, weights, adapter.capacity(machine, base_cap)))
    common = _Common(
        engine=engine,
        options=tuple(options),
        weights_mib=weights,
        executable=tuple(executable) if executable else _installed_executable(machine, engine, adapter),
        model=model_path or (source.file_name if source.kind == "https" else source.value),
        served_name=assign.model.name,
        env=adapter.runtime_environment(machine, engine_model.engine_version),
        memory_share=adapter.MEMORY_SHARE,
    )
    engines = tuple(_engine_plan(i, unit, machine, common, first_port + i) for i, unit in enumerate(units))
    warnings = tuple(dict.fromkeys(
        w for e in engines if (w := adapter.tier_warning(machine, e.gpu_indices, e.tier, e.args, options[0].args))))
    return Plan(engine, assign.model.name, engine_model, engines, assign.assignment_id, warnings)


def choose_engine(machine: Machine, model: protocol.ModelSpec, prefer: Sequence[str] = ()
                  ) -> tuple[EngineAdapter, protocol.EngineModel] | Refusal:
    """Of the engines this machine's runtime runs (`prefer` first, the assignment's `model.prefer`),
    the first the model has a block for; a Refusal naming them where it has none."""
    candidates = preferred(registry.for_runtime(machine.runtime), prefer, machine.runtime)
    for adapter in candidates:
        engine_model = model.for_engine(adapter.NAME)
        if engine_model is not None:
            return adapter, engine_model
    if not candidates:
        return Refusal(f"this machine's runtime ({machine.runtime}) runs none of the engines this app has")
    names = ", ".join(adapter.NAME for adapter in candidates)
    if len(candidates) == 1:
        return Refusal(f"model {model.name!r} has no {names} build, and this machine's runtime "
                       f"({machine.runtime}) runs only {names}")
    return Refusal(f"model {model.name!r} has a build for none of the engines this machine's runtime "
                   f"({machine.runtime}) runs ({names})")


def preferred(candidates: Sequence[EngineAdapter], prefer: Sequence[str], runtime: str) -> tuple[EngineAdapter, ...]:
    """`candidates` (in registration order, a fallback last) with those `prefer` names first, in its
    order (contract, Assignment: `model.prefer`); names it does not list keep their order after. A
    fallback stays last whatever the order asked: vLLM's CPU build serves `cpu` only for a model
    with no other block there. Unknown names are ignored; linear in `prefer`."""
    rank: dict[str, int] = {}
    for i, name in enumerate(prefer):
        rank.setdefault(name, i)
    return tuple(sorted(candidates, key=lambda a: (runtime in a.FALLBACK_RUNTIMES, rank.get(a.NAME, len(prefer)))))


def size_problem(model: protocol.ModelSpec) -> str | None:
    """Why an engine block is over the contract's sizes (Assignment rule 4), or None; checked
    before anything else, so that no later check has more than these to read."""
    if (size := utf8_length(model.name)) > MAX_NAME_BYTES:
        return f"assignment too large: the model name is {size:,} bytes long (at most {MAX_NAME_BYTES})"
    for engine, block in model.engines.items():
        if len(block.tiers) > MAX_TIERS:
            return f"assignment too large: {engine} has {len(block.tiers):,} tiers (at most {MAX_TIERS})"
        lists = [("base_args", block.base_args), *((f"tier {key}", args) for key, args in block.tiers.items())]
        for where, args in lists:
            if len(args) > MAX_ARGS:
                return f"assignment too large: {engine} {where} has {len(args):,} arguments (at most {MAX_ARGS})"
            for arg in args:
                if (size := utf8_length(arg)) > MAX_ARG_BYTES:
                    return (f"assignment too large: an argument in {engine} {where} is {size:,} bytes long "
                            f"(at most {MAX_ARG_BYTES:,})")
    return None


def running_version(machine: Machine, engine: str, engine_model: protocol.EngineModel) -> str | None:
    """The engine version the plan will run: the assignment's, else the one installed here (which
    provisioning then uses), else None (the newest the app ships)."""
    installed = machine.engines.get(engine)
    return engine_model.engine_version or (installed.version if installed else None)


def check_args(engine_model: protocol.EngineModel, allowlist: Allowlist, *, allow_remote_code: bool,
               version: str | None = None) -> str | None:
    """The first argument of `base_args` or of any tier the allowlist refuses (or the engine at
    `version` does not know), as a reason that starts `argument not allowed: FLAG` (or `value not
    allowed for FLAG`) and says where it was."""
    lists = [("base_args", list(engine_model.base_args))]
    lists += [(f"tier {threshold}", args) for threshold, args in engine_model.tier_thresholds()]
    for where, args in lists:
        if problem := allowlist.check(args, allow_remote_code=allow_remote_code, where=where, version=version):
            return problem
    return None


def _options(engine_model: protocol.EngineModel, allowlist: Allowlist) -> list[_Option]:
    """`base_args` alone, then base + each tier, lowest threshold first; engines take the last
    occurrence of a flag, so the cap of base + tier is the tier's where it has one. Each list is
    split on its own (each passed `check` alone, so no flag's value crosses from one to the next)."""
    base, base_cap = allowlist.split_memory_cap(engine_model.base_args)
    options = [_Option(None, base, (), base_cap)]
    for threshold, args in engine_model.tier_thresholds():
        extra, cap = allowlist.split_memory_cap(args)
        options.append(_Option(threshold, base, extra, base_cap if cap is None else cap))
    return options


def _installed_executable(machine: Machine, engine: str, adapter: EngineAdapter) -> tuple[str, ...]:
    """The engine detection found (a path), else the engine's plain command name."""
    found = machine.engines.get(engine)
    if found and found.path and found.path != IN_WSL:
        return (found.path,)
    return adapter.DEFAULT_EXECUTABLE


@dataclass(frozen=True)
class _Common:
    """What every engine process of one plan shares."""

    engine: protocol.EngineName
    options: tuple[_Option, ...]
    weights_mib: int
    executable: tuple[str, ...]
    model: str
    served_name: str
    env: Mapping[str, str]  # set for the runtime, on top of the GPUs each process sees
    memory_share: bool  # the engine is told its share of each card (`EnginePlan.memory_utilization`)


def _engine_plan(number: int, unit: Unit, machine: Machine, common: _Common, port: int) -> EnginePlan:
    chosen, fallbacks = choose_tier(list(common.options), unit, common.weights_mib)
    return EnginePlan(
        engine_id=f"e{number}",
        engine=common.engine,
        gpu_indices=unit.gpu_indices,
        layout=unit.layout,
        memory_mib=unit.judged_mib(chosen.cap),
        tier=chosen.tier,
        args=chosen.args,
        fallbacks=fallbacks,
        port=port,
        env={"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in unit.gpu_indices), **common.env},
        executable=common.executable,
        model=common.model,
        served_name=common.served_name,
        memory_cap=chosen.cap,
        memory_utilization=memory_utilization(machine, unit, chosen.cap) if common.memory_share else None,
    )


def memory_utilization(machine: Machine, unit: Unit, cap: float | None) -> float | None:
    """vLLM's `--gpu-memory-utilization` for one process: the smallest usable ÷ total among its
    cards, or, on a CPU unit (vLLM's CPU build: no cards), its usable ÷ total RAM; rounded down to
    3 decimals (vLLM checks share × total ≤ free, so rounding up could fail it), then held to the
    assignment's cap. The cap alone where a total is unknown, None where neither is."""
    measured = cards_share(machine, unit.gpu_indices) if unit.gpu_indices else share(unit.usable_mib, unit.total_mib)
    return held_to_cap(measured, cap)


def cards_share(machine: Machine, gpu_indices: Sequence[int]) -> float | None:
    """The smallest usable ÷ total among these cards (rounded down), None where one is unknown."""
    cards = [gpu for gpu in machine.gpus if gpu.index in gpu_indices]
    shares = [measured for gpu in cards if (measured := share(gpu.usable_mib, gpu.memory_total_mib)) is not None]
    return min(shares) if shares and len(shares) == len(gpu_indices) else None


def share(usable_mib: int, total_mib: int | None) -> float | None:
    """usable ÷ total rounded down to 3 decimals; None where the total is unknown."""
    if not total_mib or total_mib <= 0:
        return None
    return usable_mib * SHARE_STEPS // total_mib / SHARE_STEPS


def held_to_cap(measured: float | None, cap: float | None) -> float | None:
    known = [value for value in (measured, cap) if value is not None]
    return min(known) if known else None


def choose_tier(options: list[_Option], unit: Unit, weights_mib: int) -> tuple[_Option, tuple[Fallback, ...]]:
    """The highest tier whose threshold the unit's memory clears, judged under that tier's own cap
    (and still holding the model), then the fallbacks: the next lower cleared tier, base alone."""
    base, tiers = options[0], options[1:]
    cleared = [
        option for option in tiers
        if option.threshold is not None
        and unit.judged_mib(option.cap) >= option.threshold
        and fits(weights_mib, unit.judged_mib(option.cap))
    ]
    if not cleared:
        return base, ()
    fallbacks = [cleared[-2].fallback()] if len(cleared) > 1 else []
    return cleared[-1], (*fallbacks, base.fallback())


def _fits_nowhere(name: str, weights_mib: int, where: str) -> str:
    return (
        f"model {name!r} does not fit on this machine: its weights take {weights_mib:,} MiB, more than "
        f"{FIT_SHARE:.0%} of what any engine here could use ({where}); it was not started"
    )
