"""A stand-in for nvidia-ml-py's `pynvml` module that behaves as the real bindings do on a driver.

`FakeNvml(cards).install(monkeypatch)` puts a module object in `sys.modules["pynvml"]`, so
`PynvmlSource` runs its own calls against it: argument types, return shapes and errors included.
It fails where real NVML fails:

- errors are pynvml's own classes (`NVMLError(code)` becomes `NVMLError_NotSupported` and so on,
  `str()` is NVML's words), taken from the installed bindings so they cannot drift;
- every call but `nvmlInit` raises `NVMLError_Uninitialized` outside an init/shutdown pair (NVML
  counts them), and so does `nvmlShutdown` without an init;
- process lists hold objects with `pid` and `usedGpuMemory` in bytes, None where the driver
  says NVML_VALUE_NOT_AVAILABLE (Windows WDDM: every process, graphics or compute);
- `nvmlDeviceGetProcessUtilization(handle, timeStamp)` wants an int of microseconds (ctypes'
  `c_ulonglong` refuses a float), returns only processes busy after it, raises NotFound when
  none is, and NotSupported on a card that cannot sample;
- GeForce cards raise NotSupported for MIG; `NVML_P2P_CAPS_INDEX_READ` is pynvml's tuple `(0,)`,
  and a p2p index that is not an int fails as ctypes fails;
- a driver without the `_v3` process-list functions raises `NVMLLibraryMismatchError`, as the
  bindings' unversioned wrappers do.
"""

from __future__ import annotations

import ctypes
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pynvml as _real  # the installed bindings, only for their constants and error classes

import pytest

MIB = 1024 * 1024


@dataclass
class FakeProcess:
    pid: int
    used_mib: int
    graphics: bool = True  # a graphics (3D) context
    compute: bool = False  # a CUDA context; a process may hold both ("C+G")
    sm_pct: int = 0  # what NVML's per-process sampling would see now


@dataclass
class FakeCard:
    """One GPU; the defaults are a GeForce RTX 4090 driving the desktop on Linux."""

    name: str = "NVIDIA GeForce RTX 4090"
    uuid: str = "GPU-6513270e-269e-0d37-f2a7-4de452e6b438"
    total_mib: int = 24564
    reserved_mib: int = 342  # the driver's own share, in `used` but no process's
    compute_capability: tuple[int, int] = (8, 9)
    pcie: tuple[int, int] = (4, 16)
    power_limit_mw: int = 450_000
    power_mw: int = 31_250
    util_pct: int = 4
    temperature_c: int = 41
    energy_mj: int | None = 912_334_571  # None: the card has no energy counter
    memory_clock_mhz: int = 10_501
    bus_width_bits: int = 384
    mig_capable: bool = False
    display_active: bool = True
    process_sampling: bool = True
    processes: list[FakeProcess] = field(default_factory=list)


@dataclass(frozen=True)
class _Handle:
    index: int


class _Struct:
    """What pynvml returns for a C struct: an object with the struct's fields as attributes."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


def _error(code: int) -> Exception:
    return _real.NVMLError(code)  # type: ignore[no-any-return]


class FakeNvml:
    """The driver's state (cards, processes, sessions) and the module that reads it."""

    def __init__(
        self,
        cards: list[FakeCard],
        *,
        driver_version: str = "580.95.05",
        cuda_version: int = 13000,
        init_error: int | None = None,
        wddm: bool = False,
        missing_functions: frozenset[str] = frozenset(),
        clock_us: Callable[[], int] = lambda: time.time_ns() // 1000,
    ) -> None:
        self.cards = cards
        self.driver_version = driver_version
        self.cuda_version = cuda_version
        self.init_error = init_error
        self.wddm = wddm
        self.missing_functions = missing_functions
        self.clock_us = clock_us
        self.sessions = 0
        self.calls: list[str] = []
        self.module = self._module()

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
        monkeypatch.setitem(sys.modules, "pynvml", self.module)
        return self

    # --- the module ---------------------------------------------------------------------------

    def _module(self) -> types.ModuleType:
        module = types.ModuleType("pynvml")
        for name in dir(_real):
            if name.startswith(("NVML_", "NVMLError")) or name == "NVMLLibraryMismatchError":
                setattr(module, name, getattr(_real, name))
        module.nvmlLib = None  # type: ignore[attr-defined]
        module.nvmlInit = self._init  # type: ignore[attr-defined]
        api: dict[str, Callable[..., Any]] = {
            "nvmlShutdown": self._shutdown,
            "nvmlSystemGetDriverVersion": lambda: self.driver_version,
            "nvmlSystemGetCudaDriverVersion_v2": lambda: self.cuda_version,
            "nvmlDeviceGetCount": lambda: len(self.cards),
            "nvmlDeviceGetHandleByIndex": self._handle,
            "nvmlDeviceGetName": lambda h: self._card(h).name,
            "nvmlDeviceGetUUID": lambda h: self._card(h).uuid,
            "nvmlDeviceGetMemoryInfo": self._memory,
            "nvmlDeviceGetCudaComputeCapability": lambda h: self._card(h).compute_capability,
            "nvmlDeviceGetMaxPcieLinkGeneration": lambda h: self._card(h).pcie[0],
            "nvmlDeviceGetMaxPcieLinkWidth": lambda h: self._card(h).pcie[1],
            "nvmlDeviceGetP2PStatus": self._p2p,
            "nvmlDeviceGetEnforcedPowerLimit": lambda h: self._card(h).power_limit_mw,
            "nvmlDeviceGetPowerUsage": lambda h: self._card(h).power_mw,
            "nvmlDeviceGetUtilizationRates": lambda h: _Struct(gpu=self._card(h).util_pct, memory=0),
            "nvmlDeviceGetTemperature": self._temperature,
            "nvmlDeviceGetMaxClockInfo": self._max_clock,
            "nvmlDeviceGetMemoryBusWidth": lambda h: self._card(h).bus_width_bits,
            "nvmlDeviceGetMigMode": self._mig_mode,
            "nvmlDeviceGetTotalEnergyConsumption": self._energy,
            "nvmlDeviceGetDisplayActive": lambda h: int(self._card(h).display_active),
            "nvmlDeviceGetDisplayMode": lambda h: int(self._card(h).display_active),
            "nvmlDeviceGetComputeRunningProcesses": lambda h: self._processes(h, "compute"),
            "nvmlDeviceGetGraphicsRunningProcesses": lambda h: self._processes(h, "graphics"),
            "nvmlDeviceGetProcessUtilization": self._process_utilization,
        }
        for name, call in api.items():
            setattr(module, name, self._guarded(name, call))
        return module

    def _guarded(self, name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def guarded(*args: Any) -> Any:
            self.calls.append(name)
            if self.sessions == 0:
                raise _error(_real.NVML_ERROR_UNINITIALIZED)
            return call(*args)

        return guarded

    def _init(self) -> None:
        self.calls.append("nvmlInit")
        if self.init_error is not None:
            raise _error(self.init_error)
        self.sessions += 1

    def _shutdown(self) -> None:
        self.sessions -= 1

    def _handle(self, index: int) -> _Handle:
        if not isinstance(index, int):
            raise TypeError(f"an integer is required (got type {type(index).__name__})")
        if not 0 <= index < len(self.cards):
            raise _error(_real.NVML_ERROR_INVALID_ARGUMENT)
        return _Handle(index)

    def _card(self, handle: _Handle) -> FakeCard:
        if not isinstance(handle, _Handle) or handle.index >= len(self.cards):
            raise _error(_real.NVML_ERROR_INVALID_ARGUMENT)
        return self.cards[handle.index]

    def _memory(self, handle: _Handle) -> _Struct:
        card = self._card(handle)
        used = (card.reserved_mib + sum(p.used_mib for p in card.processes)) * MIB
        return _Struct(total=card.total_mib * MIB, free=card.total_mib * MIB - used, used=used)

    def _p2p(self, first: _Handle, second: _Handle, index: object) -> int:
        if not isinstance(index, int):
            raise ctypes.ArgumentError("argument 3: TypeError: Don't know how to convert parameter 3")
        self._card(first)
        self._card(second)
        return int(_real.NVML_P2P_STATUS_NOT_SUPPORTED)  # GeForce cards do not talk to each other

    def _temperature(self, handle: _Handle, sensor: int) -> int:
        if sensor != _real.NVML_TEMPERATURE_GPU:
            raise _error(_real.NVML_ERROR_INVALID_ARGUMENT)
        return self._card(handle).temperature_c

    def _max_clock(self, handle: _Handle, clock: int) -> int:
        if clock != _real.NVML_CLOCK_MEM:
            raise _error(_real.NVML_ERROR_NOT_SUPPORTED)
        return self._card(handle).memory_clock_mhz

    def _mig_mode(self, handle: _Handle) -> list[int]:
        if not self._card(handle).mig_capable:
            raise _error(_real.NVML_ERROR_NOT_SUPPORTED)
        return [0, 0]

    def _energy(self, handle: _Handle) -> int:
        energy = self._card(handle).energy_mj
        if energy is None:
            raise _error(_real.NVML_ERROR_NOT_SUPPORTED)
        return energy

    def _processes(self, handle: _Handle, kind: str) -> list[_Struct]:
        card = self._card(handle)
        versioned = f"nvmlDeviceGet{kind.capitalize()}RunningProcesses_v3"
        if versioned in self.missing_functions:
            raise _real.NVMLLibraryMismatchError(f"Unversioned function called ...; use {versioned}")
        listed = [p for p in card.processes if (p.graphics if kind == "graphics" else p.compute)]
        return [
            _Struct(
                pid=p.pid,
                usedGpuMemory=None if self.wddm else p.used_mib * MIB,
                gpuInstanceId=0xFFFFFFFF,
                computeInstanceId=0xFFFFFFFF,
            )
            for p in listed
        ]

    def _process_utilization(self, handle: _Handle, since_us: object) -> list[_Struct]:
        if not isinstance(since_us, int):
            raise TypeError(f"an integer is required (got type {type(since_us).__name__})")
        card = self._card(handle)
        if not card.process_sampling:
            raise _error(_real.NVML_ERROR_NOT_SUPPORTED)
        stamp = self.clock_us() - 100_000  # the driver's latest sample, a tenth of a second old
        busy = [p for p in card.processes if p.sm_pct > 0 and stamp > since_us]
        if not busy:
            raise _error(_real.NVML_ERROR_NOT_FOUND)
        return [
            _Struct(pid=p.pid, timeStamp=stamp, smUtil=p.sm_pct, memUtil=p.sm_pct // 2, encUtil=0, decUtil=0)
            for p in busy
        ]


__all__ = ["MIB", "FakeCard", "FakeNvml", "FakeProcess"]
