"""A small HTTPS file server on 127.0.0.1 for tests: a folder, added resources, Range, faults.

Faults include bodies sent without a length (chunked) and servers that announce one size and
send more, so tests can check that a download stops at its cap either way. A server can be slow
(`rate_bytes_per_s`: bodies paced like a slow line) and impatient (`idle_close_s`: a connection
whose client stops reading is closed after that long, as real servers do), so tests can pause
a download mid-way and see it resume.

Runs in a background thread (so both async httpx clients and libraries that make blocking calls
from worker threads can use it), with a trustme certificate authority the test hands to its
clients. Every request is recorded, so a test can assert which ranges were asked for, and every
connection counted, so a test can assert that nothing connected at all.

The app downloads only from public host names (`worker.provision.hosts`), so the server is named
by one (`files.example.net`, and `mirror.example.org` for a second host): `SERVED_HERE` is the
tests' host policy, which finds those two names on 127.0.0.1 and treats every other host as the
app does. `server.client()` is a download client with that policy that trusts the server.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Self
from urllib.parse import unquote, urlsplit

import httpx
import trustme

from worker.provision.hosts import IPAddress, PublicHosts, download_client

_RANGE = re.compile(r"bytes=(\d+)-(\d*)")
_PIECE = 64 * 1024  # a paced body is written this much at a time
HOST = "files.example.net"
MIRROR = "mirror.example.org"
LOOPBACK = ipaddress.IPv4Address("127.0.0.1")


@dataclass(frozen=True)
class ServedHere(PublicHosts):
    """The tests' host policy: `names` are public hosts that happen to live on 127.0.0.1; every other
    host is looked up and judged as the app judges it (so `localhost` is still refused)."""

    names: frozenset[str] = frozenset({HOST, MIRROR})

    first: tuple[IPAddress, ...] = ()  # addresses answered before 127.0.0.1 (that nothing serves on)

    def addresses_for(self, host: str, port: int) -> list[IPAddress]:
        if host.lower() in self.names:
            return [*self.first, LOOPBACK]
        return super().addresses_for(host, port)


SERVED_HERE = ServedHere()


@dataclass(frozen=True)
class SeenRequest:
    method: str
    path: str
    query: str
    headers: dict[str, str]  # lower-case names

    @property
    def range(self) -> str | None:
        return self.headers.get("range")


@dataclass
class Resource:
    """A response the test defined in memory (its body served with Range support like a file)."""

    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    content_type: str = "application/octet-stream"
    status: int = 200
    chunked: bool = False  # Transfer-Encoding: chunked, no Content-Length: the size is never announced
    claimed_size: int | None = (
        None  # announced (HEAD's Content-Length, a 206's Content-Range) whatever is sent
    )


@dataclass
class _Cut:
    after_bytes: int
    times: int


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, owner: HttpsServer, context: ssl.SSLContext) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.owner = owner
        self.context = context

    def finish_request(self, request: socket.socket, client_address: tuple[str, int]) -> None:  # type: ignore[override]
        """Handshake in the request's own thread, so one slow client never blocks accept()."""
        self.owner._count_connection()
        try:
            tls = self.context.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError):
            return
        super().finish_request(tls, client_address)

    def handle_error(self, request: object, client_address: object) -> None:
        """Connections the tests cut on purpose end in errors; they are expected, not news."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: the recorded requests are what tests look at."""

    def do_GET(self) -> None:
        self._answer(send_body=True)

    def do_HEAD(self) -> None:
        self._answer(send_body=False)

    def _answer(self, *, send_body: bool) -> None:
        owner = self.server.owner
        parts = urlsplit(self.path)
        path = unquote(parts.path)
        owner._record(
            SeenRequest(self.command, path, parts.query, {k.lower(): v for k, v in self.headers.items()})
        )
        resource = owner._lookup(path)
        if resource is None:
            self._send_status(404, b"not found")
            return
        if resource.status != 200:
            self._send_status(resource.status, resource.body, resource.headers)
            return
        self._send_resource(resource, path, send_body)

    def _send_resource(self, resource: Resource, path: str, send_body: bool) -> None:
        if resource.chunked:
            self._send_chunked(resource, send_body)
            return
        if resource.claimed_size is not None:
            self._send_claimed(resource, resource.claimed_size, send_body)
            return
        size = len(resource.body)
        start, end, status = 0, size - 1, 200
        wanted = self.headers.get("Range") if self.server.owner.honour_range else None
        match = _RANGE.fullmatch(wanted.strip()) if wanted else None
        if match:
            start = int(match.group(1))
            end = min(int(match.group(2)), size - 1) if match.group(2) else size - 1
            if start >= size:
                self._send_status(416, b"", {"Content-Range": f"bytes */{size}"})
                return
            status = 206
        body = resource.body[start : end + 1]
        self.send_response(status)
        self.send_header("Content-Type", resource.content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        for name, value in resource.headers.items():
            self.send_header(name, value)
        self.end_headers()
        if send_body:
            self._write_body(path, body)

    def _send_chunked(self, resource: Resource, send_body: bool) -> None:
        """The whole body in 64 KiB chunks; a client that hangs up early just ends the response."""
        self.send_response(200)
        self.send_header("Content-Type", resource.content_type)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if not send_body:
            return
        self.close_connection = True
        try:
            for start in range(0, len(resource.body), 64 * 1024):
                piece = resource.body[start : start + 64 * 1024]
                self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            return

    def _send_claimed(self, resource: Resource, claimed: int, send_body: bool) -> None:
        """HEAD announces `claimed` bytes; GET answers 206 "bytes 0-…/claimed" but sends the whole body."""
        if not send_body:
            self.send_response(200)
            self.send_header("Content-Length", str(claimed))
            for name, value in resource.headers.items():
                self.send_header(name, value)
            self.end_headers()
            return
        self.send_response(206)
        self.send_header("Content-Type", resource.content_type)
        self.send_header("Content-Length", str(len(resource.body)))
        self.send_header("Content-Range", f"bytes 0-{claimed - 1}/{claimed}")
        for name, value in resource.headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.close_connection = True
        try:
            self.wfile.write(resource.body)
        except OSError:
            return

    def _write_body(self, path: str, body: bytes) -> None:
        cut = self.server.owner._take_cut(path) if self.command == "GET" else None
        if cut is None:
            self._paced_write(body)
            return
        self._paced_write(body[:cut])
        self.wfile.flush()
        self.close_connection = True
        self.connection.shutdown(socket.SHUT_RDWR)

    def _paced_write(self, body: bytes) -> None:
        """`body` at the server's rate, in pieces; a client that stops reading for `idle_close_s`
        has its connection closed (counted in `idle_closes`)."""
        owner = self.server.owner
        if owner.rate_bytes_per_s is None and owner.idle_close_s is None:
            self.wfile.write(body)
            return
        self.connection.settimeout(owner.idle_close_s)
        began = time.monotonic()
        try:
            for start in range(0, len(body), _PIECE):
                piece = body[start : start + _PIECE]
                self.wfile.write(piece)
                owner._count_sent(len(piece))
                if owner.rate_bytes_per_s is not None:
                    time.sleep(max(0.0, began + (start + len(piece)) / owner.rate_bytes_per_s - time.monotonic()))
        except TimeoutError:
            owner._count_idle_close()
            self.close_connection = True
            self.connection.close()

    def _send_status(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


class HttpsServer:
    """`with HttpsServer(root) as server: async with server.client() as c: await c.get(server.url("a.gguf"))`."""

    def __init__(
        self, root: Path | None = None, *, ca: trustme.CA | None = None, honour_range: bool = True,
        rate_bytes_per_s: float | None = None, idle_close_s: float | None = None,
    ) -> None:
        self.root = root
        self.ca = ca or trustme.CA()
        self.honour_range = honour_range
        self.rate_bytes_per_s = rate_bytes_per_s  # None: as fast as the client reads
        self.idle_close_s = idle_close_s  # None: a connection waits for its client forever
        self._sent = 0
        self._idle_closes = 0
        self._resources: dict[str, Resource] = {}
        self._cuts: dict[str, _Cut] = {}
        self._seen: list[SeenRequest] = []
        self._connections = 0
        self._lock = threading.Lock()
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ca.issue_cert("127.0.0.1", "localhost", HOST, MIRROR).configure_cert(context)
        self._server = _Server(self, context)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def base_url(self) -> str:
        return f"https://{HOST}:{self.port}"

    def url(self, path: str, *, host: str = HOST) -> str:
        """The URL of `path` here, by default under the server's public-looking name."""
        return f"https://{host}:{self.port}/{path.lstrip('/')}"

    def client(self, *, timeout_s: float = 10.0) -> httpx.AsyncClient:
        """A download client as the app makes one, with the tests' host policy, trusting this server."""
        return download_client(SERVED_HERE, verify=self.client_context(), timeout_s=timeout_s)

    @property
    def connections(self) -> int:
        """How many connections were accepted (TLS or not, whatever they asked)."""
        with self._lock:
            return self._connections

    def client_context(self) -> ssl.SSLContext:
        """An SSL context that trusts this server's certificate authority (httpx `verify=`)."""
        context = ssl.create_default_context()
        self.ca.configure_trust(context)
        return context

    def add(self, path: str, body: bytes, **resource: object) -> None:
        """Serve `body` at `path` (leading slash optional), with optional headers, type, status."""
        with self._lock:
            self._resources["/" + path.lstrip("/")] = Resource(body, **resource)  # type: ignore[arg-type]

    def cut_after(self, path: str, n_bytes: int, *, times: int = 1) -> None:
        """The next `times` GETs of `path` send their headers and `n_bytes` of body, then drop the connection."""
        with self._lock:
            self._cuts["/" + path.lstrip("/")] = _Cut(n_bytes, times)

    @property
    def requests(self) -> list[SeenRequest]:
        with self._lock:
            return list(self._seen)

    def requests_for(self, path: str, method: str | None = None) -> list[SeenRequest]:
        wanted = "/" + path.lstrip("/")
        return [r for r in self.requests if r.path == wanted and (method is None or r.method == method)]

    @property
    def idle_closes(self) -> int:
        """How many connections this server closed because their client stopped reading."""
        with self._lock:
            return self._idle_closes

    @property
    def sent_bytes(self) -> int:
        """Body bytes written to clients by paced (or impatient) responses."""
        with self._lock:
            return self._sent

    def _count_sent(self, n: int) -> None:
        with self._lock:
            self._sent += n

    def _count_idle_close(self) -> None:
        with self._lock:
            self._idle_closes += 1

    def _count_connection(self) -> None:
        with self._lock:
            self._connections += 1

    def _record(self, request: SeenRequest) -> None:
        with self._lock:
            self._seen.append(request)

    def _take_cut(self, path: str) -> int | None:
        with self._lock:
            cut = self._cuts.get(path)
            if cut is None or cut.times <= 0:
                return None
            cut.times -= 1
            return cut.after_bytes

    def _lookup(self, path: str) -> Resource | None:
        with self._lock:
            resource = self._resources.get(path)
        if resource is not None:
            return resource
        return self._file(path)

    def _file(self, path: str) -> Resource | None:
        if self.root is None:
            return None
        root = self.root.resolve()
        candidate = (root / path.lstrip("/")).resolve()
        if not candidate.is_relative_to(root) or not candidate.is_file():
            return None
        return Resource(candidate.read_bytes())
