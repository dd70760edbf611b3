"""The reference coordinator: a real websockets server on 127.0.0.1 that speaks protocol 1.

Used by the tests and by `--coordinator local`, the embedded default a newcomer gets without a
network account. It checks the Bearer token, answers `hello` with `welcome` (and the assignment
it was given), records every message the node sends, can send the node anything (or close it
with any code), and offers an OpenAI-compatible HTTP endpoint on 127.0.0.1 that turns each HTTP
request into a `request` frame and streams the `response.*` frames back, so a person can `curl`
their own node. The HTTP side is stdlib asyncio streams: HTTP/1.1, keep-alive, chunked answers.
It answers programs on this computer only: a request addressed to another host name (DNS
rebinding) or sent by a web page from another origin is refused before it reaches the node.
"""

from __future__ import annotations

import asyncio
import http
import itertools
import json
import logging
import re
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Self

from pydantic import BaseModel
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from worker import protocol
from worker.link import WEBSOCKET_MAX_SIZE
from worker.provision.sources import BadSource, parse_source

log = logging.getLogger(__name__)

PROVIDER_PATH = "/v1/provider"
DEFAULT_DEADLINE_S = 300.0
_MAX_HTTP_BODY = protocol.MAX_FRAME_BYTES - 64 * 1024  # what still fits one `request` frame
_TERMINAL = (protocol.ResponseEnd, protocol.ResponseError)
_RESPONSES = (protocol.ResponseHead, protocol.ResponseChunk, protocol.ResponseEnd, protocol.ResponseError)
_LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
_LOOPBACK_ORIGIN = re.compile(r"https?://(?:127\.0\.0\.1|localhost|\[::1\])(?::([0-9]{1,5}))?")
_SINGLE_HEADERS = ("host", "origin")  # a request that repeats one could show each check a different value


class NoNode(RuntimeError):
    """No node is connected to this coordinator."""


@dataclass(frozen=True)
class Collected:
    """A whole relayed answer, as the coordinator received it."""

    head: protocol.ResponseHead | None
    data: str
    chunks: int
    end: protocol.ResponseEnd | None
    error: protocol.ResponseError | None


class Exchange:
    """One `request` sent to the node, and its `response.*` frames as they arrive."""

    def __init__(self, request: protocol.Request) -> None:
        self.request = request
        self.queue: asyncio.Queue[BaseModel] = asyncio.Queue()

    @property
    def id(self) -> str:
        return self.request.id

    async def frames(self) -> AsyncIterator[BaseModel]:
        """Every frame of the answer, the terminal one last."""
        while True:
            frame = await self.queue.get()
            yield frame
            if isinstance(frame, _TERMINAL):
                return

    async def collect(self, timeout: float = 10.0) -> Collected:
        head, parts, end, error = None, [], None, None
        async with asyncio.timeout(timeout):
            async for frame in self.frames():
                if isinstance(frame, protocol.ResponseHead):
                    head = frame
                elif isinstance(frame, protocol.ResponseChunk):
                    parts.append(frame.data)
                elif isinstance(frame, protocol.ResponseEnd):
                    end = frame
                elif isinstance(frame, protocol.ResponseError):
                    error = frame
        return Collected(head, "".join(parts), len(parts), end, error)


class ReferenceCoordinator:
    """A coordinator for one node. Loop-bound; `await start()` before use, `await stop()` after."""

    def __init__(
        self,
        *,
        token: str | None = None,
        port: int = 0,
        http_port: int | None = None,
        heartbeat_s: float = 10.0,
        price: protocol.Price | None = None,
        assign: protocol.Assign | None = None,
        hello_timeout_s: float = 10.0,
        ping_interval: float | None = 20.0,
        record: bool = True,
        close_timeout: float = 2.0,
    ) -> None:
        self.token = token  # None: any token (or none) is accepted
        self.assign = assign  # sent after welcome to every node that connects
        self.reject_with: int | None = None  # close every new connection at once with this code
        self.received: list[Any] = []  # every message from the node, parsed (Unknown included)
        self._record = record  # False for long runs (local mode, benchmarks): only hellos are kept
        self.bad_frames: list[str] = []  # why frames from the node were refused
        self.handshake_headers: list[dict[str, str]] = []
        self.hellos: list[protocol.Hello] = []
        self._port = port
        self._http_port = http_port
        self._heartbeat_s = heartbeat_s
        self._price = price or protocol.Price()
        self._hello_timeout_s = hello_timeout_s
        self._ping_interval = ping_interval
        self._close_timeout = close_timeout
        self._server: Server | None = None
        self._http_server: asyncio.Server | None = None
        self._node: ServerConnection | None = None
        self._exchanges: dict[str, Exchange] = {}
        self._ids = itertools.count(1)
        self._arrived = asyncio.Condition()
        self._background: set[asyncio.Task[None]] = set()

    # --- life ------------------------------------------------------------------------------

    async def start(self) -> Self:
        self._server = await serve(
            self._serve_node, "127.0.0.1", self._port,
            max_size=WEBSOCKET_MAX_SIZE, ping_interval=self._ping_interval, close_timeout=self._close_timeout,
        )
        self._port = self._server.sockets[0].getsockname()[1]
        if self._http_port is not None and self._http_server is None:
            self._http_server = await asyncio.start_server(self._serve_http, "127.0.0.1", self._http_port)
            self._http_port = self._http_server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        """Stops the websocket side (nodes see close code 1001); the HTTP side with it."""
        await self._stop_websocket()
        if self._http_server is not None:
            self._http_server.close()
            await self._http_server.wait_closed()
            self._http_server = None

    async def restart(self) -> None:
        """Stops and starts again on the same port, as a coordinator that was redeployed."""
        await self._stop_websocket()
        await self.start()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _stop_websocket(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self._port}{PROVIDER_PATH}"

    @property
    def http_url(self) -> str:
        """The OpenAI-compatible base URL (ends in /v1)."""
        if self._http_server is None:
            raise RuntimeError("the HTTP endpoint is off; create the coordinator with http_port=0")
        return f"http://127.0.0.1:{self._http_port}/v1"

    @property
    def node_connected(self) -> bool:
        return self._node is not None

    # --- talking to the node -----------------------------------------------------------------

    async def send(self, message: BaseModel) -> None:
        await self.send_raw(protocol.encode(message))

    async def send_raw(self, frame: str | bytes) -> None:
        if self._node is None:
            raise NoNode("no node is connected")
        await self._node.send(frame)

    async def close_node(self, code: int, reason: str = "") -> None:
        """Closes the node's connection with a close code (4401, 4403, 4409, 4426, …)."""
        if self._node is not None:
            await self._node.close(code, reason)

    def drop_node(self) -> None:
        """Cuts the node's TCP connection with no close frame, as a network failure would."""
        if self._node is not None:
            self._node.transport.abort()

    def freeze_node(self) -> None:
        """Stops reading from the node (pings go unanswered), as a hung coordinator would."""
        if self._node is not None:
            self._node.transport.pause_reading()

    async def request(self, body: Any, *, path: str = "/v1/chat/completions", method: str = "POST",
                      deadline_s: float = DEFAULT_DEADLINE_S, request_id: str | None = None) -> Exchange:
        """Sends one `request` frame; the answer arrives on the returned `Exchange`."""
        request = protocol.Request(id=request_id or f"r-{next(self._ids)}", method=method, path=path,
                                   body=body, deadline_s=deadline_s)
        exchange = Exchange(request)
        self._exchanges[request.id] = exchange
        try:
            await self.send(request)
        except (NoNode, ConnectionClosed):
            self._exchanges.pop(request.id, None)
            raise
        return exchange

    async def cancel(self, request_id: str) -> None:
        await self.send(protocol.Cancel(id=request_id))

    async def wait_for(self, match: str | Callable[[Any], bool], *, after: int = 0,
                       timeout: float = 5.0) -> Any:
        """The first message from the node at index `after` or later that matches (a type name
        or a predicate); waits for it."""
        test = _type_is(match) if isinstance(match, str) else match
        async with asyncio.timeout(timeout), self._arrived:
            while True:
                for message in self.received[after:]:
                    if test(message):
                        return message
                after = len(self.received)
                await self._arrived.wait()

    async def wait_for_connections(self, count: int, timeout: float = 5.0) -> protocol.Hello:
        """Waits until `count` nodes have said hello in all; returns the latest hello."""
        async with asyncio.timeout(timeout), self._arrived:
            await self._arrived.wait_for(lambda: len(self.hellos) >= count)
        return self.hellos[-1]

    # --- the websocket side ----------------------------------------------------------------

    async def _serve_node(self, ws: ServerConnection) -> None:
        assert ws.request is not None
        self.handshake_headers.append({k: v for k, v in ws.request.headers.raw_items()})
        if ws.request.path != PROVIDER_PATH:
            await ws.close(protocol.CLOSE_PROTOCOL_ERROR, f"connect to {PROVIDER_PATH}")
            return
        if self.reject_with is not None:
            await ws.close(self.reject_with, "rejected")
            return
        if self.token is not None and ws.request.headers.get("Authorization") != f"Bearer {self.token}":
            await ws.close(protocol.CLOSE_UNAUTHORIZED, "token missing or wrong")
            return
        try:
            hello = await self._read_hello(ws)
            if hello is None:
                return
            await self._take_over(ws, hello)
            async for frame in ws:
                await self._receive(ws, frame)
        except ConnectionClosed:
            pass
        finally:
            if self._node is ws:
                self._node = None
                self._fail_exchanges("the node's connection was lost before the answer was complete")

    async def _read_hello(self, ws: ServerConnection) -> protocol.Hello | None:
        try:
            async with asyncio.timeout(self._hello_timeout_s):
                hello = protocol.parse_from_node(await ws.recv())
        except (TimeoutError, ConnectionClosed):
            await ws.close(protocol.CLOSE_PROTOCOL_ERROR, "no hello")
            return None
        except protocol.BadMessage as exc:
            await ws.close(protocol.CLOSE_PROTOCOL_ERROR, f"bad hello: {exc}"[:120])
            return None
        if not isinstance(hello, protocol.Hello):
            await ws.close(protocol.CLOSE_PROTOCOL_ERROR, "the first message must be hello")
            return None
        if hello.protocol != protocol.PROTOCOL_VERSION:
            await ws.close(protocol.CLOSE_UPGRADE_REQUIRED, f"protocol {hello.protocol} is not supported")
            return None
        return hello

    async def _take_over(self, ws: ServerConnection, hello: protocol.Hello) -> None:
        previous, self._node = self._node, ws
        if previous is not None:
            self._fail_exchanges("another connection took over")
            # in the background: a hung old connection must not delay the new one's welcome
            closing = asyncio.create_task(
                previous.close(protocol.CLOSE_TAKEN_OVER, "another connection with this node id took over"))
            self._background.add(closing)
            closing.add_done_callback(self._background.discard)
        await ws.send(protocol.encode(protocol.Welcome(
            node_id=hello.node_id, heartbeat_s=self._heartbeat_s, price=self._price)))
        if self.assign is not None:
            await ws.send(protocol.encode(self.assign))
        async with self._arrived:
            self.hellos.append(hello)
            self.received.append(hello)
            self._arrived.notify_all()

    async def _receive(self, ws: ServerConnection, frame: str | bytes) -> None:
        try:
            message = protocol.parse_from_node(frame)
        except protocol.BadMessage as exc:
            self.bad_frames.append(str(exc))
            await ws.send(protocol.encode(exc.reply()))
            return
        if isinstance(message, _RESPONSES):
            self._route(message)
        if not self._record:
            return
        async with self._arrived:
            self.received.append(message)
            self._arrived.notify_all()

    def _route(self, message: Any) -> None:
        exchange = self._exchanges.get(message.id)
        if exchange is None:
            log.warning("the node answered request %s, which is not pending", message.id)
            return
        exchange.queue.put_nowait(message)
        if isinstance(message, _TERMINAL):
            del self._exchanges[message.id]

    def _fail_exchanges(self, why: str) -> None:
        for exchange in self._exchanges.values():
            exchange.queue.put_nowait(protocol.ResponseError(id=exchange.id, status=502, code="node_gone", message=why))
        self._exchanges.clear()

    # --- the OpenAI-compatible HTTP side -------------------------------------------------------

    async def _serve_http(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        port: int = writer.get_extra_info("sockname")[1]
        try:
            while True:
                request = await _read_http_request(reader, port)
                if request is None or not await self._answer_http(request, reader, writer):
                    break
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        except _HttpRefusal as refusal:
            await _write_json(writer, refusal.status, _openai_error(refusal.message, refusal.code), keep_alive=False)
        finally:
            writer.close()

    async def _answer_http(self, request: _HttpRequest, reader: asyncio.StreamReader,
                           writer: asyncio.StreamWriter) -> bool:
        path = request.target.split("?", 1)[0]
        if request.method == "GET" and path == "/v1/models":
            await _write_json(writer, 200, self._models(), keep_alive=request.keep_alive)
            return request.keep_alive
        if request.method not in ("GET", "POST") or not path.startswith("/v1/"):
            await _write_json(writer, 404, _openai_error(f"no route {request.method} {path}", "not_found"),
                              keep_alive=request.keep_alive)
            return request.keep_alive
        try:
            body = json.loads(request.body) if request.body else None
        except ValueError as exc:
            await _write_json(writer, 400, _openai_error(f"the body is not JSON: {exc}", "bad_request"),
                              keep_alive=request.keep_alive)
            return request.keep_alive
        try:
            exchange = await self.request(body, path=request.target, method=request.method,
                                          deadline_s=request.deadline_s)
        except (NoNode, ConnectionClosed):
            await _write_json(writer, 503, _openai_error(
                "no node is connected to this coordinator; start one with `gpu-provider run`", "no_node"),
                keep_alive=request.keep_alive)
            return request.keep_alive
        return await _stream_to_http(exchange, reader, writer, request.keep_alive, self.cancel)

    def _models(self) -> dict[str, Any]:
        names = [self.assign.model.name] if self.assign is not None else []
        return {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "gpu-provider"} for n in names]}


def _type_is(name: str) -> Callable[[Any], bool]:
    def test(message: Any) -> bool:
        return getattr(message, "type", None) == name

    return test


@dataclass(frozen=True)
class _HttpRequest:
    method: str
    target: str
    headers: dict[str, str]
    body: bytes

    @property
    def keep_alive(self) -> bool:
        return self.headers.get("connection", "").lower() != "close"

    @property
    def deadline_s(self) -> float:
        """`X-Deadline-S` lets a caller shorten the default deadline."""
        try:
            value = float(self.headers.get("x-deadline-s", DEFAULT_DEADLINE_S))
        except ValueError:
            return DEFAULT_DEADLINE_S
        return value if 0 < value <= DEFAULT_DEADLINE_S else DEFAULT_DEADLINE_S


class _HttpRefusal(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


async def _read_http_request(reader: asyncio.StreamReader, port: int) -> _HttpRequest | None:
    """The next request on the connection; refuses one from another site, which never reaches the node."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    request_line, *lines = head.decode("latin-1").rstrip("\r\n").split("\r\n")
    parts = request_line.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise _HttpRefusal(400, "bad_request", "this endpoint speaks HTTP/1.1")
    pairs = [(k.strip().lower(), v.strip()) for k, v in (line.split(":", 1) for line in lines if ":" in line)]
    for name in _SINGLE_HEADERS:
        if sum(key == name for key, _ in pairs) > 1:
            raise _HttpRefusal(400, "bad_request", f"the request repeats its {name.title()} header; send it once")
    headers = dict(pairs)
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise _HttpRefusal(411, "length_required", "send the body with a Content-Length")
    try:
        length = int(headers.get("content-length", "0") or 0)
    except ValueError:
        raise _HttpRefusal(400, "bad_request", "Content-Length is not a number") from None
    if length > _MAX_HTTP_BODY:
        raise _HttpRefusal(413, "too_large", f"the body is over {_MAX_HTTP_BODY} bytes")
    body = await reader.readexactly(length) if length else b""
    _refuse_other_sites(headers, port)  # after the body: closing on unread bytes would reset the answer away
    return _HttpRequest(parts[0], parts[1], headers, body)


def host_problem(headers: Mapping[str, str], port: int) -> str | None:
    """Why the request was not addressed to this computer's endpoint; None when it was.

    A web page that rebinds its own name to 127.0.0.1 still sends that name as Host, so only
    the loopback names (with this server's port, when one is given) are accepted."""
    host = headers.get("host", "").strip().lower()
    if host in {form for name in _LOOPBACK_NAMES for form in (name, f"{name}:{port}")}:
        return None
    if not host:
        return f"the request has no Host header; send `Host: 127.0.0.1:{port}` (every HTTP/1.1 client does)"
    return (f"this endpoint only answers programs on this computer; the request was addressed to {_quoted(host)}, "
            f"not to 127.0.0.1, localhost or [::1] on port {port}, as a web page using DNS rebinding would do. "
            f"Programs on this computer use http://127.0.0.1:{port}/v1")


def origin_problem(headers: Mapping[str, str]) -> str | None:
    """Why the request came from a web page that may not use the endpoint; None when it did not.

    Browsers add Origin themselves, so a page cannot leave it out; programs send none. A page
    served from this computer (any loopback port) is itself a program here, so it may."""
    origin = headers.get("origin")
    if origin is None:
        return None
    match = _LOOPBACK_ORIGIN.fullmatch(origin.strip().lower())
    if match is not None and (match.group(1) is None or 0 < int(match.group(1)) < 65536):
        return None
    page = "a sandboxed page or a local file (Origin: null)" if origin.strip() == "null" \
        else f"the web page at {_quoted(origin.strip())}"
    return (f"this endpoint only answers programs on this computer; the request came from {page}, "
            "and only pages served from this computer (localhost) may use it")


def _refuse_other_sites(headers: Mapping[str, str], port: int) -> None:
    """Raises the refusal for a request from another site; no CORS header is ever granted."""
    problem = host_problem(headers, port)
    if problem is not None:
        missing = not headers.get("host", "").strip()
        raise _HttpRefusal(400 if missing else 403, "bad_request" if missing else "forbidden", problem)
    problem = origin_problem(headers)
    if problem is not None:
        raise _HttpRefusal(403, "forbidden", problem)


def _quoted(text: str) -> str:
    """A header's value fit for a message: quoted (control characters visible) and short."""
    return repr(text[:100])


async def _stream_to_http(exchange: Exchange, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                          keep_alive: bool, cancel: Callable[[str], Any]) -> bool:
    """Writes the node's answer as an HTTP response; cancels the request if the client leaves."""
    gone = asyncio.ensure_future(reader.read(1))
    outcome: bool | None = None
    try:
        outcome = await _relay_frames(exchange, gone, writer, keep_alive)
    except ConnectionError:
        outcome = None
    finally:
        gone.cancel()
        await asyncio.wait([gone])  # the reader is free again before the next request
    if outcome is None:
        try:
            await cancel(exchange.id)
        except (NoNode, ConnectionClosed):
            pass
    return bool(outcome) and gone.cancelled()  # anything read meanwhile (EOF, pipelining) ends it


async def _relay_frames(exchange: Exchange, gone: asyncio.Future[bytes], writer: asyncio.StreamWriter,
                        keep_alive: bool) -> bool | None:
    """Whether to keep the connection; None when the client left before the end."""
    head: protocol.ResponseHead | None = None
    while True:
        if gone.done():
            return None
        frame = exchange.queue.get_nowait() if not exchange.queue.empty() else await _next_or_gone(exchange, gone)
        if frame is None:
            return None
        if isinstance(frame, protocol.ResponseHead):
            head = frame
            writer.write(_status_line(frame.status) + b"Content-Type: %b\r\nTransfer-Encoding: chunked\r\n"
                         b"Cache-Control: no-cache\r\n\r\n" % (frame.content_type or "application/json").encode())
        elif isinstance(frame, protocol.ResponseChunk) and frame.data:
            data = frame.data.encode("utf-8")
            writer.write(b"%x\r\n%b\r\n" % (len(data), data))
        elif isinstance(frame, protocol.ResponseEnd):
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            return keep_alive
        elif isinstance(frame, protocol.ResponseError):
            return await _write_error(writer, frame, head, keep_alive)
        await writer.drain()


async def _next_or_gone(exchange: Exchange, gone: asyncio.Future[bytes]) -> BaseModel | None:
    """The next frame, or None when the HTTP client went away first."""
    getter = asyncio.ensure_future(exchange.queue.get())
    waiting: list[asyncio.Future[Any]] = [getter, gone]
    await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    if getter.done():
        return getter.result()
    getter.cancel()
    return None


async def _write_error(writer: asyncio.StreamWriter, error: protocol.ResponseError,
                       head: protocol.ResponseHead | None, keep_alive: bool) -> bool:
    document = _openai_error(error.message, error.code)
    if head is None:
        await _write_json(writer, error.status, document, keep_alive=keep_alive)
        return keep_alive
    if (head.content_type or "").startswith("text/event-stream"):
        event = b"data: " + json.dumps(document, ensure_ascii=False).encode("utf-8") + b"\n\n"
        writer.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(event), event))
        await writer.drain()
        return keep_alive
    return False  # a JSON body cut short: closing without the last chunk tells the client so


def _status_line(status: int) -> bytes:
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = "Client Closed Request" if status == 499 else "Status"
    return b"HTTP/1.1 %d %b\r\n" % (status, phrase.encode())


def _openai_error(message: str, code: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": code, "code": code}}


async def _write_json(writer: asyncio.StreamWriter, status: int, document: Any, *, keep_alive: bool) -> None:
    payload = json.dumps(document, ensure_ascii=False).encode("utf-8")
    connection = b"keep-alive" if keep_alive else b"close"
    writer.write(_status_line(status) + b"Content-Type: application/json\r\nContent-Length: %d\r\n"
                 b"Connection: %b\r\n\r\n%b" % (len(payload), connection, payload))
    await writer.drain()


# --- local mode ------------------------------------------------------------------------------

DEFAULT_LOCAL_MODEL = (
    "https://huggingface.co/Qwen/Qwen2.5-0.5B-Instruct-GGUF/resolve/main/qwen2.5-0.5b-instruct-q4_k_m.gguf"
    "#sha256=74a4da8c9fdbcd15bd1f6d01d621410d31c6fc00986f5eb687824e7b93d7a9db"
)
DEFAULT_LOCAL_MODEL_MIB = 470
LOCAL_ASSIGNMENT_ID = "local-1"
VLLM_RUNTIMES = frozenset({"native", "wsl2"})
_LLAMACPP_ARGS = ["--ctx-size", "4096"]
_LLAMACPP_TIERS = {"8000": ["--ctx-size", "8192"], "16000": ["--ctx-size", "16384"]}
_VLLM_ARGS = ["--max-model-len", "8192"]
_PARAMS = re.compile(r"(\d+(?:\.\d+)?)\s*[bB](?![a-zA-Z])")
_BYTES_PER_PARAM = (("q2", 0.35), ("q3", 0.45), ("q4", 0.6), ("q5", 0.7), ("q6", 0.82), ("q8", 1.07),
                    ("awq", 0.6), ("gptq", 0.6), ("w4a16", 0.6), ("int4", 0.6), ("fp8", 1.05), ("w8a8", 1.05))


class LocalModelError(ValueError):
    """The model given for local mode cannot be used; the message says why and what to do."""


class HasRuntime(Protocol):
    """What local mode needs to know of the machine (`hardware.Machine` has it)."""

    @property
    def runtime(self) -> str: ...


DEFAULT_OPENAI_PORT = 8090


class LocalCoordinator:
    """`--coordinator local`: the reference coordinator, assigning a model that suits this
    machine, with its OpenAI-compatible endpoint on 127.0.0.1 (port 8090 unless taken or given)."""

    def __init__(self, *, token: str, machine: HasRuntime, model: str | None = None,
                 openai_port: int | None = None, port: int = 0) -> None:
        self._token = token
        self._runtime = machine.runtime
        self._model = model
        self._openai_port = openai_port
        self._port = port
        self._coordinator: ReferenceCoordinator | None = None

    async def start(self) -> Self:
        """Builds the assignment (raises `LocalModelError` with what to do) and starts serving."""
        assign = await asyncio.to_thread(local_assignment, self._runtime, self._model)
        if self._openai_port is not None:
            self._coordinator = await self._start_on(assign, self._openai_port)
            return self
        try:
            self._coordinator = await self._start_on(assign, DEFAULT_OPENAI_PORT)
        except OSError as exc:
            log.warning("port %d is taken (%s); the OpenAI endpoint gets a free port instead", DEFAULT_OPENAI_PORT, exc)
            self._coordinator = await self._start_on(assign, 0)
        return self

    async def _start_on(self, assign: protocol.Assign, openai_port: int) -> ReferenceCoordinator:
        coordinator = ReferenceCoordinator(
            token=self._token, port=self._port, http_port=openai_port, assign=assign, record=False
        )
        try:
            return await coordinator.start()
        except OSError:
            await coordinator.stop()
            raise

    async def stop(self) -> None:
        if self._coordinator is not None:
            await self._coordinator.stop()

    @property
    def coordinator(self) -> ReferenceCoordinator:
        if self._coordinator is None:
            raise RuntimeError("start() the local coordinator first")
        return self._coordinator

    @property
    def assignment(self) -> protocol.Assign | None:
        return self.coordinator.assign

    @property
    def ws_url(self) -> str:
        return self.coordinator.url

    @property
    def openai_url(self) -> str:
        """The base URL an OpenAI client takes (`…/v1`)."""
        return self.coordinator.http_url


def local_assignment(runtime: str, model: str | None = None, *, weights_mib: int | None = None) -> protocol.Assign:
    """The `assign` local mode sends: llama.cpp for a GGUF file (path or URL), vLLM for a model
    folder or Hugging Face repo. A local path is measured on disk (a few stat calls: call this
    from a thread). A URL carries its hash as `URL#sha256=HEX`: downloads are always verified."""
    text = model or DEFAULT_LOCAL_MODEL
    text, sha256 = _split_hash(text)
    try:
        source = parse_source(text)
    except BadSource as exc:
        raise LocalModelError(str(exc)) from None
    gguf = source.label.lower().endswith(".gguf")
    if source.kind == "hf" and "gguf" in source.value.lower():
        raise LocalModelError(
            f"{text!r} is a repository of GGUF files; name one file instead: "
            "https://huggingface.co/ORG/REPO/resolve/main/FILE.gguf#sha256=HASH, or a downloaded file's path")
    if source.kind == "https" and sha256 is None:
        raise LocalModelError(
            f"{text!r} is a download without its sha256; add it as {text}#sha256=HASH (the hash the model's "
            "page lists), or download the file and give its path")
    if not gguf and runtime not in VLLM_RUNTIMES:
        raise LocalModelError(
            f"this machine runs llama.cpp only (runtime {runtime!r}), which needs a .gguf file; "
            f"{text!r} is not one. Give a GGUF file's path or https:// URL")
    size = weights_mib or _weights_mib(source.kind, source.value, model is None)
    name = re.sub(r"\.gguf$", "", source.label, flags=re.IGNORECASE).lower()
    if gguf:
        spec = protocol.EngineModel(source=source.value, sha256=sha256, weights_mib=size, base_args=_LLAMACPP_ARGS,
                                    tiers=_LLAMACPP_TIERS)
        return protocol.Assign(assignment_id=LOCAL_ASSIGNMENT_ID, model=protocol.ModelSpec(name=name, llamacpp=spec))
    spec = protocol.EngineModel(source=source.value, weights_mib=size, base_args=_VLLM_ARGS)
    return protocol.Assign(assignment_id=LOCAL_ASSIGNMENT_ID, model=protocol.ModelSpec(name=name, vllm=spec))


def _split_hash(text: str) -> tuple[str, str | None]:
    """`URL#sha256=HEX` → (URL, hex); anything else unchanged."""
    base, marker, digest = text.partition("#sha256=")
    if not marker:
        return text, None
    if not re.fullmatch(r"[0-9a-fA-F]{64}", digest):
        raise LocalModelError(f"{digest!r} after #sha256= is not a sha256 (64 hexadecimal digits)")
    return base, digest.lower()


def _weights_mib(kind: str, value: str, is_default: bool) -> int:
    if is_default:
        return DEFAULT_LOCAL_MODEL_MIB
    if kind == "local":
        return _measured_mib(Path(value))
    return _estimated_mib(value)


def _measured_mib(path: Path) -> int:
    if path.is_file():
        total = path.stat().st_size
    elif path.is_dir():
        total = sum(p.stat().st_size for p in path.iterdir()
                    if p.is_file() and p.suffix in (".safetensors", ".bin", ".pt", ".gguf"))
    else:
        raise LocalModelError(f"{str(path)!r} does not exist; give the path of a downloaded model")
    if total == 0:
        raise LocalModelError(f"{str(path)!r} holds no model weights (.safetensors, .bin or .gguf)")
    return max(1, round(total / 2**20))


def _estimated_mib(name: str) -> int:
    """A size from the name (`…-0.5B-…-Q4_K_M`): the parameter count times the bytes a weight takes."""
    match = _PARAMS.search(name.rsplit("/", 1)[-1])
    if match is None:
        raise LocalModelError(
            f"can't tell how large {name!r} is from its name; download it and give its path instead")
    lowered = name.lower()
    per_param = next((b for tag, b in _BYTES_PER_PARAM if tag in lowered), 0.6 if ".gguf" in lowered else 2.0)
    return max(1, round(float(match.group(1)) * 1e9 * per_param / 2**20))
