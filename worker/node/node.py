"""The orchestrator: the one place that knows the order of things.

detect → hello → assign → plan → provision → supervise → relay → measure, plus pause, resume,
update and shutdown. Each part owns its state: the coordinator connection (`Uplink`), the engines
(`EngineSet`), the GPUs (`GpuWatch`), the relay's measurements (`Metering`, the relay's hooks),
the ledger (`Books`), who hears what and when (`Publisher`, with the `StatusFile`), whether the
computer may sleep (`KeepAwake`: not while an engine serves), auto-tune (`AutoTune`: the held
plan's tuning, its searches and the kept result on each launch), the lender's limits and
downloads (`Lender`: judged each second, the relay's cap of requests at once, a pause while too
hot, on battery or losing money; downloads held while paused, paced, counted, cancelled);
`node_view` builds what the node shows and reports. The desktop app's node (`wait_for_setup`)
detects and then waits for the first-run flow before it connects, downloads or starts anything.
The Node composes them on one asyncio loop, keeps the assignment, the plan and the pause, and
turns coordinator messages and user commands into actions in the right order: what to do is
`policy`'s to decide, pure, and the Node carries it out; the 1 Hz sampling is `sampler`'s.
Commands (`pause`, `resume`, `retry`, `save_settings`, `sign_out`, `shutdown`, …) are safe to
call from any thread. `diagnosis` words what failed for the person.
"""

from __future__ import annotations

import asyncio
import gc
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from worker.contract import protocol
from worker.node import policy
from worker.node import autopause
from worker.node.autopause import AutoPauser
from worker.system.config import Paths, Settings, State, load_state, save_state
from worker.system.config import save_settings as write_settings
from worker.system.datalock import DataFolderInUse, DataFolderLock
from worker.system.keepawake import KeepAwake, PowerAssertion, platform_assertion
from worker.node.provision_failure import network_failure, offline_problem, provision_problem
from worker.serve.engine_set import EngineSet
from worker.contract.events import EngineSnapshot, NodeSnapshot, NodeState, Problem, RoutingNotice
from worker.measure.gpu_watch import GpuWatch
from worker.hardware import Machine, NvmlSource, PynvmlSource
from worker.hardware.nvml import find_wsl_nvml_library
from worker.measure.ledger import Books
from worker.link.connection import Backoff
from worker.node.tasks import LoopTasks
from worker.measure.metering import Metering
from worker.link.outgoing import Outgoing
from worker.node.sampler import Sampler
from worker.node.autotune import AutoTune, Hooks
from worker.node.lender import Lender
from worker.node.reminders import Reminders
from worker.node.tuner import TunerSettings
from worker.node.view import Pause, build_hello, build_snapshot, build_status, engine_views
from worker.plan.planner import DEFAULT_FIRST_PORT, EnginePlan, Plan, Refusal, plan
from worker.plan.share_preview import SharePreview, preview
from worker.serve.process import reap_leftovers
from worker.provision.assignment import OFFLINE_BACKOFF, OfflineRetry, provision
from worker.provision.errors import ProvisionError
from worker.provision.transfer import DownloadCancelled
from worker.node.publisher import Publisher, Subscriber
from worker.relay.forward import Relay, engine_http_client
from worker.serve.restart_policy import RestartBackoff
from worker.node.status import StatusFile
from worker.link.uplink import Uplink
from worker.update import NodeHooks, Updater, UpdateStatus

log = logging.getLogger(__name__)

DRAIN_S = 30.0


class Node:
    """Owns the relay, the assignment and the pause, and the parts that own the rest."""

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
        offline_backoff: RestartBackoff = OFFLINE_BACKOFF,
        power: PowerAssertion | None = None,
        tuner_settings: TunerSettings | None = None,
        local_tune: dict[str, Any] | None = None,
        wait_for_setup: bool = False,
    ) -> None:
        """`offline_backoff`: when a download or install the network cut short is tried again;
        `power`: what keeps the computer awake while it serves (None: this platform's own);
        `tuner_settings`: how hard a tuning measures (None: as each search's budget allows); `local_tune`: with the
        local coordinator, the contract's `tune` block its assignment carries (`local_tune_block`);
        `wait_for_setup`: the desktop app's node, which waits for the first-run flow
        (`Settings.setup_complete`) before it connects, downloads or starts anything."""
        self.paths = paths.ensure()
        self.settings = settings
        self._wait_for_setup = wait_for_setup
        self._set_up = asyncio.Event()  # the first-run flow finished (or was never asked for)
        self._hardware_override = hardware_override
        self._engine_bins = dict(engine_bins or {})
        self._first_port = first_port
        self._clock = clock
        self._monotonic = monotonic

        self.state: State
        self.machine: Machine | None = None
        self._stopping: asyncio.Event | None = None
        self._tasks = LoopTasks()

        self._owner = DataFolderLock(self.paths)
        self._gpus = GpuWatch(nvml)
        self._game_detection: str | None = None  # known once the machine is: what auto-pause can see
        self._engines = EngineSet(self.paths, self._gpus, on_event=self._on_engine_change,
                                  remeasure=self._remeasure_memory)
        self._books = Books(self.paths.ledger_file, lambda: self.settings.currency,
                            lambda: self.settings.electricity_price_per_kwh)
        self._metering = Metering(self._engines.get, self._books, self._terms, monotonic, clock)
        self._sampler = Sampler(self._gpus, self._books, self._metering, cards=self._engines.cards,
                                targets=self._engines.ready_targets, in_flight=self._in_flight,
                                settings=lambda: self.settings, clock=clock)
        self._last_heartbeat = monotonic()
        self._status_file = StatusFile(self.paths, lambda: self._owner.held, monotonic)
        self._news = Publisher(self._build_snapshot, self._status, self._send, self._status_file,
                               reminders=Reminders(lambda: self.settings, monotonic))
        self._engine_http = engine_http_client()
        # No default outlet: the link hands each request the connection it came on. The relay
        # tells `Metering` of generations, and asks `_gate` whether it may take a request now.
        self._relay = Relay(Outgoing.nowhere(), self._engines.ready_targets, self._gate, http=self._engine_http,
                            hooks=self._metering)
        self._uplink = Uplink(coordinator_url, self.paths, token_provider=token_provider, backoff=backoff,
                              local_model=model, openai_port=openai_port, local_tune=local_tune, hello=self._hello,
                              on_message=self._on_message, on_disconnect=self._on_disconnect,
                              on_bad_message=self._on_bad_message, on_change=self._news.publish,
                              requests=self._relay)
        self._updater: Updater | None = None
        self._offline_retry = OfflineRetry(self._tasks.spawn, offline_backoff, clock=clock)

        self._welcome: protocol.Welcome | None = None
        self._held = policy.State()  # the assignment, plan, problem, refusal and pause: `policy` decides
        self._draining = False  # while the relay drains for an engine stop
        self._engines_lock: asyncio.Lock | None = None
        self._awake = KeepAwake(power if power is not None else platform_assertion())
        self._autotune = AutoTune(self.paths, self._tuning_hooks(), self._tasks, settings=tuner_settings,
                                  monotonic=monotonic)
        self._routing: RoutingNotice | None = None  # the network's latest word on the traffic it sends
        self._lender = Lender(settings, self.paths, self._relay.set_max_requests, monotonic=monotonic, clock=clock)
        self._guard_resuming = False  # a guard's resume waits for the engines lock: one at a time

    # --- commands (any thread) ----------------------------------------------------------------

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """`callback(snapshot)` on the core's loop thread for every new snapshot; returns its undo."""
        return self._news.subscribe(callback)

    def snapshot(self) -> NodeSnapshot:
        return self._news.latest or self._build_snapshot()

    def pause(self, duration_s: float | None = None, reason: str = "user", detail: str | None = None) -> None:
        until = self._clock() + duration_s if duration_s else None
        why = reason if not until or reason != "user" else "timed"
        self._tasks.call(lambda: self._tasks.spawn(self._do_pause(why, until, detail)))

    def resume(self) -> None:
        self._tasks.call(lambda: self._tasks.spawn(self._resume_by_person()))

    def pause_download(self) -> None:
        """The person's pause of downloads alone: held until `resume_download` (serving goes on)."""
        self._lender.downloads.hold("paused_by_you")
        self._tasks.call(self._news.publish)

    def resume_download(self) -> None:
        self._lender.downloads.release("paused_by_you")
        self._tasks.call(self._news.publish)

    def cancel_download(self) -> None:
        """The running download stops and its partial file goes; the node pauses, the assignment
        kept (not a failure): Resume fetches it again."""
        self._lender.downloads.cancel()

    def preview_share(self, gpu_index: int, pct: int) -> SharePreview:
        """What lending `pct` % of this card would leave for the desktop and let the engine hold,
        before it is saved (from the engine's measured KV where one serves on it). `ValueError`:
        no such card, or a share outside 10-100 %."""
        snap = self.snapshot()
        gpu = next((g for g in snap.gpus if g.index == gpu_index), None)
        if gpu is None:
            raise ValueError(f"no GPU {gpu_index} on this computer")
        return preview(gpu, pct, snap.engines, reserve_mib=self.settings.memory_reserve_mib)

    def save_settings(self, settings: Settings) -> None:
        """The one place settings are saved: written (on the calling thread, so that a dialog can
        say what failed), then applied to the running node. `OSError`: nothing was applied."""
        write_settings(self.paths, settings)
        self._tasks.call(lambda: self._set_settings(settings))

    def token_changed(self) -> None:
        """The user signed in (again): connect now instead of waiting in `signed_out`."""
        self._tasks.call(self._sign_in)

    def sign_out(self) -> None:
        """The user signed out: the link closes and waits in `signed_out` for `token_changed`."""
        self._tasks.call(lambda: self._tasks.spawn(self._uplink.sign_out()))

    def retry(self) -> None:
        """The user's Retry: failed engines, a failed download or install, an offline link, now."""
        self._tasks.call(lambda: self._tasks.spawn(self._try_again()))

    def shutdown(self) -> None:
        self._tasks.call(lambda: self._stopping.set() if self._stopping else None)

    def history(self, series: str, since: float) -> list[tuple[float, float]]:
        return self._books.chart(series, since)

    def log_files(self) -> dict[str, Path]:
        files = {"app": self.paths.log_dir / "gpu-provider.log"}
        for engine in self.snapshot().engines:  # the snapshot, not the live dict: any thread may ask
            if engine.log_path:
                files[f"engine {engine.engine_id}"] = Path(engine.log_path)
        return files

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
        self._tasks.bind()
        self._stopping = asyncio.Event()
        self._engines_lock = asyncio.Lock()
        self.state = load_state(self.paths)
        if self.state.paused:
            self._held = dataclasses.replace(self._held, pause=Pause("user", self.state.pause_until))
        reaped = await asyncio.to_thread(reap_leftovers, self.paths.run_dir)
        if reaped:
            log.warning("stopped %d engine process(es) a previous run left behind: %s", len(reaped), reaped)
        self._news.publish()  # "Finding your GPUs…" (`detecting`) while `_detect` runs
        self.machine = await asyncio.to_thread(self._detect)
        if self._gpus.nvml is None and self._hardware_override is None and self.machine.gpus:
            self._gpus.nvml = PynvmlSource(library=find_wsl_nvml_library() if self.machine.runtime == "wsl2" else None)
        self._game_detection = await asyncio.to_thread(autopause.detection_limit, nvml=self._gpus.nvml is not None)
        await asyncio.to_thread(self._books.open)
        try:
            self._last_heartbeat = self._monotonic()
            self._tasks.spawn(self._sampler.run(self._each_second))  # local: the figures, the status file
            if await self._setup_finished():
                await self._start_work()
                await self._stopping.wait()
        finally:
            await self._close()

    async def _setup_finished(self) -> bool:
        """The desktop app's node waits here until the first-run flow saves `setup_complete`:
        nothing connects, downloads or starts before the person says so. False: quit first."""
        if not self._setup_needed():
            return True
        assert self._stopping is not None
        log.info("waiting for the first-run setup: nothing connects, downloads or starts until it is finished")
        self._news.publish()
        waits = [asyncio.ensure_future(self._set_up.wait()), asyncio.ensure_future(self._stopping.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        return not self._stopping.is_set()

    def _setup_needed(self) -> bool:
        return self._wait_for_setup and not self.settings.setup_complete

    async def _start_work(self) -> None:
        """The link (the local coordinator started where it is local), updates, game pauses."""
        assert self.machine is not None
        await self._step(policy.ProblemFound(await self._uplink.open(self.machine)))  # a local model that cannot be served
        self._run_link()
        self._updater = Updater(
            self.paths,
            self.settings,
            NodeHooks(self._in_flight, self._stop_serving, self._resume_serving, self._exit_for_update),
            on_progress=self._news.on_download,
            on_status=self._on_update_status,
        )
        self._tasks.spawn(self._updater.run_feed_checks())
        self._tasks.spawn(self._autopause().run())
        self._news.publish()
        gc.freeze()  # what start-up made lives as long as the node: full collections skip it

    async def _close(self) -> None:
        log.info("stopping: draining requests and stopping engines")
        self._autotune.cancel(resume=False)
        await self._step(policy.Quit())  # "Stopping…" at once; each second publishes `in_flight` as it drains
        self._owner.mark_stopping()  # a second start meanwhile is told to wait, not that we run on
        try:
            await self._wind_down()
        finally:
            self._owner.release()  # only now: the engines are gone

    async def _wind_down(self) -> None:
        if self._relay.in_flight:
            self._draining = True
            await self._relay.drain(min(DRAIN_S, 10.0), "draining")
        await self._stop_engines()
        await self._remember_pause()
        await self._uplink.close()
        await self._tasks.cancel_all()
        await self._stop_engines()  # any that an assign or resume cut short by the cancel had started
        await self._engines.close()
        await self._engine_http.aclose()
        self._news.publish()
        await self._books.close()
        self._status_file.remove()  # unless the new version owns the folder after an update

    def _detect(self) -> Machine:
        from worker.engines.finding import Finder
        from worker.hardware import detect

        if self._hardware_override:
            data = json.loads(Path(self._hardware_override).read_text(encoding="utf-8"))
            return Machine.from_detect_json(data)
        return detect(self.settings, Finder(self._engine_bins), nvml=self._gpus.nvml)

    # --- link -----------------------------------------------------------------------------

    def _run_link(self) -> None:
        if self._uplink.linked:
            self._tasks.spawn(self._uplink.run())

    def _sign_in(self) -> None:
        if self._uplink.resume_after_sign_in():
            self._run_link()

    async def _switch_network(self, url: str) -> None:
        """A new network in Settings: the old one's link and assignment end, the new one's link
        opens (the local coordinator where it is "local"), the app running on."""
        assert self.machine is not None
        log.info("switching to the network at %s", url)
        problem = await self._uplink.switch(url, self.machine)
        self._welcome = None
        await self._locked(policy.Unassigned(None))
        await self._step(policy.ProblemFound(problem))
        self._run_link()
        self._news.publish()

    def _hello(self) -> protocol.Hello:
        assert self.machine is not None
        return build_hello(self.state.node_id, self.machine, paused=self._held.pause is not None,
                           allow_remote_code=self.settings.allow_remote_code, limits=self._lender.limits)

    def _on_disconnect(self) -> None:
        """The coordinator is gone: nobody will read the answers, so stop generating them; what
        it said of its traffic no longer holds."""
        self._relay.cancel_all("coordinator connection lost")
        self._routing = None

    async def _send(self, message: BaseModel) -> bool:
        return await self._uplink.send(message)

    async def _on_message(self, message: Any) -> None:
        """What the coordinator asks of the node; `request` and `cancel` go to the relay directly."""
        if isinstance(message, protocol.Welcome):
            self._welcome = message
            await self._news.send_status(force=True)
        elif isinstance(message, protocol.Routing):
            self._routing = RoutingNotice(message.share, message.reason, message.message, self._clock())
            self._news.publish()
        elif isinstance(message, protocol.Assign):
            if message != self._held.assignment:
                self._autotune.cancel(resume=False)
            if self._held.assignment is None or message.assignment_id != self._held.assignment.assignment_id:
                self._routing = None  # its word was about the old model's traffic
            self._tasks.spawn(self._locked(policy.Assigned(message)))
        elif isinstance(message, protocol.Unassign):
            if self._held.assignment is not None and self._held.assignment.assignment_id == message.assignment_id:
                self._autotune.unassigned()
            self._tasks.spawn(self._locked(policy.Unassigned(message.assignment_id)))
        elif isinstance(message, protocol.Tune):
            self._autotune.on_message(message)
        elif isinstance(message, protocol.Pause):
            self._tasks.spawn(self._do_pause("coordinator", None))
        elif isinstance(message, protocol.Resume):
            self._tasks.spawn(self._resume("coordinator"))
        elif isinstance(message, protocol.Update):
            self._tasks.spawn(self._offer_update(message))
        elif isinstance(message, protocol.Error):
            log.warning("coordinator reported an error: %s %s (ref %s)", message.code, message.message, message.ref)

    # --- the policy's executor ------------------------------------------------------------

    async def _locked(self, event: policy.Event) -> None:
        """`event` decided and carried out under the engines lock: never from the link's reader
        (an assign may hold the lock for minutes)."""
        assert self._engines_lock is not None
        async with self._engines_lock:
            await self._step(event)

    async def _step(self, event: policy.Event) -> None:
        """Decide on `event` and carry the decision out; a fact an action finds is the next event."""
        start = self._observed()
        decision = policy.decide(start, event)
        for action in decision.before:
            await self._act(action)
        self._held = policy.commit(self._held, start, decision.state)
        self._keep_awake()
        self._lender.follow_pause(self._held.pause)
        for action in decision.after:
            follow = await self._act(action)
            if follow is not None:
                await self._step(follow)

    def _observed(self) -> policy.State:
        return dataclasses.replace(self._held, engines=tuple(self._engines.states()))

    async def _act(self, action: policy.Action) -> policy.Event | None:
        """One action carried out; the fact it found where the policy must weigh it."""
        if isinstance(action, policy.PlanAssignment):
            return await self._plan_assignment(action.assign)
        if isinstance(action, policy.StartProvision):
            return await self._provision_assignment(action.assign, action.plan)
        if isinstance(action, policy.DescribeFailure):
            return policy.ProblemFound(self._provision_failed(action.error))
        if isinstance(action, policy.StartEngines):
            return await self._start_engines()
        if isinstance(action, policy.StopEngines):
            await self._stop_for(action)
        elif isinstance(action, policy.LaunchEngines):
            await self._launch(list(action.engine_plans))
        elif isinstance(action, policy.RestartFailed):
            await self._engines.restart_failed()
        elif isinstance(action, policy.ResetOfflineRetry):
            self._offline_retry.reset()
        elif isinstance(action, policy.SaveAssignment):
            self.state.last_assignment = action.assign.model_dump()
            await self._save_state()
        elif isinstance(action, policy.SavePause):
            self.state.paused, self.state.pause_until = action.paused, action.until
            await self._save_state()
        elif isinstance(action, policy.ReportRefusal):
            log.warning("assignment %s refused: %s", action.assignment_id, action.reason)
        elif isinstance(action, policy.SendStatus):
            await self._news.send_status(force=True)
        else:
            self._news.publish()
        return None

    async def _remember_pause(self) -> None:
        """A person's pause the quit cut short (it is saved once its engines stopped) still holds
        at the next start."""
        pause = self._held.pause
        if not hasattr(self, "state") or pause is None or pause.reason not in ("user", "timed"):
            return
        if not self.state.paused or self.state.pause_until != pause.until:
            self.state.paused, self.state.pause_until = True, pause.until
            await self._save_state()

    async def _save_state(self) -> None:
        """The state written for the next start; a write that fails is logged and the node goes
        on as decided: what it does now (serving, or the card freed for a game) matters more."""
        try:
            await asyncio.to_thread(save_state, self.paths, self.state)
        except OSError as exc:
            log.error("could not save the node's state in %s (%s); the next start may not remember it",
                      self.paths.state_file, exc)

    async def _plan_assignment(self, assign: protocol.Assign) -> policy.Event:
        """Plan (which validates every argument and the source) before anything stops. `plan`
        runs in a thread: the loop keeps relaying while a large assignment is checked."""
        assert self.machine is not None
        result = await asyncio.to_thread(plan, self.machine, assign, self.settings, first_port=self._first_port)
        if isinstance(result, Refusal):
            return policy.Refuse(assign.assignment_id, result.reason, assign)
        log.info(
            "assignment %s: %s on %s (%s)",
            assign.assignment_id,
            assign.model.name,
            result.engine,
            ", ".join(f"{e.engine_id} {e.layout} gpus={list(e.gpu_indices)} tier={e.tier}" for e in result.engines),
        )
        for warning in result.warnings:
            log.warning("assignment %s: %s", assign.assignment_id, warning)
        return policy.Planned(assign, result)

    async def _provision_assignment(self, assign: protocol.Assign, accepted: Plan) -> policy.Event:
        """The new model fetched while the old engines keep serving."""
        try:
            engine_plans = await self._provision_tracked(accepted)
        except ProvisionError as exc:
            return policy.ProvisionFailed(assign, accepted, exc)
        except DownloadCancelled:
            return policy.Cancelled(assign, accepted)
        return policy.Provisioned(assign, accepted, tuple(engine_plans))

    async def _on_bad_message(self, error: protocol.BadMessage) -> None:
        """An `assign` that does not even fit the schema (a tier key of "²") is refused like any other."""
        if error.message_type == "assign":
            self._tasks.spawn(self._locked(policy.Refuse(error.ref or "(no assignment_id)", str(error))))

    async def _start_engines(self) -> policy.Event | None:
        """Provision and start the held plan (after a resume, or a retry); a failure is the next event."""
        assert self._held.plan is not None
        try:
            engine_plans = await self._provision_tracked(self._held.plan)
        except ProvisionError as exc:
            return policy.ProblemFound(self._provision_failed(exc))
        except DownloadCancelled:
            return policy.Cancelled()
        await self._launch(engine_plans)
        return None

    def _provision_failed(self, exc: ProvisionError) -> Problem:
        """The problem to show; one the network caused is tried again by itself, later each time."""
        if not network_failure(exc):
            return provision_problem(exc.problem)
        return offline_problem(exc.problem, self._offline_retry.schedule(lambda: self._try_again(by_hand=False)))

    async def _try_again(self, by_hand: bool = True) -> None:
        """What failed, again now: the engines that gave up (fresh, their counts reset), or the
        plan's provisioning; `by_hand` (the person's Retry) also the link, the backoff started over."""
        if by_hand:
            self._uplink.reconnect_now()
        await self._locked(policy.Retry(by_hand))

    async def _provision_tracked(self, current: Plan) -> list[EnginePlan]:
        """`provision`, published first and its failure logged; raises `ProvisionError`, or
        `DownloadCancelled` where the person cancelled the download."""
        assert self.machine is not None
        self._news.publish()
        try:
            engine_plans = await provision(current, self.machine, self.paths, self.settings, self._news.on_download,
                                           engine_bins=self._engine_bins, control=self._lender.downloads)
        except ProvisionError as exc:
            log.error("%s: %s", exc.problem.title, exc.problem.message)
            raise
        except DownloadCancelled:
            log.info("the download was cancelled: paused, the assignment kept for Resume")
            raise
        self._offline_retry.reset()
        return engine_plans

    async def _launch(self, engine_plans: list[EnginePlan]) -> None:
        """The engines started, each with the arguments tuning kept for it after its tier."""
        features = self._welcome.features if self._welcome else []
        await self._engines.launch(await self._autotune.launching(self.machine, features, engine_plans))
        self._news.publish()

    async def _remeasure_memory(self, engine_plan: EnginePlan) -> float | None:
        """The memory share to start the plan's engine with after vLLM found a card's memory held
        (`GpuWatch.memory_share`); None where the cards cannot be read."""
        if self.machine is None:
            return None
        return await self._gpus.memory_share(self.machine, engine_plan, self.settings)

    async def _stop_for(self, action: policy.StopEngines) -> None:
        if not action.lock:
            await self._drain_and_stop(action.reason)
            return
        assert self._engines_lock is not None
        async with self._engines_lock:
            await self._drain_and_stop(action.reason)

    async def _drain_and_stop(self, reason: Literal["paused", "draining", "tuning"]) -> None:
        if not self._engines:
            return
        self._draining = True
        try:
            await self._relay.drain(DRAIN_S, reason)
            await self._stop_engines()
        finally:
            self._draining = False

    async def _stop_engines(self) -> None:
        for engine_id in await self._engines.stop_all():
            self._metering.forget(engine_id)
            self._autotune.stopped(engine_id)
        self._news.publish()

    def _on_engine_change(self, snap: EngineSnapshot, reason: str) -> None:
        sup = self._engines.get(snap.engine_id)
        run_id = sup.run_id if sup is not None else None
        if snap.state == "ready" and run_id is not None:
            self._metering.start_run(snap.engine_id, run_id)
        elif snap.state in ("starting", "failed", "stopped"):
            self._metering.forget(snap.engine_id)
        self._autotune.engine_changed(snap, started=snap.state == "ready" and run_id is not None)
        self._keep_awake()  # before the snapshot that shows it
        self._news.publish()  # serving, failing and pausing speak through the state (app/notify.py), not notices
        if self._tasks.loop:
            self._tasks.spawn(self._news.send_status())

    def _keep_awake(self) -> None:
        """The computer kept awake exactly while an engine serves, the node is neither paused nor
        stopping, and the person wants it so (the setting)."""
        serving = any(state in ("ready", "degraded") for state in self._engines.states())
        held = self._held
        self._awake.want(self.settings.keep_awake_while_serving and serving and held.pause is None
                         and not held.stopping)

    # --- pause ----------------------------------------------------------------------------

    async def _do_pause(self, reason: str, until: float | None, detail: str | None = None) -> None:
        log.info("pause (%s)%s", reason, f" until {time.ctime(until)}" if until else "")
        self._autotune.cancel()  # a game or a pause ends the running trial at once; tuning resumes later
        await self._step(policy.Paused(reason, until, detail))  # announced at once; the engines stop under the lock

    def _set_settings(self, settings: Settings) -> None:
        switched = settings.coordinator_url != self.settings.coordinator_url
        waiting = self._setup_needed() or self.machine is None  # the link is not open yet
        self.settings = settings
        self._keep_awake()
        self._lender.update_settings(settings)
        if self._updater:
            self._updater.apply_settings(settings)
        if switched and not waiting:
            self._tasks.spawn(self._switch_network(settings.coordinator_url))
        elif switched:  # the link opens on the new network once detection (and setup) end
            self._uplink.url = settings.coordinator_url
        if not self._setup_needed():
            self._set_up.set()

    async def _resume_by_person(self) -> None:
        """The person's Resume lifts any pause; over a guard's, that reason is left alone until it clears."""
        self._lender.person_resumed(self._held.pause)
        await self._resume("user")

    async def _resume(self, by: Literal["user", "coordinator", "timer", "guard"]) -> None:
        """A resume that lifts the pause lets downloads go at once, before it waits for the engines
        lock: the download the pause held may be what holds the lock."""
        if policy.decide(self._observed(), policy.Resumed(by)).state.pause is None:
            self._lender.release_downloads()
        await self._locked(policy.Resumed(by))

    def _autopause(self) -> AutoPauser:
        """Pauses for games: GPU users that are not the app's (vLLM's workers are its engine's children)."""
        return AutoPauser(self, lambda: self.settings, lambda: self._gpus.processes_besides(self._own_pids))

    def _own_pids(self) -> set[int]:
        """The engines' processes, a tuning's trial engine among them."""
        return self._engines.own_pids() | self._autotune.own_pids()

    # --- auto-tune ---------------------------------------------------------------------------

    def _tuning_hooks(self) -> Hooks:
        """What `AutoTune` carries a search out with: the engines under their lock, the relay's
        drain, this node's launch, and its news."""
        return Hooks(held=lambda: self._held, settings=lambda: self.settings, lock=lambda: self._engines_lock,
                     engines=self._engines, requests=lambda: self._metering.figures().requests,
                     in_flight=self._in_flight, drain=lambda: self._relay.drain(DRAIN_S, "tuning"),
                     stop_engines=self._drain_and_stop, launch=self._launch, send=self._send,
                     send_status=lambda force: self._news.send_status(force=force))

    # --- the relay's gate, and the terms of what it meters ----------------------------------

    def _gate(self) -> policy.Gate | None:
        return policy.gate(self._held, draining=self._draining, ready=bool(self._engines.ready_targets()),
                           tuning=self._autotune.measuring)

    def _terms(self) -> tuple[str, protocol.Price] | None:
        """What a finished generation earns under: the planned model at the coordinator's price."""
        if self._held.plan is None:
            return None
        return self._held.plan.model_name, self._welcome.price if self._welcome else protocol.Price()

    # --- status and snapshots ----------------------------------------------------------------

    def _node_state(self) -> NodeState:
        return self._observed().node_state()

    def _status(self) -> protocol.Status:
        held = self._held
        return build_status(state=self._node_state(), assignment=held.assignment, problem=held.problem,
                            refused=held.refused,
                            engines=engine_views(self._engines.snapshots(), {}, self._autotune.tuned),
                            figures=self._metering.figures(), gpus=self._gpus.samples.values(),
                            in_flight=self._in_flight(), tuning=self._autotune.view(), limits=self._lender.limits,
                            downloads=self._news.downloads.values())

    async def _each_second(self) -> None:
        """After the sample: a timed pause's end, then the news (a heartbeat when one is due)."""
        if policy.resume_due(self._held, self._clock()):
            self._tasks.spawn(self._resume("timer"))
        self._judge_limits()
        self._autotune.each_second()
        heartbeat = self._welcome.heartbeat_s if self._welcome else 10.0
        beat = self._monotonic() - self._last_heartbeat >= heartbeat
        if beat:
            self._last_heartbeat = self._monotonic()
        await self._news.tick(heartbeat=beat)

    # --- the lender's limits --------------------------------------------------------------------

    def _judge_limits(self) -> None:
        """This second's readings judged by the lender's limits; their pause taken or lifted (not
        while quitting: the engines are stopping anyway)."""
        event = self._lender.judge(
            self._held.pause, samples=self._gpus.samples.values(), capacity=self._metering.last_capacity,
            price=self._welcome.price if self._welcome else None, serving=bool(self._engines.ready_targets()),
            in_flight=self._in_flight())
        if self._held.stopping:
            return
        if isinstance(event, policy.Paused):
            self._tasks.spawn(self._do_pause(event.reason, None, event.detail))
        elif event is not None and not self._guard_resuming:
            self._guard_resuming = True
            self._tasks.spawn(self._guard_resume())

    async def _guard_resume(self) -> None:
        """One at a time: the lock may be held for minutes by an assignment's download."""
        try:
            await self._resume("guard")
        finally:
            self._guard_resuming = False

    def _build_snapshot(self) -> NodeSnapshot:
        started = hasattr(self, "state")  # loaded when the node starts running
        return build_snapshot(
            at=self._clock(),
            state=self._node_state() if started else "idle",
            node_id=self.state.node_id if started else "",
            machine=self.machine,
            lent=self.settings.gpus_to_lend,
            gpu_samples=self._gpus.samples,
            pause=self._held.pause,
            assignment=self._held.assignment,
            problem=self._held.problem or self._engines.problem() or self._uplink.connection.problem,
            engines=self._engines.snapshots(),
            metrics=self._metering.latest,
            throughput=self._metering.throughput(self.machine, self._held.plan),
            connection=self._uplink.connection,
            downloads=self._news.downloads.values(),
            in_flight=self._in_flight(),
            notices=self._news.notices,
            earnings=self._books.earnings,
            last_capacity=self._metering.last_capacity,
            stopping=self._held.stopping,
            update_ready=self._updater.ready_version if self._updater else None,
            game_detection=self._game_detection,
            tuning=self._autotune.view(),
            tuned=self._autotune.tuned,
            setup_needed=self._setup_needed(),
            routing=self._routing,
            limits=self._lender.limits,
        )

    # --- updates --------------------------------------------------------------------------

    async def _offer_update(self, update: protocol.Update) -> None:
        log.info("update %s offered by the coordinator", update.version)
        if self._updater:
            await self._updater.offer(update)

    def install_update_now(self) -> None:
        """The user's "install now": applies a staged update without waiting for idle."""
        if self._updater:
            updater = self._updater
            self._tasks.call(lambda: self._tasks.spawn(updater.install_now()))

    def _on_update_status(self, status: UpdateStatus) -> None:
        """Installed and rolled-back updates become notifications; refusals stay in the log. One
        ready to install shows as `update_ready` (the app says so, and offers the restart)."""
        if status.phase == "installed":
            self._news.notice(f"Update {status.version} installed")
        elif status.phase == "rolled_back":
            self._news.notice(f"Update {status.version} was rolled back: {status.message}")
        self._news.publish()

    def _in_flight(self) -> int:
        return self._relay.in_flight

    async def _stop_serving(self) -> None:
        """Before an update swaps the install: requests drained, engines gone, link closed and the
        data folder given up, so that the new version can own it. The engines lock stays held until
        `_resume_serving` (or the exit): no assign or resume starts an engine during the handover."""
        assert self._engines_lock is not None
        await self._engines_lock.acquire()
        await self._drain_and_stop("paused" if self._held.pause else "draining")
        await self._uplink.close()
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
            if await self._uplink.reopen(local_stopped=handed_over):
                self._run_link()
            await self._step(policy.HandedBack())
        finally:
            self._engines_lock.release()

    def _exit_for_update(self) -> None:
        self.shutdown()
