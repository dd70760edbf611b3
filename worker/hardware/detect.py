"""Turn readings (NVML, host) and the engines found into a `Machine`: runtime, usable memory, groups.

The readers live at the edge (`nvml.py`, `host.py`); the engines are found by the caller's
`EngineFinder` (the engines package sits above this one, so it is handed in, never imported).
Everything here is pure arithmetic over what they returned, so a recorded reading replays
through the same code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from worker.system.config import Settings
from worker.hardware.host import HostFacts, read_host
from worker.hardware.model import EngineInstall, Gpu, GpuGroup, Machine
from worker.hardware.nvml import GpuReading, NvidiaReading, NvmlSource, PynvmlSource, find_wsl_nvml_library, read_nvidia

if TYPE_CHECKING:
    from worker.contract.protocol import Runtime


class EngineFinder(Protocol):
    """The engines' part of detection (`worker.engines.finding.Finder`): which engines this
    machine has (on Windows, those the app installed inside `wsl_distro` too), and whether an
    engine that serves NVIDIA cards on Linux runs on a group, installed or not yet, which is what
    names the runtime `native` or `wsl2`."""

    def find(self, system: str, wsl_distro: str | None = None) -> dict[str, EngineInstall]: ...

    def drives(self, group: GpuGroup) -> bool: ...


def usable_mib(free_mib: int, settings: Settings) -> int:
    """What one card can give an engine: `floor(free × gpu_memory_utilization) − memory_reserve_mib`.

    Measured from what is free *now* (a gaming PC's desktop holds some), then the engine's
    utilisation cap, then a fixed reserve for the CUDA context; never below 0. With the default
    settings (0.90, 512 MiB) a 4090 with 23,458 MiB free gives 20,600 MiB and a 5090 with 31,364
    MiB free gives 27,715 MiB. The protocol's example is consistent with this: its GPU 0 shows
    23,980 MiB free (21,070 usable) while the group reports 20,600, the smaller figure of its
    second card, because a group reports its smallest member.

    The same rule measures RAM for vLLM's CPU build (`Machine.engine_ram_usable_mib`): it reads its
    memory flag as the share of RAM it may take, and refuses to start when that share is not free.
    """
    return max(0, int(free_mib * settings.gpu_memory_utilization) - settings.memory_reserve_mib)


def card_usable_mib(index: int, free_mib: int, total_mib: int, settings: Settings) -> int:
    """`usable_mib` held to the share of this card the lender lends (`Settings.memory_share`):
    never above `floor(total × share ÷ 100) − memory_reserve_mib`, whatever is free, so the rest
    stays the desktop's and games'. A 24,564 MiB card lent at 50 % gives at most 11,770 MiB; at
    100 % (no limit) the cap is above any free reading and changes nothing."""
    lent = share_cap_mib(total_mib, settings.memory_share(index), settings.memory_reserve_mib)
    return min(usable_mib(free_mib, settings), lent)


def share_cap_mib(total_mib: int, pct: int, reserve_mib: int) -> int:
    """The most an engine may use of a card lent at `pct` %: the rest is the desktop's (and the
    reserve goes to the engine's CUDA context). Shared by detection and the Settings preview."""
    return max(0, total_mib * pct // 100 - reserve_mib)


def with_shares(machine: Machine, settings: Settings) -> Machine:
    """The machine with each lent card's usable memory judged again from its detected reading under
    `settings`' memory shares, and its groups and effective memory with it: a share changed in
    Settings holds from the next plan and engine start without detecting again. Apple's working
    set is the system's, not a card's: left as it is."""
    gpus = tuple(dataclasses.replace(g, usable_mib=_usable(g, settings) if g.lent else 0) for g in machine.gpus)
    groups = group_gpus(gpus) if machine.groups or machine.runtime != "cpu" else ()
    effective = machine.effective_vram_mib
    if not machine.unified_memory:
        effective = groups[0].usable_mib_total if groups and machine.runtime != "cpu" else 0
    return dataclasses.replace(machine, gpus=gpus, groups=groups if machine.runtime != "cpu" else (),
                               effective_vram_mib=effective)


def _usable(gpu: Gpu, settings: Settings) -> int:
    return card_usable_mib(gpu.index, gpu.memory_free_mib, gpu.memory_total_mib, settings)


def detect(
    settings: Settings,
    engines: EngineFinder,
    *,
    nvml: NvmlSource | None = None,
    host: HostFacts | None = None,
) -> Machine:
    """This machine as the network should see it. Blocking (NVML, small probes): run in a thread."""
    facts = host or read_host()
    if nvml is None:
        nvml = PynvmlSource(library=find_wsl_nvml_library() if facts.is_wsl2 else None)
    reading = read_nvidia(nvml) if facts.apple is None else NvidiaReading()
    found = engines.find(facts.system, facts.wsl_distro)
    return build_machine(facts, reading, found, settings, engines.drives)


def build_machine(
    facts: HostFacts, reading: NvidiaReading, engines: dict[str, EngineInstall], settings: Settings,
    drives: Callable[[GpuGroup], bool],
) -> Machine:
    """`drives`: whether a Linux engine runs on a group (`EngineFinder.drives`)."""
    lend = None if settings.gpus_to_lend is None else set(settings.gpus_to_lend)
    gpus = tuple(_gpu(r, settings, lend) for r in reading.gpus)
    groups = group_gpus(gpus)
    runtime = _runtime(facts, groups, drives)
    problems = [reading.problem] if reading.problem else []
    problems += [f"GPU {g.index}: {e}" for g in gpus for e in g.errors]
    if facts.apple is not None:
        effective = facts.apple.recommended_working_set_mib
    else:
        effective = groups[0].usable_mib_total if groups and runtime != "cpu" else 0
    return Machine(
        os=facts.os,
        runtime=runtime,
        arch=facts.arch,
        cpu_model=facts.cpu_model,
        cpu_cores=facts.cpu_cores,
        ram_mib=facts.ram_mib,
        gpus=gpus,
        groups=groups if runtime != "cpu" else (),
        effective_vram_mib=effective,
        unified_memory=facts.apple is not None,
        engines=engines,
        driver_version=reading.driver_version,
        cuda_version=reading.cuda_version,
        chip=facts.apple.chip if facts.apple else None,
        problems=tuple(problems),
        engine_ram_mib=facts.engine_ram_mib,
        engine_ram_usable_mib=None if facts.engine_ram_free_mib is None else usable_mib(facts.engine_ram_free_mib,
                                                                                      settings),
        wsl_distro=facts.wsl_distro if facts.system == "Windows" else None,
    )


def _gpu(reading: GpuReading, settings: Settings, lend: set[int] | None) -> Gpu:
    v: dict[str, Any] = reading.values
    memory = v.get("memory") or {}
    free, total = int(memory.get("free_mib", 0)), int(memory.get("total_mib", 0))
    mig = bool(v.get("mig_mode"))
    errors = list(reading.errors)
    if mig:
        errors.append("MIG mode is on; a whole-GPU engine cannot use this card, so it is not lent")
    lent = (lend is None or reading.index in lend) and not mig and bool(memory)
    return Gpu(
        index=reading.index,
        uuid=str(v.get("uuid") or f"GPU-unknown-{reading.index}"),
        name=str(v.get("name") or "unknown NVIDIA GPU"),
        memory_total_mib=total,
        memory_free_mib=free,
        memory_used_mib=memory.get("used_mib"),
        usable_mib=card_usable_mib(reading.index, free, total, settings) if lent else 0,
        compute_capability=v.get("compute_capability"),
        pcie_gen=v.get("pcie_gen"),
        pcie_width=v.get("pcie_width"),
        p2p_peers=reading.p2p_peers,
        power_limit_w=_watts(v.get("power_limit_mw")),
        power_w=_watts(v.get("power_mw")),
        util_pct=v.get("utilization_pct"),
        temperature_c=v.get("temperature_c"),
        memory_bandwidth_gbps=_bandwidth_gbps(v.get("memory_clock_mhz"), v.get("bus_width_bits")),
        mig_enabled=mig,
        lent=lent,
        errors=tuple(errors),
    )


def _watts(milliwatts: int | None) -> float | None:
    return None if milliwatts is None else round(milliwatts / 1000, 1)


def _bandwidth_gbps(clock_mhz: int | None, bus_bits: int | None) -> float | None:
    """Peak bandwidth: NVML's memory clock is half the data rate (DDR), so × 2 × bus bytes."""
    if not clock_mhz or not bus_bits:
        return None
    return float(round(clock_mhz * 2 * bus_bits / 8 / 1000))


def group_gpus(gpus: tuple[Gpu, ...]) -> tuple[GpuGroup, ...]:
    """Lent GPUs of one model together, best first (most usable memory in total, then per card)."""
    by_name: dict[str, list[Gpu]] = {}
    for gpu in gpus:
        if gpu.lent and gpu.usable_mib > 0:
            by_name.setdefault(gpu.name, []).append(gpu)
    groups = [_group(members) for members in by_name.values()]
    return tuple(sorted(groups, key=lambda g: (-g.usable_mib_total, -g.usable_mib_per_gpu, g.gpu_indices)))


def _group(members: list[Gpu]) -> GpuGroup:
    indices = tuple(g.index for g in members)
    peer_to_peer = len(members) > 1 and all(set(indices) - {g.index} <= set(g.p2p_peers) for g in members)
    return GpuGroup(
        gpu_indices=indices,
        name=members[0].name,
        usable_mib_per_gpu=min(g.usable_mib for g in members),
        peer_to_peer=peer_to_peer,
        compute_capability=members[0].compute_capability,
    )


def _runtime(facts: HostFacts, groups: tuple[GpuGroup, ...], drives: Callable[[GpuGroup], bool]) -> Runtime:
    """Named for where an engine runs: an NVIDIA group that a Linux engine drives makes `native`
    (`wsl2` under WSL2, or on Windows with a WSL2 distribution to install it into, whether or not
    it is installed yet); else `apple-silicon`, `windows` with a card lent, or `cpu`."""
    if facts.apple is not None:
        return "apple-silicon"
    linux_gpu = any(drives(g) for g in groups)
    if facts.system == "Windows":
        return "wsl2" if linux_gpu and facts.wsl_distro else "windows" if groups else "cpu"
    if linux_gpu:
        return "wsl2" if facts.is_wsl2 else "native"
    return "cpu"
