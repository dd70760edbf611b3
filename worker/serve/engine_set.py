"""The node's engines: one `EngineSupervisor` per engine of the current plan, started together on
free ports and stopped together; where the relay may send requests, and which processes on the
machine are the app's. The crashes requests caused are counted here, for the node's whole run
(every supervisor, the ones a Retry or a new assignment starts too, shares one `RequestCrashes`)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Collection, Sequence
from typing import Protocol

import httpx
import psutil

from worker.system.config import Paths
from worker.serve.diagnosis import engine_problem
from worker.contract.events import EngineSnapshot, NodeState, Problem
from worker.hardware import NvmlError, NvmlSource
from worker.plan.planner import EnginePlan
from worker.system.ports import free_first_port
from worker.relay.forward import EngineTarget
from worker.serve.restart_policy import CardMemory, Ended, RequestCrashes, RestartBackoff, SupervisorTiming
from worker.serve.supervisor import CardReader, EngineSupervisor, EventCallback, Remeasure


class GpuMemory(Protocol):
    """What the engine set asks of the node's GPUs (`worker.measure.gpu_watch.GpuWatch`, which
    measures above this stage): whether NVML reads them, and whether processes still hold memory."""

    @property
    def nvml(self) -> NvmlSource | None: ...

    def released(self, pids: Collection[int]) -> bool: ...


class EngineSet:
    """The running supervisors by engine id, and the HTTP client of the engines on a TCP port
    (one on a Unix socket has its own)."""

    def __init__(self, paths: Paths, gpus: GpuMemory, *, on_event: EventCallback, remeasure: Remeasure) -> None:
        self._paths = paths
        self._gpus = gpus
        self._on_event = on_event
        self._remeasure = remeasure
        self._supervisors: dict[str, EngineSupervisor] = {}
        self.timing, self.backoff = SupervisorTiming(), RestartBackoff()  # each new supervisor's (tests shorten them)
        self._http: httpx.AsyncClient | None = None
        self.request_crashes = RequestCrashes()

    def __len__(self) -> int:
        return len(self._supervisors)

    def get(self, engine_id: str) -> EngineSupervisor | None:
        return self._supervisors.get(engine_id)

    def snapshots(self) -> list[EngineSnapshot]:
        """Safe from any thread (auto-pause asks from one): the dict is copied in one step."""
        return [s.snapshot() for s in list(self._supervisors.values())]

    def cards(self) -> set[int]:
        """The GPUs the engines run on (starting ones too: loading a model draws power)."""
        return {index for sup in list(self._supervisors.values()) for index in sup.plan.gpu_indices}

    def states(self) -> list[NodeState]:
        return [snap.state for snap in self.snapshots()]

    def serving(self) -> bool:
        """Some engine serves, or is on its way to (a failed or stopped one is not)."""
        return any(state not in ("failed", "stopped") for state in self.states())

    def ready_targets(self) -> list[EngineTarget]:
        """Where the relay may send requests now: the engines that are ready (or degraded but serving)."""
        return [t for t in (s.target() for s in self._supervisors.values()) if t is not None]

    async def launch(self, engine_plans: Sequence[EnginePlan]) -> None:
        """Starts one supervisor per plan (returns once each is started, not ready), on
        consecutive ports that nothing listens on."""
        first = free_first_port(engine_plans[0].port, len(engine_plans)) if engine_plans else 0
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), trust_env=False)
        for i, engine_plan in enumerate(engine_plans):
            await self._start(dataclasses.replace(engine_plan, port=first + i))

    async def _start(self, engine_plan: EnginePlan) -> None:
        gpu_released = self._gpus.released if self._gpus.nvml is not None else None
        sup = EngineSupervisor(engine_plan, paths=self._paths, on_event=self._on_event, http=self._http,
                               gpu_released=gpu_released, remeasure=self._remeasure, timing=self.timing,
                               backoff=self.backoff, request_crashes=self.request_crashes,
                               read_cards=self._card_reader())
        self._supervisors[engine_plan.engine_id] = sup
        await sup.start()

    def _card_reader(self, system: str = os.name) -> CardReader | None:
        """NVML's reading of a plan's cards, on Windows only: there CUDA spills a start that does
        not fit into shared system memory instead of failing (the sysmem fallback)."""
        source = self._gpus.nvml
        if system != "nt" or source is None:
            return None

        async def read(indices: Sequence[int]) -> dict[int, CardMemory]:
            return await asyncio.to_thread(card_memory, source, indices)
        return read

    async def restart_failed(self) -> list[str]:
        """The person's Retry: each engine that gave up starts again now, with a fresh supervisor
        (its failure counts reset) on the plan it last ran; the ids of those started."""
        failed = [(i, s) for i, s in list(self._supervisors.items()) if s.snapshot().state == "failed"]
        started = []
        for engine_id, sup in failed:
            await sup.stop()
            if self._supervisors.get(engine_id) is sup:  # a stop_all meanwhile took it away
                await self._start(sup.plan)
                started.append(engine_id)
        return started

    def problem(self) -> Problem | None:
        """The first engine that gave up, or that starts again after failing, in a person's words;
        None while every engine serves or starts for the first time, or starts again at once
        after a request crashed it (the caller's doing: nothing for the person to act on)."""
        for sup in list(self._supervisors.values()):
            snap = sup.snapshot()
            ended = sup.last_ended or Ended("crashed", snap.last_error or "", 0.0, False)
            if snap.state == "failed":
                return engine_problem(snap.engine, ended, gave_up=True)
            restarting = (snap.failures_in_a_row > 0 and not ended.by_request) or ended.kind == "free_memory"
            if snap.state == "starting" and sup.last_ended is not None and restarting:
                return engine_problem(snap.engine, ended, gave_up=False, retry_at=snap.retry_at)
        return None

    async def stop_all(self) -> list[str]:
        """Stops every engine (until its GPU memory is free); the ids of those removed."""
        sups = list(self._supervisors.items())
        await asyncio.gather(*(s.stop() for _, s in sups), return_exceptions=True)
        removed = []
        for engine_id, sup in sups:  # only these: one an assign or resume started meanwhile still runs
            if self._supervisors.get(engine_id) is sup:
                del self._supervisors[engine_id]
                removed.append(engine_id)
        return removed

    async def close(self) -> None:
        """After the last `stop_all`."""
        if self._http is not None:
            http, self._http = self._http, None
            await http.aclose()

    def own_pids(self) -> set[int]:
        """The app's process, its engines' and their children (vLLM's workers are the engine's)."""
        own = {os.getpid()}
        for snap in self.snapshots():
            if snap.pid is None:
                continue
            own.add(snap.pid)
            try:
                own.update(child.pid for child in psutil.Process(snap.pid).children(recursive=True))
            except psutil.Error:
                pass
        return own


def card_memory(source: NvmlSource, indices: Sequence[int]) -> dict[int, CardMemory]:
    """NVML's memory reading of each card in `indices`; {} where NVML cannot read them."""
    try:
        source.init()
    except NvmlError:
        return {}
    try:
        readings = {i: source.query("memory", i) for i in indices}
    except NvmlError:
        return {}
    finally:
        source.shutdown()
    return {i: CardMemory(int(m["used_mib"]), int(m["total_mib"])) for i, m in readings.items()}
