"""The node's one connection to the coordinator: a websocket the app opens outward.

`Link.run()` connects, sends `hello` first, hands every parsed coordinator message to the node,
answers malformed ones with `error`, and reconnects with full-jitter exponential backoff until
`close()`; `reopen()` lets a later `run()` connect again (an update that was rolled back). Close
codes the person must act on (signed out, banned, update needed) stop the retries and are shown
as a `ConnectionSnapshot` with an `events.Problem`.

Frame size: the protocol caps frames at 16 MiB and promises an `error` reply, not a dropped
connection, for a frame over it. websockets closes with 1009 on a message over its `max_size`,
so its limit is set to 4 × 16 MiB and the parser refuses what lies between with `bad_message`;
only a frame over 64 MiB (no honest coordinator sends one) costs the connection.

Batching: where this connection's `welcome` lists `batch`, the first message sent in a loop
iteration goes out at once, and those that follow it in that iteration as one `batch` frame, flushed
as soon as nothing else is ready (and at 256 messages, 1 MiB or 1 ms): at a busy node's token rate,
one frame per token event is the relay's limit, while a lone message must not wait for a batch.
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

from worker import __version__, events, protocol

log = logging.getLogger(__name__)
SIGNED_OUT = events.Problem("Signed out", "Sign in to lend your GPU to the network.", "sign_in")  # no token, or signed out

WEBSOCKET_MAX_SIZE = 4 * protocol.MAX_FRAME_BYTES
TAKEN_OVER_PAUSE_S = 300.0
BATCH_MAX_MESSAGES = 256
BATCH_MAX_CHARS = 1024 * 1024  # of JSON: far under the 16 MiB frame limit
BATCH_MAX_WAIT_S = 0.001  # the protocol's bound on how long a batch may hold a message

MessageHandler = Callable[[Any], Awaitable[None]]
Send = Callable[[BaseModel], Awaitable[bool]]
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


class _Batch:
    """Messages for one frame, gathered in one loop iteration; `sent` tells each of their senders
    whether the frame went out."""

    def __init__(self, ws: ClientConnection, opened_at: float) -> None:
        self.ws = ws
        self.opened_at = opened_at
        self.frames: list[str] = []
        self.chars = 0
        self.closed = False
        self.sent: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

    def add(self, frame: str) -> None:
        self.frames.append(frame)
        self.chars += len(frame)

    def full(self, now: float) -> bool:
        return (len(self.frames) >= BATCH_MAX_MESSAGES or self.chars >= BATCH_MAX_CHARS
                or now - self.opened_at >= BATCH_MAX_WAIT_S)


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
    ) -> None:
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
        self._ws: ClientConnection | None = None
        self._batching = False  # this connection's welcome lists "batch"
        self._batch: _Batch | None = None  # the one still taking messages
        self._flushes: set[asyncio.Task[None]] = set()
        self._generation = 0
        self._closing = False
        self._running = False  # a `run()` loop is in progress
        self._wake = asyncio.Event()
        self._snapshot = events.ConnectionSnapshot(url, "connecting")
        self._unwritten: set[_Batch] = set()  # closed, their frame not yet written
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

    async def send(self, message: BaseModel, *, generation: int | None = None) -> bool:
        """Sends one message; False when not connected, or when `generation` is no longer current."""
        ws = self._ws
        if ws is None or (generation is not None and generation != self._generation):
            return False
        if self._batching:
            return await self._send_batched(ws, protocol.encode(message))
        return await self._send_now(ws, protocol.encode(message))

    async def _send_batched(self, ws: ClientConnection, frame: str) -> bool:
        """The first message of a loop iteration goes out at once, as it would unbatched (a lone
        message costs nothing more); those that follow it in the same iteration join one batch,
        flushed when nothing else is ready. Batched sends are shielded: a sender cancelled while it
        waits must not cancel the answer its batch-mates wait for."""
        loop = asyncio.get_running_loop()
        batch = self._batch
        if batch is None or batch.ws is not ws:
            batch = self._batch = _Batch(ws, loop.time())
            loop.call_soon(self._flush, batch)
            if not self._unwritten:  # nothing queued ahead of it: no need to wait its turn
                return await self._send_now(ws, frame)
        batch.add(frame)
        if batch.full(loop.time()):
            self._flush(batch)
        return await asyncio.shield(batch.sent)

    @staticmethod
    async def _send_now(ws: ClientConnection, frame: str) -> bool:
        try:
            await ws.send(frame)
        except ConnectionClosed:
            return False
        return True

    def _flush(self, batch: _Batch) -> None:
        """Closes `batch` to new messages and sends what it holds. Batches start writing in the
        order they were closed (websockets writes a frame before its first await), and no message
        is sent at once while one is still unwritten, so order is kept."""
        if batch.closed:  # a full batch, flushed before its scheduled flush came
            return
        batch.closed = True
        if self._batch is batch:
            self._batch = None
        if not batch.frames:  # its iteration's one message went out at once
            return
        self._unwritten.add(batch)
        task = asyncio.get_running_loop().create_task(self._send_batch(batch))
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)
        task.add_done_callback(lambda _task: self._unwritten.discard(batch))  # also if cancelled unstarted

    async def _send_batch(self, batch: _Batch) -> None:
        frames = batch.frames
        frame = frames[0] if len(frames) == 1 else protocol.encode_batch(frames)
        self._unwritten.discard(batch)  # written in the send below, before it first waits
        try:
            await batch.ws.send(frame)
        except ConnectionClosed:
            batch.sent.set_result(False)
        except asyncio.CancelledError:
            batch.sent.cancel()
            raise
        except Exception as exc:  # as an unbatched send would raise it to its caller
            batch.sent.set_exception(exc)
        else:
            batch.sent.set_result(True)

    def sender(self) -> Send:
        """A `send` bound to the current connection: it answers False once that connection is gone,
        even after a reconnect, so an answer never leaks onto a later connection."""
        generation = self._generation

        async def send(message: BaseModel) -> bool:
            return await self.send(message, generation=generation)

        return send

    async def _connect_once(self, token: str) -> _Ending:
        self._set_state("connecting")
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
            self._batching = False  # until this connection's welcome says otherwise
            self._ws = ws
            self._set_state("connected")
            async for frame in ws:
                await self._dispatch(frame)
        except ConnectionClosed:
            pass
        finally:
            self._ws = None
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
            message = protocol.parse_from_coordinator(frame)
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
            self._batching = protocol.BATCH_FEATURE in message.features
        try:
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
