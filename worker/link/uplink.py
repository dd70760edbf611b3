"""The node's one connection to a coordinator: the network's (`--coordinator URL`, through
`Link`), the built-in local one (`--coordinator local`: `worker.link.local`, started and stopped
here, its assignment carrying the person's `tune` block where they asked for tuning), or none
(`""`, `"none"`). It keeps the connection's state as the app shows it (with the person's sign-out
and their switch to another network), and marks for a pending update that this version started
and that it reached the coordinator."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from worker import __version__
from worker.contract import protocol
from worker.system.config import Paths
from worker.contract.events import ConnectionSnapshot, Problem
from worker.relay.forward import RequestHandler
from worker.hardware import Machine
from worker.link.connection import SIGNED_OUT, Backoff, Link, MessageHandler
from worker.update import mark_hello_reached, mark_started

if TYPE_CHECKING:
    from worker.link.local import LocalCoordinator

log = logging.getLogger(__name__)

TokenProvider = Callable[[], str | None]


class Uplink:
    """The link (once `open` found a coordinator) and the local coordinator it may lead to."""

    def __init__(
        self,
        url: str,
        paths: Paths,
        *,
        token_provider: TokenProvider | None,
        backoff: Backoff | None,
        local_model: str | None,
        openai_port: int | None,
        local_tune: dict[str, Any] | None = None,
        hello: Callable[[], protocol.Hello],
        on_message: MessageHandler,
        on_disconnect: Callable[[], None],
        on_bad_message: Callable[[protocol.BadMessage], Awaitable[None]],
        on_change: Callable[[], None],
        requests: RequestHandler | None = None,
    ) -> None:
        """`on_change` is called after each change of `connection`; `requests` (the relay) is
        handed each `request` and `cancel` frame by the link; `local_tune`: the contract's `tune`
        block local mode's assignment carries (None: local mode does not tune)."""
        self.url = url
        self.connection = ConnectionSnapshot(url, "disabled")
        self._paths = paths
        self._token_provider = token_provider
        self._backoff = backoff
        self._local_model = local_model
        self._openai_port = openai_port
        self._local_tune = local_tune
        self._hello = hello
        self._on_message = on_message
        self._on_disconnect = on_disconnect
        self._on_bad_message = on_bad_message
        self._on_change = on_change
        self._requests = requests
        self._link: Link | None = None
        self._local: LocalCoordinator | None = None
        self._signed_out = False  # the person signed out: the link stays closed until they sign in

    @property
    def linked(self) -> bool:
        """There is a coordinator to connect to: `run` serves the link."""
        return self._link is not None

    async def open(self, machine: Machine) -> Problem | None:
        """Finds the coordinator (starting the local one) and makes the link; a `Problem` where
        the local coordinator cannot serve its model."""
        url, token_provider, problem = await self._coordinator(machine)
        if url:
            link: Link = Link(
                url,
                token_provider,
                self._hello,
                self._on_message,
                backoff=self._backoff or Backoff(),
                on_state=lambda snapshot: self._on_state(link, snapshot),
                on_disconnect=self._on_disconnect,
                on_bad_message=self._on_bad_message,
                requests=self._requests,
            )
            self._link = link
            mark_started(self._paths, __version__)  # an update waiting for this version: offline, not broken
        return problem

    async def _coordinator(self, machine: Machine) -> tuple[str | None, TokenProvider, Problem | None]:
        """The URL and token source: the network's coordinator, or the built-in local one."""
        if self.url in ("", "none"):
            return None, lambda: None, None
        if self.url != "local":
            from worker.system.secrets import get_token

            return self.url, self._token_provider or get_token, None
        from worker.link.local import LocalCoordinator, LocalModelError

        token = secrets.token_urlsafe(24)
        local = LocalCoordinator(token=token, machine=machine, model=self._local_model, openai_port=self._openai_port,
                                 paths=self._paths, tune=self._local_tune)
        try:
            self._local = await local.start()
        except LocalModelError as exc:
            log.error("%s", exc)
            return None, lambda: None, Problem(exc.title, str(exc), "settings")
        log.info("local coordinator on %s; OpenAI endpoint on %s", self._local.ws_url, self._local.openai_url)
        return self._local.ws_url, lambda: token, None

    async def run(self) -> None:
        """Keeps the link connected until `close` (returns at once without one)."""
        if self._link is not None:
            await self._link.run()

    async def send(self, message: BaseModel) -> bool:
        return bool(self._link and await self._link.send(message))

    def resume_after_sign_in(self) -> bool:
        """A new token is in place: connect now. True when the link must be `run` again (after
        `sign_out` closed it)."""
        if self._link is None:
            return False
        if not self._signed_out:
            self._link.resume_after_sign_in()
            return False
        self._signed_out = False
        self._link.reopen()
        self._set_connection(ConnectionSnapshot(self.url, "connecting"))
        return True

    def reconnect_now(self) -> None:
        """The person's Retry: an offline link tries again at once instead of after its backoff."""
        if self._link is not None and not self._signed_out and self.connection.state != "connected":
            self._link.resume_after_sign_in()

    async def sign_out(self) -> None:
        """The person signed out: the link closes and the connection says `signed_out` until
        `resume_after_sign_in` (the app removes the token itself)."""
        self._signed_out = True
        self._set_connection(ConnectionSnapshot(self.url, "signed_out", SIGNED_OUT))
        if self._link is not None:
            await self._link.close()

    async def switch(self, url: str, machine: Machine) -> Problem | None:
        """Another network, without restarting the app: the link (and the local coordinator)
        closed, then `open` on `url`; `run` must be called again. A `Problem` as `open` gives."""
        await self.close()
        self._link, self._local, self._signed_out = None, None, False
        self.url = url
        self._set_connection(ConnectionSnapshot(url, "disabled"))
        return await self.open(machine)

    async def close(self) -> None:
        """The link closed and the local coordinator stopped (the next version needs its ports)."""
        if self._link is not None:
            await self._link.close()
        if self._local is not None:
            await self._local.stop()

    async def reopen(self, local_stopped: bool) -> bool:
        """After `close`, for an update that was rolled back: the local coordinator again (where
        it was stopped) and the link reopened. True when there is a link for `run`."""
        if local_stopped and self._local is not None:
            await self._local.start()
            if self._link is not None:
                self._link.url = self._local.ws_url
        if self._link is None:
            return False
        self._link.reopen()
        return True

    def _on_state(self, link: Link, snapshot: ConnectionSnapshot) -> None:
        if link is not self._link or self._signed_out:
            return  # a link closing for a switch or a sign-out says nothing about the connection now
        if snapshot.state == "connected":  # tells a pending update check this version reached the coordinator
            mark_hello_reached(self._paths, __version__)
        self._set_connection(snapshot)

    def _set_connection(self, snapshot: ConnectionSnapshot) -> None:
        self.connection = snapshot
        self._on_change()
