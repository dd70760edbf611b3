"""The orchestrator: the one place that knows the order of things.

detect → hello → assign → plan → provision → supervise → relay → measure, plus pause, resume,
update and shutdown. Every other module has one job; the Node composes them on one asyncio loop,
turns coordinator messages and user commands into actions, and hands out `NodeSnapshot`s.
Commands (`pause`, `resume`, `apply_settings`, `shutdown`) are safe to call from any thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Collection, Coroutine
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal, TypeVar

import httpx
import psutil
from pydantic import BaseModel

from worker import __version__, protocol
from worker.autopause import AutoPauser
from worker.datalock import DataFolderInUse, DataFolderLock
from worker.config import Paths, Settings, State, load_state, save_state
from worker.engines import published_args
from worker.events import (
    ConnectionSnapshot,
    DownloadProgress,
    EarningsSnapshot,
    EngineSnapshot,
    GpuSnapshot,
    NodeSnapshot,
    NodeState,
    Problem,
    ThroughputSnapshot,
)
from worker.hardware import (
    Gpu,
    GpuSample,
    Machine,
    NvmlError,
    NvmlSource,
    PynvmlSource,
    gpu_processes,
    sample_gpus,
    usable_mib,
)
from worker.hardware.nvml import find_wsl_nvml_library, read_nvidia
from worker.ledger import EnergyIntegrator, Ledger
from worker.link import Backoff, Link
from worker.loopback_http import LoopbackClient
from worker.measure import RunMeter, aggregate, cross_check, roofline
from worker.metrics import EngineMetrics, MetricsUnavailable, scrape
from worker.plan import DEFAULT_FIRST_PORT, EnginePlan, Plan, Refusal, memory_utilization, plan
from worker.procs import reap_leftovers
from worker.provision.engine_install import ensure_engine
from worker.provision.errors import ProvisionError
from worker.provision.models import ensure_model
from worker.relay import EngineTarget, Relay, RelayHooks, engine_http_client
from worker.supervise import EngineSupervisor
from worker.update import NodeHooks, Updater, UpdateStatus, mark_hello_reached, mark_started

log = logging.getLogger(__name__)

DRAIN_S = 30.0
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
TICK_S = 1.0
EARNINGS_REFRESH_S = 60.0
STATUS_FILE_S = 10.0  # `gpu-provider status` reads at most this stale a clock
IDLE_SCRAPE_S = 10.0  # engine /metrics while nothing is in flight: an idle node stays near 0 % CPU
Subscriber = Callable[[NodeSnapshot], None]
T = TypeVar("T")


def summarise(states: list[NodeState]) -> NodeState:
    """The node's state from its engines', as the protocol defines it."""
    if not states:
        return "configured"
    serving = [s for s in states if s in ("ready", "degraded")]
    if serving and len(serving) == len(states) and all(s == "ready" for s in states):
        return "ready"
    if serving:
        return "degraded"
    if all(s == "failed" for s in states):
        return "failed"
    if any(s == "starting" for s in states):
        return "starting"
    if all(s == "stopped" for s in states):
        return "stopped"
    return "configured"


@dataclass
class _Pause:
    reason: str
    until: float | None  # wall-clock seconds; None = until resumed
    detail: str | None = None  # the game auto-pause saw


class Node(RelayHooks):
    """Owns the link, the relay, the engines' supervisors, the meters and the ledger."""

    def __init__(
        self,
        paths: Paths,
        settings: Settings,
        *,
        coordinator_url: str,
        hardware_override: Path | None = None,
        engine_bins: dict[str, str] | None = None,
        model: str | None = None,
        token_provider: Callable[[], str | None] | None = None,
        nvml: NvmlSource | None = None,
        backoff: Backoff | None = None,
        openai_port: int | None = None,
        first_port: int = DEFAULT_FIRST_PORT,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.paths = paths.ensure()
        self.settings = settings
        self.coordinator_url = coordinator_url
        self._hardware_override = hardware_override
        self._engine_bins = dict(engine_bins or {})
        self._model_choice = model
        self._token_provider = token_provider
        self._nvml = nvml
        self._backoff = backoff
        self._openai_port = openai_port
        self._first_port = first_port
        self._clock = clock
        self._monotonic = monotonic

        self.state: State
        self.machine: Machine | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._subscribers: list[Subscriber] = []
        self._snapshot: NodeSnapshot | None = None
        self._lock = threading.Lock()

        self._link: Link | None = None
        self._relay: Relay | None = None
        self._http: httpx.AsyncClient | None = None
        self._engine_http: LoopbackClient | None = None
        self._ledger: Ledger | None = None
        self._ledger_guard = threading.Lock()  # held while the ledger is used, so it is never used closed
        self._ledger_writes: set[asyncio.Future[Any]] = set()  # credits still being written
        self._earnings: EarningsSnapshot | None = None  # read off the loop, so snapshots never touch SQLite
        self._local: Any = None  # worker.localnet.LocalCoordinator when --coordinator local
        self._energy = EnergyIntegrator()

        self._welcome: protocol.Welcome | None = None
        self._assignment: protocol.Assign | None = None
        self._plan: Plan | None = None
        self._problem: Problem | None = None
        self._refused: protocol.Refused | None = None  # the latest assignment this node would not run
        self._supervisors: dict[str, EngineSupervisor] = {}
        self._meters: dict[str, RunMeter] = {}
        self._request_engine: dict[str, str] = {}
        self._last_scrape = float("-inf")
        self._earnings_read_at = float("-inf")
        self._status_written: NodeSnapshot | None = None
        self._status_written_at = float("-inf")
        self._engine_metrics: dict[str, EngineMetrics] = {}  # latest /metrics per engine
        self._metrics_at_ready: dict[str, EngineMetrics] = {}  # the run's baseline, for spec-decode figures
        self._token_baseline: dict[str, tuple[EngineMetrics, int]] = {}  # /metrics and relay tokens, engine idle
        self._generations: set[str] = set()  # request ids that generate tokens: the only ones metered
        self._pause: _Pause | None = None
        self._draining = False
        self._provisioning = False
        self._downloads: dict[str, DownloadProgress] = {}
        self._gpu_samples: dict[int, GpuSample] = {}
        self._connection = ConnectionSnapshot(coordinator_url, "disabled")
        self._notices: list[str] = []
        self._engines_lock: asyncio.Lock | None = None
        self._last_status_key: tuple[Any, ...] | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._updater: Updater | None = None
        self._owner = DataFolderLock(self.paths)

    # --- commands (any thread) ----------------------------------------------------------------

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        with self._lock:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return unsubscribe

    def snapshot(self) -> NodeSnapshot:
        return self._snapshot or self._build_snapshot()

    def pause(self, duration_s: float | None = None, reason: str = "user", detail: str | None = None) -> None:
        until = self._clock() + duration_s if duration_s else None
        why = reason if not until or reason != "user" else "timed"
        self._on_loop(lambda: self._spawn(self._do_pause(why, until, detail)))

    def resume(self) -> None:
        self._on_loop(lambda: self._spawn(self._do_resume()))

    def apply_settings(self, settings: Settings) -> None:
        self._on_loop(lambda: self._set_settings(settings))

    def token_changed(self) -> None:
        """The user signed in (again): connect now instead of waiting in `signed_out`."""
        self._on_loop(lambda: self._link.resume_after_sign_in() if self._link else None)

    def shutdown(self) -> None:
        self._on_loop(lambda: self._stopping.set() if self._stopping else None)

    def history(self, series: str, since: float) -> list[tuple[float, float]]:
        return self._with_ledger(lambda ledger: ledger.series(series, since)) or []

    def log_files(self) -> dict[str, Path]:
        files = {"app": self.paths.log_dir / "gpu-provider.log"}
        for engine in self.snapshot().engines:  # the snapshot, not the live dict: any thread may ask
            if engine.log_path:
                files[f"engine {engine.engine_id}"] = Path(engine.log_path)
        return files

    def _on_loop(self, action: Callable[[], Any]) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            action()
        else:
            loop.call_soon_threadsafe(action)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        self._tasks.append(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        if task in self._tasks:
            self._tasks.remove(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("internal task failed", exc_info=task.exception())

    # --- life -----------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve until `shutdown()`; engines are always stopped on the way out. The data folder is
        this node's from before it reads, reaps or starts anything until its engines have stopped:
        a second node on it raises `DataFolderInUse` at once and touches nothing."""
        self._owner.acquire()
        try:
            await self._serve()
        finally:
            self._owner.release()  # `_close` released it already, unless setting up failed

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        self._engines_lock = asyncio.Lock()
        self.state = load_state(self.paths)
        if self.state.paused:
            self._pause = _Pause("user", self.state.pause_until)
        reaped = await asyncio.to_thread(reap_leftovers, self.paths.run_dir)
        if reaped:
            log.warning("stopped %d engine process(es) a previous run left behind: %s", len(reaped), reaped)
        self.machine = await asyncio.to_thread(self._detect)
        if self._nvml is None and self._hardware_override is None and self.machine.gpus:
            self._nvml = PynvmlSource(library=find_wsl_nvml_library() if self.machine.runtime == "wsl2" else None)
        self._ledger = await asyncio.to_thread(Ledger, self.paths.ledger_file)
        await asyncio.to_thread(self._read_earnings)
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), trust_env=False)
        self._engine_http = engine_http_client()
        self._relay = Relay(self._send, self._ready_targets, self._gate, http=self._engine_http, hooks=self)
        try:
            url, token_provider = await self._coordinator()
            if url:
                self._link = Link(
                    url,
                    token_provider,
                    self._hello,
                    self._on_message,
                    backoff=self._backoff or Backoff(),
                    on_state=self._on_connection,
                    on_disconnect=self._on_disconnect,
                    on_bad_message=self._on_bad_message,
                )
                mark_started(self.paths, __version__)  # an update waiting for this version: offline, not broken
                self._spawn(self._link.run())
            self._updater = Updater(
                self.paths,
                self.settings,
                NodeHooks(self._in_flight, self._stop_serving, self._resume_serving, self._exit_for_update),
                on_progress=self._on_download,
                on_status=self._on_update_status,
            )
            self._spawn(self._updater.run_feed_checks())
            self._spawn(self._ticker())
            self._spawn(self._autopause().run())
            self._publish()
            await self._stopping.wait()
        finally:
            await self._close()

    async def _close(self) -> None:
        log.info("stopping: draining requests and stopping engines")
        self._owner.mark_stopping()  # a second start meanwhile is told to wait, not that we run on
        try:
            await self._wind_down()
        finally:
            self._owner.release()  # only now: the engines are gone

    async def _wind_down(self) -> None:
        if self._relay and self._relay.in_flight:
            self._draining = True
            await self._relay.drain(min(DRAIN_S, 10.0), "draining")
        await self._stop_engines()
        if self._link:
            await self._link.close()
        if self._local:
            await self._local.stop()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._stop_engines()  # any that an assign or resume cut short by the cancel had started
        if self._http:
            await self._http.aclose()
        if self._engine_http:
            await self._engine_http.aclose()
        self._publish()
        await asyncio.gather(*self._ledger_writes, return_exceptions=True)
        await asyncio.to_thread(self._close_ledger)
        if self._owner.held:  # after an update the new version owns the folder, and this file
            self.paths.status_file.unlink(missing_ok=True)

    def _detect(self) -> Machine:
        from worker.hardware import detect

        if self._hardware_override:
            data = json.loads(Path(self._hardware_override).read_text(encoding="utf-8"))
            return Machine.from_detect_json(data)
        return detect(self.settings, nvml=self._nvml, engine_bins=self._engine_bins)

    async def _coordinator(self) -> tuple[str | None, Callable[[], str | None]]:
        """The URL and token source: the network's coordinator, or the built-in local one."""
        if self.coordinator_url in ("", "none"):
            return None, lambda: None
        if self.coordinator_url != "local":
            from worker.secrets import get_token

            return self.coordinator_url, self._token_provider or get_token
        from worker.localnet import LocalCoordinator, LocalModelError

        token = secrets.token_urlsafe(24)
        assert self.machine is not None
        local = LocalCoordinator(token=token, machine=self.machine, model=self._model_choice, openai_port=self._openai_port)
        try:
            self._local = await local.start()
        except LocalModelError as exc:
            self._problem = Problem("The local model cannot be used", str(exc), "settings")
            log.error("%s", exc)
            return None, lambda: None
        log.info("local coordinator on %s; OpenAI endpoint on %s", self._local.ws_url, self._local.openai_url)
        return self._local.ws_url, lambda: token

    # --- link -----------------------------------------------------------------------------

    def _hello(self) -> protocol.Hello:
        assert self.machine is not None
        return protocol.Hello(
            node_id=self.state.node_id,
            app_version=__version__,
            paused=self._pause is not None,
            engine_args=published_args(allow_remote_code=self.settings.allow_remote_code),
            **self.machine.to_detect_json(),
        )

    def _on_connection(self, snapshot: ConnectionSnapshot) -> None:
        self._connection = snapshot
        if snapshot.state == "connected":
            self._on_hello_sent()
        self._publish()

    def _on_hello_sent(self) -> None:
        """Tells a pending update check that this version came up and reached the coordinator."""
        mark_hello_reached(self.paths, __version__)

    def _on_disconnect(self) -> None:
        """The coordinator is gone: nobody will read the answers, so stop generating them."""
        if self._relay:
            self._relay.cancel_all("coordinator connection lost")

    async def _send(self, message: BaseModel) -> bool:
        return bool(self._link and await self._link.send(message))

    async def _on_message(self, message: Any) -> None:
        if isinstance(message, protocol.Request):
            assert self._relay is not None and self._link is not None
            self._relay.handle(message, self._link.sender())
            if self._relay.is_serving(message.id) and message.method == "POST" and message.path.split("?")[0] in GENERATION_PATHS:
                self._generations.add(message.id)
        elif isinstance(message, protocol.Cancel):
            assert self._relay is not None
            self._relay.cancel(message.id)
        elif isinstance(message, protocol.Welcome):
            self._welcome = message
            await self._send_status(force=True)
        elif isinstance(message, protocol.Assign):
            self._spawn(self._assign(message))
        elif isinstance(message, protocol.Unassign):
            if self._assignment and self._assignment.assignment_id == message.assignment_id:
                self._spawn(self._unassign())
        elif isinstance(message, protocol.Pause):
            if self._pause is None or self._pause.reason == "coordinator":  # the person's own pause stays theirs
                self._spawn(self._do_pause("coordinator", None))
        elif isinstance(message, protocol.Resume):
            if self._pause is not None and self._pause.reason == "coordinator":  # lifts only its own pause
                self._spawn(self._do_resume())
        elif isinstance(message, protocol.Update):
            self._spawn(self._offer_update(message))
        elif isinstance(message, protocol.Error):
            log.warning("coordinator reported an error: %s %s (ref %s)", message.code, message.message, message.ref)

    # --- assignment and engines ------------------------------------------------------------

    async def _assign(self, assign: protocol.Assign) -> None:
        """Plan (which validates every argument and the source) before anything stops; provision
        the new model while the old engines keep serving; only then drain them and start anew."""
        assert self._engines_lock is not None and self.machine is not None
        async with self._engines_lock:
            if assign == self._assignment and self._supervisors and self._node_state() != "failed":
                await self._send_status(force=True)  # re-sent after a reconnect: keep serving, no reload
                return
            result = plan(self.machine, assign, self.settings, first_port=self._first_port)
            if isinstance(result, Refusal):
                if not self._serving():
                    self._assignment = assign
                await self._refuse(assign.assignment_id, result.reason)
                return
            log.info(
                "assignment %s: %s on %s (%s)",
                assign.assignment_id,
                assign.model.name,
                result.engine,
                ", ".join(f"{e.engine_id} {e.layout} gpus={list(e.gpu_indices)} tier={e.tier}" for e in result.engines),
            )
            engine_plans: list[EnginePlan] | None = None
            if not self._pause:
                try:
                    engine_plans = await self._provision_tracked(result)
                except ProvisionError as exc:
                    if self._serving():
                        await self._refuse(assign.assignment_id, exc.problem.message)
                        return
                    await self._drain_and_stop()
                    await self._adopt(assign, result, exc.problem)
                    return
            await self._drain_and_stop()
            await self._adopt(assign, result, None)
            if engine_plans is not None:
                await self._launch(engine_plans)

    async def _adopt(self, assign: protocol.Assign, accepted: Plan | None, problem: Problem | None) -> None:
        """`assign` is now the node's assignment (its engines not started yet)."""
        self._assignment = assign
        self._plan = accepted
        self._problem = problem
        self._refused = None
        self.state.last_assignment = assign.model_dump()
        await asyncio.to_thread(save_state, self.paths, self.state)
        await self._send_status(force=True)

    async def _refuse(self, assignment_id: str, reason: str) -> None:
        """A new assignment this node will not run: the one serving keeps serving, and `status`
        says what was refused and why; a node with nothing else to serve reports `failed`."""
        log.warning("assignment %s refused: %s", assignment_id, reason)
        self._refused = protocol.Refused(assignment_id=assignment_id, reason=reason)
        if not self._serving():
            await self._drain_and_stop()
            self._plan = None
            self._problem = Problem("Assignment refused", reason, "none")
            if self._assignment is not None and self._assignment.assignment_id != assignment_id:
                self._assignment = None  # the old one no longer runs; the refused one is in `refused`
        await self._send_status(force=True)

    def _serving(self) -> bool:
        """Some engine serves, or is on its way to (a failed or stopped one is not)."""
        return any(s.snapshot().state not in ("failed", "stopped") for s in self._supervisors.values())

    async def _on_bad_message(self, error: protocol.BadMessage) -> None:
        """An `assign` that does not even fit the schema (a tier key of "²") is refused like any other."""
        if error.message_type == "assign":
            self._spawn(self._refuse_locked(error.ref or "(no assignment_id)", str(error)))

    async def _refuse_locked(self, assignment_id: str, reason: str) -> None:
        assert self._engines_lock is not None
        async with self._engines_lock:  # never from the link's reader: an assign may hold the lock for minutes
            await self._refuse(assignment_id, reason)

    async def _unassign(self) -> None:
        assert self._engines_lock is not None
        async with self._engines_lock:
            await self._drain_and_stop()
            self._assignment = None
            self._plan = None
            self._problem = None
            self._refused = None
            await self._send_status(force=True)

    async def _start_engines(self) -> None:
        """Provision and start the current plan (after a resume, or a retry)."""
        assert self._plan is not None
        self._problem = None  # a retry (after a resume) must not keep showing the last failure
        try:
            engine_plans = await self._provision_tracked(self._plan)
        except ProvisionError as exc:
            self._problem = exc.problem
            return
        await self._launch(engine_plans)

    async def _provision_tracked(self, current: Plan) -> list[EnginePlan]:
        """`_provision`, with the node showing that it is provisioning; raises `ProvisionError`."""
        self._provisioning = True
        self._publish()
        try:
            return await self._provision(current)
        except ProvisionError as exc:
            log.error("%s: %s", exc.problem.title, exc.problem.message)
            raise
        finally:
            self._provisioning = False

    async def _launch(self, engine_plans: list[EnginePlan]) -> None:
        first = free_first_port(engine_plans[0].port, len(engine_plans)) if engine_plans else 0
        engine_plans = [replace(ep, port=first + i) for i, ep in enumerate(engine_plans)]
        for engine_plan in engine_plans:
            sup = EngineSupervisor(
                engine_plan,
                paths=self.paths,
                on_event=self._on_engine_change,
                http=self._http,
                gpu_released=self._gpu_released if self._nvml is not None else None,
                remeasure=self._remeasure_memory,
            )
            self._supervisors[engine_plan.engine_id] = sup
            await sup.start()
        self._publish()

    async def _remeasure_memory(self, engine_plan: EnginePlan) -> float | None:
        """vLLM's memory share for the plan's cards from a fresh NVML reading, by the rules of
        detection (`usable_mib`) and planning (`memory_utilization`, with the assignment's cap);
        None where the cards cannot be read. Asked after vLLM found a card's memory held."""
        if self._nvml is None or self.machine is None:
            return None
        reading = await asyncio.to_thread(read_nvidia, self._nvml)
        memory = {gpu.index: gpu.values["memory"] for gpu in reading.gpus if gpu.values.get("memory")}
        cards = [gpu for gpu in self.machine.gpus if gpu.index in engine_plan.gpu_indices and gpu.index in memory]
        if len(cards) != len(engine_plan.gpu_indices):
            return None
        fresh = tuple(
            replace(gpu, memory_total_mib=int(memory[gpu.index]["total_mib"]),
                    memory_free_mib=int(memory[gpu.index]["free_mib"]),
                    usable_mib=usable_mib(int(memory[gpu.index]["free_mib"]), self.settings))
            for gpu in cards
        )
        return memory_utilization(replace(self.machine, gpus=fresh), engine_plan.gpu_indices, engine_plan.memory_cap)

    async def _provision(self, current: Plan) -> list[EnginePlan]:
        """Model files (and, where missing, the engine) in place; the plans rewritten to use them."""
        executable, env = await self._engine_executable(current)
        path = await ensure_model(current.engine_model, current.engine, self.paths, self.settings, self._on_download)
        return [replace(ep, model=str(path), executable=executable, env={**ep.env, **env}) for ep in current.engines]

    async def _engine_executable(self, current: Plan) -> tuple[tuple[str, ...], dict[str, str]]:
        """The engine the user pointed at, the one found on the machine, or one installed now."""
        assert self.machine is not None
        engine, wanted = current.engine, current.engine_model.engine_version
        given = self._engine_bins.get(engine)
        if given:
            return (given,), _library_env(Path(given).parent)
        found = self.machine.engines.get(engine)
        if found and found.path and (wanted is None or found.version == wanted):
            return current.engines[0].executable, {}
        install = await ensure_engine(
            engine,
            wanted,
            self.paths,
            self._on_download,
            accelerator=_accelerator(self.machine),
            cuda_driver=_cuda_version(self.machine.cuda_version),
        )
        return install.executable, _library_env(install.library_dir) if install.library_dir else {}

    async def _drain_and_stop(self) -> None:
        if not self._supervisors:
            return
        self._draining = True
        try:
            if self._relay:
                await self._relay.drain(DRAIN_S, "paused" if self._pause else "draining")
            await self._stop_engines()
        finally:
            self._draining = False

    async def _stop_engines(self) -> None:
        sups = list(self._supervisors.items())
        await asyncio.gather(*(s.stop() for _, s in sups), return_exceptions=True)
        for engine_id, sup in sups:  # only these: one an assign or resume started meanwhile still runs
            if self._supervisors.get(engine_id) is sup:
                del self._supervisors[engine_id]
                self._forget_run(engine_id)
        self._publish()

    def _on_engine_change(self, snap: EngineSnapshot, reason: str) -> None:
        sup = self._supervisors.get(snap.engine_id)
        if snap.state == "ready" and sup is not None and sup.run_id is not None:
            run_id = sup.run_id
            meter = self._meters.get(snap.engine_id)
            if meter is None or meter.run_id != run_id:
                self._forget_run(snap.engine_id)
                self._meters[snap.engine_id] = RunMeter(run_id, clock=self._monotonic)
                self._notice(f"Serving {self._plan.model_name if self._plan else 'the model'} on {snap.engine_id}")
        elif snap.state in ("starting", "failed", "stopped"):
            self._forget_run(snap.engine_id)
            if snap.state == "failed":
                self._notice(f"Engine {snap.engine_id} failed: {snap.last_error}")
        self._publish()
        if self._loop:
            self._spawn(self._send_status())

    def _forget_run(self, engine_id: str) -> None:
        """A run's figures end with it: nothing of an old run leaks into the next."""
        self._meters.pop(engine_id, None)
        self._engine_metrics.pop(engine_id, None)
        self._metrics_at_ready.pop(engine_id, None)
        self._token_baseline.pop(engine_id, None)

    # --- pause ----------------------------------------------------------------------------

    async def _do_pause(self, reason: str, until: float | None, detail: str | None = None) -> None:
        assert self._engines_lock is not None
        self._pause = _Pause(reason, until, detail)
        if detail:
            self._notice(f"Paused for {detail}")
        self.state.paused, self.state.pause_until = reason in ("user", "timed"), until
        await asyncio.to_thread(save_state, self.paths, self.state)
        log.info("paused (%s)%s", reason, f" until {time.ctime(until)}" if until else "")
        await self._send_status(force=True)
        async with self._engines_lock:
            await self._drain_and_stop()
        await self._send_status(force=True)

    async def _do_resume(self) -> None:
        assert self._engines_lock is not None
        async with self._engines_lock:  # after a pause still stopping the engines, or "ready" would be a lie
            if self._pause is None:
                return
            self._pause = None
            self.state.paused, self.state.pause_until = False, None
            await asyncio.to_thread(save_state, self.paths, self.state)
            log.info("resumed")
            await self._send_status(force=True)
            if self._plan and not self._supervisors:
                await self._start_engines()

    def _set_settings(self, settings: Settings) -> None:
        self.settings = settings
        if self._updater:
            self._updater.apply_settings(settings)

    def _autopause(self) -> AutoPauser:
        return AutoPauser(self, lambda: self.settings, self._foreign_gpu_processes)

    def _foreign_gpu_processes(self) -> list[Any]:
        """GPU users that are not our engines (vLLM's workers are the engine's children)."""
        if self._nvml is None:
            return []
        own = self._own_pids()
        return [p for p in gpu_processes(self._nvml) if p.pid not in own]

    def _own_pids(self) -> set[int]:
        own = {os.getpid()}
        for snap in (s.snapshot() for s in list(self._supervisors.values())):
            if snap.pid is None:
                continue
            own.add(snap.pid)
            try:
                own.update(child.pid for child in psutil.Process(snap.pid).children(recursive=True))
            except psutil.Error:
                pass
        return own

    def _gpu_released(self, pids: Collection[int]) -> bool:
        """True once none of `pids` holds GPU memory (called in a thread while an engine stops)."""
        return self._nvml is None or not any(p.pid in pids for p in gpu_processes(self._nvml))

    # --- relay hooks ----------------------------------------------------------------------

    def _gate(self) -> Literal["paused", "draining", "not_ready"] | None:
        if self._pause is not None:
            return "paused"
        if self._draining:
            return "draining"
        if not self._ready_targets():
            return "not_ready"
        return None

    def _ready_targets(self) -> list[EngineTarget]:
        targets = (s.target() for s in self._supervisors.values())
        return [EngineTarget(t.engine_id, t.base_url, t.api_key, t.served_name, t.socket_path)
                for t in targets if t is not None]

    def on_start(self, request_id: str, engine_id: str, t: float) -> None:
        if request_id not in self._generations:
            return
        self._request_engine[request_id] = engine_id
        sup = self._supervisors.get(engine_id)
        if sup:
            sup.request_started()
        meter = self._meters.get(engine_id)
        if meter:
            meter.request_started(request_id, t)

    def on_first_token(self, request_id: str, t: float) -> None:
        meter = self._meters.get(self._request_engine.get(request_id, ""))
        if meter:
            meter.first_token(request_id, t)

    def on_end(self, request_id: str, engine_id: str, t: float, usage: protocol.Usage | None, ok: bool) -> None:
        if request_id not in self._generations:
            return
        self._generations.discard(request_id)
        started = self._request_engine.pop(request_id, None) is not None  # False: cancelled before it ran
        sup = self._supervisors.get(engine_id)
        if sup and started:
            sup.request_finished()
        meter = self._meters.get(engine_id)
        if meter:
            meter.request_finished(request_id, t, usage, ok)
        if usage and self._plan and self._loop:
            price = self._welcome.price if self._welcome else protocol.Price()
            run_id = meter.run_id if meter else ""
            model = self._plan.model_name

            def credit() -> None:
                self._with_ledger(lambda ledger: ledger.record_request(
                    request_id, run_id, model, usage.prompt_tokens, usage.completion_tokens, price))
                self._read_earnings()

            # in the executor at once, and awaited (never cancelled) before the ledger closes
            write = self._loop.run_in_executor(None, credit)
            self._ledger_writes.add(write)
            write.add_done_callback(self._ledger_writes.discard)

    # --- status and snapshots ----------------------------------------------------------------

    def _node_state(self) -> NodeState:
        if self._pause is not None:
            return "paused"
        if self._assignment is None:
            return "failed" if self._problem else "idle"
        if self._plan is None or (self._problem and not self._supervisors):
            return "failed"
        if not self._supervisors:
            return "configured"
        return summarise([s.snapshot().state for s in self._supervisors.values()])

    def _status(self) -> protocol.Status:
        engines = [s.snapshot() for s in self._supervisors.values()]
        figures = aggregate(self._meters.values(), clock=self._monotonic)
        return protocol.Status(
            state=self._node_state(),
            assignment_id=self._assignment.assignment_id if self._assignment else None,
            model=self._assignment.model.name if self._assignment else None,
            last_error=self._problem.message if self._problem else None,
            refused=self._refused,
            engines=[
                protocol.EngineStatus(
                    engine_id=e.engine_id,
                    gpu_indices=list(e.gpu_indices),
                    layout=e.layout,
                    argv=list(e.argv),
                    state=e.state,
                    kv_cache_tokens=e.kv_cache_tokens,
                    kv_cache_gib=e.kv_cache_gib,
                    max_model_len=e.context.declared,
                    max_concurrency=e.max_concurrency,
                    restarts=e.restarts,
                    last_error=e.last_error,
                )
                for e in engines
            ],
            throughput=protocol.Throughput(
                tokens_per_s=figures.tokens_per_s,
                per_request_tokens_per_s=figures.per_request_tokens_per_s,
                run_tokens=figures.run_tokens,
                run_seconds=round(figures.run_seconds, 3),
                requests=figures.requests,
            ),
            gpus=[
                protocol.GpuStatus(
                    index=s.index,
                    util_pct=s.util_pct,
                    memory_used_mib=s.memory_used_mib,
                    power_w=s.power_w,
                    temperature_c=s.temperature_c,
                )
                for s in self._gpu_samples.values()
            ],
            in_flight=self._relay.in_flight if self._relay else 0,
        )

    async def _send_status(self, force: bool = False) -> bool:
        """On every state change (or `force`); the heartbeat sends regardless. True if sent
        (the snapshot was published with it)."""
        status = self._status()
        key = (status.state, tuple((e.engine_id, e.state, e.restarts) for e in status.engines), status.last_error,
               status.refused)
        if not force and key == self._last_status_key:
            return False
        self._last_status_key = key
        self._publish()
        await self._send(status)
        return True

    async def _ticker(self) -> None:
        last_heartbeat = self._monotonic()
        while True:
            await asyncio.sleep(TICK_S)
            await self._sample()
            if self._pause and self._pause.until and self._clock() >= self._pause.until:
                self._spawn(self._do_resume())
            heartbeat = self._welcome.heartbeat_s if self._welcome else 10.0
            beat = self._monotonic() - last_heartbeat >= heartbeat
            if beat:
                last_heartbeat = self._monotonic()
            if not await self._send_status(force=beat):
                self._publish()
            if self._status_file_due():
                await asyncio.to_thread(self._write_status_file)

    async def _sample(self) -> None:
        """GPU telemetry, energy and chart history, once a second, off the loop."""
        now = self._clock()
        if self._nvml is not None:
            try:
                samples = await asyncio.to_thread(sample_gpus, self._nvml)
            except NvmlError as exc:
                log.debug("GPU sample failed: %s", exc)
                samples = []
            self._gpu_samples = {s.index: s for s in samples}
            joules = sum(self._energy.add(s.index, now, s.power_w, s.energy_mj) for s in samples)
            if joules:
                price, currency = self.settings.electricity_price_per_kwh, self.settings.currency
                await asyncio.to_thread(
                    self._with_ledger, lambda ledger: ledger.record_energy(joules, now, price, currency)
                )
        if self._in_flight() or self._monotonic() - self._last_scrape >= IDLE_SCRAPE_S:
            self._last_scrape = self._monotonic()
            await self._scrape_engines()
        figures = aggregate(self._meters.values(), clock=self._monotonic)
        rows = [("tokens_per_s", figures.tokens_per_s), ("kv_usage", self._mean_kv_usage())]
        if self._gpu_samples:
            utils = [s.util_pct for s in self._gpu_samples.values() if s.util_pct is not None]
            powers = [s.power_w for s in self._gpu_samples.values() if s.power_w is not None]
            rows += [("gpu_util", sum(utils) / len(utils) if utils else None), ("power_w", sum(powers) if powers else None)]
        await asyncio.to_thread(self._record_samples, rows, now)

    async def _scrape_engines(self) -> None:
        """Each ready engine's /metrics: KV usage and queues for the dashboard, counters to
        cross-check what the relay counted."""
        for target in self._ready_targets():
            sup = self._supervisors.get(target.engine_id)
            if sup is None:
                continue
            try:  # through the supervisor's client: it reaches the engine's socket
                metrics = await scrape(sup.http, f"{target.base_url}/metrics", target.api_key, sup.plan.engine)
            except (MetricsUnavailable, httpx.HTTPError) as exc:
                log.debug("engine %s: /metrics unavailable: %s", target.engine_id, exc)
                continue
            self._engine_metrics[target.engine_id] = metrics
            self._metrics_at_ready.setdefault(target.engine_id, metrics)
            self._cross_check(target.engine_id, sup, metrics)

    def _cross_check(self, engine_id: str, sup: EngineSupervisor, metrics: EngineMetrics) -> None:
        """The relay's tokens against the engine's counter, between two scrapes with nothing in
        flight: the engine counts a stream's tokens as it goes, the relay at `response.end`, and
        the first scrape may come after the first requests."""
        meter = self._meters.get(engine_id)
        if meter is None or sup.in_flight:
            return
        before = self._token_baseline.get(engine_id)
        self._token_baseline[engine_id] = (metrics, meter.run_tokens)
        if before is None or meter.run_tokens == before[1]:
            return
        relayed = meter.run_tokens - before[1]
        check = cross_check(relayed, before[0], metrics)
        if not check.agrees():
            log.warning("engine %s: the relay counted %d tokens since the last check, the engine %s",
                        engine_id, relayed, check)

    def _mean_kv_usage(self) -> float | None:
        usage = [m.kv_usage for m in self._engine_metrics.values() if m.kv_usage is not None]
        return 100.0 * sum(usage) / len(usage) if usage else None

    def _engine_views(self) -> tuple[EngineSnapshot, ...]:
        """The supervisors' snapshots with the latest /metrics figures laid over them."""
        views = []
        for sup in self._supervisors.values():
            snap = sup.snapshot()
            metrics = self._engine_metrics.get(snap.engine_id)
            if metrics is not None and snap.state in ("ready", "degraded"):
                snap = replace(
                    snap,
                    kv_usage_pct=100.0 * metrics.kv_usage if metrics.kv_usage is not None else None,
                    requests_running=metrics.requests_running,
                    requests_waiting=metrics.requests_waiting,
                )
            views.append(snap)
        return tuple(views)

    def _throughput(self) -> ThroughputSnapshot:
        """The node's figures; with one engine, its roofline share too (per engine by nature)."""
        if len(self._meters) != 1 or self.machine is None or self._plan is None:
            return aggregate(self._meters.values(), clock=self._monotonic)
        engine_id, meter = next(iter(self._meters.items()))
        sup = self._supervisors.get(engine_id)
        if sup is None:
            return meter.snapshot(self._monotonic())
        bandwidths = [g.memory_bandwidth_gbps for g in self.machine.gpus
                      if g.index in sup.plan.gpu_indices and g.memory_bandwidth_gbps]
        baseline, latest = self._metrics_at_ready.get(engine_id), self._engine_metrics.get(engine_id)
        spec = latest.since(baseline) if latest is not None and baseline is not None else None
        line = roofline(meter.per_request_tokens_per_s(), bandwidths, self._plan.engine_model.weights_mib * 2**20, spec,
                        concurrency=meter.peak_concurrency)
        return meter.snapshot(self._monotonic(), line)

    def _record_samples(self, rows: list[tuple[str, float | None]], now: float) -> None:
        """Chart points every second; earnings are re-read after each credit (in `on_end`) and
        here once a minute, for electricity and the day's rollover."""
        values = {name: value for name, value in rows if value is not None}
        if values:
            self._with_ledger(lambda ledger: ledger.record_samples(values, now))
        if now - self._earnings_read_at >= EARNINGS_REFRESH_S:
            self._earnings_read_at = now
            self._read_earnings()

    # --- the ledger (called in a thread) ------------------------------------------------------

    def _with_ledger(self, use: Callable[[Ledger], T]) -> T | None:
        """`use(ledger)` while the ledger is open; None (and nothing done) once it is closed."""
        with self._ledger_guard:
            return use(self._ledger) if self._ledger is not None else None

    def _read_earnings(self) -> None:
        currency = self.settings.currency
        self._earnings = self._with_ledger(lambda ledger: ledger.summary(currency=currency)) or self._earnings

    def _close_ledger(self) -> None:
        with self._ledger_guard:
            ledger, self._ledger = self._ledger, None
        if ledger is not None:
            ledger.close()

    def _notice(self, text: str) -> None:
        self._notices = (self._notices + [text])[-10:]

    def _build_snapshot(self) -> NodeSnapshot:
        machine = self.machine
        engines = self._engine_views()
        lent = set(self.settings.gpus_to_lend) if self.settings.gpus_to_lend is not None else None
        gpus = tuple(self._gpu_view(g, lent) for g in (machine.gpus if machine else ()))
        earnings = self._earnings
        kwargs: dict[str, Any] = {}
        if earnings is not None:
            kwargs["earnings"] = earnings
        return NodeSnapshot(
            at=self._clock(),
            state=self._node_state() if hasattr(self, "state") else "idle",
            node_id=self.state.node_id if hasattr(self, "state") else "",
            runtime=machine.runtime if machine else "cpu",
            paused=self._pause is not None,
            pause_reason=self._pause.reason if self._pause else None,  # type: ignore[arg-type]
            pause_until=self._pause.until if self._pause else None,
            pause_detail=self._pause.detail if self._pause else None,
            assignment_id=self._assignment.assignment_id if self._assignment else None,
            model=self._assignment.model.name if self._assignment else None,
            problem=self._problem or self._connection.problem,
            gpus=gpus,
            groups=tuple(tuple(g.gpu_indices) for g in (machine.groups if machine else ())),
            effective_vram_mib=machine.effective_vram_mib if machine else 0,
            engines=engines,
            throughput=self._throughput(),
            connection=self._connection,
            downloads=tuple(self._downloads.values()),
            in_flight=self._relay.in_flight if self._relay else 0,
            notices=tuple(self._notices),
            **kwargs,
        )

    def _gpu_view(self, gpu: Gpu, lent: set[int] | None) -> GpuSnapshot:
        """Detection's facts with the latest telemetry sample laid over them (when there is one)."""
        live: Gpu | GpuSample = self._gpu_samples.get(gpu.index) or gpu
        return GpuSnapshot(
            index=gpu.index,
            name=gpu.name,
            memory_total_mib=gpu.memory_total_mib,
            memory_usable_mib=gpu.usable_mib,
            memory_used_mib=live.memory_used_mib,
            util_pct=live.util_pct,
            temperature_c=live.temperature_c,
            power_w=live.power_w,
            power_limit_w=gpu.power_limit_w,
            lent=lent is None or gpu.index in lent,
        )

    def _publish(self) -> None:
        snap = self._build_snapshot()
        self._snapshot = snap
        with self._lock:
            subscribers = list(self._subscribers)
        for callback in subscribers:
            try:
                callback(snap)
            except Exception:  # a broken viewer must not stop the node
                log.exception("a snapshot subscriber failed")

    def _status_file_due(self) -> bool:
        """Rewrite `status.json` when more than the clock changed, else every `STATUS_FILE_S`."""
        snap = self._snapshot
        if snap is None:
            return False
        visible = snap.without_clock()
        due = visible != self._status_written or self._monotonic() - self._status_written_at >= STATUS_FILE_S
        if due:
            self._status_written, self._status_written_at = visible, self._monotonic()
        return due

    def _write_status_file(self) -> None:
        """Only while this node owns the folder (during an update hand-over the new version does);
        0600, like every file the app writes."""
        snap = self._snapshot
        if snap is None or not self._owner.held:
            return
        data = {"pid": os.getpid(), "version": __version__, "snapshot": asdict(snap)}
        tmp = self.paths.status_file.with_suffix(".tmp")
        descriptor = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w", encoding="utf-8") as out:
            out.write(json.dumps(data, default=str))
        os.replace(tmp, self.paths.status_file)

    def _on_download(self, event: DownloadProgress) -> None:
        if event.finished or event.error:
            self._downloads.pop(event.what, None)
        else:
            self._downloads[event.what] = event
        self._publish()

    # --- updates --------------------------------------------------------------------------

    async def _offer_update(self, update: protocol.Update) -> None:
        log.info("update %s offered by the coordinator", update.version)
        if self._updater:
            await self._updater.offer(update)

    def install_update_now(self) -> None:
        """The user's "install now": applies a staged update without waiting for idle."""
        if self._updater:
            updater = self._updater
            self._on_loop(lambda: self._spawn(updater.install_now()))

    def _on_update_status(self, status: UpdateStatus) -> None:
        """Installed and rolled-back updates become notifications; refusals stay in the log."""
        if status.phase == "installed":
            self._notice(f"Update {status.version} installed")
        elif status.phase == "rolled_back":
            self._notice(f"Update {status.version} was rolled back: {status.message}")
        self._publish()

    def _in_flight(self) -> int:
        return self._relay.in_flight if self._relay else 0

    async def _stop_serving(self) -> None:
        """Before an update swaps the install: requests drained, engines gone, link closed and the
        data folder given up, so that the new version can own it. The engines lock stays held until
        `_resume_serving` (or the exit): no assign or resume starts an engine during the handover."""
        assert self._engines_lock is not None
        await self._engines_lock.acquire()
        await self._drain_and_stop()
        if self._link:
            await self._link.close()
        if self._local:
            await self._local.stop()  # the new version's local coordinator needs the same ports
        self._owner.release()

    async def _resume_serving(self) -> None:
        """After a rolled-back (or refused) update: own the data folder again, reconnect, and start
        the engines again. Another copy that took the folder meanwhile keeps it; this one stops."""
        assert self._engines_lock is not None
        handed_over = not self._owner.held  # else stopping failed half-way: the local coordinator still runs
        try:
            try:
                self._owner.acquire()
            except DataFolderInUse as exc:
                log.error("after the update was rolled back, another copy owns the data folder: %s", exc)
                self.shutdown()
                return
            if handed_over and self._local:
                await self._local.start()
                if self._link:
                    self._link.url = self._local.ws_url
            if self._link:
                self._link.reopen()
                self._spawn(self._link.run())
            if self._plan and not self._pause and not self._supervisors:
                await self._start_engines()
        finally:
            self._engines_lock.release()

    def _exit_for_update(self) -> None:
        self.shutdown()


def free_first_port(start: int, count: int, attempts: int = 500) -> int:
    """The first of `count` consecutive ports from `start` up that nothing listens on: an engine
    given a port another program holds would only crash-loop on "address already in use"."""
    for first in range(start, min(start + attempts * count, 65536 - count), count):
        if all(_port_free(first + i) for i in range(count)):
            return first
    return start


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the engines bind: TIME_WAIT is no obstacle
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _accelerator(machine: Machine) -> Literal["cpu", "cuda", "metal"]:
    if machine.runtime == "apple-silicon":
        return "metal"
    return "cuda" if machine.gpus else "cpu"


def _cuda_version(text: str | None) -> tuple[int, int] | None:
    major, _, minor = (text or "").partition(".")
    return (int(major), int(minor or 0)) if major.isdigit() and (minor or "0").isdigit() else None


def _library_env(folder: Path) -> dict[str, str]:
    """Engines shipped with their shared libraries beside them find them through the loader path."""
    if not any(folder.glob("*.so*")) and not any(folder.glob("*.dylib")):
        return {}
    name = "DYLD_LIBRARY_PATH" if os.uname().sysname == "Darwin" else "LD_LIBRARY_PATH"
    existing = os.environ.get(name)
    return {name: f"{folder}{os.pathsep}{existing}" if existing else str(folder)}


class _ProgressLines:
    """Headless mode's progress bar: one log line per download every few seconds."""

    def __init__(self, every_s: float = 3.0) -> None:
        self._every_s = every_s
        self._last: dict[str, float] = {}

    def __call__(self, snap: NodeSnapshot) -> None:
        now = time.monotonic()
        for d in snap.downloads:
            if now - self._last.get(d.what, 0.0) < self._every_s:
                continue
            self._last[d.what] = now
            if d.step:
                log.info("%s: %s", d.what, d.step)
                continue
            share = f"{d.fraction:.0%} " if d.fraction is not None else ""
            total = f" of {d.total_bytes / 1e6:,.0f} MB" if d.total_bytes else ""
            rate = f", {d.rate_bps / 1e6:,.1f} MB/s" if d.rate_bps else ""
            eta = f", {d.eta_s:,.0f} s left" if d.eta_s is not None else ""
            log.info("downloading %s: %s(%s MB%s%s%s)", d.what, share, f"{d.done_bytes / 1e6:,.0f}", total, rate, eta)


def run_headless(
    paths: Paths,
    settings: Settings,
    *,
    coordinator_url: str,
    hardware_override: Path | None = None,
    engine_bins: dict[str, str] | None = None,
    model: str | None = None,
    openai_port: int | None = None,
    verbose: bool = False,
) -> int:
    """`gpu-provider run --headless`: the whole node without Qt; Ctrl-C / SIGTERM drain and exit 0."""
    import signal

    from worker.applog import configure

    configure(paths, console=True, verbose=verbose)
    node = Node(
        paths,
        settings,
        coordinator_url=coordinator_url,
        hardware_override=hardware_override,
        engine_bins=engine_bins,
        model=model,
        openai_port=openai_port,
    )
    node.subscribe(_ProgressLines())

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, node.shutdown)
            except (NotImplementedError, RuntimeError):  # Windows: Ctrl-C arrives as KeyboardInterrupt
                pass
        await node.run()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass
    log.info("stopped")
    return 0
