"""Where vLLM runs and how a plan for it is shaped: the cards it can use (or RAM, for its CPU
build), its layout over them, what it needs under WSL2, and the tier settings known to slow it down.

Pure: rules over a `Machine` and argument lists.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from worker.engines import layout
from worker.engines.layout import Unit, capped, fits

if TYPE_CHECKING:
    from worker.hardware.model import EngineInstall, GpuGroup, Machine

MIN_COMPUTE_CAPABILITY = (7, 5)
NO_CARD = "no lent NVIDIA GPU here has compute capability 7.5 or newer, which vLLM needs"
NO_CPU_BUILD = ("this computer has no graphics card vLLM can use, and vLLM's CPU version is not installed; "
                "a model for this computer needs a llama.cpp build")


def serves_group(group: GpuGroup) -> bool:
    """vLLM runs on NVIDIA cards of compute capability 7.5 or newer."""
    if not group.compute_capability:
        return False
    major, _, minor = group.compute_capability.partition(".")
    return (int(major), int(minor or 0)) >= MIN_COMPUTE_CAPABILITY


def is_cpu_build(install: EngineInstall | None) -> bool:
    """vLLM's CPU build: a version tagged `+cpu`, which vLLM itself takes for the CPU platform."""
    return install is not None and "cpu" in (install.version or "")


def units(machine: Machine, weights_mib: int, cap: float | None) -> list[Unit] | str:
    """Tensor-parallel or one replica per card, over the groups whose cards vLLM can use; on a
    `cpu` machine with the CPU build, one process over RAM."""
    if machine.runtime == "cpu":
        return _ram_units(machine, weights_mib, cap)
    groups = [g for g in machine.groups if serves_group(g)]
    if not groups:
        return NO_CARD
    return layout.per_card_units(machine, groups, weights_mib, cap)


def _ram_units(machine: Machine, weights_mib: int, cap: float | None) -> list[Unit] | str:
    """One process over the RAM measured as usable (judged like a card: held to `cap` × total)."""
    if not is_cpu_build(machine.engines.get("vllm")):
        return NO_CPU_BUILD
    usable, total = _engine_ram(machine)
    unit = Unit((), "single", usable, total)
    return [unit] if fits(weights_mib, unit.judged_mib(cap)) else []


def _engine_ram(machine: Machine) -> tuple[int, int]:
    """(usable, total) as measured at detection; all of RAM for a machine read back from `detect`
    JSON, which carries no such reading."""
    total = machine.engine_ram_mib or machine.ram_mib
    usable = machine.engine_ram_usable_mib
    return (total if usable is None else usable), total


def capacity(machine: Machine, cap: float | None) -> str:
    if machine.runtime != "cpu":
        return layout.per_card_capacity(machine, cap)
    usable, total = _engine_ram(machine)
    judged = capped(usable, total, cap)
    held = f", held to the assignment's memory cap of {cap:g}" if judged < usable else ""
    return f"{judged:,} MiB of the RAM free now{held}"


_VERSION_PREFIX = re.compile(r"v?(\d+)\.(\d+)")
FIXED_PINNED_MEMORY = (0, 30)  # the V2 model runner tolerates WSL2's lack of pinned memory from here


def runtime_environment(machine: Machine, version: str | None) -> dict[str, str]:
    """What vLLM needs under WSL2 (engines.md A8, Part C 7): pinned memory is off there unless
    `VLLM_WSL2_ENABLE_PIN_MEMORY=1`, and before 0.30 the default V2 model runner crashed without it
    ("UVA is not available"), so such versions also get the V1 runner. The version is the
    assignment's, else the installed one's; an unknown version gets pinned memory only."""
    if machine.runtime != "wsl2":
        return {}
    env = {"VLLM_WSL2_ENABLE_PIN_MEMORY": "1"}
    installed = machine.engines.get("vllm")
    match = _VERSION_PREFIX.match(version or (installed.version if installed else None) or "")
    if match and (int(match.group(1)), int(match.group(2))) < FIXED_PINNED_MEMORY:
        env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    return env


BATCHED_TOKENS = ("--max-num-batched-tokens",)
SPECULATIVE = ("--speculative-config", "-sc", "--spec-method", "--spec-tokens")
_HUMAN_FACTORS = {"k": 1000, "m": 1000**2, "K": 1024, "M": 1024**2}  # vLLM's `32k` / `32K` integers


def tier_warning(machine: Machine, gpu_indices: Sequence[int], tier: str | None, args: Sequence[str],
                 base_args: Sequence[str]) -> str | None:
    """A warning when the tier this engine runs raises vLLM's `--max-num-batched-tokens` above
    base_args' value (or vLLM's default for its card) while speculative decoding is on: a larger
    prefill chunk can silently disable the drafter's CUDA graph (field note 004: 109 → 19 tok/s
    decode, with acceptance still looking healthy)."""
    if tier is None or not _has_flag(args, SPECULATIVE):
        return None
    raised = _last_value(args, BATCHED_TOKENS)
    if raised is None:
        return None
    given = _last_value(base_args, BATCHED_TOKENS)
    base_tokens = _human_int(given) if given is not None else _default_batched_tokens(machine, gpu_indices)
    if _human_int(raised) <= base_tokens:
        return None
    return (
        f"tier {tier} raises --max-num-batched-tokens to {raised} (base: {base_tokens}) with speculative "
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
