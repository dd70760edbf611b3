"""NVML readings through one small, replayable source object.

Every NVML call the detector and the live telemetry make goes through `NvmlSource.query(name,
*indices)`, which returns plain JSON values. `PynvmlSource` answers from the real library;
`worker.hardware.replay` records those answers and serves them back, so tests run the exact same
code path without a GPU. Blocking: call from a thread in the core, never on the event loop.

`tests/support/fake_pynvml.py` stands in for the `pynvml` module itself, so the adapter's own calls
(argument types, the errors NVML raises, None memory on Windows) are tested too.
"""

from __future__ import annotations

import ctypes
import glob
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, TypeVar

MIB = 1024 * 1024
NOT_SUPPORTED = "Not Supported"  # NVML's answer for a reading the card does not offer: absent, not an error
# pynvml spells NVML_P2P_CAPS_INDEX_READ as the tuple `(0,)` (a stray comma), which ctypes refuses.
P2P_CAPS_INDEX_READ = 0
# Per-process utilisation samples younger than this count as "now" (NVML samples every 1/6 s to 1 s).
PROCESS_SAMPLE_WINDOW_US = 1_000_000
WSL_NVML_LIBRARY_GLOBS = ("/usr/lib/wsl/lib/libnvidia-ml.so.1", "/usr/lib/wsl/drivers/*/libnvidia-ml.so.1")


T = TypeVar("T")


class NvmlError(Exception):
    """A query (or NVML itself) failed; the message is NVML's own words."""


class NvmlSource(Protocol):
    def init(self) -> None: ...

    def shutdown(self) -> None: ...

    def query(self, name: str, *indices: int) -> Any: ...


def find_wsl_nvml_library(patterns: tuple[str, ...] = WSL_NVML_LIBRARY_GLOBS) -> str | None:
    """WSL2 ships NVML with the Windows driver under /usr/lib/wsl, often outside the linker's path."""
    for pattern in patterns:
        for path in sorted(glob.glob(pattern)):
            if os.path.isfile(path):
                return path
    return None


_load_lock = threading.Lock()


class PynvmlSource:
    """The real NVML through nvidia-ml-py; `library` forces a path (WSL2's lives under /usr/lib/wsl)."""

    def __init__(self, library: str | None = None) -> None:
        self._library = library
        self._nvml: Any = None
        self._handles: dict[int, Any] = {}

    def init(self) -> None:
        try:
            import pynvml
        except ImportError as exc:
            raise NvmlError(f"nvidia-ml-py is not installed: {exc}") from exc
        self._nvml = pynvml
        try:
            with _load_lock:
                if self._library and pynvml.nvmlLib is None:
                    pynvml.nvmlLib = ctypes.CDLL(self._library)
            pynvml.nvmlInit()
        except (pynvml.NVMLError, OSError) as exc:
            raise NvmlError(str(exc) or type(exc).__name__) from exc

    def shutdown(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass
        self._handles.clear()

    def query(self, name: str, *indices: int) -> Any:
        call = _QUERIES.get(name)
        if call is None:
            raise NvmlError(f"unknown NVML query {name!r}")
        if self._nvml is None:
            raise NvmlError("Uninitialized")
        try:
            return call(self._nvml, *(self._handle(i) for i in indices))
        except (self._nvml.NVMLError, self._nvml.NVMLLibraryMismatchError) as exc:
            # NVMLLibraryMismatchError: a driver too old for the bindings' unversioned call (process lists)
            raise NvmlError(str(exc) or type(exc).__name__) from exc

    def _handle(self, index: int) -> Any:
        """Cached per session; one dict lookup, because another thread's `shutdown` may clear it."""
        handle = self._handles.get(index)
        if handle is None:
            handle = self._handles[index] = self._nvml.nvmlDeviceGetHandleByIndex(index)
        return handle


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _process_entries(entries: Any) -> list[dict[str, int | None]]:
    """NVML's process structs as JSON; `usedGpuMemory` is None where NVML cannot tell (Windows WDDM)."""
    return [
        {"pid": int(p.pid), "used_mib": None if p.usedGpuMemory is None else int(p.usedGpuMemory) // MIB}
        for p in entries
    ]


def _process_utilization(n: Any, h: Any) -> list[dict[str, int]]:
    """Each busy process's latest SM utilisation over the last second.

    NVML returns samples only for processes that used the GPU, newer than a CPU timestamp in
    microseconds, and raises NotFound when there is none: then every process is idle. Cards
    that cannot sample raise NotSupported, which the caller keeps apart from "idle".
    """
    since_us = time.time_ns() // 1000 - PROCESS_SAMPLE_WINDOW_US
    try:
        samples = n.nvmlDeviceGetProcessUtilization(h, since_us)
    except n.NVMLError_NotFound:
        return []
    latest: dict[int, int] = {}
    for sample in sorted(samples, key=lambda s: int(s.timeStamp)):
        latest[int(sample.pid)] = int(sample.smUtil)
    return [{"pid": pid, "sm_pct": pct} for pid, pct in sorted(latest.items())]


def _cuda_version(n: Any) -> str:
    version = int(n.nvmlSystemGetCudaDriverVersion_v2())
    return f"{version // 1000}.{version % 1000 // 10}"


def _memory(n: Any, h: Any) -> dict[str, int]:
    info = n.nvmlDeviceGetMemoryInfo(h)
    return {"total_mib": int(info.total) // MIB, "free_mib": int(info.free) // MIB, "used_mib": int(info.used) // MIB}


_QUERIES: dict[str, Callable[..., Any]] = {
    "driver_version": lambda n: _text(n.nvmlSystemGetDriverVersion()),
    "cuda_version": _cuda_version,
    "device_count": lambda n: int(n.nvmlDeviceGetCount()),
    "uuid": lambda n, h: _text(n.nvmlDeviceGetUUID(h)),
    "name": lambda n, h: _text(n.nvmlDeviceGetName(h)),
    "memory": _memory,
    "compute_capability": lambda n, h: "%d.%d" % tuple(n.nvmlDeviceGetCudaComputeCapability(h)),
    "pcie_gen": lambda n, h: int(n.nvmlDeviceGetMaxPcieLinkGeneration(h)),
    "pcie_width": lambda n, h: int(n.nvmlDeviceGetMaxPcieLinkWidth(h)),
    "p2p": lambda n, a, b: n.nvmlDeviceGetP2PStatus(a, b, P2P_CAPS_INDEX_READ) == n.NVML_P2P_STATUS_OK,
    "power_limit_mw": lambda n, h: int(n.nvmlDeviceGetEnforcedPowerLimit(h)),
    "power_mw": lambda n, h: int(n.nvmlDeviceGetPowerUsage(h)),
    "utilization_pct": lambda n, h: int(n.nvmlDeviceGetUtilizationRates(h).gpu),
    "temperature_c": lambda n, h: int(n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU)),
    "memory_clock_mhz": lambda n, h: int(n.nvmlDeviceGetMaxClockInfo(h, n.NVML_CLOCK_MEM)),
    "bus_width_bits": lambda n, h: int(n.nvmlDeviceGetMemoryBusWidth(h)),
    "mig_mode": lambda n, h: int(n.nvmlDeviceGetMigMode(h)[0]),
    "energy_mj": lambda n, h: int(n.nvmlDeviceGetTotalEnergyConsumption(h)),
    "compute_processes": lambda n, h: _process_entries(n.nvmlDeviceGetComputeRunningProcesses(h)),
    "graphics_processes": lambda n, h: _process_entries(n.nvmlDeviceGetGraphicsRunningProcesses(h)),
    "process_utilization": _process_utilization,
}

QUERY_NAMES = tuple(_QUERIES)


@dataclass(frozen=True)
class GpuReading:
    """One GPU's raw NVML answers; `errors` names each query that failed and why."""

    index: int
    values: dict[str, Any]
    p2p_peers: tuple[int, ...]
    errors: tuple[str, ...]


@dataclass(frozen=True)
class NvidiaReading:
    gpus: tuple[GpuReading, ...] = ()
    driver_version: str | None = None
    cuda_version: str | None = None
    problem: str | None = None  # why NVML gave nothing (no driver, init failed)


_PER_GPU = (
    "uuid", "name", "memory", "compute_capability", "pcie_gen", "pcie_width", "power_limit_mw",
    "power_mw", "utilization_pct", "temperature_c", "memory_clock_mhz", "bus_width_bits", "mig_mode",
)


def read_nvidia(source: NvmlSource) -> NvidiaReading:
    """Everything detection needs from NVML; one GPU's failed query never hides the others."""
    try:
        source.init()
    except NvmlError as exc:
        return NvidiaReading(problem=f"NVIDIA driver not usable ({exc})")
    try:
        count = int(source.query("device_count"))
        gpus = tuple(_read_gpu(source, index, count) for index in range(count))
        return NvidiaReading(
            gpus=gpus,
            driver_version=_optional(source, "driver_version"),
            cuda_version=_optional(source, "cuda_version"),
        )
    except NvmlError as exc:
        return NvidiaReading(problem=f"NVML could not list GPUs ({exc})")
    finally:
        source.shutdown()


def _read_gpu(source: NvmlSource, index: int, count: int) -> GpuReading:
    values: dict[str, Any] = {}
    errors: list[str] = []
    for name in _PER_GPU:
        try:
            values[name] = source.query(name, index)
        except NvmlError as exc:
            if str(exc) != NOT_SUPPORTED:
                errors.append(f"{name}: {exc}")
    peers = []
    for other in range(count):
        if other == index:
            continue
        try:
            if source.query("p2p", index, other):
                peers.append(other)
        except NvmlError as exc:
            errors.append(f"p2p with GPU {other}: {exc}")
    return GpuReading(index=index, values=values, p2p_peers=tuple(peers), errors=tuple(errors))


def _optional(source: NvmlSource, name: str, *indices: int) -> Any:
    try:
        return source.query(name, *indices)
    except NvmlError:
        return None


@dataclass(frozen=True)
class GpuSample:
    """Live telemetry of one GPU; None where the card does not report it."""

    index: int
    util_pct: float | None
    memory_used_mib: int | None
    power_w: float | None
    temperature_c: float | None
    energy_mj: int | None


@dataclass(frozen=True)
class GpuProcess:
    """One process on one GPU; None where NVML cannot tell (memory on Windows, a card that cannot sample)."""

    pid: int
    gpu_index: int
    used_mib: int | None
    kind: str  # "compute" or "graphics"
    sm_pct: int | None = None  # SM utilisation over the last second; 0 when NVML saw it idle


def _each_gpu(source: NvmlSource, read: Callable[[NvmlSource, int], list[T]]) -> list[T]:
    """`read(source, index)` for every GPU in one NVML session; [] when NVML is unusable."""
    try:
        source.init()
    except NvmlError:
        return []
    try:
        return [item for index in range(int(source.query("device_count"))) for item in read(source, index)]
    except NvmlError:
        return []
    finally:
        source.shutdown()


def sample_gpus(source: NvmlSource) -> list[GpuSample]:
    """One telemetry sample per GPU (measurement, the status message); [] when NVML is unusable."""
    return _each_gpu(source, lambda s, index: [_sample(s, index)])


def _sample(source: NvmlSource, index: int) -> GpuSample:
    memory = _optional(source, "memory", index)
    power_mw = _optional(source, "power_mw", index)
    return GpuSample(
        index=index,
        util_pct=_optional(source, "utilization_pct", index),
        memory_used_mib=memory["used_mib"] if memory else None,
        power_w=power_mw / 1000 if power_mw is not None else None,
        temperature_c=_optional(source, "temperature_c", index),
        energy_mj=_optional(source, "energy_mj", index),
    )


def gpu_processes(source: NvmlSource) -> list[GpuProcess]:
    """Every process using a GPU (compute and graphics), for auto-pause when a game starts."""
    return _each_gpu(source, _processes_on)


def _processes_on(source: NvmlSource, index: int) -> list[GpuProcess]:
    """The GPU's compute and graphics processes, each with its SM utilisation where the card samples it."""
    listed = [
        (kind, entry)
        for kind in ("compute", "graphics")
        for entry in _optional(source, f"{kind}_processes", index) or []
    ]
    if not listed:
        return []
    samples = _optional(source, "process_utilization", index)
    sm_pct = None if samples is None else {int(s["pid"]): int(s["sm_pct"]) for s in samples}
    return [
        GpuProcess(
            int(entry["pid"]),
            index,
            entry.get("used_mib"),
            kind,
            None if sm_pct is None else sm_pct.get(int(entry["pid"]), 0),
        )
        for kind, entry in listed
    ]
