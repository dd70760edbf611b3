"""A lean HTTP/1.1 client for the engines this app started (on a Unix socket, or on 127.0.0.1):
the relay's hot path.

Why not httpx: httpx/h11 turn every HTTP chunk (one SSE event, one token) into its own event
(~40–60 µs each), and httpcore's pool scans every connection on each request start and end,
which blocked the loop for ~18 ms per request at 256 streams (`bench/README.md`). Here one
socket read becomes one `aiter_raw` item however many chunks it holds, chunk framing is decoded
in one pass per read, and idle connections wait in a deque: O(1) to take and to give back.

Scope, on purpose: plain `http://` to `127.0.0.1` or `localhost` only (anything else is a
`ValueError`: this is not a general-purpose client), or to the Unix socket a request names (its
URL then gives only the Host header and the path), HTTP/1.1 with keep-alive, response bodies
framed by `Content-Length`, `Transfer-Encoding: chunked` or the connection's end. The calls are
the slice of httpx's API the relay makes, so tests can compare it with httpx directly.
"""

from __future__ import annotations

import asyncio
import json as jsonlib
import re
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from types import TracebackType
from typing import Any, Self
from urllib.parse import urlsplit

CONNECT_TIMEOUT_S = 5.0
MAX_IDLE_PER_ENGINE = 256  # the relay's busiest engines serve a few hundred streams at once
# vLLM (uvicorn) and llama-server both close a keep-alive connection after 5 s idle; one idle
# this long is closed here instead, so a request is never written onto a connection the engine
# is closing at that moment.
IDLE_LIMIT_S = 4.0
READ_SIZE = 1 << 18
_STREAM_LIMIT = 1 << 20  # the longest response head or chunk-size line accepted
_LOOPBACK_HOSTS = {"127.0.0.1": "127.0.0.1", "localhost": "127.0.0.1"}
_NO_BODY_STATUSES = frozenset({204, 304})
_UNSAFE = re.compile(r"[\r\n\0]")

Address = tuple[str, int] | str  # (host, port) on loopback, or a Unix socket's path


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


class _Connection:
    """One keep-alive socket to an engine, and when it was last given back idle."""

    __slots__ = ("idle_since", "reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_since = 0.0

    def usable(self, now: float) -> bool:
        return now - self.idle_since < IDLE_LIMIT_S and not self.writer.is_closing() and not self.reader.at_eof()

    def abort(self) -> None:
        """Resets the socket: an engine reading it sees the client go away and stops generating."""
        self.writer.transport.abort()


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

    def __init__(self, pool: _IdlePool, connection: _Connection, status: int, headers: Headers,
                 keep_alive: bool) -> None:
        self._pool = pool
        self._connection = connection
        self.status_code = status
        self.headers = headers
        self._reusable = keep_alive
        self._complete = False
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

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive, chunk framing removed; errors are `LoopbackHTTPError`."""
        try:
            async for data in self._body():
                yield data
        except (OSError, EOFError, ValueError, asyncio.LimitOverrunError) as exc:
            raise _engine_error("the engine broke off its answer", exc) from exc

    def _body(self) -> AsyncIterator[bytes]:
        if self.status_code in _NO_BODY_STATUSES:
            return self._sized(0)
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            return self._chunked()
        length = self.headers.get("content-length")
        if length is not None:
            return self._sized(int(length))
        self._reusable = False
        return self._until_closed()

    async def _sized(self, remaining: int) -> AsyncIterator[bytes]:
        if remaining < 0:
            raise ValueError(f"a negative Content-Length ({remaining})")
        reader = self._connection.reader
        while remaining > 0:
            data = await reader.read(min(remaining, READ_SIZE))
            if not data:
                raise EOFError(f"the connection closed {remaining} bytes before the end of the body")
            remaining -= len(data)
            yield data
        self._complete = True

    async def _chunked(self) -> AsyncIterator[bytes]:
        """Decodes every whole chunk of each read in one pass, and yields their bytes together."""
        reader = self._connection.reader
        held = b""
        while not self._complete:
            data = await reader.read(READ_SIZE)
            if not data:
                raise EOFError("the connection closed in the middle of a chunked body")
            held = held + data if held else data
            payload, used, self._complete = decode_chunks(held)
            held = held[used:]
            if payload:
                yield payload
        if held:
            self._reusable = False  # bytes past the body's end: the stream is out of step

    async def _until_closed(self) -> AsyncIterator[bytes]:
        reader = self._connection.reader
        while data := await reader.read(READ_SIZE):
            yield data
        self._complete = True

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._complete and self._reusable:
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
            connection.writer.write(request.encoded())
            response = await _read_head(pool, connection)
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
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                if isinstance(address, str):
                    reader, writer = await asyncio.open_unix_connection(address, limit=_STREAM_LIMIT)
                else:
                    reader, writer = await asyncio.open_connection(*address, limit=_STREAM_LIMIT)
        except TimeoutError as exc:
            raise LoopbackHTTPError(
                f"the engine at {where} accepted no connection within {self._connect_timeout_s:g} s"
            ) from exc
        except OSError as exc:
            raise _engine_error(f"could not connect to the engine at {where}", exc) from exc
        return _Connection(reader, writer)


async def _read_head(pool: _IdlePool, connection: _Connection) -> Response:
    try:
        head = await connection.reader.readuntil(b"\r\n\r\n")
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
        return Response(pool, connection, int(status), headers, keep_alive)
    except (OSError, EOFError, ValueError, asyncio.LimitOverrunError) as exc:
        raise _engine_error("the engine sent no proper answer", exc) from exc


def _engine_error(what: str, cause: BaseException) -> LoopbackHTTPError:
    detail = str(cause) or type(cause).__name__
    return LoopbackHTTPError(f"{what}: {detail}")
