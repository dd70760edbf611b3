"""A lean HTTP/1.1 client for the engines this app started (on a Unix socket, or on 127.0.0.1):
the relay's hot path.

Why not httpx: httpx/h11 turn every HTTP chunk (one SSE event, one token) into its own event
(~40–60 µs each), and httpcore's pool scans every connection on each request start and end,
which blocked the loop for ~18 ms per request at 256 streams (`bench/README.md`). Here each
connection is an `asyncio.Protocol`: a socket read's chunks are decoded in one pass in the read's
own callback and handed on from there (`Response.stream_to`: no task or future per read, which
was most of the relay's cost per token), or kept for `aiter_raw`; idle connections wait in a
deque: O(1) to take and to give back.

Scope, on purpose: plain `http://` to `127.0.0.1` or `localhost` only (anything else is a
`ValueError`: this is not a general-purpose client), or to the Unix socket a request names (its
URL then gives only the Host header and the path), HTTP/1.1 with keep-alive, response bodies
framed by `Content-Length`, `Transfer-Encoding: chunked` or the connection's end. The calls are
the slice of httpx's API the relay makes (and `stream_to`), so tests can compare it with httpx directly.
"""

from __future__ import annotations

import asyncio
import json as jsonlib
import re
import socket
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from types import TracebackType
from typing import Any, Literal, Self, cast
from urllib.parse import urlsplit

CONNECT_TIMEOUT_S = 5.0
UNIX_BACKLOG_RETRY_S = 0.001  # first wait when an engine's Unix socket has its backlog full; doubles
UNIX_BACKLOG_RETRY_MAX_S = 0.05
MAX_IDLE_PER_ENGINE = 256  # the relay's busiest engines serve a few hundred streams at once
# vLLM (uvicorn) and llama-server both close a keep-alive connection after 5 s idle; one idle
# this long is closed here instead, so a request is never written onto a connection the engine
# is closing at that moment.
IDLE_LIMIT_S = 4.0
READ_SIZE = 1 << 18  # the most one socket read takes
_STREAM_LIMIT = 1 << 20  # the longest response head or chunk-size line accepted
KEEP_LIMIT = 1 << 20  # body bytes kept for a slow `aiter_raw` reader before reading pauses
_LOOPBACK_HOSTS = {"127.0.0.1": "127.0.0.1", "localhost": "127.0.0.1"}
_NO_BODY_STATUSES = frozenset({204, 304})
_UNSAFE = re.compile(r"[\r\n\0]")

Address = tuple[str, int] | str  # (host, port) on loopback, or a Unix socket's path
Sink = Callable[[bytes], None]


class LoopbackHTTPError(OSError):
    """The engine could not be reached, or broke off or garbled its answer; the relay's 502."""


class Headers(dict[str, str]):
    """Response headers under lower-cased names, looked up in any case (as with httpx)."""

    def get(self, name: str, default: Any = None) -> Any:
        return super().get(name.lower(), default)

    def __getitem__(self, name: str) -> str:
        return super().__getitem__(name.lower())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and super().__contains__(name.lower())


class Request:
    """One request, checked when built so that `send` cannot write a malformed one."""

    __slots__ = ("_head", "address", "content", "headers", "method", "url")

    def __init__(self, method: str, url: str, content: bytes | None, headers: Mapping[str, str],
                 socket_path: str | None = None) -> None:
        parts = urlsplit(url)
        host = parts.hostname or ""
        if parts.scheme != "http" or host not in _LOOPBACK_HOSTS:
            raise ValueError(f"the loopback client only talks to http://127.0.0.1 or http://localhost, not {url!r}")
        port = parts.port or 80
        self.method = method
        self.url = url
        self.content = content or b""
        self.headers = dict(headers)
        self.address: Address = socket_path if socket_path is not None else (_LOOPBACK_HOSTS[host], port)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self._head = _request_head(method, target, f"{host}:{port}", len(self.content), self.headers)

    def encoded(self) -> bytes:
        return self._head + self.content


def _request_head(method: str, target: str, host: str, length: int, headers: Mapping[str, str]) -> bytes:
    """The request line and headers; a line break smuggled into any of them is refused."""
    if _UNSAFE.search(method + target) or " " in method + target or any(
        _UNSAFE.search(name + value) for name, value in headers.items()
    ):
        raise ValueError("the method, URL or a header holds a line break; the request would be malformed")
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}", f"Content-Length: {length}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class _Connection(asyncio.BufferedProtocol):
    """One keep-alive socket to an engine, read by callbacks: no task wakes up per read.

    Reads land in a buffer the client's connections share (`recv_into`): a plain protocol is
    handed a fresh 256 KiB bytes object per read, which the allocator maps and unmaps each time
    (a quarter of the relay's CPU at an 8-GPU node's token rate went to that). The callback
    copies out what it read before it returns, so one buffer serves every connection. (Windows'
    proactor reads into each transport's own buffer and copies into this one in a synchronous
    call, so sharing holds there too.)

    The bytes of the answer in progress go to its `_Answer`; bytes with no answer in progress
    mean the connection is out of step, and it is closed.
    """

    def __init__(self, buffer: memoryview) -> None:
        self.transport: asyncio.Transport | None = None
        self.idle_since = 0.0
        self.lost = False
        self._answer: _Answer | None = None
        self._buffer = buffer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream transport (uvloop's is no subclass)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._buffer

    def buffer_updated(self, nbytes: int) -> None:
        data = bytes(self._buffer[:nbytes])
        if self._answer is None:
            self.abort()
        else:
            self._answer.feed(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self._answer is not None:
            self._answer.ended(exc)

    def start(self, request: bytes) -> _Answer:
        """Writes `request`; its answer is read from here on."""
        assert self.transport is not None
        self._answer = _Answer(self)
        self.transport.write(request)
        return self._answer

    def release(self) -> None:
        """The answer was read to its end: the connection is idle."""
        self._answer = None

    def usable(self, now: float) -> bool:
        return (now - self.idle_since < IDLE_LIMIT_S and not self.lost
                and self.transport is not None and not self.transport.is_closing())

    def pause(self, paused: bool) -> None:
        if self.transport is not None and not self.transport.is_closing():
            (self.transport.pause_reading if paused else self.transport.resume_reading)()

    def abort(self) -> None:
        """Resets the socket: an engine reading it sees the client go away and stops generating."""
        self.lost = True
        if self.transport is not None:
            self.transport.abort()


class _Answer:
    """One answer, parsed as its bytes arrive: the head, then the body with its framing removed,
    handed to a sink (`Response.stream_to`) or kept for `Response.aiter_raw`."""

    def __init__(self, connection: _Connection) -> None:
        self._connection = connection
        self._loop = asyncio.get_running_loop()
        self.head: asyncio.Future[tuple[int, Headers]] = self._loop.create_future()
        self._framing: Literal["head", "sized", "chunked", "until_closed"] = "head"
        self._held = b""  # a head, chunk or chunk-size line not yet whole
        self._remaining = 0  # of a sized body
        self.complete = False
        self.reusable = True
        self.error: BaseException | None = None
        self._sink: Sink | None = None
        self._done: asyncio.Future[None] | None = None
        self._parts: list[bytes] = []  # body bytes not yet taken by `chunks`
        self._kept = 0  # their size
        self._waiter: asyncio.Future[None] | None = None

    def feed(self, data: bytes) -> None:
        if self.complete or self.error is not None:
            self.reusable = False  # bytes past the body's end: the stream is out of step
            return
        try:
            if self._framing == "head":
                data = self._read_head(data)
            if data:
                self._read_body(data)
        except ValueError as exc:
            what = "garbled its answer" if self.head.done() else "sent no proper answer"
            self._fail(_engine_error(f"the engine {what}", exc))

    def ended(self, exc: Exception | None) -> None:
        """The connection closed."""
        if self.complete or self.error is not None:
            return
        if self._framing == "until_closed" and exc is None:
            self._finish()
            return
        if self._framing == "head":
            where = "before its answer's head was whole"
        elif self._framing == "sized":
            where = f"{self._remaining} bytes before the end of the body"
        else:
            where = "in the middle of a chunked body"
        self._fail(_engine_error("the engine broke off its answer", exc or EOFError(f"the connection closed {where}")))

    def _read_head(self, data: bytes) -> bytes:
        """Parses the head once it is whole; returns the bytes after it."""
        held = self._held + data if self._held else data
        end = held.find(b"\r\n\r\n")
        if end < 0:
            if len(held) > _STREAM_LIMIT:
                raise ValueError("the answer's head is too long")
            self._held = held
            return b""
        self._held = b""
        status, headers, keep_alive = _parse_head(held[:end])
        self.reusable = keep_alive
        length = headers.get("content-length")
        if status in _NO_BODY_STATUSES:
            self._framing, self._remaining = "sized", 0
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            self._framing = "chunked"
        elif length is not None:
            self._framing, self._remaining = "sized", int(length)
            if self._remaining < 0:
                raise ValueError(f"a negative Content-Length ({length})")
        else:
            self._framing, self.reusable = "until_closed", False
        if not self.head.done():  # else the request was given up on (a deadline) as the head came
            self.head.set_result((status, headers))
        if self._framing == "sized" and not self._remaining:
            self._finish()
        return held[end + 4 :]

    def _read_body(self, data: bytes) -> None:
        if self._framing == "chunked":
            held = self._held + data if self._held else data
            payload, used, complete = decode_chunks(held)
            self._held = held[used:]
            if payload:
                self._deliver(payload)
            if complete and self.error is None:
                self.reusable = self.reusable and not self._held
                self._finish()
        elif self._framing == "sized":
            if len(data) > self._remaining:
                self.reusable = False
                data = data[: self._remaining]
            self._remaining -= len(data)
            self._deliver(data)
            if not self._remaining and self.error is None:
                self._finish()
        else:
            self._deliver(data)

    def _deliver(self, data: bytes) -> None:
        if self._sink is not None:
            try:
                self._sink(data)
            except Exception as exc:  # the reader gave up: its reason ends the answer
                self._fail(exc)
            return
        self._parts.append(data)
        self._kept += len(data)
        if self._kept > KEEP_LIMIT:
            self._connection.pause(True)  # until `chunks` takes them
        self._wake()

    def _finish(self) -> None:
        self.complete = True
        if self._done is not None and not self._done.done():
            self._done.set_result(None)
        self._wake()

    def _fail(self, error: BaseException) -> None:
        self.error, self.reusable = error, False
        if not self.head.done():
            self.head.set_exception(error)
        if self._done is not None and not self._done.done():
            self._done.set_exception(error)
        self._wake()
        self._connection.abort()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive: whatever came since the last item, as one item."""
        while True:
            if self._parts:
                data = self._parts[0] if len(self._parts) == 1 else b"".join(self._parts)
                self._parts.clear()
                if self._kept > KEEP_LIMIT:
                    self._connection.pause(False)
                self._kept = 0
                yield data
            elif self.error is not None:
                raise self.error
            elif self.complete:
                return
            else:
                self._waiter = self._loop.create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None

    def stream_to(self, sink: Sink) -> asyncio.Future[None]:
        self._done = self._loop.create_future()
        parts, self._parts, self._kept = self._parts, [], 0
        self._connection.pause(False)
        self._sink = sink
        if parts:
            self._deliver(b"".join(parts))
        if self.error is not None and not self._done.done():
            self._done.set_exception(self.error)
        elif self.complete and not self._done.done():
            self._done.set_result(None)
        return self._done

class _IdlePool:
    """Idle connections to one engine: newest last, at most `limit`; every step O(1)."""

    def __init__(self, limit: int, clock: Callable[[], float]) -> None:
        self._limit = limit
        self._clock = clock
        self._idle: deque[_Connection] = deque()

    def take(self) -> _Connection | None:
        """The most recently used connection still fit to reuse; stale ones on the way are closed."""
        now = self._clock()
        while self._idle:
            connection = self._idle.pop()
            if connection.usable(now):
                return connection
            connection.abort()
        return None

    def give_back(self, connection: _Connection) -> None:
        """Keeps `connection` for the next request; the oldest idle one makes room, and any
        gone stale at the far end are closed now rather than left half-open."""
        if self._limit <= 0:
            connection.abort()
            return
        now = self._clock()
        while self._idle and (len(self._idle) >= self._limit or not self._idle[0].usable(now)):
            self._idle.popleft().abort()
        connection.idle_since = now
        self._idle.append(connection)

    def close(self) -> None:
        while self._idle:
            self._idle.pop().abort()


class Response:
    """One answer. Its connection goes back to the pool only when the body was read to its end;
    closing it earlier resets the connection, so the engine stops working on it."""

    def __init__(self, pool: _IdlePool, connection: _Connection, answer: _Answer, status: int,
                 headers: Headers) -> None:
        self._pool = pool
        self._connection = connection
        self._answer = answer
        self.status_code = status
        self.headers = headers
        self._closed = False
        self._content: bytes | None = None

    @property
    def content(self) -> bytes:
        if self._content is None:
            raise RuntimeError("read the response with aread() before using .content")
        return self._content

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    async def aread(self) -> bytes:
        if self._content is None:
            self._content = b"".join([part async for part in self.aiter_raw()])
        return self._content

    def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive, framing removed; errors are `LoopbackHTTPError`."""
        return self._answer.chunks()

    def stream_to(self, sink: Sink) -> Awaitable[None]:
        """Hands the body's bytes to `sink` as each read brings them, from the socket's callback:
        no task wakes up per read (the relay's hot path at thousands of streamed tokens a second).
        The awaitable ends with the body; it raises `LoopbackHTTPError`, or whatever `sink`
        raised (which also ends the answer and resets the connection)."""
        return self._answer.stream_to(sink)

    def pause_reading(self) -> None:
        """Stops reading the body until `resume_reading` (the reader's own backlog is full)."""
        if not self._closed:
            self._connection.pause(True)

    def resume_reading(self) -> None:
        """Reads on; after `aclose` it does nothing (the connection may serve another answer)."""
        if not self._closed:
            self._connection.pause(False)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._answer.complete and self._answer.reusable:
            self._connection.release()
            self._connection.pause(False)  # its next answer is read whatever this one's reader did
            self._pool.give_back(self._connection)
        else:
            self._connection.abort()

def decode_chunks(buffer: bytes) -> tuple[bytes, int, bool]:
    """(the data of every whole chunk in `buffer`, bytes used, whether the last chunk was reached).

    Raises ValueError for a chunk-size line that is not hex or runs past `_STREAM_LIMIT`."""
    parts: list[bytes] = []
    position, size_of_buffer = 0, len(buffer)
    while True:
        line_end = buffer.find(b"\r\n", position)
        if line_end < 0:
            if size_of_buffer - position > _STREAM_LIMIT:
                raise ValueError("a chunk-size line is too long")
            return b"".join(parts), position, False
        size = int(buffer[position:line_end].split(b";", 1)[0], 16)
        if size < 0:
            raise ValueError("a negative chunk size")
        if size == 0:
            trailers_end = buffer.find(b"\r\n\r\n", line_end)
            if trailers_end < 0:
                return b"".join(parts), position, False
            return b"".join(parts), trailers_end + 4, True
        data_end = line_end + 2 + size
        if data_end + 2 > size_of_buffer:
            return b"".join(parts), position, False
        if buffer[data_end : data_end + 2] != b"\r\n":
            raise ValueError("a chunk does not end where its size says")
        parts.append(buffer[line_end + 2 : data_end])
        position = data_end + 2


class LoopbackClient:
    """Keep-alive connections per engine (its socket path, or host and port); bytes in, bytes out.

    Reads have no timeout (generations are long; the relay's deadlines bound them); connecting
    has one, so an engine that accepts nothing fails fast instead of hanging a request.
    """

    def __init__(self, *, connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 max_idle_per_engine: int = MAX_IDLE_PER_ENGINE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._max_idle = max_idle_per_engine
        self._clock = clock
        self._pools: dict[Address, _IdlePool] = {}
        self._read_buffer = memoryview(bytearray(READ_SIZE))  # every connection's, one read at a time

    def build_request(self, method: str, url: str, *, content: bytes | None = None,
                      headers: Mapping[str, str] | None = None, socket_path: str | None = None) -> Request:
        """A request for `url`, sent through the Unix socket `socket_path` when one is given."""
        return Request(method, url, content, headers or {}, socket_path)

    async def send(self, request: Request, *, stream: bool = True) -> Response:
        """Writes the request and reads the response head; the body is left to read (or, with
        `stream=False`, read here). A cancel or error on the way resets the connection."""
        pool = self._pool(request.address)
        connection = pool.take() or await self._connect(request.address)
        try:
            answer = connection.start(request.encoded())
            status, headers = await answer.head
            response = Response(pool, connection, answer, status, headers)
            if not stream:
                await response.aread()
                await response.aclose()
            return response
        except BaseException:
            connection.abort()
            raise

    async def post(self, url: str, *, content: bytes | None = None, json: Any = None,
                   headers: Mapping[str, str] | None = None, socket_path: str | None = None) -> Response:
        """A whole POST (body read); `json` is encoded as UTF-8 JSON."""
        all_headers = dict(headers or {})
        if json is not None:
            content = jsonlib.dumps(json, ensure_ascii=False).encode("utf-8")
            all_headers.setdefault("Content-Type", "application/json")
        request = self.build_request("POST", url, content=content, headers=all_headers, socket_path=socket_path)
        return await self.send(request, stream=False)

    async def aclose(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        traceback: TracebackType | None) -> None:
        await self.aclose()

    def _pool(self, address: Address) -> _IdlePool:
        pool = self._pools.get(address)
        if pool is None:
            pool = self._pools[address] = _IdlePool(self._max_idle, self._clock)
        return pool

    async def _connect(self, address: Address) -> _Connection:
        where = address if isinstance(address, str) else f"{address[0]}:{address[1]}"
        loop = asyncio.get_running_loop()
        buffer = self._read_buffer
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                if isinstance(address, str):
                    _, connection = await loop.create_unix_connection(lambda: _Connection(buffer),
                                                                      sock=await _unix_socket_to(address))
                else:
                    _, connection = await loop.create_connection(lambda: _Connection(buffer), *address)
        except TimeoutError as exc:
            raise LoopbackHTTPError(
                f"the engine at {where} accepted no connection within {self._connect_timeout_s:g} s"
            ) from exc
        except OSError as exc:
            raise _engine_error(f"could not connect to the engine at {where}", exc) from exc
        return connection


async def _unix_socket_to(path: str) -> socket.socket:
    """A socket connected to `path`, waiting while the engine's listen backlog is full.

    On Linux a Unix-socket connect does not queue as TCP's does: with the backlog full (llama-server's
    HTTP library listens with a small one: 5 in older cpp-httplib, 4 per core in newer) it fails at
    once with EAGAIN, and asyncio, taking that for a connect in progress, hands back a socket that
    is not connected (EINVAL or ENOTCONN on first use): a burst of requests got 502s. A full
    backlog is retried shortly instead (the caller's connect timeout bounds the wait)."""
    delay = UNIX_BACKLOG_RETRY_S
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(path)
            return sock
        except BlockingIOError:
            sock.close()
        except BaseException:
            sock.close()
            raise
        await asyncio.sleep(delay)
        delay = min(delay * 2, UNIX_BACKLOG_RETRY_MAX_S)


def _parse_head(head: bytes) -> tuple[int, Headers, bool]:
    """(status, headers, whether the connection stays open) of a head without its blank line."""
    status_line, *lines = head.decode("latin-1").split("\r\n")
    version, status, *_ = status_line.split(" ", 2)
    if not version.startswith("HTTP/1."):
        raise ValueError(f"not an HTTP/1.x answer: {status_line[:80]!r}")
    headers = Headers()
    for line in lines:
        name, colon, value = line.partition(":")
        if colon:
            key = name.strip().lower()
            headers[key] = f"{headers[key]}, {value.strip()}" if key in headers else value.strip()
    keep_alive = version == "HTTP/1.1" and "close" not in headers.get("connection", "").lower()
    return int(status), headers, keep_alive

def _engine_error(what: str, cause: BaseException) -> LoopbackHTTPError:
    detail = str(cause) or type(cause).__name__
    return LoopbackHTTPError(f"{what}: {detail}")
