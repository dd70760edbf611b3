"""One engine process's life: start, readiness, health, restarts, out-of-memory fallback, stop.

States follow the protocol: configured → starting → ready; degraded (serving, a health check
failing); failed (gave up, the reason in `last_error`); stopped. Every change is reported with a
reason. The decisions (what to do after an attempt ended, what the log said) are pure, in
`worker.serve.restart_policy`; the process edge is `worker.serve.process`.

Only the app can reach an engine: where the platform has Unix sockets the engine listens on one,
in a folder only this user can open (vLLM `--uds`, llama-server `--host PATH.sock`), and every
request of the supervisor, the relay and the metrics scrape goes through it; elsewhere on
127.0.0.1 and a port. Either way with this run's random API key, given in the environment (any
local user can read a command line), and with the engine's user config looked up in a folder the
app owns.

Ready means `/v1/models` names the served model *and* a few tokens of a real completion came
back in time: a listening port is never enough. While serving, an engine is restarted only when
it stops answering: its process exits, or `/health` fails or takes over `health_timeout_s` (10 s)
`health_failures` (3) times in a row. A quiet request (a long prefill, an answer that arrives
whole) says nothing about the engine, so it is never a reason (contract, Relay); the relay's
deadlines bound requests.

An engine that dies by itself while serving requests was crashed by one (`crashed_by_request`:
requests in flight, as the relay tells through `EngineTarget.on_load`): it restarts at once and
does not count toward giving up; the node's `RequestCrashes` decides when constrained decoding
is refused, and `target()` carries that refusal and the engine's context to the relay.

A start that runs out of memory, or whose context does not fit the KV cache, retries a tier
lower. vLLM's "Free memory on device" refusal is no tier problem but another program holding the
card (contract, Assignment rule 3): the supervisor waits, measures again (`remeasure`) and starts
with the share that is free now.

An engine installed inside WSL2 (the plan's `in_wsl`) runs under `serve.wsl_engine`'s launcher
through its `wsl.exe`, on 127.0.0.1 and a port, its environment crossing through `WSLENV`; it is
stopped inside the distribution first (then its `wsl.exe` as any engine), and one a previous run
left there is reaped before the first start.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import shutil
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from worker.engines.base import child_environment
from worker.serve import process as procs
from worker.serve.wsl_engine import WslEngine, environment as wsl_environment
from worker.system.config import Paths, private_dir
from worker.contract.events import ContextNumbers, EngineSnapshot, NodeState
from worker.plan.planner import EnginePlan
from worker.relay.loopback_http import LoopbackClient, LoopbackHTTPError
from worker.relay.forward import EngineTarget
from worker.serve.restart_policy import (
    AttemptFacts,
    CardMemory,
    DeviceBufferLog,
    RestartBackoff,
    Ended,
    RequestCrashes,
    SupervisorTiming,
    crashed_by_request,
    next_step,
    start_options,
)

log = logging.getLogger(__name__)

PROBE_PROMPT = "Hello"
UNIX_SOCKETS = os.name == "posix"  # Windows (and vLLM inside WSL2, reached from Windows) keep TCP
# A socket path must fit `sun_path` with its NUL: 108 bytes on Linux, 104 on macOS.
SOCKET_PATH_MAX_BYTES = 103
SOCKET_HOST_URL = "http://localhost"  # the Host an engine on a Unix socket is asked as

EventCallback = Callable[[EngineSnapshot, str], None]
# The `--gpu-memory-utilization` for a plan's cards from a fresh reading; None when none can be made.
Remeasure = Callable[[EnginePlan], Awaitable[float | None]]
# NVML's memory reading of the given cards, by GPU index (a card it cannot read left out).
CardReader = Callable[[Sequence[int]], Awaitable[Mapping[int, CardMemory]]]


def engine_home(paths: Paths) -> Path:
    """The app's private folder (0700) for its engines: their sockets, and the user config folder
    they are pointed at (kept empty, so no config file of the user's reaches them)."""
    return private_dir(paths.run_dir / "engines")


def socket_path_for(home: Path, engine_id: str) -> tuple[Path, Path | None]:
    """(the engine's socket path, a temporary folder to remove afterwards or None).

    The socket lives in `home`; when that path would not fit `sun_path`, in a fresh private
    temporary folder instead (mkdtemp makes it 0700)."""
    path = home / f"{engine_id}.sock"
    if len(os.fsencode(path)) <= SOCKET_PATH_MAX_BYTES:
        return path, None
    folder = Path(tempfile.mkdtemp(prefix="gpu-provider-"))
    return folder / f"{engine_id}.sock", folder


class EngineSupervisor:
    """Runs one `EnginePlan`'s engine and keeps it serving, or says why it cannot."""

    def __init__(self, plan: EnginePlan, *, paths: Paths, on_event: EventCallback | None = None,
                 timing: SupervisorTiming = SupervisorTiming(), backoff: RestartBackoff = RestartBackoff(),
                 sleep: Callable[[float], Any] = asyncio.sleep, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time,
                 key_factory: Callable[[], str] = lambda: secrets.token_hex(24),  # never starts with "-" (argparse)
                 base_env: Mapping[str, str] | None = None, gpu_released: procs.GpuReleased | None = None,
                 http: httpx.AsyncClient | None = None, unix_socket: bool | None = None,
                 remeasure: Remeasure | None = None, request_crashes: RequestCrashes | None = None,
                 read_cards: CardReader | None = None):
        """`http` is used for an engine on a TCP port; one on a Unix socket gets its own client.
        `unix_socket` None follows the platform (`UNIX_SOCKETS`) and the engine (`UNIX_SOCKET`); False keeps
        an engine on 127.0.0.1.
        `remeasure` gives the memory share to start with after vLLM found the card's memory held
        (None: the planned share again). `wall_clock` dates the next start (`retry_at`) for people.
        `request_crashes` is the node's count of crashes requests caused (shared by its engines).
        `read_cards` (Windows, where CUDA spills a start that does not fit into shared system memory)
        reads the plan's cards before a start and once it is ready, to tell such a start (`spilled`)."""
        self.plan = plan
        self.adapter = plan.adapter
        self._paths = paths
        self._on_event = on_event
        self._timing = timing
        self._backoff = backoff
        self._sleep = sleep
        self._clock = clock
        self._wall_clock = wall_clock
        self._key_factory = key_factory
        self._base_env = dict(os.environ if base_env is None else base_env)
        self._gpu_released = gpu_released
        self._remeasure = remeasure
        self._read_cards = read_cards
        self._http = http
        self._owns_http = False
        self._health_client = LoopbackClient(max_idle_per_engine=1)
        self._wsl = WslEngine(plan.wsl_distro, plan.engine_id) if plan.in_wsl else None
        # an engine that cannot listen on a Unix socket (SGLang) keeps 127.0.0.1 and its key everywhere,
        # and so does one inside WSL2 (Windows cannot reach a socket inside the VM)
        self._unix_socket = ((UNIX_SOCKETS if unix_socket is None else unix_socket) and self.adapter.UNIX_SOCKET
                             and self._wsl is None)
        self._socket_path: Path | None = None
        self._temp_folder: Path | None = None
        self._config_home: Path | None = None
        self._base_url = f"http://127.0.0.1:{plan.port}"
        self._snapshot = EngineSnapshot(
            engine_id=plan.engine_id, engine=plan.engine, gpu_indices=tuple(plan.gpu_indices), layout=plan.layout,
            state="configured", tier=plan.tier, memory_mib=plan.memory_mib,
            port=None if self._unix_socket else plan.port, restart_limit=timing.max_fast_failures)
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._process: procs.EngineProcess | None = None
        self._api_key: str | None = None
        self._run_id: str | None = None
        self._facts = AttemptFacts()
        self._in_flight = 0
        self._request_crashes = request_crashes or RequestCrashes(clock=clock)
        self._relayed = 0  # requests of any path on the engine now (the relay's count, via `on_load`)
        self._last_relayed_end: float | None = None
        self.last_ended: Ended | None = None  # how the latest attempt ended (None: none has yet)

    # --- what others read ----------------------------------------------------------------

    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    def target(self) -> EngineTarget | None:
        """Where to send requests now; None unless the engine is ready (or degraded but serving)."""
        if self._snapshot.state not in ("ready", "degraded") or self._api_key is None:
            return None
        socket_path = str(self._socket_path) if self._socket_path is not None else None
        return EngineTarget(self.plan.engine_id, self._base_url, self._api_key, self.plan.served_name, socket_path,
                            context=self._snapshot.context.servable,
                            constraints_refused=self._request_crashes.refusal, on_load=self._relayed_change)

    @property
    def http(self) -> httpx.AsyncClient:
        """A client that reaches this engine at `target().base_url` (through its socket, if it has one)."""
        if self._http is None:
            raise RuntimeError("the supervisor has no client before start()")
        return self._http

    @property
    def run_id(self) -> str | None:
        """Changes each time a new engine process becomes ready, so measurements never mix runs."""
        return self._run_id

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def _relayed_change(self, change: int) -> None:
        self._relayed = max(0, self._relayed + change)
        if change < 0:
            self._last_relayed_end = self._clock()

    def request_started(self) -> None:
        self._in_flight += 1

    def request_finished(self) -> None:
        self._in_flight = max(0, self._in_flight - 1)

    async def wait_for_state(self, *states: NodeState, timeout: float) -> EngineSnapshot:
        """The snapshot once the state is one of `states`; TimeoutError otherwise."""
        async with asyncio.timeout(timeout):
            while self._snapshot.state not in states:
                await self._changed.wait()
        return self._snapshot

    # --- start and stop ------------------------------------------------------------------

    async def start(self) -> None:
        """Begin supervising (returns at once; follow the events or `wait_for_state`)."""
        if self._task is not None and not self._task.done():
            return
        self._prepare_listener()
        self._task = asyncio.create_task(self._supervise(), name=f"supervise-{self.plan.engine_id}")

    def _prepare_listener(self) -> None:
        """The private folder; the socket path and a client of its own where sockets are used."""
        if self._config_home is not None:
            return
        self._config_home = engine_home(self._paths)
        if self._unix_socket:
            self._socket_path, self._temp_folder = socket_path_for(self._config_home, self.plan.engine_id)
            self._base_url = SOCKET_HOST_URL
            transport = httpx.AsyncHTTPTransport(uds=str(self._socket_path))
            self._http, self._owns_http = httpx.AsyncClient(transport=transport, trust_env=False), True
        elif self._http is None:
            self._http, self._owns_http = httpx.AsyncClient(trust_env=False), True

    async def stop(self, reason: str = "stopped") -> None:
        """Stop the engine (graceful, then forced) and wait until it and its GPU memory are gone.

        Final: a stopped supervisor is not started again (make a new one).
        """
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._stop_process()
        self._remove_socket()
        if self._temp_folder is not None:
            shutil.rmtree(self._temp_folder, ignore_errors=True)
        self._set("stopped", reason)
        if self._owns_http and self._http is not None:
            await self._http.aclose()
        await self._health_client.aclose()

    def _remove_socket(self) -> None:
        """A socket file left by an engine that is gone: the next one could not bind its path."""
        if self._socket_path is not None:
            self._socket_path.unlink(missing_ok=True)

    # --- the loop ------------------------------------------------------------------------

    async def _supervise(self) -> None:
        try:
            await self._keep_serving()
        except Exception as exc:  # a bug here must not leave the engine "starting" for ever
            log.exception("engine %s: supervisor error", self.plan.engine_id)
            await self._stop_process()
            message = f"The engine supervisor stopped on an internal error ({exc}); see the app log."
            self._set("failed", message, last_error=message)

    async def _keep_serving(self) -> None:
        pid_path = procs.pid_file(self._paths.run_dir, self.plan.engine_id)
        await asyncio.to_thread(procs.reap_pid_file, pid_path, self._timing.stop)
        await self._stop_inside_wsl()  # one a previous run left inside: the host pid file names only wsl.exe
        options = start_options(self.plan)
        option, fast_failures, memory_waits, reason = 0, 0, 0, "starting"
        while True:
            tier, args = options[option]
            ended = await self._attempt(tier, args, pid_path, reason)
            memory_waits = memory_waits + 1 if ended.kind == "free_memory" else 0
            turned_off = ended.by_request and self._request_crashes.record()
            if not memory_waits and not ended.by_request:  # neither is a failure of the engine's
                fast = not ended.was_ready or ended.uptime_s < self._timing.stable_after_s
                fast_failures = fast_failures + 1 if fast else 1
            following = options[option + 1][0] if option + 1 < len(options) else None
            step = next_step(ended, option=option, options=len(options), fast_failures=fast_failures, tier=tier,
                             next_tier=following, timing=self._timing, backoff=self._backoff,
                             memory_waits=memory_waits)
            self.last_ended = ended
            if step.action == "fail":
                self._set("failed", step.reason, last_error=step.reason, failures_in_a_row=fast_failures)
                return
            reason = step.reason
            if turned_off:
                reason = f"{reason}\n{self._request_crashes.refusal}"
            if step.action == "fallback":
                option += 1
                fast_failures = 0
                self._update(failures_in_a_row=0)
            elif step.action == "wait":
                self._set("starting", reason, last_error=ended.message, retry_at=self._wall_clock() + step.delay_s)
                memory_waits = await self._wait_for_memory(step.delay_s, memory_waits)
                reason = "starting with the GPU memory that is free now"
            else:
                self._set("starting", reason, restarts=self._snapshot.restarts + 1, last_error=ended.message,
                          failures_in_a_row=fast_failures, retry_at=self._wall_clock() + step.delay_s)
                await self._sleep(step.delay_s)

    async def _wait_for_memory(self, delay_s: float, waits: int) -> int:
        """Sleep, then take the share of the cards that is free now, for every later start (the
        last one where none can be measured). Where none is free at all, no engine could start:
        keep waiting, longer each time. Returns the waits in a row so far."""
        while True:
            await self._sleep(delay_s)
            share = await self._remeasure(self.plan) if self._remeasure is not None else None
            if share is None:
                return waits
            if share > 0:
                self.plan = dataclasses.replace(self.plan, memory_utilization=share)
                return waits
            waits += 1
            delay_s = self._timing.memory_wait.delay(waits)
            self._set("starting", "still waiting for GPU memory", retry_at=self._wall_clock() + delay_s)

    async def _attempt(self, tier: str | None, args: Sequence[str], pid_path: Path, reason: str) -> Ended:
        """Run one engine process until it ends or must be restarted; it is stopped on return."""
        self._api_key = self._key_factory()
        self._facts = AttemptFacts()
        self._remove_socket()
        socket_path = str(self._socket_path) if self._socket_path is not None else None
        argv = self.plan.argv(args, socket_path=socket_path)
        assert self._config_home is not None, "start() prepares the private folder"
        env = {**self.plan.environment(self._base_env, api_key=self._api_key, config_home=str(self._config_home)),
               **dict(self.plan.env)}
        started_argv = argv
        if self._wsl is not None:
            started_argv, env = self._wsl_start(argv)
        log_path = procs.rotate_logs(self._paths.log_dir, self.plan.engine_id)
        cards_before = await self._cards()
        started = self._clock()
        self._set("starting", reason, tier=tier, argv=tuple(argv), phase="launching",
                  kv_cache_tokens=None, kv_cache_gib=None, max_concurrency=None, context=ContextNumbers(),
                  log_path=str(log_path), pid=None, retry_at=None)
        try:
            self._process = procs.spawn(started_argv, env=env, log_path=log_path, pid_path=pid_path,
                                        on_line=self.observe_line)
        except OSError as exc:
            return Ended("unstartable", f"Could not start {started_argv[0]}: {exc}. Check that the engine is "
                         "installed.", 0.0, False)
        self._update(pid=self._process.pid)
        ended = await self._until_ready(self._process, started)
        if ended is None and cards_before is not None:
            ended = await self._spilled(cards_before, started)
        if ended is None:
            await self._became_ready()
            ended = await self._serve(self._process, started)
        await self._stop_process()
        return ended

    async def _cards(self) -> Mapping[int, CardMemory] | None:
        """NVML's reading of the plan's cards where a start may spill (`read_cards` given, an engine
        that logs its device buffers, GPUs), else None."""
        if self._read_cards is None or not self.plan.gpu_indices or not isinstance(self.adapter, DeviceBufferLog):
            return None
        return await self._read_cards(self.plan.gpu_indices)

    async def _spilled(self, before: Mapping[int, CardMemory], started: float) -> Ended | None:
        """An `oom` ending when the ready engine's start spilled into shared system memory."""
        after = await self._cards()
        if after is None:
            return None
        return self._facts.spilled(self.plan.gpu_indices, before, after, self._clock() - started)

    async def _stop_process(self) -> None:
        if self._process is not None:
            await self._stop_inside_wsl()
            await self._process.stop(self._timing.stop, self._gpu_released)
            self._process = None

    def _wsl_start(self, argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
        """`wsl.exe` running `argv` under the launcher, and its environment: the engine's own
        variables (its key among them) cross into the distribution through `WSLENV` only. Its user
        configuration folder is the launcher's, inside (the app's is a Windows path)."""
        assert self._wsl is not None and self._api_key is not None
        own = {**self.plan.environment({}, api_key=self._api_key), **dict(self.plan.env)}
        return (self._wsl.start_argv(argv, self._timing.stop.grace_s),
                wsl_environment(child_environment(self._base_env), own))

    async def _stop_inside_wsl(self) -> None:
        """End the engine's Linux processes (a failure is logged by `WslEngine.stop`; its `wsl.exe`
        is stopped afterwards either way)."""
        if self._wsl is not None:
            await asyncio.to_thread(self._wsl.stop, self._timing.stop.grace_s)

    # --- log facts -----------------------------------------------------------------------

    def observe_line(self, line: str) -> None:
        """One line of the engine's output (stdout or stderr): facts go into the snapshot."""
        if isinstance(self.adapter, DeviceBufferLog):
            self._facts.note_device_buffer(self.adapter.device_buffer(line))
        fact = self.adapter.parse_line(line)
        if fact is None:
            return
        snap = self._facts.absorb(fact, self._snapshot)
        if snap.phase != self._snapshot.phase:
            self._set("starting", snap.phase or "", phase=snap.phase)
        else:
            self._snapshot = snap

    # --- readiness -----------------------------------------------------------------------

    async def _until_ready(self, process: procs.EngineProcess, started: float) -> Ended | None:
        deadline = started + self._timing.ready_timeout_s
        while True:
            if process.returncode is not None or await self._exited_within(process, self._timing.poll_s):
                return await self._ended_by_exit(process, started, was_ready=False)
            if await self._probe():
                return None
            if self._clock() >= deadline:
                return Ended("timeout", f"not ready after {self._timing.ready_timeout_s:.0f} s",
                             self._clock() - started, False)

    async def _exited_within(self, process: procs.EngineProcess, seconds: float) -> bool:
        try:
            await asyncio.wait_for(process.wait(), seconds)
        except TimeoutError:
            return False
        return True

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._api_key}"}

    def _url(self, path: str) -> str:
        return f"{self._base_url}{path}"

    async def _get_json(self, path: str) -> Any:
        response = await self.http.get(self._url(path), headers=self._headers(),
                                       timeout=self._timing.request_timeout_s)
        response.raise_for_status()
        return response.json()

    async def _probe(self) -> bool:
        """`/v1/models` names our model and a few tokens of a real completion come back."""
        try:
            models = await self._get_json("/v1/models")
            cards = [card for card in models.get("data", []) if card.get("id") == self.plan.served_name]
            if not cards:
                return False
            response = await self.http.post(
                self._url("/v1/completions"), headers=self._headers(), timeout=self._timing.probe_timeout_s,
                json={"model": self.plan.served_name, "prompt": PROBE_PROMPT,
                      "max_tokens": self._timing.probe_max_tokens, "temperature": 0})
            response.raise_for_status()
            if not response.json().get("choices"):
                return False
        except (httpx.HTTPError, ValueError, AttributeError):
            return False
        declared = cards[0].get("max_model_len")
        if isinstance(declared, int):
            self._update(context=dataclasses.replace(self._snapshot.context, declared=declared))
        return True

    async def _became_ready(self) -> None:
        await self._read_when_ready()
        self._run_id = uuid.uuid4().hex[:12]
        self._set("ready", "answered /v1/models and a test completion", phase="ready")

    async def _read_when_ready(self) -> None:
        """What the engine tells only once ready (llama.cpp: context and slots from /props and
        /slots), read at its adapter's `READY_READS` and put into the snapshot by its adapter."""
        paths = self.adapter.READY_READS
        if not paths:
            return
        try:
            reads = {path: await self._get_json(path) for path in paths}
            snapshot = self.adapter.ready_snapshot(reads, self._snapshot, self._facts.slots)
        except (httpx.HTTPError, ValueError, AttributeError, TypeError, KeyError) as exc:
            log.warning("engine %s: could not read %s: %s", self.plan.engine_id, " or ".join(paths), exc)
            return
        self._snapshot = snapshot

    # --- serving -------------------------------------------------------------------------

    async def _serve(self, process: procs.EngineProcess, started: float) -> Ended:
        failures = 0
        while True:
            if await self._exited_within(process, self._timing.health_interval_s):
                # Who was busy is read at the exit, before its last lines are awaited.
                since = None if self._last_relayed_end is None else self._clock() - self._last_relayed_end
                in_flight = self._relayed
                ended = await self._ended_by_exit(process, started, was_ready=True)
                return crashed_by_request(ended, in_flight=in_flight, since_last_request_s=since)
            uptime = self._clock() - started
            problem = await self._health_problem()
            if problem is None:
                failures = 0
                if self._snapshot.state == "degraded":
                    self._set("ready", "health check answered again")
                continue
            failures += 1
            if failures >= self._timing.health_failures:
                return Ended("unhealthy", f"stopped answering /health ({problem}, {failures} checks in a row)",
                             uptime, True)
            if self._snapshot.state == "ready":
                self._set("degraded", f"health check failed: {problem}")

    async def _health_problem(self) -> str | None:
        """One `/health` check, through the relay's lean client: it runs every few seconds for
        as long as the engine serves, and httpx's per-request work was most of an idle node's CPU."""
        timeout = self._timing.health_timeout_s
        socket_path = str(self._socket_path) if self._socket_path is not None else None
        request = self._health_client.build_request("GET", self._url("/health"), socket_path=socket_path)
        try:
            async with asyncio.timeout(timeout):
                response = await self._health_client.send(request, stream=False)
        except TimeoutError:
            return f"no answer within {timeout:g} s"
        except (LoopbackHTTPError, ValueError, EOFError) as exc:
            return type(exc).__name__
        return None if response.status_code == 200 else f"HTTP {response.status_code}"

    async def _ended_by_exit(self, process: procs.EngineProcess, started: float, *, was_ready: bool) -> Ended:
        status = await process.wait()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(process.output_closed(), self._timing.output_settle_s)
        return self._facts.ending(status, process.tail, self._clock() - started, was_ready)

    # --- state -----------------------------------------------------------------------------

    def _update(self, **changes: Any) -> None:
        self._snapshot = dataclasses.replace(self._snapshot, **changes)

    def _set(self, state: NodeState, reason: str, **changes: Any) -> None:
        self._snapshot = dataclasses.replace(self._snapshot, state=state, **changes)
        log.info("engine %s: %s (%s)", self.plan.engine_id, state, reason.splitlines()[0] if reason else "")
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        if self._on_event is not None:
            self._on_event(self._snapshot, reason)
