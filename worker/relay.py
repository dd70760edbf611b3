"""The relay: a coordinator `request` → a local engine (its Unix socket, or 127.0.0.1) →
`response.*` frames back.

Every request the relay accepts ends with exactly one terminal message (`response.end` or
`response.error`), whatever happens: the whole exchange runs in one task whose last act sends
that message. The one exception is a coordinator that is gone: then the engine request is
closed (so no GPU time goes to an answer nobody will receive) and nothing is sent.

A body that gives media by URL (`image_url: "http://192.168.1.1/…"`) is refused before it
reaches the engine, which would otherwise fetch it from the provider's home network: media come
inline, as `data:` URLs.

The relay never retries a generation. Its hot path only queues the engine's reads; a per-request
sender task cuts what has piled up at SSE event boundaries (so a multi-byte character is never
split), looks for `"usage"` with one substring search over the whole block, decodes it, and sends
it as one `response.chunk` frame: a busy socket means fewer, larger frames.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import unquote

from pydantic import BaseModel, ValidationError

from worker import protocol
from worker.loopback_http import LoopbackClient, LoopbackHTTPError, Response

log = logging.getLogger(__name__)

Send = Callable[[BaseModel], Awaitable[bool]]
GateCode = Literal["paused", "draining", "not_ready"]

DRAIN_TIMEOUT_S = 30.0
_FRAME_CHARS = 1 << 20  # at most 6 MiB once JSON-escaped: far below the protocol's 16 MiB
_MAX_HELD_BYTES = 1 << 20  # an "event" this long without a blank line is relayed as it is
_PATH = re.compile(r"^/v1/[A-Za-z0-9._~!$&'()*+,;=:@%/-]*(\?[A-Za-z0-9._~!$&'()*+,;=:@%/?-]*)?$")
_EVENT_SEPARATOR = re.compile(rb"(\r?\n\r?\n)")
_USAGE_KEY = b'"usage"'
# Where a body names media: keys whose string value is a URL (OpenAI, responses and Anthropic
# forms), and media objects (inline base64 and plain fields). Only inline data passes.
_URL_KEYS = frozenset({"url", "image_url", "audio_url", "video_url", "file_url"})
_MEDIA_OBJECTS = frozenset({"input_audio", "file"})
_URL_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)
MAX_BODY_DEPTH = 64

_GATE_MESSAGES: dict[str, str] = {
    "paused": "this node is paused by its owner; send the request to another node",
    "draining": "this node is finishing its current requests before it stops; send the request elsewhere",
    "not_ready": "no engine on this node is ready to serve yet; send the request elsewhere",
}


@dataclass(frozen=True)
class EngineTarget:
    """Where one ready engine listens, and how to talk to it."""

    engine_id: str
    base_url: str  # http://127.0.0.1:PORT, or only the Host (http://localhost) for a socket
    api_key: str
    served_model_name: str
    socket_path: str | None = None  # the engine's Unix socket, when it listens on one


class RelayHooks:
    """Measurement and ledger callbacks. The defaults do nothing; subclass what you need.

    They run on the event loop once per request: keep them quick.
    """

    def on_start(self, request_id: str, engine_id: str, t: float) -> None:
        """A request was handed to an engine."""

    def on_first_token(self, request_id: str, t: float) -> None:
        """The first bytes of the answer reached the relay."""

    def on_end(
        self, request_id: str, engine_id: str, t: float, usage: protocol.Usage | None, ok: bool
    ) -> None:
        """A request finished; `ok` is False for errors, cancels and engine failures."""


def engine_http_client() -> LoopbackClient:
    """The relay's client to its engines: loopback only, no read timeout (deadlines are the
    relay's), no cap on concurrent streams, and O(1) work per request start and end (httpx's
    per-chunk and pool costs capped the relay at a third of its capacity; `bench/README.md`)."""
    return LoopbackClient()


class StreamFilter:
    """The engine's bytes → UTF-8 text to relay, picking up `usage` on the way.

    For an event stream it relays whole SSE events only (a blank line is ASCII, so a multi-byte
    character split across network reads is always joined first) and, when the relay asked for usage on the caller's behalf,
    drops the usage-only chunk (`"choices": []`) from what is relayed.
    """

    def __init__(self, *, events: bool, strip_usage: bool) -> None:
        self._events = events
        self._strip_usage = strip_usage
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._held = b""
        self.usage: protocol.Usage | None = None

    def feed(self, data: bytes) -> str:
        if not self._events:
            return self._decoder.decode(data)
        if self._held:
            data = self._held + data
            self._held = b""
        elif data.endswith(b"\n\n") and _USAGE_KEY not in data:
            return data.decode("utf-8", "replace")  # the common case: whole events, no usage
        end = _end_of_last_event(data)
        if end == 0 and len(data) <= _MAX_HELD_BYTES:
            self._held = data
            return ""
        if end == 0:
            end = _utf8_safe_end(data)
        complete, self._held = data[:end], data[end:]
        return self._read_usage(complete).decode("utf-8", "replace")

    def finish(self) -> str:
        rest, self._held = self._held, b""
        if self._events:
            return self._read_usage(rest).decode("utf-8", "replace")
        return self._decoder.decode(b"", final=True)

    def read_json_usage(self, body: bytes) -> None:
        """Usage of a whole (non-streamed) JSON answer."""
        if _USAGE_KEY not in body:
            return
        try:
            document = json.loads(body)
        except ValueError:
            return
        if isinstance(document, dict):
            self._remember_usage(document.get("usage"))

    def _read_usage(self, block: bytes) -> bytes:
        if _USAGE_KEY not in block:
            return block
        parts = _EVENT_SEPARATOR.split(block)
        kept: list[bytes] = []
        for event, separator in zip(parts[0::2], parts[1::2] + [b""]):
            if _USAGE_KEY in event and self._is_usage_only(event):
                continue
            kept.append(event + separator)
        return b"".join(kept)

    def _is_usage_only(self, event: bytes) -> bool:
        """Reads the event's usage; True when the event should be left out of the relay."""
        payload = b"\n".join(
            line[5:].removeprefix(b" ") for line in event.splitlines() if line.startswith(b"data:")
        )
        try:
            document = json.loads(payload)
        except ValueError:
            return False
        if not isinstance(document, dict):
            return False
        self._remember_usage(document.get("usage"))
        return self._strip_usage and document.get("choices") == [] and document.get("usage") is not None

    def _remember_usage(self, usage: Any) -> None:
        if not isinstance(usage, dict):
            return
        try:
            self.usage = protocol.Usage.model_validate(usage)
        except ValidationError:
            log.debug("the engine's usage %r does not fit the protocol; ignored", usage)


def _end_of_last_event(data: bytes) -> int:
    """Index just past the last blank line (`\\n\\n` or `\\r\\n\\r\\n`); 0 when there is none."""
    lf = data.rfind(b"\n\n")
    crlf = data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


def _utf8_safe_end(data: bytes) -> int:
    """The longest prefix of `data` that does not end inside a multi-byte character."""
    end = len(data)
    start = end
    while start > 0 and end - start < 4 and data[start - 1] & 0xC0 == 0x80:
        start -= 1
    if start == 0 or data[start - 1] < 0x80:
        return end
    lead = data[start - 1]
    needed = 2 if lead >= 0xC0 and lead < 0xE0 else 3 if lead < 0xF0 else 4
    return end if end - (start - 1) >= needed else start - 1


class _CoordinatorGone(Exception):
    """The connection the request came on is closed: stop, and send nothing more."""


class _Outbox:
    """One response's bytes on their way to the socket.

    The engine's reads are only queued on the hot path; a separate task sends. Whatever piles up
    while it waits for the socket is filtered, decoded and sent as one frame, in order, so a busy
    socket means fewer, larger frames and the per-byte work is done in bulk.
    """

    def __init__(self, request_id: str, send: Send, filter_: StreamFilter) -> None:
        self._request_id = request_id
        self._send = send
        self._filter = filter_
        self._parts: list[bytes] = []
        self._wake = asyncio.Event()
        self._closing = False
        self.gone = False
        self._task = asyncio.create_task(self._run(), name=f"relay-outbox-{request_id}")

    def put(self, data: bytes) -> None:
        self._parts.append(data)
        self._wake.set()

    async def close(self) -> bool:
        """Sends what is left; False when the coordinator is gone."""
        self._closing = True
        self._wake.set()
        await self._task
        return not self.gone

    def abort(self) -> None:
        self._task.cancel()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._parts:
                data = b"".join(self._parts)
                self._parts.clear()
                if not await self._deliver(self._filter.feed(data)):
                    return
            if self._closing and not self._parts:
                await self._deliver(self._filter.finish())
                return

    async def _deliver(self, text: str) -> bool:
        for start in range(0, len(text), _FRAME_CHARS):
            piece = protocol.ResponseChunk(id=self._request_id, data=text[start : start + _FRAME_CHARS])
            if not await self._send(piece):
                self.gone = True
                return False
        return True


class _Job:
    """One accepted request, from its arrival to its terminal message."""

    __slots__ = ("request", "send", "silent", "stop", "target", "task")

    def __init__(self, request: protocol.Request, send: Send, target: EngineTarget) -> None:
        self.request = request
        self.send = send
        self.target = target
        self.task: asyncio.Task[None] | None = None
        self.stop: protocol.ResponseError | None = None  # why it was stopped from outside
        self.silent = False  # the coordinator is gone: send nothing


class Relay:
    """Forwards `request` frames to the least-loaded ready engine and streams the answers back."""

    def __init__(
        self,
        send: Send,
        ready_targets: Callable[[], Sequence[EngineTarget]],
        gate: Callable[[], GateCode | None],
        *,
        http: LoopbackClient,
        hooks: RelayHooks | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._send = send
        self._ready_targets = ready_targets
        self._gate = gate
        self._http = http
        self._hooks = hooks or RelayHooks()
        self._clock = clock
        self._jobs: dict[str, _Job] = {}
        self._by_engine: dict[str, int] = {}
        self._refusing: GateCode | None = None
        self._replies: set[asyncio.Task[None]] = set()

    @property
    def in_flight(self) -> int:
        return len(self._jobs)

    def is_serving(self, request_id: str) -> bool:
        """True while `request_id` was accepted and has not reached its terminal message."""
        return request_id in self._jobs

    def in_flight_by_engine(self) -> dict[str, int]:
        return {engine: n for engine, n in self._by_engine.items() if n}

    def handle(self, request: protocol.Request, send: Send | None = None) -> asyncio.Task[None]:
        """Starts serving `request`; `send` (default: the relay's) should be bound to the
        connection the request came on, so that its answer never leaks onto a later one."""
        send = send or self._send
        refusal = self._refusal(request)
        if refusal is not None:
            return self._reply(send, refusal)
        if request.id in self._jobs:
            return self._reply(send, protocol.Error(
                code="duplicate_request", message=f"request {request.id!r} is already in flight", ref=request.id
            ))
        target = min(self._ready_targets(), key=lambda t: self._by_engine.get(t.engine_id, 0))
        job = _Job(request, send, target)
        self._jobs[request.id] = job
        self._by_engine[target.engine_id] = self._by_engine.get(target.engine_id, 0) + 1
        job.task = asyncio.create_task(self._serve(job), name=f"relay-{request.id}")
        job.task.add_done_callback(lambda _task: self._settle_unstarted(job))
        return job.task

    def _settle_unstarted(self, job: _Job) -> None:
        """A task cancelled before its first step never ran `_serve`'s `finally`: settle it here,
        so even a `cancel` right behind its `request` gets exactly one terminal message."""
        if self._jobs.get(job.request.id) is not job:
            return
        self._forget(job)
        self._report_end(job.request.id, job.target.engine_id, None, False)
        if job.stop is not None and not job.silent:
            self._reply(job.send, job.stop)

    def _reply(self, send: Send, message: BaseModel) -> asyncio.Task[None]:
        """Sends a one-frame answer in its own task, held until it is done."""

        async def reply() -> None:
            await send(message)

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
        problem = _unrelayable(request.method, request.path) or media_by_url(request.body)
        if problem is not None:
            return protocol.ResponseError(id=request.id, status=400, code="bad_request", message=problem)
        code = self._refusing or self._gate()
        if code is None and not self._ready_targets():
            code = "not_ready"
        if code is not None:
            return protocol.ResponseError(id=request.id, status=503, code=code, message=_GATE_MESSAGES[code])
        return None

    async def _serve(self, job: _Job) -> None:
        request, engine_id = job.request, job.target.engine_id
        terminal: BaseModel | None = None
        usage: protocol.Usage | None = None
        ok = False
        try:
            self._hooks.on_start(request.id, engine_id, self._clock())
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
            self._report_end(request.id, engine_id, usage, ok)
        if terminal is not None and not job.silent:
            await job.send(terminal)

    async def _exchange(self, job: _Job) -> tuple[protocol.Usage | None, int]:
        request, target = job.request, job.target
        content, strip_usage = engine_body(request.body, target.served_model_name)
        upstream = self._http.build_request(
            request.method, target.base_url.rstrip("/") + request.path,
            content=content, headers=_engine_headers(target.api_key, content is not None),
            socket_path=target.socket_path,
        )
        response: Response | None = None
        try:
            async with asyncio.timeout(request.deadline_s):
                response = await self._http.send(upstream, stream=True)
                streamed = _asks_stream(request.body) and _is_event_stream(response)
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
        request_id = job.request.id
        outbox = _Outbox(request_id, job.send, filter_)
        put = outbox.put
        first = True
        try:
            async for raw in response.aiter_raw():
                if first:
                    self._hooks.on_first_token(request_id, self._clock())
                    first = False
                put(raw)
                if outbox.gone:
                    raise _CoordinatorGone
            delivered = await outbox.close()
        except LoopbackHTTPError:
            await outbox.close()  # what the engine did send still goes out, before the 502
            raise
        finally:
            outbox.abort()
        if not delivered:
            raise _CoordinatorGone

    async def _send_whole(self, job: _Job, body: bytes, filter_: StreamFilter) -> None:
        if body:
            self._hooks.on_first_token(job.request.id, self._clock())
        text = filter_.feed(body) + filter_.finish()
        filter_.read_json_usage(body)
        for start in range(0, len(text), _FRAME_CHARS):
            piece = text[start : start + _FRAME_CHARS]
            await _deliver(job, protocol.ResponseChunk(id=job.request.id, data=piece))

    def _forget(self, job: _Job) -> None:
        self._jobs.pop(job.request.id, None)
        self._by_engine[job.target.engine_id] -= 1

    def _report_end(self, request_id: str, engine_id: str, usage: protocol.Usage | None, ok: bool) -> None:
        try:
            self._hooks.on_end(request_id, engine_id, self._clock(), usage, ok)
        except Exception:
            log.exception("a relay hook failed at the end of request %s", request_id)


async def _deliver(job: _Job, message: BaseModel) -> None:
    if not await job.send(message):
        raise _CoordinatorGone


def _unrelayable(method: str, path: str) -> str | None:
    """Why this request may not reach the engine, or None."""
    if method not in ("GET", "POST"):
        return f"only GET and POST are relayed, not {method!r}"
    segments = unquote(path.split("?", 1)[0]).split("/")
    if not _PATH.match(path) or ".." in segments or any("\\" in s for s in segments):
        return f"only paths under /v1/ are relayed, not {path!r}"
    return None


def media_by_url(body: Any) -> str | None:
    """Why `body` would make the engine fetch something, or None (pure).

    Anywhere in the body (`messages[*].content[*]`, a responses `input`, an Anthropic `source`,
    a rerank document): the string value of a URL key must be a `data:` URL, and no string inside
    a media object (`input_audio`, `file`) may be a URL. Anything nested deeper than
    `MAX_BODY_DEPTH` is refused unread."""
    stack: list[tuple[Any, str, str | None, bool, int]] = [(body, "body", None, False, 0)]
    while stack:
        value, where, key, in_media, depth = stack.pop()
        if depth > MAX_BODY_DEPTH:
            return f"the request body is nested more than {MAX_BODY_DEPTH} levels deep"
        if isinstance(value, dict):
            stack.extend((v, f"{where}.{k}", k, in_media or k in _MEDIA_OBJECTS, depth + 1) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, f"{where}[{i}]", None, in_media, depth + 1) for i, v in enumerate(value))
        elif isinstance(value, str) and _fetched(value, key in _URL_KEYS, in_media):
            return (f"{where[:160]} gives media by URL; this node never fetches from the network for a request: "
                    "send the media inline as a data: URL (data:image/png;base64,…)")
    return None


def _fetched(text: str, url_key: bool, in_media: bool) -> bool:
    """A string the engine would fetch: a URL key's value that is not a `data:` URL, or a URL
    (`scheme://…`) inside a media object."""
    stripped = text.strip()
    if stripped[:5].lower() == "data:":
        return False
    return url_key or (in_media and _URL_SCHEME.match(stripped) is not None and "://" in stripped)


def _asks_stream(body: Any) -> bool:
    return isinstance(body, dict) and body.get("stream") is True


def _is_event_stream(response: Response) -> bool:
    content_type: str = response.headers.get("content-type", "")
    return content_type.startswith("text/event-stream")


def engine_body(body: Any, served_model_name: str) -> tuple[bytes | None, bool]:
    """The body sent to the engine, and whether the relay added `include_usage` (so that the
    usage-only chunk must be left out of what the caller gets)."""
    if body is None:
        return None, False
    if not isinstance(body, dict):
        return json.dumps(body, ensure_ascii=False).encode("utf-8"), False
    body = dict(body)
    body["model"] = served_model_name
    strip_usage = False
    if body.get("stream") is True:
        options = body.get("stream_options")
        options = dict(options) if isinstance(options, dict) else {}
        if options.get("include_usage") is not True:
            options["include_usage"] = True
            body["stream_options"] = options
            strip_usage = True
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8"), strip_usage


def _engine_headers(api_key: str, has_body: bool) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {api_key}", "Accept-Encoding": "identity"}
    if has_body:
        headers["Content-Type"] = "application/json"
    return headers
