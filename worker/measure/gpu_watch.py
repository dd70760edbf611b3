"""The node's GPUs while it runs, through its one NVML source (None: no NVIDIA card, or a
`--hardware` file): a sample a second with the energy drawn since the last one, the processes
that hold a card, and a fresh reading of a plan's cards (or, for vLLM's CPU build, of RAM) when
vLLM found their memory held."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Collection
from pathlib import Path

from worker.system.config import Settings
from worker.hardware import (
    Gpu,
    GpuProcess,
    GpuSample,
    Machine,
    NvmlError,
    NvmlSource,
    gpu_processes,
    sample_gpus,
    usable_mib,
)
from worker.hardware.detect import card_usable_mib
from worker.hardware.host import MIB, SYSFS, read_engine_ram
from worker.hardware.nvml import read_nvidia
from worker.measure.energy import EnergyIntegrator
from worker.plan.planner import EnginePlan, cards_share, held_to_cap, share

log = logging.getLogger(__name__)


class GpuWatch:
    """The latest telemetry sample per card and the energy integrator that goes with it."""

    def __init__(self, nvml: NvmlSource | None, *, sysfs: Path = SYSFS) -> None:
        self.nvml = nvml
        self._sysfs = sysfs  # where the RAM an engine on the CPU sees is read (`read_engine_ram`)
        self.samples: dict[int, GpuSample] = {}  # by card index; empty without NVML
        self._energy = EnergyIntegrator()

    async def sample(self, now: float) -> dict[int, float]:
        """Samples every card (off the loop); the joules each drew since the last sample, by index."""
        if self.nvml is None:
            return {}
        try:
            samples = await asyncio.to_thread(sample_gpus, self.nvml)
        except NvmlError as exc:
            log.debug("GPU sample failed: %s", exc)
            samples = []
        self.samples = {s.index: s for s in samples}
        return {s.index: self._energy.add(s.index, now, s.power_w, s.energy_mj) for s in samples}

    def processes_besides(self, own: Callable[[], Collection[int]]) -> list[GpuProcess]:
        """GPU users that are none of `own()` (the app's processes: asked only where NVML is)."""
        if self.nvml is None:
            return []
        ours = own()
        return [p for p in gpu_processes(self.nvml) if p.pid not in ours]

    def released(self, pids: Collection[int]) -> bool:
        """True once none of `pids` holds GPU memory (called in a thread while an engine stops)."""
        return self.nvml is None or not any(p.pid in pids for p in gpu_processes(self.nvml))

    async def memory_share(self, machine: Machine, engine_plan: EnginePlan, settings: Settings) -> float | None:
        """vLLM's memory share for the plan's cards from a fresh NVML reading, or, for vLLM's CPU
        build (no cards), from the RAM measured again as vLLM measures it; by the rules of detection
        (`card_usable_mib`: a card's held to the share the lender lends; `usable_mib` for RAM) and
        planning (`cards_share`/`share`, held to the assignment's cap). None where the cards cannot
        be read."""
        if not engine_plan.gpu_indices:
            total, free = await asyncio.to_thread(read_engine_ram, self._sysfs)
            measured = share(usable_mib(free // MIB, settings), total // MIB)
            return held_to_cap(measured, engine_plan.memory_cap)
        if self.nvml is None:
            return None
        reading = await asyncio.to_thread(read_nvidia, self.nvml)
        memory = {gpu.index: gpu.values["memory"] for gpu in reading.gpus if gpu.values.get("memory")}
        cards = [gpu for gpu in machine.gpus if gpu.index in engine_plan.gpu_indices and gpu.index in memory]
        if len(cards) != len(engine_plan.gpu_indices):
            return None
        fresh = tuple(_fresh(gpu, int(memory[gpu.index]["free_mib"]), int(memory[gpu.index]["total_mib"]), settings)
                      for gpu in cards)
        measured = cards_share(dataclasses.replace(machine, gpus=fresh), engine_plan.gpu_indices)
        return held_to_cap(measured, engine_plan.memory_cap)


def _fresh(gpu: Gpu, free_mib: int, total_mib: int, settings: Settings) -> Gpu:
    return dataclasses.replace(gpu, memory_total_mib=total_mib, memory_free_mib=free_mib,
                               usable_mib=card_usable_mib(gpu.index, free_mib, total_mib, settings))
