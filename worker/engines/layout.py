"""How an engine lays its processes over a machine's GPUs: the rules the adapters pick from.

Pure. An adapter's `units` chooses one rule (`per_card_units`: tensor-parallel or one replica per
card, as vLLM runs; `whole_group_units`: one process over a whole group, RAM or the Mac's working
set, as llama.cpp runs) and `worker.plan.planner` judges tiers on the units it returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker.hardware.model import GpuGroup, Machine
    from worker.contract.protocol import Layout

FIT_SHARE = 0.9  # weights may take at most 90 % of the usable memory
TENSOR_GROUP_SIZES = (2, 4)  # a model that fits one card goes tensor-parallel only here; 8+ stay replicas
# The Mac's one integrated GPU: an engine over the working set runs on it, not on the CPU, and
# the plan, the status and the coordinator say so (no GPU index would read as a CPU engine).
APPLE_GPU = 0


@dataclass(frozen=True)
class Unit:
    """One engine process to be: its GPUs, its layout, their usable memory and (where known) their
    total memory, each summed over the GPUs as a multiple of the smallest card."""

    gpu_indices: tuple[int, ...]
    layout: Layout
    usable_mib: int
    total_mib: int | None = None

    def judged_mib(self, cap: float | None) -> int:
        """The memory this process is judged by: its usable memory, held to `cap` × total."""
        return capped(self.usable_mib, self.total_mib, cap)


def fits(weights_mib: int, memory_mib: int) -> bool:
    return weights_mib <= FIT_SHARE * memory_mib


def capped(usable_mib: int, total_mib: int | None, cap: float | None) -> int:
    """min(usable, cap × total); the usable figure alone where no cap or no total is known."""
    if cap is None or total_mib is None:
        return usable_mib
    return min(usable_mib, int(cap * total_mib))


def smallest_total_mib(machine: Machine, indices: Sequence[int]) -> int | None:
    """The smallest total memory among these cards (a group is held to its smallest member)."""
    totals = [gpu.memory_total_mib for gpu in machine.gpus if gpu.index in indices]
    return min(totals) if len(totals) == len(indices) and totals else None


def per_card_units(machine: Machine, groups: Sequence[GpuGroup], weights_mib: int, cap: float | None) -> list[Unit]:
    """Per group, best first: tensor-parallel over a group of 2 or 4 for a model that fits one card
    but takes at least half of it, else one replica per card; a model too big for one card runs
    tensor-parallel over the smallest power-of-two subset that holds it. One card alone: `single`."""
    units = [
        unit
        for group in groups
        for unit in _group_units(group, weights_mib, smallest_total_mib(machine, group.gpu_indices), cap)
    ]
    if len(units) == 1 and len(units[0].gpu_indices) == 1:
        return [Unit(units[0].gpu_indices, "single", units[0].usable_mib, units[0].total_mib)]
    return units


def _group_units(group: GpuGroup, weights_mib: int, card_total_mib: int | None, cap: float | None) -> list[Unit]:
    """Layout by the memory each card is judged by (its usable memory, held to the cap)."""
    indices = group.gpu_indices
    per_gpu = capped(group.usable_mib_per_gpu, card_total_mib, cap)

    def unit(gpus: tuple[int, ...], layout: Layout) -> Unit:
        total = None if card_total_mib is None else card_total_mib * len(gpus)
        return Unit(gpus, layout, group.usable_mib_per_gpu * len(gpus), total)

    if fits(weights_mib, per_gpu):
        if weights_mib >= per_gpu / 2 and len(indices) in TENSOR_GROUP_SIZES:
            return [unit(indices, "tensor")]
        return [unit((i,), "replica") for i in indices]
    size = 2
    while size <= len(indices) and not fits(weights_mib, per_gpu * size):
        size *= 2
    if size > len(indices):
        return []
    return [unit(indices[start : start + size], "tensor") for start in range(0, len(indices) - size + 1, size)]


def whole_group_units(machine: Machine, weights_mib: int) -> list[Unit]:
    """One process over each group (`layers`: split by layers), over the Mac's GPU working set, or
    over RAM on a machine without lent GPUs; those the model fits."""
    if machine.runtime == "apple-silicon":
        candidates = [Unit((APPLE_GPU,), "single", machine.effective_vram_mib)]
    elif machine.runtime == "cpu" or not machine.groups:
        candidates = [Unit((), "single", machine.ram_mib)]
    else:
        candidates = [
            Unit(g.gpu_indices, "layers" if len(g.gpu_indices) > 1 else "single", g.usable_mib_total)
            for g in machine.groups
        ]
    return [unit for unit in candidates if fits(weights_mib, unit.usable_mib)]


def per_card_capacity(machine: Machine, cap: float | None) -> str:
    """What one card of the best group offers, for a refusal (the whole-group words without GPUs)."""
    if not machine.groups:
        return whole_group_capacity(machine)
    best = machine.groups[0]
    per_gpu = capped(best.usable_mib_per_gpu, smallest_total_mib(machine, best.gpu_indices), cap)
    held = f", held to the assignment's memory cap of {cap:g}" if per_gpu < best.usable_mib_per_gpu else ""
    return f"{len(best.gpu_indices)} × {best.name} with {per_gpu:,} MiB usable each{held}"


def whole_group_capacity(machine: Machine) -> str:
    """What one process over the best group, the working set or RAM could use, for a refusal."""
    if machine.runtime == "apple-silicon":
        return f"the GPU working set of {machine.effective_vram_mib:,} MiB"
    if machine.groups:
        return f"{machine.groups[0].usable_mib_total:,} MiB usable on {machine.groups[0].name}"
    return f"{machine.ram_mib:,} MiB of RAM"
