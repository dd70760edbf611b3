"""Decide how this machine serves an assignment: engine, layout, tier, argv — or refuse, with why.

Pure: the rules of the protocol's Assignment section, applied to a `Machine`.

- Engine by runtime: vLLM on `native`/`wsl2` (NVIDIA, compute capability ≥ 7.5), llama.cpp on
  `apple-silicon`, `windows` and `cpu`.
- Safety first: every argument of `base_args` and of every tier must be on the engine's allowlist
  (`worker/engines/*_args.py`), with a value of its type, before anything else is decided; then
  the engine version must be one the app ships, and the source one it may load. The app-owned
  flags are appended last by the engine adapter, and nothing ever goes through a shell.
- Memory cap: a `--gpu-memory-utilization` (or `--device-memory-utilization`) in the assignment
  leaves the args and becomes `EnginePlan.memory_cap` (the last one wins); fit and tier are then
  judged by min(usable, cap × total) of the process's cards.
- Layout, per vLLM group (best first): a model that fits one card (weights ≤ 90 % of its usable
  memory) but takes at least half of it runs tensor-parallel over a group of 2 or 4; otherwise one
  replica per card (groups of 8 or more always). A model too big for one card runs tensor-parallel
  over the smallest power-of-two subset that holds it, as many subsets as the group has room for.
  llama.cpp runs one engine over a whole group (layout `layers`: it splits by layers), or one over
  the Mac's GPU working set, or one over RAM on a CPU machine.
- Tier: each engine process is judged by the memory it sees (one card, or the sum for a
  multi-GPU engine); the highest cleared threshold's args follow `base_args`. The next lower tier,
  then `base_args` alone, are kept as fallbacks for an out-of-memory start; they run under the
  chosen tier's memory cap.
- Memory share (contract, Assignment rule 3): vLLM is told `--gpu-memory-utilization` = the
  smallest usable ÷ total over the process's cards, rounded down to 3 decimals and held to the
  cap, so its start-up check passes on a card whose desktop holds memory; fallbacks use the same.
  llama.cpp runs with `--fit off` (its adapter), so a context that does not fit fails instead.
- Runtime: vLLM under WSL2 gets the environment that keeps it starting there (engines.md A8).
- Warnings (`Plan.warnings`, for the log): a speculative-decoding tier that raises vLLM's
  `--max-num-batched-tokens` above base, which a field report saw cut decode from 109 to 19 tok/s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from worker import protocol
from worker.config import Settings
from worker.engines import EngineAdapter, get_adapter
from worker.engines.allowlist import Allowlist
from worker.hardware.detect import runs_vllm
from worker.hardware.model import GpuGroup, Machine
from worker.provision.releases import version_problem
from worker.provision.sources import BadSource, check_source

FIT_SHARE = 0.9  # weights may take at most 90 % of the usable memory
SHARE_STEPS = 1000  # vLLM's memory share is rounded down to 3 decimals
TENSOR_GROUP_SIZES = (2, 4)  # a model that fits one card goes tensor-parallel only here; 8+ stay replicas
DEFAULT_FIRST_PORT = 18100
API_KEY_SHOWN = "***"

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

    @property
    def tensor_parallel(self) -> int:
        return len(self.gpu_indices) if self.engine == "vllm" and self.layout == "tensor" else 1

    @property
    def adapter(self) -> EngineAdapter:
        return get_adapter(self.engine)

    def argv(self, api_key: str, args: Sequence[str] | None = None, *, socket_path: str | None = None) -> list[str]:
        """The command line for this engine (with `args` from a fallback when retrying; listening on
        `socket_path` instead of the port where the supervisor gives one)."""
        return self.adapter.command(
            self.executable,
            self.model,
            self.args if args is None else args,
            port=self.port,
            api_key=api_key,
            served_name=self.served_name,
            tensor_parallel=self.tensor_parallel,
            socket_path=socket_path,
            memory_utilization=self.memory_utilization,
        )

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
            "argv": self.argv(API_KEY_SHOWN),
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
class _Unit:
    """One engine process to be: its GPUs, its layout, their usable memory and (where known) their
    total memory, each summed over the GPUs as a multiple of the smallest card."""

    gpu_indices: tuple[int, ...]
    layout: protocol.Layout
    usable_mib: int
    total_mib: int | None = None

    def judged_mib(self, cap: float | None) -> int:
        """The memory this process is judged by: its usable memory, held to `cap` × total."""
        return _capped(self.usable_mib, self.total_mib, cap)


@dataclass(frozen=True)
class _Option:
    """`base_args` alone (threshold None) or with one tier's args, with the memory cap taken out."""

    threshold: int | None
    args: tuple[str, ...]
    cap: float | None

    @property
    def tier(self) -> str | None:
        return None if self.threshold is None else str(self.threshold)

    def fallback(self) -> Fallback:
        return self.tier, self.args


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
    adapter = get_adapter(engine)
    problem = check_args(engine_model, adapter.ALLOWED_ARGS, allow_remote_code=settings.allow_remote_code)
    problem = problem or version_problem(engine, engine_model.engine_version)
    if problem:
        return Refusal(problem)
    try:
        source = check_source(engine_model.source, engine_model.sha256, engine)
    except BadSource as exc:
        return Refusal(str(exc))
    weights = engine_model.weights_mib
    options = _options(engine_model, adapter.ALLOWED_ARGS)
    base_cap = options[0].cap
    units = vllm_units(machine, weights, base_cap) if engine == "vllm" else llamacpp_units(machine, weights)
    if isinstance(units, Refusal):
        return units
    if not units:
        return Refusal(_fits_nowhere(machine, assign.model.name, weights, engine, base_cap))
    common = _Common(
        engine=engine,
        options=tuple(options),
        weights_mib=weights,
        executable=tuple(executable) if executable else _installed_executable(machine, engine, adapter),
        model=model_path or (source.file_name if source.kind == "https" else source.value),
        served_name=assign.model.name,
        env=runtime_environment(machine, engine, engine_model.engine_version),
    )
    engines = tuple(_engine_plan(i, unit, machine, common, first_port + i) for i, unit in enumerate(units))
    warnings = tuple(dict.fromkeys(w for e in engines if (w := speculative_batch_warning(e, options[0], machine))))
    return Plan(engine, assign.model.name, engine_model, engines, assign.assignment_id, warnings)


def check_args(engine_model: protocol.EngineModel, allowlist: Allowlist, *, allow_remote_code: bool) -> str | None:
    """The first argument of `base_args` or of any tier the allowlist refuses, as a reason that starts
    `argument not allowed: FLAG` (or `value not allowed for FLAG`) and says where it was."""
    lists = [("base_args", list(engine_model.base_args))]
    lists += [(f"tier {threshold}", args) for threshold, args in engine_model.tier_thresholds()]
    for where, args in lists:
        if problem := allowlist.check(args, allow_remote_code=allow_remote_code, where=where):
            return problem
    return None


def _options(engine_model: protocol.EngineModel, allowlist: Allowlist) -> list[_Option]:
    """`base_args` alone, then base + each tier, lowest threshold first; engines take the last
    occurrence of a flag, so the cap of base + tier is the tier's where it has one."""
    base = list(engine_model.base_args)
    options = [_Option(None, *allowlist.split_memory_cap(base))]
    options += [
        _Option(threshold, *allowlist.split_memory_cap(base + args))
        for threshold, args in engine_model.tier_thresholds()
    ]
    return options


def _installed_executable(machine: Machine, engine: str, adapter: EngineAdapter) -> tuple[str, ...]:
    """The engine detection found (a path), else the engine's plain command name."""
    found = machine.engines.get(engine)
    if found and found.path and found.path != "wsl":
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


def _engine_plan(number: int, unit: _Unit, machine: Machine, common: _Common, port: int) -> EnginePlan:
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
        memory_utilization=memory_utilization(machine, unit.gpu_indices, chosen.cap)
        if common.engine == "vllm" else None,
    )


def memory_utilization(machine: Machine, gpu_indices: Sequence[int], cap: float | None) -> float | None:
    """vLLM's `--gpu-memory-utilization` for a process on these cards: the smallest usable ÷ total
    among them, rounded down to 3 decimals (vLLM checks share × total ≤ free on every card, so
    rounding up could fail it), then held to the assignment's cap. The cap alone where a card's
    total is unknown, None where neither is."""
    cards = [gpu for gpu in machine.gpus if gpu.index in gpu_indices]
    shares = [gpu.usable_mib * SHARE_STEPS // gpu.memory_total_mib / SHARE_STEPS for gpu in cards
              if gpu.memory_total_mib > 0]
    measured = min(shares) if shares and len(shares) == len(gpu_indices) else None
    known = [share for share in (measured, cap) if share is not None]
    return min(known) if known else None


_VERSION_PREFIX = re.compile(r"v?(\d+)\.(\d+)")
VLLM_FIXED_PINNED_MEMORY = (0, 30)  # the V2 model runner tolerates WSL2's lack of pinned memory from here


def runtime_environment(machine: Machine, engine: protocol.EngineName, version: str | None) -> dict[str, str]:
    """What vLLM needs under WSL2 (engines.md A8, Part C 7): pinned memory is off there unless
    `VLLM_WSL2_ENABLE_PIN_MEMORY=1`, and before 0.30 the default V2 model runner crashed without it
    ("UVA is not available"), so such versions also get the V1 runner. The version is the
    assignment's, else the installed one's; an unknown version gets pinned memory only."""
    if engine != "vllm" or machine.runtime != "wsl2":
        return {}
    env = {"VLLM_WSL2_ENABLE_PIN_MEMORY": "1"}
    installed = machine.engines.get("vllm")
    match = _VERSION_PREFIX.match(version or (installed.version if installed else None) or "")
    if match and (int(match.group(1)), int(match.group(2))) < VLLM_FIXED_PINNED_MEMORY:
        env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    return env


BATCHED_TOKENS = ("--max-num-batched-tokens",)
SPECULATIVE = ("--speculative-config", "-sc", "--spec-method", "--spec-tokens")
_HUMAN_FACTORS = {"k": 1000, "m": 1000**2, "K": 1024, "M": 1024**2}  # vLLM's `32k` / `32K` integers


def speculative_batch_warning(engine: EnginePlan, base: _Option, machine: Machine) -> str | None:
    """A warning when the tier this engine runs raises vLLM's `--max-num-batched-tokens` above
    base_args' value (or vLLM's default for its card) while speculative decoding is on: a larger
    prefill chunk can silently disable the drafter's CUDA graph (field note 004: 109 → 19 tok/s
    decode, with acceptance still looking healthy)."""
    if engine.engine != "vllm" or engine.tier is None or not _has_flag(engine.args, SPECULATIVE):
        return None
    raised = _last_value(engine.args, BATCHED_TOKENS)
    if raised is None:
        return None
    given = _last_value(base.args, BATCHED_TOKENS)
    base_tokens = _human_int(given) if given is not None else _default_batched_tokens(machine, engine.gpu_indices)
    if _human_int(raised) <= base_tokens:
        return None
    return (
        f"tier {engine.tier} raises --max-num-batched-tokens to {raised} (base: {base_tokens}) with speculative "
        "decoding on; a larger prefill chunk can disable the drafter's CUDA graph and cut decode speed several "
        "times over (one report: 109 to 19 tokens/s). Keep the base value in speculative tiers."
    )


def _default_batched_tokens(machine: Machine, gpu_indices: Sequence[int]) -> int:
    """vLLM's own default for an API server (`EngineArgs.get_batch_defaults`): 8192 on cards of 70 GiB
    or more other than the A100, else 2048."""
    cards = [gpu for gpu in machine.gpus if gpu.index in gpu_indices]
    big = bool(cards) and all(g.memory_total_mib >= 70 * 1024 and "a100" not in g.name.lower() for g in cards)
    return 8192 if big else 2048


def _flag_values(args: Sequence[str], spellings: Sequence[str]) -> list[str | None]:
    """The value after each occurrence of the flag (`--f V` or `--f=V`; None for a bare switch)."""
    found: list[str | None] = []
    for i, token in enumerate(args):
        name, equals, inline = token.partition("=") if token.startswith("--") else (token, "", "")
        if name in spellings:
            found.append(inline if equals else (args[i + 1] if i + 1 < len(args) else None))
    return found


def _has_flag(args: Sequence[str], spellings: Sequence[str]) -> bool:
    return bool(_flag_values(args, spellings))


def _last_value(args: Sequence[str], spellings: Sequence[str]) -> str | None:
    values = _flag_values(args, spellings)
    return values[-1] if values else None


def _human_int(text: str) -> int:
    """`8192`, `8k` (× 1000), `1.5k`, `8K` (× 1024): forms the allowlist already accepted."""
    factor = _HUMAN_FACTORS.get(text[-1:])
    return int(float(text[:-1]) * factor) if factor else int(text)


def choose_tier(options: list[_Option], unit: _Unit, weights_mib: int) -> tuple[_Option, tuple[Fallback, ...]]:
    """The highest tier whose threshold the unit's memory clears, judged under that tier's own cap
    (and still holding the model), then the fallbacks: the next lower cleared tier, base alone."""
    base, tiers = options[0], options[1:]
    cleared = [
        option for option in tiers
        if option.threshold is not None
        and unit.judged_mib(option.cap) >= option.threshold
        and _fits(weights_mib, unit.judged_mib(option.cap))
    ]
    if not cleared:
        return base, ()
    fallbacks = [cleared[-2].fallback()] if len(cleared) > 1 else []
    return cleared[-1], (*fallbacks, base.fallback())


def _fits(weights_mib: int, memory_mib: int) -> bool:
    return weights_mib <= FIT_SHARE * memory_mib


def _capped(usable_mib: int, total_mib: int | None, cap: float | None) -> int:
    """min(usable, cap × total); the usable figure alone where no cap or no total is known."""
    if cap is None or total_mib is None:
        return usable_mib
    return min(usable_mib, int(cap * total_mib))


def _smallest_total_mib(machine: Machine, indices: Sequence[int]) -> int | None:
    """The smallest total memory among these cards (a group is held to its smallest member)."""
    totals = [gpu.memory_total_mib for gpu in machine.gpus if gpu.index in indices]
    return min(totals) if len(totals) == len(indices) and totals else None


def vllm_units(machine: Machine, weights_mib: int, cap: float | None = None) -> list[_Unit] | Refusal:
    groups = [g for g in machine.groups if runs_vllm(g)]
    if not groups:
        return Refusal("no lent NVIDIA GPU here has compute capability 7.5 or newer, which vLLM needs")
    units = [
        unit
        for group in groups
        for unit in _group_units(group, weights_mib, _smallest_total_mib(machine, group.gpu_indices), cap)
    ]
    if len(units) == 1 and len(units[0].gpu_indices) == 1:
        return [_Unit(units[0].gpu_indices, "single", units[0].usable_mib, units[0].total_mib)]
    return units


def _group_units(group: GpuGroup, weights_mib: int, card_total_mib: int | None, cap: float | None) -> list[_Unit]:
    """Layout by the memory each card is judged by (its usable memory, held to the cap)."""
    indices = group.gpu_indices
    per_gpu = _capped(group.usable_mib_per_gpu, card_total_mib, cap)

    def unit(gpus: tuple[int, ...], layout: protocol.Layout) -> _Unit:
        total = None if card_total_mib is None else card_total_mib * len(gpus)
        return _Unit(gpus, layout, group.usable_mib_per_gpu * len(gpus), total)

    if _fits(weights_mib, per_gpu):
        if weights_mib >= per_gpu / 2 and len(indices) in TENSOR_GROUP_SIZES:
            return [unit(indices, "tensor")]
        return [unit((i,), "replica") for i in indices]
    size = 2
    while size <= len(indices) and not _fits(weights_mib, per_gpu * size):
        size *= 2
    if size > len(indices):
        return []
    return [unit(indices[start : start + size], "tensor") for start in range(0, len(indices) - size + 1, size)]


def llamacpp_units(machine: Machine, weights_mib: int) -> list[_Unit]:
    if machine.runtime == "apple-silicon":
        candidates = [_Unit((), "single", machine.effective_vram_mib)]
    elif machine.runtime == "cpu" or not machine.groups:
        candidates = [_Unit((), "single", machine.ram_mib)]
    else:
        candidates = [
            _Unit(g.gpu_indices, "layers" if len(g.gpu_indices) > 1 else "single", g.usable_mib_total)
            for g in machine.groups
        ]
    return [unit for unit in candidates if _fits(weights_mib, unit.usable_mib)]


def _fits_nowhere(machine: Machine, name: str, weights_mib: int, engine: str, cap: float | None) -> str:
    if engine == "vllm" and machine.groups:
        best = machine.groups[0]
        per_gpu = _capped(best.usable_mib_per_gpu, _smallest_total_mib(machine, best.gpu_indices), cap)
        held = f", held to the assignment's memory cap of {cap:g}" if per_gpu < best.usable_mib_per_gpu else ""
        where = f"{len(best.gpu_indices)} × {best.name} with {per_gpu:,} MiB usable each{held}"
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
