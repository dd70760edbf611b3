"""The reference coordinator: a real websockets server on 127.0.0.1 that speaks protocol 1.

Local mode (`--coordinator local`) and the tests both run it. It checks the Bearer token,
answers `hello` with `welcome` (and the assignment it was given), sends `request` frames and
hands their `response.*` frames back on an `Exchange`. Its welcome lists `batch` unless built with
`batch=False`, and `autotune` unless built with `autotune=False` (its assignment's engine blocks may
carry `tune` blocks; `tune()` sends the `tune` message; `routing()` the routing notice); a
`batch` frame is unpacked, so every consumer sees the node's messages one by one. The
OpenAI-compatible HTTP side is `openai_endpoint.py`, a client of `request` and `cancel` like any test.

The tests also need a coordinator that misbehaves and remembers: the attributes and methods
under "test hooks" exist for them; local mode never calls them and keeps `record=False`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal, Self

from pydantic import BaseModel
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from worker.contract import protocol
from worker.link.connection import WEBSOCKET_MAX_SIZE

log = logging.getLogger(__name__)

PROVIDER_PATH = "/v1/provider"
DEFAULT_DEADLINE_S = 300.0
_TERMINAL = (protocol.ResponseEnd, protocol.ResponseError)
_RESPONSES = (protocol.ResponseHead, protocol.ResponseChunk, protocol.ResponseEnd, protocol.ResponseError)


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
        heartbeat_s: float = 10.0,
        price: protocol.Price | None = None,
        assign: protocol.Assign | None = None,
        hello_timeout_s: float = 10.0,
        ping_interval: float | None = 20.0,
        record: bool = True,
        close_timeout: float = 2.0,
        batch: bool = True,
        autotune: bool = True,
    ) -> None:
        self.token = token  # None: any token (or none) is accepted
        self.assign = assign  # sent after welcome to every node that connects
        self.hellos: list[protocol.Hello] = []
        # test hooks (see the module's docstring)
        self.reject_with: int | None = None  # close every new connection at once with this code
        self.received: list[Any] = []  # every message from the node, parsed (Unknown included)
        self.bad_frames: list[str] = []  # why frames from the node were refused
        self.frame_sizes: list[int] = []  # messages per frame from the node after hello (a batch: its length)
        self.handshake_headers: list[dict[str, str]] = []
        self._record = record  # False for long runs (local mode, benchmarks): only hellos are kept
        self._port = port
        self._heartbeat_s = heartbeat_s
        self._price = price or protocol.Price()
        self._hello_timeout_s = hello_timeout_s
        self._ping_interval = ping_interval
        self._close_timeout = close_timeout
        # False: tests of the unbatched path, and of a node whose coordinator does not read tuning
        self._features = [f for f, offered in ((protocol.BATCH_FEATURE, batch), (protocol.AUTOTUNE_FEATURE, autotune))
                          if offered]
        self._server: Server | None = None
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
        return self

    async def stop(self) -> None:
        """Stops serving; a connected node sees close code 1001."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self._port}{PROVIDER_PATH}"

    @property
    def node_connected(self) -> bool:
        return self._node is not None

    # --- talking to the node -----------------------------------------------------------------

    async def send(self, message: BaseModel) -> None:
        await self._send(protocol.encode(message))

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

    async def tune(self, assignment_id: str, action: Literal["start", "cancel", "forget"] = "start") -> None:
        """Asks the node to start or cancel tuning `assignment_id`, or to forget what it kept."""
        await self.send(protocol.Tune(assignment_id=assignment_id, action=action))

    async def routing(self, share: float, reason: protocol.RoutingReason | None = None, message: str = "") -> None:
        """Tells the node how much of its model's traffic it gets now and why not more (shown to
        the person beside the node's own reasons)."""
        await self.send(protocol.Routing(share=share, reason=reason, message=message))

    async def wait_for_connections(self, count: int, timeout: float = 5.0) -> protocol.Hello:
        """Waits until `count` nodes have said hello in all; returns the latest hello."""
        async with asyncio.timeout(timeout), self._arrived:
            await self._arrived.wait_for(lambda: len(self.hellos) >= count)
        return self.hellos[-1]

    # --- test hooks: a coordinator that misbehaves, and what the node sent it ----------------

    async def send_raw(self, frame: str | bytes) -> None:
        """Sends any frame, valid or not."""
        await self._send(frame)

    async def restart(self) -> None:
        """Stops and starts again on the same port, as a coordinator that was redeployed."""
        await self.stop()
        await self.start()

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

    async def wait_for(self, match: str | Callable[[Any], bool], *, after: int = 0,
                       timeout: float = 5.0) -> Any:
        """The first message from the node at index `after` or later of `received` that matches
        (a type name or a predicate); waits for it."""
        test = _type_is(match) if isinstance(match, str) else match
        async with asyncio.timeout(timeout), self._arrived:
            while True:
                for message in self.received[after:]:
                    if test(message):
                        return message
                after = len(self.received)
                await self._arrived.wait()

    # --- the websocket side ----------------------------------------------------------------

    async def _send(self, frame: str | bytes) -> None:
        if self._node is None:
            raise NoNode("no node is connected")
        await self._node.send(frame)

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
            node_id=hello.node_id, heartbeat_s=self._heartbeat_s, price=self._price, features=self._features)))
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
        messages = protocol.unpack(message)  # every consumer sees a batch's messages one by one
        for each in messages:
            if isinstance(each, _RESPONSES):
                self._route(each)
        if not self._record:
            return
        async with self._arrived:
            self.frame_sizes.append(len(messages))
            self.received.extend(messages)
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


def _type_is(name: str) -> Callable[[Any], bool]:
    def test(message: Any) -> bool:
        return getattr(message, "type", None) == name

    return test
