"""What an accepted plan needs on the machine before its engines start: the model's files and the
engine, each found or fetched; the engine plans rewritten to use them; and, where the engine can
tell (`base.StartCheck`), that each start fits the memory and cores measured now. Raises
`ProvisionError`. `OfflineRetry` tries a provisioning the network cut short again by itself, later
each time."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from worker.system.config import Paths, Settings
from worker.engines.base import Room, Run, StartCheck
from worker.engines.releases import Releases
from worker.contract.events import Problem
from worker.hardware import IN_WSL, Machine, usable_mib
from worker.plan.planner import EnginePlan, Plan
from worker.provision.engine_install import accelerator_of, cuda_version, ensure_engine, library_env
from worker.provision.errors import ProvisionError
from worker.provision.models import ensure_model
from worker.provision.progress import ProgressCallback
from worker.provision.transfer import TransferControl
from worker.system.backoff import DoublingBackoff

OFFLINE_BACKOFF = DoublingBackoff(initial_s=15.0, maximum_s=600.0)  # 15 s doubling to 10 min


async def provision(current: Plan, machine: Machine, paths: Paths, settings: Settings, on_progress: ProgressCallback,
                    *, engine_bins: Mapping[str, str], control: TransferControl | None = None) -> list[EnginePlan]:
    """Model files (and, where missing, the engine) in place; the plans rewritten to use them.
    `control`: the node's hold, pace, budget and cancel over every download it makes."""
    engine = await _engine_executable(current, machine, paths, on_progress, engine_bins, control)
    path = await ensure_model(current.engine_model, current.engine, paths, settings, on_progress,
                              wsl_distro=engine.wsl_distro if engine.in_wsl else None, control=control)
    plans = [dataclasses.replace(ep, model=str(path), executable=engine.executable, env={**ep.env, **engine.env},
                                 in_wsl=engine.in_wsl, wsl_distro=engine.wsl_distro)
             for ep in current.engines]
    await asyncio.to_thread(check_room, plans, machine, settings)
    return plans


def check_room(plans: list[EnginePlan], machine: Machine, settings: Settings) -> None:
    """Every argument list each engine may start with (its tier, then its fallbacks) fits the room
    measured now (RAM, and the CPU's threads), where its adapter can tell; else `ProvisionError` with the adapter's reason, so
    nothing starts. RAM is what is free now and what the engines serving now hold (they stop
    before the new ones start), never more than the machine has, judged as a card's usable memory
    is (contract, Assignment: usable RAM). Blocking (reads the model's header): run in a thread."""
    free_mib = min(machine.ram_mib, (psutil.virtual_memory().available + _held_by_engines()) // 2**20)
    threads = psutil.cpu_count(logical=True) or machine.cpu_cores  # an engine's thread count counts logical CPUs
    for ep in plans:
        adapter = ep.adapter
        if not isinstance(adapter, StartCheck):
            continue
        from_ram = not ep.gpu_indices and machine.runtime != "apple-silicon"
        room = Room(None if from_ram else ep.memory_mib, usable_mib(free_mib, settings), threads)
        runs: list[Run] = [(_where(tier), args) for tier, args in ((ep.tier, ep.args), *ep.fallbacks)]
        if reason := adapter.start_problem(ep.model, runs, room):
            raise ProvisionError(Problem("Assignment refused", reason))


def _held_by_engines() -> int:
    """Bytes this app's child processes (its engines) hold on their own: resident less what is
    shared with files (the model's mapped pages, which `available` already counts)."""
    held = 0
    for child in psutil.Process().children(recursive=True):
        try:
            memory = child.memory_info()
        except psutil.Error:
            continue
        held += max(0, memory.rss - getattr(memory, "shared", 0))
    return held


def _where(tier: str | None) -> str:
    return "base_args" if tier is None else f"tier {tier}"


@dataclass(frozen=True)
class _Engine:
    """What the engine processes start: the argv prefix, its variables, and (`in_wsl`) that it is
    a Linux command inside the WSL2 distribution `wsl_distro`."""

    executable: tuple[str, ...]
    env: Mapping[str, str]
    in_wsl: bool = False
    wsl_distro: str | None = None


async def _engine_executable(current: Plan, machine: Machine, paths: Paths, on_progress: ProgressCallback,
                             engine_bins: Mapping[str, str], control: TransferControl | None = None) -> _Engine:
    """The engine the user pointed at, the one found on the machine, or one installed now (one
    found inside WSL2 is installed-or-found there, which gives its Linux command line)."""
    engine, wanted = current.engine, current.engine_model.engine_version
    given = engine_bins.get(engine)
    if given:
        return _Engine((given,), library_env(Path(given).parent))
    found = machine.engines.get(engine)
    releases = current.engines[0].adapter.RELEASES
    if (found and found.path and found.path != IN_WSL
            and (wanted is None or _same_release(releases, found.version, wanted))):
        return _Engine(current.engines[0].executable, {})
    install = await ensure_engine(
        engine,
        wanted,
        paths,
        on_progress,
        accelerator=accelerator_of(machine),
        cuda_driver=cuda_version(machine.cuda_version),
        runtime=machine.runtime,  # the build for this runtime (a CPU build on a machine without a usable GPU)
        machine_os=machine.os,
        wsl_distro=machine.wsl_distro,
        control=control,
    )
    env = library_env(install.library_dir) if install.library_dir else {}
    return _Engine(install.executable, env, install.in_wsl, install.wsl_distro)


def _same_release(releases: Releases, found: str | None, wanted: str) -> bool:
    """`0.32.0+cpu` found is the `0.32.0` asked for: the build tag says which runtime, not which release."""
    return found is not None and releases.normalise(found) == releases.normalise(wanted)


class OfflineRetry:
    """When a provisioning the network cut short runs again: after `backoff`'s delay for the
    failures in a row so far; one wait at a time, which `reset` (a success, a Retry) ends."""

    def __init__(self, spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task[Any]], backoff: DoublingBackoff = OFFLINE_BACKOFF,
                 *, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 clock: Callable[[], float] = time.time) -> None:
        """`spawn` runs a coroutine as the node's task (cancelled with the others at the end)."""
        self._spawn = spawn
        self._backoff = backoff
        self._sleep = sleep
        self._clock = clock
        self._wait: asyncio.Task[Any] | None = None
        self.failures = 0

    def schedule(self, again: Callable[[], Coroutine[Any, Any, Any]]) -> float:
        """`again()` after the next delay (as its own task); returns when, in wall-clock seconds."""
        self._cancel()
        self.failures += 1
        delay = self._backoff.delay(self.failures)
        self._wait = self._spawn(self._later(delay, again))
        return self._clock() + delay

    def reset(self) -> None:
        self._cancel()
        self.failures = 0

    def _cancel(self) -> None:
        if self._wait is not None:
            self._wait.cancel()
            self._wait = None

    async def _later(self, delay: float, again: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        await self._sleep(delay)
        self._wait = None  # `again` may schedule the next wait: this one must not be cancelled by it
        self._spawn(again())
