"""The local OpenAI-compatible endpoint: HTTP on 127.0.0.1 in front of the reference coordinator.

Each HTTP request under /v1/ becomes a `request` frame to the node, and its `response.*`
frames stream back as the HTTP answer, so a person can `curl` their own node or point an
OpenAI client at it. aiohttp speaks HTTP; this module only decides what is served.

It answers programs on this computer only, and of those only the ones that send its key
(`Authorization: Bearer KEY`, compared in constant time): another account on a shared computer
can reach 127.0.0.1 too. A request addressed to another host name (a web page using DNS
rebinding), sent by a web page from another origin, or without the key is refused before it
reaches the node, on every path; no CORS header is ever granted. It listens on both loopback
addresses (127.0.0.1 and, where the computer has it, ::1), so that no other program can hold the
one that `localhost` leads a client to first; a port taken on either is an error, never a move.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import http
import json
import re
from collections.abc import Mapping
from typing import Any, Self

from aiohttp import web
from pydantic import BaseModel
from websockets.exceptions import ConnectionClosed

from worker.contract import protocol
from worker.link.local.coordinator import DEFAULT_DEADLINE_S, Exchange, NoNode, ReferenceCoordinator

MAX_BODY_BYTES = protocol.MAX_FRAME_BYTES - 64 * 1024  # what still fits one `request` frame
_SHUTDOWN_S = 1.0  # answers still streaming when the endpoint stops are cut after this long
_LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
_LOOPBACK_ORIGIN = re.compile(r"https?://(?:127\.0\.0\.1|localhost|\[::1\])(?::([0-9]{1,5}))?")
_SINGLE_HEADERS = ("Host", "Origin", "Authorization")  # repeated, each check could see a different value
_NO_IPV6 = (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT)  # ::1 missing: 127.0.0.1 alone is every loopback there is
_PORT_0_TRIES = 5  # port 0: 127.0.0.1's free port may be taken on ::1; another free one is tried


class OpenAIEndpoint:
    """HTTP on loopback for one coordinator, for callers with `key`. `await start()` (OSError
    when the port is taken)."""

    def __init__(self, coordinator: ReferenceCoordinator, *, key: str, port: int = 0) -> None:
        if not key:
            raise ValueError("the endpoint needs a key")
        self._coordinator = coordinator
        self._key = f"Bearer {key}".encode()
        self._port = port
        self._runner: web.AppRunner | None = None

    async def start(self) -> Self:
        for _ in range(_PORT_0_TRIES if self._port == 0 else 1):
            try:
                self._runner = await self._listen()
                break
            except OSError as exc:
                if self._port != 0 or exc.errno != errno.EADDRINUSE:
                    raise
        else:
            raise OSError(errno.EADDRINUSE, "no port was free on both 127.0.0.1 and ::1")
        self._port = self._runner.addresses[0][1]
        return self

    async def _listen(self) -> web.AppRunner:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_route("*", "/{path:.*}", self._handle)
        # handler_cancellation: a client that disconnects cancels its handler, which cancels
        # the request upstream at once, even while no frame is arriving.
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=_SHUTDOWN_S)
        await runner.setup()
        try:
            await web.TCPSite(runner, "127.0.0.1", self._port).start()
            await _listen_on_ipv6_loopback(runner, runner.addresses[0][1])
        except OSError:
            await runner.cleanup()
            raise
        return runner

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def url(self) -> str:
        """The base URL an OpenAI client takes (ends in /v1)."""
        if self._runner is None:
            raise RuntimeError("start() the endpoint first")
        return f"http://127.0.0.1:{self._port}/v1"

    @property
    def addresses(self) -> list[Any]:
        """Where it listens: (host, port) of each socket."""
        return list(self._runner.addresses) if self._runner is not None else []

    # --- one request -----------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._serve(request)
        except _Refusal as refusal:
            response = _error_response(refusal.status, refusal.code, refusal.message)
            response.headers.update(refusal.headers)
            return response

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        _refuse_other_sites(request, self._port)
        self._refuse_without_key(request)
        path = request.raw_path.split("?", 1)[0]
        if request.method == "GET" and path == "/v1/models":
            return _json_response(200, self._models())
        if request.method not in ("GET", "POST") or not path.startswith("/v1/"):
            raise _Refusal(404, "not_found", f"no route {request.method} {path}")
        body = await _json_body(request)
        try:
            exchange = await self._coordinator.request(body, path=request.raw_path, method=request.method,
                                                       deadline_s=_deadline_s(request.headers))
        except (NoNode, ConnectionClosed):
            raise _Refusal(503, "no_node",
                           "no node is connected to this coordinator; start one with `gpu-provider run`") from None
        return await self._relay(request, exchange)

    def _refuse_without_key(self, request: web.BaseRequest) -> None:
        """401 unless `Authorization: Bearer KEY` is this endpoint's key (compared in constant time)."""
        given = request.headers.get("Authorization", "").strip().encode("utf-8", "replace")
        if not hmac.compare_digest(given, self._key):
            raise _Refusal(401, "unauthorized",
                           "this endpoint needs its key: send `Authorization: Bearer KEY`, with the key that "
                           "`gpu-provider status` (or the app's Connection card) shows", {"WWW-Authenticate": "Bearer"})

    def _models(self) -> dict[str, Any]:
        assign = self._coordinator.assign
        names = [assign.model.name] if assign is not None else []
        return {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "gpu-provider"} for n in names]}

    async def _relay(self, request: web.Request, exchange: Exchange) -> web.StreamResponse:
        """The node's answer as the HTTP response; a client that leaves cancels the request upstream."""
        answer = _Answer(request)
        try:
            async for frame in exchange.frames():
                await answer.take(frame)
        except ConnectionError:  # the client left while a part was being written
            await self._cancel_upstream(exchange.id)
            return answer.response if answer.response is not None else web.Response(status=499)
        except asyncio.CancelledError:  # the client left while the node was thinking
            await self._cancel_upstream(exchange.id)
            raise
        return answer.result()

    async def _cancel_upstream(self, request_id: str) -> None:
        try:
            await self._coordinator.cancel(request_id)
        except (NoNode, ConnectionClosed):
            pass  # the node is gone, and the request with it


class _Answer:
    """One relayed answer, built frame by frame: head, chunks, then end or error."""

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self._head: protocol.ResponseHead | None = None
        self.response: web.StreamResponse | None = None

    async def take(self, frame: BaseModel) -> None:
        if isinstance(frame, protocol.ResponseHead):
            await self._start(frame)
        elif isinstance(frame, protocol.ResponseChunk) and frame.data and self.response is not None:
            await self.response.write(frame.data.encode("utf-8"))
        elif isinstance(frame, protocol.ResponseEnd) and self.response is not None:
            await self.response.write_eof()
        elif isinstance(frame, protocol.ResponseError):
            await self._fail(frame)

    def result(self) -> web.StreamResponse:
        if self.response is None:  # an end, or data, with no head before it: the node broke the protocol
            return _error_response(502, "bad_gateway", "the node's answer had no response.head")
        return self.response

    async def _start(self, head: protocol.ResponseHead) -> None:
        self._head = head
        self.response = web.StreamResponse(status=head.status, reason=_reason(head.status), headers={
            "Content-Type": head.content_type or "application/json", "Cache-Control": "no-cache"})
        self.response.enable_chunked_encoding()
        await self.response.prepare(self._request)

    async def _fail(self, error: protocol.ResponseError) -> None:
        """Before the head: an error response. In an event stream: a last error event. In a JSON
        body: the connection closes without the last chunk, which tells the client it was cut."""
        document = _openai_error(error.message, error.code)
        if self.response is None or self._head is None:
            self.response = _error_response(error.status, error.code, error.message)
        elif (self._head.content_type or "").startswith("text/event-stream"):
            await self.response.write(b"data: " + json.dumps(document, ensure_ascii=False).encode("utf-8") + b"\n\n")
            await self.response.write_eof()
        elif self._request.transport is not None:
            self._request.transport.close()


class _Refusal(Exception):
    """An answer the endpoint gives itself, as an OpenAI-style error."""

    def __init__(self, status: int, code: str, message: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.headers = dict(headers or {})


async def _listen_on_ipv6_loopback(runner: web.AppRunner, port: int) -> None:
    """::1 on `port` too, unless this computer has no IPv6 loopback (then there is nothing to hold)."""
    try:
        await web.TCPSite(runner, "::1", port).start()
    except OSError as exc:
        if exc.errno not in _NO_IPV6:
            raise


async def _json_body(request: web.Request) -> Any:
    """The body as JSON (None when empty); a body too large for one frame is refused unread."""
    too_large = _Refusal(413, "too_large", f"the body is over {MAX_BODY_BYTES} bytes")
    if (request.content_length or 0) > MAX_BODY_BYTES:
        raise too_large
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None
    try:
        return json.loads(raw) if raw else None
    except ValueError as exc:
        raise _Refusal(400, "bad_request", f"the body is not JSON: {exc}") from None


def _deadline_s(headers: Mapping[str, str]) -> float:
    """`X-Deadline-S` lets a caller shorten the default deadline."""
    try:
        value = float(headers.get("x-deadline-s", DEFAULT_DEADLINE_S))
    except ValueError:
        return DEFAULT_DEADLINE_S
    return value if 0 < value <= DEFAULT_DEADLINE_S else DEFAULT_DEADLINE_S


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


def _refuse_other_sites(request: web.BaseRequest, port: int) -> None:
    """Raises the refusal for a request from another site, or one that repeats Host or Origin."""
    headers = request.headers
    for name in _SINGLE_HEADERS:
        if len(headers.getall(name, [])) > 1:
            raise _Refusal(400, "bad_request", f"the request repeats its {name} header; send it once")
    problem = host_problem(headers, port)
    if problem is not None:
        missing = not headers.get("host", "").strip()
        raise _Refusal(400 if missing else 403, "bad_request" if missing else "forbidden", problem)
    problem = origin_problem(headers)
    if problem is not None:
        raise _Refusal(403, "forbidden", problem)


def _quoted(text: str) -> str:
    """A header's value fit for a message: quoted (control characters visible) and short."""
    return repr(text[:100])


def _reason(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "Client Closed Request" if status == 499 else "Status"


def _openai_error(message: str, code: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": code, "code": code}}


def _error_response(status: int, code: str, message: str) -> web.Response:
    return _json_response(status, _openai_error(message, code))


def _json_response(status: int, document: Any) -> web.Response:
    return web.Response(status=status, reason=_reason(status), content_type="application/json",
                        body=json.dumps(document, ensure_ascii=False).encode("utf-8"))
