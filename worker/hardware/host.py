"""The host around the GPUs: operating system, kernel, CPU, RAM, on a Mac the Apple chip, and on
Windows the WSL2 distribution engines that run only on Linux go into.

`read_host()` reads the live machine with cheap calls only (no system_profiler, no nvidia-smi; on
Windows `wsl.exe -l -v`, which the WSL service answers without starting a distribution), so
`detect` stays well under a second. `HostFacts` is plain data, recorded and replayed with the NVML
readings.
"""

from __future__ import annotations

import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psutil

from worker.system import children, wsl
from worker.system.secrets import ENV_VAR as TOKEN_VARIABLE

MIB = 1024 * 1024
APPLE_WORKING_SET_SHARE = 0.75  # Metal's recommendedMaxWorkingSetSize on Apple Silicon, ≈ 75 % of RAM

Runner = Callable[[list[str], float], str | None]


@dataclass(frozen=True)
class AppleFacts:
    chip: str
    unified_memory_mib: int

    @property
    def recommended_working_set_mib(self) -> int:
        return int(self.unified_memory_mib * APPLE_WORKING_SET_SHARE)


@dataclass(frozen=True)
class HostFacts:
    system: str  # platform.system(): "Linux", "Windows", "Darwin"
    machine: str  # "x86_64", "arm64", "AMD64"
    kernel_release: str  # /proc/sys/kernel/osrelease on Linux (has "microsoft" under WSL2)
    cpu_model: str
    cpu_cores: int
    ram_mib: int
    apple: AppleFacts | None = None
    # The RAM an engine on the CPU sees as vLLM's CPU build measures it (its NUMA node's, held to
    # the cgroup's limit): total and free now; None where not read (a recorded machine).
    engine_ram_mib: int | None = None
    engine_ram_free_mib: int | None = None
    # On Windows, the WSL2 distribution engines that run only on Linux go into (`wsl.list_distros`:
    # the default usable one); None elsewhere, or where WSL2 has none.
    wsl_distro: str | None = None

    @property
    def os(self) -> str:
        return {"Linux": "linux", "Windows": "windows", "Darwin": "macos"}.get(self.system, self.system.lower())

    @property
    def arch(self) -> str:
        return {"AMD64": "x86_64", "aarch64": "arm64"}.get(self.machine, self.machine)

    @property
    def is_wsl2(self) -> bool:
        release = self.kernel_release.lower()
        return self.system == "Linux" and ("microsoft" in release or "wsl" in release)

    @classmethod
    def from_json(cls, data: dict[str, object]) -> HostFacts:
        apple = data.get("apple")
        return cls(
            system=str(data["system"]),
            machine=str(data["machine"]),
            kernel_release=str(data.get("kernel_release", "")),
            cpu_model=str(data.get("cpu_model", "unknown")),
            cpu_cores=int(data.get("cpu_cores", 1)),  # type: ignore[call-overload]
            ram_mib=int(data["ram_mib"]),  # type: ignore[call-overload]
            apple=AppleFacts(**apple) if isinstance(apple, dict) else None,
            engine_ram_mib=_optional_int(data.get("engine_ram_mib")),
            engine_ram_free_mib=_optional_int(data.get("engine_ram_free_mib")),
            wsl_distro=_optional_distro(data.get("wsl_distro")),
        )


def _optional_int(value: object) -> int | None:
    return None if value is None else int(value)  # type: ignore[call-overload]


def _optional_distro(value: object) -> str | None:
    """A recorded distribution name, only where it is one."""
    if value is None:
        return None
    if not isinstance(value, str) or not wsl.DISTRO_NAME.fullmatch(value):
        raise ValueError(f"not a WSL distribution name: {str(value)[:80]!r}")
    return value


def run_quietly(argv: list[str], timeout_s: float) -> str | None:
    """Run a probe (argv list, never a shell) and return its stdout, or None when it fails or hangs.
    The probe (sysctl, nvidia-smi) is no engine: it gets the app's environment without the token."""
    env = {name: value for name, value in os.environ.items() if name != TOKEN_VARIABLE}
    try:
        done = children.run(argv, timeout_s=timeout_s, env=env)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def read_host(run: Runner = run_quietly,
              distros: Callable[[], tuple[wsl.Distro, ...]] = wsl.list_distros) -> HostFacts:
    """This machine's facts; on Windows, `distros` lists WSL2's (boots its VM when stopped)."""
    system = platform.system()
    machine = platform.machine()
    apple = _read_apple(run) if system == "Darwin" and machine == "arm64" else None
    engine_ram, engine_ram_free = read_engine_ram()
    return HostFacts(
        system=system,
        machine=machine,
        kernel_release=_kernel_release(),
        cpu_model=apple.chip if apple else _cpu_model(system, run),
        cpu_cores=psutil.cpu_count(logical=False) or os.cpu_count() or 1,
        ram_mib=psutil.virtual_memory().total // MIB,
        apple=apple,
        engine_ram_mib=engine_ram // MIB,
        engine_ram_free_mib=engine_ram_free // MIB,
        wsl_distro=next((d.name for d in distros()), None) if system == "Windows" else None,
    )


SYSFS = Path("/sys")
# (limit, usage) of cgroup v2, then v1, under SYSFS
_CGROUP_LIMITS = (("fs/cgroup/memory.max", "fs/cgroup/memory.current"),
                  ("fs/cgroup/memory/memory.limit_in_bytes", "fs/cgroup/memory/memory.usage_in_bytes"))
_NO_LIMIT = 1 << 62  # cgroup v1's "unlimited" is a number near the page counter's maximum


def read_engine_ram(sysfs: Path = SYSFS) -> tuple[int, int]:
    """(total, free) bytes as vLLM's CPU build measures them (`vllm/utils/cpu_resource_utils.py`
    `get_memory_node_info`, 0.32): the NUMA node of the first CPU this process may run on, its free
    memory plus the file cache and reclaimable slab, both held to the cgroup's limit; the whole
    machine's where there are no nodes (macOS, some boards). Its start-up check compares the share
    it is given of this total with this free figure, so the app measures the same."""
    node = _first_cpu_node(sysfs)
    info = _node_meminfo(sysfs, node) if node is not None else None
    if info is None:
        memory = psutil.virtual_memory()
        total, free = int(memory.total), int(memory.available)
    else:
        total = info["MemTotal"]
        free = info["MemFree"] + info["Active(file)"] + info["Inactive(file)"] + info["SReclaimable"]
    limits = ((_read_int(sysfs / limit), sysfs / usage) for limit, usage in _CGROUP_LIMITS)
    limit, usage = next(((limit, usage) for limit, usage in limits if limit is not None), (None, None))
    if limit is not None and usage is not None and limit < min(total, _NO_LIMIT):
        total, free = limit, max(0, min(free, limit - (_read_int(usage) or 0)))
    return total, free


def _first_cpu_node(sysfs: Path) -> int | None:
    if not hasattr(os, "sched_getaffinity"):
        return None
    first = min(os.sched_getaffinity(0), default=0)
    links = sorted((sysfs / "devices" / "system" / "cpu" / f"cpu{first}").glob("node[0-9]*"))
    return int(links[0].name[4:]) if links else None


def _node_meminfo(sysfs: Path, node: int) -> dict[str, int] | None:
    """`Node 0 MemTotal: 97421888 kB` lines as bytes by key; None where the file or a key is missing."""
    try:
        text = (sysfs / "devices" / "system" / "node" / f"node{node}" / "meminfo").read_text(
            encoding="ascii", errors="replace")
    except OSError:
        return None
    info = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[3].isdigit():
            info[parts[2].rstrip(":")] = int(parts[3]) * 1024
    needed = ("MemTotal", "MemFree", "Active(file)", "Inactive(file)", "SReclaimable")
    return info if all(key in info for key in needed) else None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text(encoding="ascii").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _kernel_release() -> str:
    try:
        return Path("/proc/sys/kernel/osrelease").read_text(encoding="utf-8").strip()
    except OSError:
        return platform.release()


def _cpu_model(system: str, run: Runner) -> str:
    if system == "Linux":
        try:
            for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
        except OSError:
            pass
    if system == "Darwin":
        brand = run(["sysctl", "-n", "machdep.cpu.brand_string"], 2.0)
        if brand:
            return brand.strip()
    return platform.processor() or platform.machine() or "unknown"


def _read_apple(run: Runner) -> AppleFacts | None:
    brand = run(["sysctl", "-n", "machdep.cpu.brand_string"], 2.0)
    memsize = run(["sysctl", "-n", "hw.memsize"], 2.0)
    if not brand or not memsize or not memsize.strip().isdigit():
        return None
    return AppleFacts(chip=brand.strip(), unified_memory_mib=int(memsize.strip()) // MIB)
