"""The node's one connection to the coordinator: a websocket the app opens outward.

`Link.run()` connects, sends `hello` first, hands `request` and `cancel` frames to the relay (with
the connection's outlet) and every other parsed coordinator message to the node, answers
malformed ones with `error`, and reconnects with full-jitter exponential backoff until
`close()`; `reopen()` lets a later `run()` connect again (an update that was rolled back). Close
codes the person must act on (signed out, banned, update needed) stop the retries and are shown
as a `ConnectionSnapshot` with an `events.Problem`.

Frame size: the protocol caps frames at 16 MiB and promises an `error` reply, not a dropped
connection, for a frame over it. websockets closes with 1009 on a message over its `max_size`,
so its limit is set to 4 × 16 MiB and the parser refuses what lies between with `bad_message`;
only a frame over 64 MiB (no honest coordinator sends one) costs the connection.

Sending: each connection's `outgoing.Outgoing` keeps messages in order and is its requests'
outlet (`sender()`); `post` queues one without waiting (the relay's hot path), `send` waits until
it is written. Where the `welcome` lists
`batch`, what is queued in one loop iteration goes out as one `batch` frame: at a busy node's
token rate one frame per token event is the relay's limit, while a lone message goes out at once.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import (
    ConnectionClosed,
    InvalidHandshake,
    InvalidStatus,
    InvalidURI,
)

from worker import __version__
from worker.contract import events
from worker.contract import protocol
from worker.engines import registry
from worker.link.outgoing import Outgoing
from worker.relay.forward import RequestHandler

log = logging.getLogger(__name__)
SIGNED_OUT = events.Problem("Signed out", "Sign in to lend your GPU to the network.", "sign_in")  # no token, or signed out

WEBSOCKET_MAX_SIZE = 4 * protocol.MAX_FRAME_BYTES
TAKEN_OVER_PAUSE_S = 300.0

MessageHandler = Callable[[Any], Awaitable[None]]
_Outcome = Literal["retry", "signed_out", "banned", "taken_over", "update_required", "closing"]


class Backoff:
    """Full-jitter exponential backoff: each delay is random() × min(cap, base × 2^attempt).

    The attempt count resets only after a connection has stayed up `reset_after_s`, so a
    coordinator that accepts and closes at once still meets longer and longer pauses.
    """

    def __init__(self, base_s: float = 1.0, cap_s: float = 60.0, reset_after_s: float = 60.0,
                 random_source: Callable[[], float] = random.random) -> None:
        self.base_s = base_s
        self.cap_s = cap_s
        self.reset_after_s = reset_after_s
        self._random = random_source
        self._attempt = 0

    def next_delay(self) -> float:
        ceiling = min(self.cap_s, self.base_s * 2.0 ** min(self._attempt, 62))
        self._attempt += 1
        return self._random() * ceiling

    def connection_lasted(self, seconds: float) -> None:
        if seconds >= self.reset_after_s:
            self._attempt = 0

    def reset(self) -> None:
        self._attempt = 0


def url_problem(url: str) -> str | None:
    """Why the app must not connect to `url` (plain ws:// off loopback, not a websocket URL), or None."""
    parts = urlsplit(url)
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        return f"the coordinator address {url!r} is not a ws:// or wss:// URL"
    if parts.scheme == "ws" and not _is_loopback(parts.hostname):
        return (f"the coordinator address {url!r} uses plain ws://, which is allowed only to this computer "
                "(127.0.0.1, ::1, localhost); use wss://")
    return None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class _Ending:
    outcome: _Outcome
    reason: str
    uptime_s: float = 0.0


_PROBLEMS: dict[str, events.Problem] = {
    "signed_out": events.Problem(
        "Signed out", "The coordinator did not accept this app's sign-in (the token is missing, wrong or "
        "revoked). Sign in again to reconnect.", "sign_in"),
    "banned": events.Problem(
        "This node is not allowed", "The coordinator refused this node: it is banned, or the token is not "
        "allowed for it. Sign in with another account, or contact the network's support.", "sign_in"),
    "update_required": events.Problem(
        "Update needed", f"The coordinator no longer supports protocol {protocol.PROTOCOL_VERSION}, which this "
        "app speaks. Update the app to reconnect.", "update"),
    "taken_over": events.Problem(
        "Another connection took over", "Another copy of this app connected with the same node id. Quit the "
        "other copy (or give it its own data folder); this one will try again later.", "none"),
}


class Link:
    """The websocket to the coordinator. Loop-bound: call every method on the core's loop."""

    def __init__(
        self,
        url: str,
        token_provider: Callable[[], str | None],
        make_hello: Callable[[], protocol.Hello],
        on_message: MessageHandler,
        *,
        backoff: Backoff | None = None,
        ping_interval: float = 20.0,
        ping_timeout: float = 20.0,
        open_timeout: float = 10.0,
        close_timeout: float = 10.0,
        taken_over_pause_s: float = TAKEN_OVER_PAUSE_S,
        clock: Callable[[], float] = time.monotonic,
        on_state: Callable[[events.ConnectionSnapshot], None] | None = None,
        on_disconnect: Callable[[], None] | None = None,
        on_bad_message: Callable[[protocol.BadMessage], Awaitable[None]] | None = None,
        requests: RequestHandler | None = None,
    ) -> None:
        """`requests`: where `request` and `cancel` frames go; without it, to `on_message` too."""
        self.url = url
        self._token_provider = token_provider
        self._make_hello = make_hello
        self._on_message = on_message
        self._backoff = backoff or Backoff()
        self._ping_interval = ping_interval
        self._ping_timeout = ping_timeout
        self._open_timeout = open_timeout
        self._close_timeout = close_timeout
        self._taken_over_pause_s = taken_over_pause_s
        self._clock = clock
        self._on_state = on_state
        self._on_disconnect = on_disconnect
        self._on_bad_message = on_bad_message
        self._requests = requests
        self._ws: ClientConnection | None = None
        self._out: Outgoing | None = None  # the open connection's send queue
        self._generation = 0
        self._closing = False
        self._running = False  # a `run()` loop is in progress
        self._wake = asyncio.Event()
        self._snapshot = events.ConnectionSnapshot(url, "connecting")
        self.welcome: protocol.Welcome | None = None

    @property
    def snapshot(self) -> events.ConnectionSnapshot:
        return self._snapshot

    @property
    def generation(self) -> int:
        """Counts connections; a request's answer belongs to the generation it arrived on."""
        return self._generation

    @property
    def connected(self) -> bool:
        return self._ws is not None

    async def run(self) -> None:
        """Connects and reconnects until `close()`. One loop at a time: called while a loop runs
        (one that `reopen()` kept going), it returns at once."""
        if self._running:
            return
        self._running = True
        try:
            await self._run()
        finally:
            self._running = False

    async def _run(self) -> None:
        problem = url_problem(self.url)
        if problem is not None:
            log.error("not connecting: %s", problem)
            self._set_state("offline", events.Problem("Coordinator address refused", problem + ".", "settings"))
        while not self._closing and problem is not None:
            await self._pause(None)
        while not self._closing:
            token = await self._read_token()
            if not token:
                self._set_state("signed_out", SIGNED_OUT)
                await self._pause(None)
                continue
            ending = await self._connect_once(token)
            await self._after(ending)
        self._set_state("disabled")

    async def _read_token(self) -> str | None:
        """The token, read in a thread (a keyring may block on a desktop prompt)."""
        try:
            return await asyncio.to_thread(self._token_provider)
        except Exception:
            log.exception("could not read the provider token")
            return None

    async def close(self) -> None:
        """Stops `run()` (until `reopen()`); closes the connection (code 1000)."""
        self._closing = True
        self._wake.set()
        ws = self._ws
        if ws is not None:
            await ws.close()

    def reopen(self) -> None:
        """Undoes `close()`, so that the next `run()` connects again at once (after a rolled-back
        update the node serves on). A loop that had not yet noticed the close carries on."""
        self._closing = False
        self._backoff.reset()

    def resume_after_sign_in(self) -> None:
        """A new token is in place: connect now (ends a signed-out or banned stop)."""
        self._backoff.reset()
        self._wake.set()

    async def send(self, message: BaseModel) -> bool:
        """Sends one message on the open connection and waits until it is written; False when
        not connected."""
        return await self.sender().send(message)

    def sender(self) -> Outgoing:
        """The open connection's outlet (`send` and `post`): it answers False once that
        connection is gone, even after a reconnect, so an answer never leaks onto a later one."""
        return self._out or Outgoing.nowhere()

    async def _connect_once(self, token: str) -> _Ending:
        # A try after the link went down keeps why it is down: the person still reads Offline.
        self._set_state("connecting", self._snapshot.problem if self._snapshot.state == "offline" else None)
        self._wake.clear()  # a wake-up meant for an earlier pause must not skip the next one
        try:
            hello = protocol.encode(self._make_hello())
        except Exception as exc:
            log.exception("could not describe this node for hello")
            return _Ending("retry", f"could not build hello ({type(exc).__name__}: {exc})")
        try:
            ws = await connect(
                self.url,
                additional_headers={"Authorization": f"Bearer {token}"},
                user_agent_header=f"gpu-provider/{__version__}",
                max_size=WEBSOCKET_MAX_SIZE,
                ping_interval=self._ping_interval,
                ping_timeout=self._ping_timeout,
                open_timeout=self._open_timeout,
                close_timeout=self._close_timeout,
                proxy=None if _is_loopback(urlsplit(self.url).hostname or "") else True,
            )
        except InvalidStatus as exc:
            return _ending_for_http_status(exc.response.status_code)
        except (OSError, InvalidHandshake, InvalidURI, TimeoutError) as exc:
            return _Ending("retry", f"could not connect ({type(exc).__name__}: {exc})")
        if self._closing:
            await ws.close()
            return _Ending("closing", "closed by the app")
        return await self._serve(ws, hello)

    async def _serve(self, ws: ClientConnection, hello: str) -> _Ending:
        self._generation += 1
        connected_at = self._clock()
        try:
            await ws.send(hello)
            self._out = Outgoing(ws.send)  # unbatched until this connection's welcome says otherwise
            self._ws = ws
            self._set_state("connected")
            async for frame in ws:
                await self._dispatch(frame)
        except ConnectionClosed:
            pass
        finally:
            if self._out is not None:
                self._out.close()
            self._ws, self._out = None, None
            self._connection_ended()
        uptime = self._clock() - connected_at
        if self._closing:
            return _Ending("closing", "closed by the app", uptime)
        return _ending_for_close(ws.close_code, ws.close_reason, uptime)

    def _connection_ended(self) -> None:
        """Tells the node at once (before any pause), so that it can cancel what the coordinator
        will never receive."""
        if self._on_disconnect is None:
            return
        try:
            self._on_disconnect()
        except Exception:
            log.exception("the node's disconnect handler failed")

    async def _dispatch(self, frame: str | bytes) -> None:
        try:
            message = protocol.parse_from_coordinator(frame, engine_names=registry.names())
        except protocol.BadMessage as exc:
            log.warning("coordinator sent a bad message: %s", exc)
            await self.send(exc.reply())
            if self._on_bad_message is not None:
                await self._on_bad_message(exc)
            return
        if isinstance(message, protocol.Unknown):
            log.info("ignoring a coordinator message of unknown type %r", message.type)
            return
        if isinstance(message, protocol.Welcome):
            self.welcome = message
            if self._out is not None:
                self._out.batching = protocol.BATCH_FEATURE in message.features
        try:
            if isinstance(message, protocol.Request) and self._requests is not None:
                self._requests.handle(message, self.sender())  # answered on the connection it came on
            elif isinstance(message, protocol.Cancel) and self._requests is not None:
                self._requests.cancel(message.id)
            else:
                await self._on_message(message)
        except Exception as exc:
            log.exception("handling the coordinator's %r message failed", message.type)
            ref = getattr(message, "id", None) or getattr(message, "assignment_id", None)
            await self.send(protocol.Error(code="handling_failed", message=f"{type(exc).__name__}: {exc}", ref=ref))

    async def _after(self, ending: _Ending) -> None:
        if ending.outcome == "closing":
            return
        log.info("coordinator connection ended: %s", ending.reason)
        if ending.outcome == "retry":
            self._backoff.connection_lasted(ending.uptime_s)
            delay = self._backoff.next_delay()
            self._set_state("offline", events.Problem(
                "Can't reach the coordinator",
                f"The connection ended ({ending.reason}). Retrying in {delay:.0f} s; check the network "
                "if this keeps happening.", "check_network"), retry_in_s=delay)
            await self._pause(delay)
        elif ending.outcome == "taken_over":
            self._set_state("taken_over", _PROBLEMS["taken_over"], retry_in_s=self._taken_over_pause_s)
            await self._pause(self._taken_over_pause_s)
        elif ending.outcome == "update_required":
            self._set_state("update_required", _PROBLEMS["update_required"])
            while not self._closing:
                await self._pause(None)
        else:
            self._set_state(ending.outcome, _PROBLEMS[ending.outcome])
            await self._pause(None)

    async def _pause(self, seconds: float | None) -> None:
        """Waits `seconds` (None: until woken); `close()` and `resume_after_sign_in()` wake it."""
        if not self._closing:
            try:
                await asyncio.wait_for(self._wake.wait(), seconds)
            except TimeoutError:
                pass
        self._wake.clear()

    def _set_state(self, state: events.ConnectionState, problem: events.Problem | None = None,
                   retry_in_s: float | None = None) -> None:
        snapshot = events.ConnectionSnapshot(self.url, state, problem, retry_in_s)
        if snapshot == self._snapshot:
            return
        self._snapshot = snapshot
        if self._on_state is not None:
            self._on_state(snapshot)


_CLOSE_OUTCOMES: dict[int, _Outcome] = {
    protocol.CLOSE_UNAUTHORIZED: "signed_out",
    protocol.CLOSE_FORBIDDEN: "banned",
    protocol.CLOSE_TAKEN_OVER: "taken_over",
    protocol.CLOSE_UPGRADE_REQUIRED: "update_required",
}
_HTTP_OUTCOMES: dict[int, _Outcome] = {401: "signed_out", 403: "banned", 426: "update_required"}


def _ending_for_close(code: int | None, reason: str | None, uptime: float) -> _Ending:
    described = f"close code {code}" + (f": {reason}" if reason else "")
    outcome = _CLOSE_OUTCOMES.get(code or 0, "retry")
    if code == protocol.CLOSE_PROTOCOL_ERROR:
        log.error("the coordinator refused this app's hello (%s); this is a bug in the app", described)
    return _Ending(outcome, described, uptime)


def _ending_for_http_status(status: int) -> _Ending:
    outcome = _HTTP_OUTCOMES.get(status, "retry")
    return _Ending(outcome, f"the coordinator answered the handshake with HTTP {status}")
