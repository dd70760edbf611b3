"""Where SGLang runs and how a plan for it is shaped: NVIDIA cards of compute capability 8.0 or
newer (contract, Assignment), laid out per card as vLLM is, and the share of each card it is told.

Pure: rules over a `Machine` and the plan's measured share.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from worker.engines import layout
from worker.engines.layout import Unit

if TYPE_CHECKING:
    from worker.hardware.model import GpuGroup, Machine

MIN_COMPUTE_CAPABILITY = (8, 0)
NO_CARD = "no lent NVIDIA GPU here has compute capability 8.0 or newer, which SGLang needs"
# `--mem-fraction-static` is SGLang's share for weights and KV cache; the rest of the card is for
# activations and CUDA graphs. SGLang's own default (`arg_groups/memory_hook.py`, 0.5.23) reserves
# 512 MiB + 1.5 MiB per chunked-prefill token (at least 2048: 3.5 GiB) plus its graphs, and at least
# 10 GiB on cards over 60 GiB: 0.15 of a 24 GiB card, 0.125 of an 80 GiB one. The app takes 0.15 of
# each card off the share it measured as usable, so SGLang's activations fit beside what others hold.
ACTIVATION_HEADROOM = 0.15
MIN_STATIC_FRACTION = 0.05  # below this SGLang has no room for weights: it refuses (a lower tier is tried)


def serves_group(group: GpuGroup) -> bool:
    """SGLang runs on NVIDIA cards of compute capability 8.0 (Ampere) or newer."""
    if not group.compute_capability:
        return False
    major, _, minor = group.compute_capability.partition(".")
    return (int(major), int(minor or 0)) >= MIN_COMPUTE_CAPABILITY


def units(machine: Machine, weights_mib: int, cap: float | None) -> list[Unit] | str:
    """Tensor-parallel or one process per card, over the groups whose cards SGLang can use."""
    groups = [g for g in machine.groups if serves_group(g)]
    if not groups:
        return NO_CARD
    return layout.per_card_units(machine, groups, weights_mib, cap)


def capacity(machine: Machine, cap: float | None) -> str:
    return layout.per_card_capacity(machine, cap)


def static_fraction(share: float) -> float:
    """`--mem-fraction-static` for the usable `share` of each card: the share less SGLang's
    activation headroom, rounded down to 3 decimals, never below `MIN_STATIC_FRACTION`."""
    return max(MIN_STATIC_FRACTION, math.floor(round((share - ACTIVATION_HEADROOM) * 1000, 6)) / 1000)


def runtime_environment(machine: Machine, version: str | None) -> dict[str, str]:
    """Nothing: SGLang needs no setting of its own on `native` or `wsl2`."""
    return {}


def tier_warning(machine: Machine, gpu_indices: Sequence[int], tier: str | None, args: Sequence[str],
                 base_args: Sequence[str]) -> str | None:
    """None: no SGLang tier setting is known to run badly."""
    return None
