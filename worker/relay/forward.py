"""The relay: a coordinator `request` → a local engine (its Unix socket, or 127.0.0.1) →
`response.*` frames back.

Every request the relay accepts ends with exactly one terminal message (`response.end` or
`response.error`), whatever happens: the whole exchange runs in one task whose last act sends
that message. The one exception is a coordinator that is gone: then the engine request is
closed (so no GPU time goes to an answer nobody will receive) and nothing is sent.

Which requests may reach an engine (paths, media by URL, bounded sizes), which are generations, the body an
engine is sent and the reading of its answer are `worker.relay.body`'s rules. The relay decides
once, on accepting a request, whether it is a generation; only generations reach its hooks.
Where the lender limits the requests served at once (`set_max_requests`), one over that limit of
requests in flight at the relay gets 503 `at_capacity` before any engine sees it.

The relay never retries a generation. Its hot path runs in the engine socket's read callback
(`Response.stream_to`): each read's bytes go through the `StreamFilter` (whole SSE events, usage
read on the way) and are queued as one `response.chunk` on the connection the request came on
(`Outlet.post`), with no task or future per read; the link writes what a loop iteration queued
together (one `batch` frame where the coordinator allows it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from pydantic import BaseModel

from worker.contract import protocol
from worker.relay.loopback_http import LoopbackClient, LoopbackHTTPError, Response
from worker.relay.body import (
    StreamFilter,
    asks_stream,
    beyond_context,
    constrained,
    engine_body,
    engine_headers,
    is_generation,
    media_by_url,
    unbounded,
    unrelayable,
)

log = logging.getLogger(__name__)

GateCode = Literal["paused", "draining", "tuning", "not_ready"]

DRAIN_TIMEOUT_S = 30.0
_FRAME_CHARS = 1 << 20  # at most 6 MiB once JSON-escaped: far below the protocol's 16 MiB
PROGRESS_EVERY_S = 1.0

_GATE_MESSAGES: dict[str, str] = {
    "paused": "this node is paused by its owner; send the request to another node",
    "draining": "this node is finishing its current requests before it stops; send the request elsewhere",
    "tuning": "this node is measuring which engine settings serve fastest on it, for a few minutes; send the "
              "request elsewhere",
    "not_ready": "no engine on this node is ready to serve yet; send the request elsewhere",
}
_AT_CAPACITY = ("this node's owner lets it serve {n} request{s} at once and that many are running; "
                "send the request elsewhere or try again shortly")


class Outlet(Protocol):
    """Where a request's answer goes: the connection it came on (`outgoing.Outgoing`)."""

    congested: bool  # more is queued than the connection should hold: stop adding to it

    async def send(self, message: BaseModel) -> bool:
        """Writes `message` after everything queued before it; False once the connection is gone."""

    def post(self, frame: str) -> bool:
        """Queues an encoded message without waiting, in order; False once the connection is gone."""

    def when_drained(self, callback: Callable[[], None]) -> None:
        """Calls `callback` once it is no longer congested."""


class RequestHandler(Protocol):
    """The relay as the link sees it: `request` and `cancel` frames go to it directly, each
    request with the outlet of the connection it came on. Whether it is accepted is the relay's
    gate's say (the node's pause, drain and readiness), not the link's."""

    def handle(self, request: protocol.Request, outlet: Outlet | None = None) -> asyncio.Task[None]: ...

    def cancel(self, request_id: str) -> bool: ...


@dataclass(frozen=True)
class EngineTarget:
    """Where one ready engine listens, and how to talk to it."""

    engine_id: str
    base_url: str  # http://127.0.0.1:PORT, or only the Host (http://localhost) for a socket
    api_key: str
    served_model_name: str
    socket_path: str | None = None  # the engine's Unix socket, when it listens on one
    context: int | None = None  # the tokens one request may use; None while not known
    constraints_refused: str | None = None  # why constrained decoding is refused now, or None
    # Told +1 when a request (any path) is handed to this engine and -1 when it is done with it:
    # the supervisor tells a crash a request caused from an engine that broke by itself.
    on_load: Callable[[int], None] | None = field(default=None, compare=False, repr=False)


class RelayHooks:
    """Measurement and ledger callbacks, for generations only (`relay_body.is_generation`): the
    relay calls them for no other request. The defaults do nothing; subclass what you need.

    They run on the event loop once per request: keep them quick.
    """

    def on_start(self, request_id: str, engine_id: str, t: float) -> None:
        """A generation was handed to an engine."""

    def on_first_token(self, request_id: str, t: float) -> None:
        """The first bytes of the answer reached the relay."""

    def on_progress(self, request_id: str, events: int, t: float) -> None:
        """A streamed answer's SSE events relayed so far (about one a token), at most every
        `PROGRESS_EVERY_S`: a long stream counts in the live figures before it ends."""

    def on_end(
        self, request_id: str, engine_id: str, t: float, usage: protocol.Usage | None, ok: bool
    ) -> None:
        """A generation finished; `ok` is False for errors, cancels and engine failures. Also
        called for one cancelled before it started (without `on_start`)."""


_NO_HOOKS = RelayHooks()  # what a request that is no generation reports to


def engine_http_client() -> LoopbackClient:
    """The relay's client to its engines: loopback only, no read timeout (deadlines are the
    relay's), no cap on concurrent streams, and O(1) work per request start and end (httpx's
    per-chunk and pool costs capped the relay at a third of its capacity; `bench/README.md`)."""
    return LoopbackClient()


class _CoordinatorGone(Exception):
    """The connection the request came on is closed: stop, and send nothing more."""


class _Stream:
    """One streamed answer on its way: called with each engine read's bytes, from the socket's
    read callback, it reports the first token and progress and queues the filtered text as one
    `response.chunk`. Raises `_CoordinatorGone` (which ends the engine request) once the
    connection the request came on is gone; stops reading the engine while that connection is
    congested (a slow coordinator), until it drains."""

    __slots__ = ("_clock", "_events", "_filter", "_frames", "_hooks", "_outlet", "_post", "_report_at",
                 "_request_id", "_response")

    def __init__(self, job: _Job, response: Response, filter_: StreamFilter, clock: Callable[[], float]) -> None:
        self._request_id = job.request.id
        self._frames = protocol.ChunkFrames(job.request.id)
        self._outlet = job.outlet
        self._post = job.outlet.post
        self._response = response
        self._hooks = job.hooks
        self._filter = filter_
        self._clock = clock
        self._events = 0
        self._report_at: float | None = None  # None until the first read, which is the first token

    def take(self, raw: bytes) -> None:
        now = self._clock()
        if self._report_at is None:
            self._hooks.on_first_token(self._request_id, now)
            self._report_at = now + PROGRESS_EVERY_S
        self._events += raw.count(b"\n\n")  # SSE events end in a blank line
        if now >= self._report_at and self._events:
            self._hooks.on_progress(self._request_id, self._events, now)
            self._report_at = now + PROGRESS_EVERY_S
        self._queue(self._filter.feed(raw))
        if self._outlet.congested:
            self._response.pause_reading()
            self._outlet.when_drained(self._response.resume_reading)

    def finish(self) -> None:
        """Queues what the filter still held (an event the engine left unfinished)."""
        self._queue(self._filter.finish())

    def _queue(self, text: str) -> None:
        for start in range(0, len(text), _FRAME_CHARS):
            if not self._post(self._frames.encode(text[start : start + _FRAME_CHARS])):
                raise _CoordinatorGone


class _Job:
    """One accepted request, from its arrival to its terminal message."""

    __slots__ = ("hooks", "outlet", "request", "silent", "stop", "target", "task")

    def __init__(self, request: protocol.Request, outlet: Outlet, target: EngineTarget, hooks: RelayHooks) -> None:
        self.request = request
        self.outlet = outlet
        self.target = target
        self.hooks = hooks  # the relay's for a generation, else none
        self.task: asyncio.Task[None] | None = None
        self.stop: protocol.ResponseError | None = None  # why it was stopped from outside
        self.silent = False  # the coordinator is gone: send nothing


class Relay:
    """Forwards `request` frames to the least-loaded ready engine and streams the answers back."""

    def __init__(
        self,
        outlet: Outlet,
        ready_targets: Callable[[], Sequence[EngineTarget]],
        gate: Callable[[], GateCode | None],
        *,
        http: LoopbackClient,
        hooks: RelayHooks | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._outlet = outlet
        self._ready_targets = ready_targets
        self._gate = gate
        self._http = http
        self._hooks = hooks or _NO_HOOKS
        self._clock = clock
        self._jobs: dict[str, _Job] = {}
        self._by_engine: dict[str, int] = {}
        self._refusing: GateCode | None = None
        self._max_requests: int | None = None  # the lender's limit of requests at once; None = none
        self._replies: set[asyncio.Task[None]] = set()

    @property
    def in_flight(self) -> int:
        return len(self._jobs)

    def set_max_requests(self, n: int | None) -> None:
        """The lender's limit of requests in flight at once (lowered while a card runs hot); None
        lifts it. Requests already in flight run on; only new ones over it are refused."""
        if n is not None and n < 1:
            raise ValueError("max_requests must be at least 1")
        self._max_requests = n

    def is_serving(self, request_id: str) -> bool:
        """True while `request_id` was accepted and has not reached its terminal message."""
        return request_id in self._jobs

    def in_flight_by_engine(self) -> dict[str, int]:
        return {engine: n for engine, n in self._by_engine.items() if n}

    def handle(self, request: protocol.Request, outlet: Outlet | None = None) -> asyncio.Task[None]:
        """Starts serving `request`; `outlet` (default: the relay's) should be bound to the
        connection the request came on, so that its answer never leaks onto a later one."""
        outlet = outlet or self._outlet
        refusal = self._refusal(request)
        if refusal is not None:
            return self._reply(outlet, refusal)
        if request.id in self._jobs:
            return self._reply(outlet, protocol.Error(
                code="duplicate_request", message=f"request {request.id!r} is already in flight", ref=request.id
            ))
        target = min(self._ready_targets(), key=lambda t: self._by_engine.get(t.engine_id, 0))
        refusal = self._engine_refusal(request, target)
        if refusal is not None:
            return self._reply(outlet, refusal)
        hooks = self._hooks if is_generation(request.method, request.path) else _NO_HOOKS
        job = _Job(request, outlet, target, hooks)
        self._jobs[request.id] = job
        self._by_engine[target.engine_id] = self._by_engine.get(target.engine_id, 0) + 1
        _tell_load(target, 1)
        job.task = asyncio.create_task(self._serve(job), name=f"relay-{request.id}")
        job.task.add_done_callback(lambda _task: self._settle_unstarted(job))
        return job.task

    def _settle_unstarted(self, job: _Job) -> None:
        """A task cancelled before its first step never ran `_serve`'s `finally`: settle it here,
        so even a `cancel` right behind its `request` gets exactly one terminal message."""
        if self._jobs.get(job.request.id) is not job:
            return
        self._forget(job)
        self._report_end(job, None, False)
        if job.stop is not None and not job.silent:
            self._reply(job.outlet, job.stop)

    def _reply(self, outlet: Outlet, message: BaseModel) -> asyncio.Task[None]:
        """Sends a one-frame answer in its own task, held until it is done."""

        async def reply() -> None:
            await outlet.send(message)

        task = asyncio.create_task(reply())
        self._replies.add(task)
        task.add_done_callback(self._replies.discard)
        return task

    def cancel(self, request_id: str) -> bool:
        """Closes the engine request (so the engine stops generating); ends it with 499."""
        job = self._jobs.get(request_id)
        if job is None or job.task is None:
            return False
        job.stop = protocol.ResponseError(
            id=request_id, status=499, code="cancelled", message="the request was cancelled by the caller"
        )
        job.task.cancel()
        return True

    def cancel_all(self, reason: str) -> int:
        """The coordinator is gone: close every engine request and send nothing."""
        jobs = list(self._jobs.values())
        for job in jobs:
            job.silent = True
            if job.task is not None:
                job.task.cancel()
        if jobs:
            log.info("cancelled %d in-flight request(s) upstream: %s", len(jobs), reason)
        return len(jobs)

    async def drain(self, timeout: float = DRAIN_TIMEOUT_S, code: GateCode = "paused") -> int:
        """Refuses new requests with 503 `code`, lets in-flight ones finish for up to `timeout`
        seconds, then ends the rest with 503 `code`. Returns how many were cut off."""
        self._refusing = code
        try:
            tasks = [job.task for job in self._jobs.values() if job.task is not None]
            if tasks:
                await asyncio.wait(tasks, timeout=timeout)
            cut = list(self._jobs.values())
            for job in cut:
                job.stop = protocol.ResponseError(
                    id=job.request.id, status=503, code=code,
                    message=f"this node stopped serving ({code}) before the answer was complete",
                )
                if job.task is not None:
                    job.task.cancel()
            if cut:
                await asyncio.wait([job.task for job in cut if job.task is not None])
            return len(cut)
        finally:
            self._refusing = None

    def _refusal(self, request: protocol.Request) -> protocol.ResponseError | None:
        problem = unrelayable(request.method, request.path) or media_by_url(request.body) or unbounded(request.body)
        if problem is not None:
            return protocol.ResponseError(id=request.id, status=400, code="bad_request", message=problem)
        code = self._refusing or self._gate()
        if code is None and not self._ready_targets():
            code = "not_ready"
        if code is not None:
            return protocol.ResponseError(id=request.id, status=503, code=code, message=_GATE_MESSAGES[code])
        limit = self._max_requests
        if limit is not None and len(self._jobs) >= limit:
            return protocol.ResponseError(id=request.id, status=503, code="at_capacity",
                                          message=_AT_CAPACITY.format(n=limit, s="" if limit == 1 else "s"))
        return None

    @staticmethod
    def _engine_refusal(request: protocol.Request, target: EngineTarget) -> protocol.ResponseError | None:
        """What the chosen engine cannot take: more tokens than its context, or constrained
        decoding where the node has stopped accepting it."""
        problem = beyond_context(request.body, target.context)
        if problem is None and target.constraints_refused is not None and constrained(request.body):
            problem = target.constraints_refused
        if problem is None:
            return None
        return protocol.ResponseError(id=request.id, status=400, code="bad_request", message=problem)

    async def _serve(self, job: _Job) -> None:
        request, engine_id = job.request, job.target.engine_id
        terminal: BaseModel | None = None
        usage: protocol.Usage | None = None
        ok = False
        try:
            job.hooks.on_start(request.id, engine_id, self._clock())
            usage, status = await self._exchange(job)
            terminal = protocol.ResponseEnd(id=request.id, usage=usage)
            ok = status < 400
        except asyncio.CancelledError:
            if job.stop is None and not job.silent:
                raise  # the loop itself is shutting down: nobody is left to answer
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            terminal = job.stop
        except _CoordinatorGone:
            job.silent = True
        except TimeoutError:
            terminal = protocol.ResponseError(
                id=request.id, status=504, code="deadline",
                message=f"no answer within the request's deadline of {request.deadline_s:g} s; "
                'use "stream": true for long answers',
            )
        except LoopbackHTTPError as exc:
            terminal = protocol.ResponseError(
                id=request.id, status=502, code="engine_failed",
                message=f"the engine failed during the request ({type(exc).__name__}: {exc})",
            )
        except Exception as exc:
            log.exception("relaying request %s failed", request.id)
            terminal = protocol.ResponseError(
                id=request.id, status=500, code="relay_failed", message=f"the relay failed: {exc}"
            )
        finally:
            self._forget(job)
            self._report_end(job, usage, ok)
        if terminal is not None and not job.silent:
            await job.outlet.send(terminal)

    async def _exchange(self, job: _Job) -> tuple[protocol.Usage | None, int]:
        request, target = job.request, job.target
        content, strip_usage = engine_body(request.body, target.served_model_name)
        upstream = self._http.build_request(
            request.method, target.base_url.rstrip("/") + request.path,
            content=content, headers=engine_headers(target.api_key, content is not None),
            socket_path=target.socket_path,
        )
        response: Response | None = None
        try:
            async with asyncio.timeout(request.deadline_s):
                response = await self._http.send(upstream, stream=True)
                streamed = asks_stream(request.body) and _is_event_stream(response)
                body = None if streamed else await response.aread()
            await _deliver(job, protocol.ResponseHead(
                id=request.id, status=response.status_code, content_type=response.headers.get("content-type")
            ))
            filter_ = StreamFilter(events=_is_event_stream(response), strip_usage=strip_usage)
            if body is None:
                await self._pump(job, response, filter_)
            else:
                await self._send_whole(job, body, filter_)
            return filter_.usage, response.status_code
        finally:
            if response is not None:
                await response.aclose()

    async def _pump(self, job: _Job, response: Response, filter_: StreamFilter) -> None:
        stream = _Stream(job, response, filter_, self._clock)
        try:
            await response.stream_to(stream.take)
        except LoopbackHTTPError:
            stream.finish()  # what the engine did send still goes out, before the 502
            raise
        stream.finish()

    async def _send_whole(self, job: _Job, body: bytes, filter_: StreamFilter) -> None:
        # No first-token time: a whole body's tokens arrive together, so timing them would make up
        # a per-request decode speed of thousands of tok/s; the meter leaves such a request out.
        text = filter_.feed(body) + filter_.finish()
        filter_.read_json_usage(body)
        for start in range(0, len(text), _FRAME_CHARS):
            piece = text[start : start + _FRAME_CHARS]
            await _deliver(job, protocol.ResponseChunk(id=job.request.id, data=piece))

    def _forget(self, job: _Job) -> None:
        self._jobs.pop(job.request.id, None)
        self._by_engine[job.target.engine_id] -= 1
        _tell_load(job.target, -1)

    def _report_end(self, job: _Job, usage: protocol.Usage | None, ok: bool) -> None:
        try:
            job.hooks.on_end(job.request.id, job.target.engine_id, self._clock(), usage, ok)
        except Exception:
            log.exception("a relay hook failed at the end of request %s", job.request.id)


def _tell_load(target: EngineTarget, change: int) -> None:
    if target.on_load is not None:
        target.on_load(change)


async def _deliver(job: _Job, message: BaseModel) -> None:
    if not await job.outlet.send(message):
        raise _CoordinatorGone


def _is_event_stream(response: Response) -> bool:
    content_type: str = response.headers.get("content-type", "")
    return content_type.startswith("text/event-stream")
