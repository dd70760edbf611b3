"""What detection found: frozen facts about this machine, and their `hello` JSON form.

Pure. `Machine.to_detect_json()` is exactly `{"platform", "hardware", "engines"}` of the protocol's
`hello`; `Machine.from_detect_json()` reads that back, so `plan --hardware FILE` sees a fleet
machine the same way the node sees its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from worker.system.wsl import DISTRO_NAME

if TYPE_CHECKING:
    from worker.contract import protocol


@dataclass(frozen=True)
class Gpu:
    """One NVIDIA GPU as NVML reported it; None where a query failed or is unsupported."""

    index: int
    uuid: str
    name: str
    memory_total_mib: int
    memory_free_mib: int
    usable_mib: int
    memory_used_mib: int | None = None
    compute_capability: str | None = None
    pcie_gen: int | None = None
    pcie_width: int | None = None
    p2p_peers: tuple[int, ...] = ()
    power_limit_w: float | None = None
    power_w: float | None = None
    util_pct: float | None = None
    temperature_c: float | None = None
    memory_bandwidth_gbps: float | None = None
    mig_enabled: bool = False
    lent: bool = True
    errors: tuple[str, ...] = ()

    @property
    def compute_capability_tuple(self) -> tuple[int, int] | None:
        if not self.compute_capability:
            return None
        major, _, minor = self.compute_capability.partition(".")
        return int(major), int(minor or 0)


@dataclass(frozen=True)
class GpuGroup:
    """GPUs of one model that may serve together; judged by the smallest member's usable memory."""

    gpu_indices: tuple[int, ...]
    name: str
    usable_mib_per_gpu: int
    peer_to_peer: bool = False
    compute_capability: str | None = None

    @property
    def usable_mib_total(self) -> int:
        return self.usable_mib_per_gpu * len(self.gpu_indices)


IN_WSL = "wsl"  # `EngineInstall.path` of an engine found inside WSL2 from Windows


@dataclass(frozen=True)
class EngineInstall:
    """An engine found on this machine: its version and, where known, how to run it (`IN_WSL`:
    inside WSL2)."""

    version: str | None
    path: str | None = None


@dataclass(frozen=True)
class Machine:
    os: str
    runtime: protocol.Runtime
    arch: str
    cpu_model: str
    cpu_cores: int
    ram_mib: int
    gpus: tuple[Gpu, ...] = ()
    groups: tuple[GpuGroup, ...] = ()
    effective_vram_mib: int = 0
    unified_memory: bool = False
    engines: dict[str, EngineInstall] = field(default_factory=dict)
    driver_version: str | None = None
    cuda_version: str | None = None
    chip: str | None = None
    problems: tuple[str, ...] = ()
    # The RAM an engine on the CPU is judged by (vLLM's CPU build): the total it takes its share of,
    # and what of it is usable now, measured as a card's is (`detect.usable_mib`). Not on the wire:
    # None for a machine read back from `detect` JSON.
    engine_ram_mib: int | None = None
    engine_ram_usable_mib: int | None = None
    # On Windows, the WSL2 distribution where engines that run only on Linux are installed and
    # started; None elsewhere. Shown by `detect` (in `platform`, which `hello` leaves out: the
    # coordinator has no use for a name the user gave) and read back from a `--hardware` file.
    wsl_distro: str | None = None

    def to_detect_json(self) -> dict[str, Any]:
        """The `platform`, `hardware` and `engines` parts of `hello`, as plain JSON.

        Built by hand rather than through the pydantic models so `detect` stays fast; the tests
        validate every fixture's output through `protocol.PlatformInfo`/`HardwareInfo`.
        """
        platform: dict[str, Any] = {"os": self.os, "runtime": self.runtime, "arch": self.arch}
        if self.wsl_distro is not None:
            platform["wsl_distro"] = self.wsl_distro
        return {
            "platform": platform,
            "hardware": {
                "gpus": [_gpu_json(gpu) for gpu in self.gpus],
                "groups": [
                    {
                        "gpu_indices": list(group.gpu_indices),
                        "name": group.name,
                        "usable_mib_per_gpu": group.usable_mib_per_gpu,
                        "peer_to_peer": group.peer_to_peer,
                    }
                    for group in self.groups
                ],
                "effective_vram_mib": self.effective_vram_mib,
                "unified_memory": self.unified_memory,
                "ram_mib": self.ram_mib,
                "cpu": {"model": self.cpu_model, "cores": self.cpu_cores},
            },
            "engines": {name: install.version for name, install in sorted(self.engines.items())},
        }

    @classmethod
    def from_detect_json(cls, data: Any) -> Machine:
        """Read a `detect` output back; raises ValueError (pydantic's) when it is not one."""
        from worker.contract import protocol

        if not isinstance(data, dict):
            raise ValueError("expected one JSON object with platform, hardware and engines")
        platform = protocol.PlatformInfo.model_validate(data.get("platform"))
        hardware = protocol.HardwareInfo.model_validate(data.get("hardware"))
        engines = data.get("engines") or {}
        if not isinstance(engines, dict):
            raise ValueError("'engines' must map engine names to versions")
        wsl_distro = _wsl_distro(data["platform"], platform.os)
        usable = {i: g.usable_mib_per_gpu for g in hardware.groups for i in g.gpu_indices}
        by_index = {gpu.index: gpu for gpu in hardware.gpus}
        return cls(
            os=platform.os,
            runtime=platform.runtime,
            arch=platform.arch,
            cpu_model=hardware.cpu.model,
            cpu_cores=hardware.cpu.cores,
            ram_mib=hardware.ram_mib,
            gpus=tuple(_gpu_from_info(gpu, usable.get(gpu.index, 0), usable) for gpu in hardware.gpus),
            groups=tuple(
                GpuGroup(
                    gpu_indices=tuple(g.gpu_indices),
                    name=g.name,
                    usable_mib_per_gpu=g.usable_mib_per_gpu,
                    peer_to_peer=bool(g.peer_to_peer),
                    compute_capability=_group_capability(g.gpu_indices, by_index),
                )
                for g in hardware.groups
            ),
            effective_vram_mib=hardware.effective_vram_mib,
            unified_memory=hardware.unified_memory,
            engines={str(k): EngineInstall(version=None if v is None else str(v)) for k, v in engines.items()},
            wsl_distro=wsl_distro,
        )


def _wsl_distro(platform: dict[str, Any], os: str) -> str | None:
    """`platform.wsl_distro` of a Windows machine, when it is a distribution's name."""
    name = platform.get("wsl_distro")
    if name is None:
        return None
    if os != "windows" or not isinstance(name, str) or not DISTRO_NAME.fullmatch(name):
        raise ValueError("'platform.wsl_distro' must name a WSL2 distribution, on a Windows machine only")
    return name


def _gpu_json(gpu: Gpu) -> dict[str, Any]:
    return {
        "index": gpu.index,
        "uuid": gpu.uuid,
        "name": gpu.name,
        "vendor": "nvidia",
        "memory_total_mib": gpu.memory_total_mib,
        "memory_free_mib": gpu.memory_free_mib,
        "compute_capability": gpu.compute_capability,
        "pcie": {"gen": gpu.pcie_gen, "width": gpu.pcie_width},
        "peer_to_peer": bool(gpu.p2p_peers),
        "power_limit_w": gpu.power_limit_w,
        "memory_bandwidth_gbps": gpu.memory_bandwidth_gbps,
    }


def _gpu_from_info(info: protocol.GpuInfo, usable_mib: int, grouped: dict[int, int]) -> Gpu:
    return Gpu(
        index=info.index,
        uuid=info.uuid,
        name=info.name,
        memory_total_mib=info.memory_total_mib,
        memory_free_mib=info.memory_free_mib,
        usable_mib=usable_mib,
        compute_capability=info.compute_capability,
        pcie_gen=info.pcie.gen if info.pcie else None,
        pcie_width=info.pcie.width if info.pcie else None,
        p2p_peers=tuple(i for i in grouped if i != info.index) if info.peer_to_peer else (),
        power_limit_w=info.power_limit_w,
        memory_bandwidth_gbps=info.memory_bandwidth_gbps,
        lent=info.index in grouped,
    )


def _group_capability(indices: list[int], by_index: dict[int, protocol.GpuInfo]) -> str | None:
    capabilities = [by_index[i].compute_capability for i in indices if i in by_index]
    return capabilities[0] if capabilities else None
