"""A lean HTTP/1.1 client for engines on 127.0.0.1, with the slice of httpx's API the relay uses.

Two jobs in the benchmark. The load generator's "direct" path reads the engine with it, so that
direct measures what the engine can stream rather than what httpx can parse. And `relay_node
--upstream lean` hands it to `worker.relay.Relay` in place of httpx, to measure the change the
profile points to: httpx/h11 turn every HTTP chunk (one SSE event, one token) into its own
event, and httpcore's pool scans every connection for each idle one on each request start and
end. Here one socket read becomes one `aiter_raw` item however many chunks it holds, and idle
connections sit in a list.

Scope: what engines on loopback answer (HTTP/1.1, chunked or Content-Length, keep-alive).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from urllib.parse import urlsplit

READ_SIZE = 1 << 18
_Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class LeanRequest:
    def __init__(self, method: str, url: str, content: bytes | None, headers: Mapping[str, str]) -> None:
        self.method = method
        self.url = url
        self.content = content or b""
        self.headers = dict(headers)


class LeanResponse:
    """One response; its connection goes back to the pool only when the body was read to its end."""

    def __init__(self, pool: list[_Connection], connection: _Connection, status: int, headers: dict[str, str]) -> None:
        self._pool = pool
        self._reader, self._writer = connection
        self.status_code = status
        self.headers = headers
        self._complete = False
        self._closed = False

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            async for data in self._chunked():
                yield data
        elif "content-length" in self.headers:
            data = await self._reader.readexactly(int(self.headers["content-length"]))
            self._complete = True
            if data:
                yield data
        else:
            while data := await self._reader.read(READ_SIZE):
                yield data

    async def _chunked(self) -> AsyncIterator[bytes]:
        """Decodes every whole chunk of each read in one pass, and yields their bytes together."""
        held = b""
        while not self._complete:
            data = await self._reader.read(READ_SIZE)
            if not data:
                raise ConnectionError("the engine closed the connection in the middle of an answer")
            held = held + data if held else data
            payload, used, self._complete = decode_chunks(held)
            held = held[used:]
            if payload:
                yield payload

    async def aread(self) -> bytes:
        return b"".join([part async for part in self.aiter_raw()])

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._complete and not self._writer.is_closing():
            self._pool.append((self._reader, self._writer))
        else:
            self._writer.transport.abort()


def decode_chunks(buffer: bytes) -> tuple[bytes, int, bool]:
    """(the data of every whole chunk, bytes used, whether the last chunk was reached)."""
    parts: list[bytes] = []
    position, size_of_buffer = 0, len(buffer)
    while True:
        line_end = buffer.find(b"\r\n", position)
        if line_end < 0:
            return b"".join(parts), position, False
        size = int(buffer[position:line_end].split(b";", 1)[0], 16)
        if size == 0:
            if buffer.startswith(b"\r\n\r\n", line_end):
                return b"".join(parts), line_end + 4, True
            return b"".join(parts), position, False
        data_end = line_end + 2 + size
        if data_end + 2 > size_of_buffer:
            return b"".join(parts), position, False
        parts.append(buffer[line_end + 2 : data_end])
        position = data_end + 2


class LeanClient:
    """Keep-alive connections per host and port; an argument list in, bytes out, nothing else."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, int], list[_Connection]] = {}

    def build_request(self, method: str, url: str, *, content: bytes | None = None,
                      headers: Mapping[str, str] | None = None) -> LeanRequest:
        return LeanRequest(method, url, content, headers or {})

    async def send(self, request: LeanRequest, *, stream: bool = True) -> LeanResponse:
        parts = urlsplit(request.url)
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        pool = self._idle.setdefault((host, port), [])
        connection = await self._connection(pool, host, port)
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        lines = [f"{request.method} {target} HTTP/1.1", f"Host: {host}:{port}",
                 f"Content-Length: {len(request.content)}"]
        lines += [f"{name}: {value}" for name, value in request.headers.items()]
        reader, writer = connection
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + request.content)
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        status = int(head[0].split(" ", 2)[1])
        headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in head[1:] if ":" in line)}
        return LeanResponse(pool, connection, status, headers)

    @staticmethod
    async def _connection(pool: list[_Connection], host: str, port: int) -> _Connection:
        while pool:
            reader, writer = pool.pop()
            if not writer.is_closing() and not reader.at_eof():
                return reader, writer
        return await asyncio.open_connection(host, port, limit=1 << 20)

    async def aclose(self) -> None:
        for pool in self._idle.values():
            for _, writer in pool:
                writer.close()
        self._idle.clear()
