"""`--coordinator local`: the reference coordinator, assigning a model that suits this machine,
with the OpenAI-compatible endpoint in front of it. The three parts of local mode, together.

The endpoint listens on its port (8090 unless given) or not at all: a port another program holds
is `LocalEndpointError`, never a move elsewhere, since a client expecting the endpoint at 8090
would hand that program the person's prompts. Its key is the data folder's own
(`config.local_endpoint_key`), written with the endpoint's address for `gpu-provider status` and
the app to show.
"""

from __future__ import annotations

import asyncio
import errno
import secrets
from functools import partial
from typing import Any, Protocol, Self

from worker.contract import protocol
from worker.system.config import LocalEndpoint, Paths, local_endpoint_key, save_local_endpoint
from worker.link.local.coordinator import ReferenceCoordinator
from worker.link.local.openai_endpoint import OpenAIEndpoint
from worker.link.local.sizing import LocalModelError, local_assignment

DEFAULT_OPENAI_PORT = 8090


class HasRuntime(Protocol):
    """What local mode needs to know of the machine (`hardware.Machine` has it)."""

    @property
    def runtime(self) -> str: ...


class LocalEndpointError(LocalModelError):
    """The endpoint cannot listen on its port; the message says why and what to do. A
    `LocalModelError`, so that the node shows it as the problem that stops local mode."""

    title = "The local endpoint cannot start"


class LocalCoordinator:
    """The coordinator and its endpoint on loopback (port 8090 unless given). With `paths`, the
    endpoint's key is the data folder's and is written there with the address; without (tests),
    a key for this run only (`api_key`)."""

    def __init__(self, *, token: str, machine: HasRuntime, model: str | None = None,
                 openai_port: int | None = None, port: int = 0, batch: bool = True,
                 paths: Paths | None = None, tune: dict[str, Any] | None = None) -> None:
        """`tune`: the `tune` block the assignment's engine block carries (None: none)."""
        self._token = token
        self._runtime = machine.runtime
        self._model = model
        self._openai_port = DEFAULT_OPENAI_PORT if openai_port is None else openai_port
        self._paths = paths
        self._key: str | None = None
        self._port = port
        self._batch = batch  # welcome lists "batch": the node may pack its messages into one frame
        self._tune = tune
        self._coordinator: ReferenceCoordinator | None = None
        self._endpoint: OpenAIEndpoint | None = None

    async def start(self) -> Self:
        """Builds the assignment (raises `LocalModelError` with what to do) and starts serving
        (`LocalEndpointError` when the endpoint's port is taken)."""
        assign = await asyncio.to_thread(partial(local_assignment, self._runtime, self._model, tune=self._tune))
        if self._key is None:
            self._key = await asyncio.to_thread(self._load_key)
        coordinator = await ReferenceCoordinator(token=self._token, port=self._port, assign=assign,
                                                 record=False, batch=self._batch).start()
        try:
            self._endpoint = await self._start_endpoint(coordinator, self._key)
            if self._paths is not None:
                endpoint = LocalEndpoint(self._endpoint.url, self._key, coordinator.url)
                await asyncio.to_thread(save_local_endpoint, self._paths, endpoint)
        except BaseException:
            if self._endpoint is not None:
                await self._endpoint.stop()
                self._endpoint = None
            await coordinator.stop()
            raise
        self._coordinator = coordinator
        return self

    def _load_key(self) -> str:
        return local_endpoint_key(self._paths) if self._paths is not None else secrets.token_urlsafe(32)

    async def _start_endpoint(self, coordinator: ReferenceCoordinator, key: str) -> OpenAIEndpoint:
        try:
            return await OpenAIEndpoint(coordinator, key=key, port=self._openai_port).start()
        except OSError as exc:
            raise LocalEndpointError(port_problem(self._openai_port, exc)) from None

    async def stop(self) -> None:
        if self._endpoint is not None:
            await self._endpoint.stop()
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
    def api_key(self) -> str:
        """The key a caller of the endpoint sends (`Authorization: Bearer KEY`)."""
        if self._key is None:
            raise RuntimeError("start() the local coordinator first")
        return self._key

    @property
    def openai_url(self) -> str:
        """The base URL an OpenAI client takes (`…/v1`)."""
        if self._endpoint is None:
            raise RuntimeError("start() the local coordinator first")
        return self._endpoint.url


def port_problem(port: int, exc: OSError) -> str:
    """Why the endpoint cannot listen on `port`, and what the person can do, in their words."""
    if exc.errno == errno.EADDRINUSE:
        return (f"Port {port} on this computer is in use by another program, so GPU Provider did not open its "
                "local endpoint (it never moves to another port: a program expecting it there would be talking to "
                f"the other one). Close that program, or choose another port with --openai-port PORT.")
    return (f"GPU Provider cannot open its local endpoint on port {port} ({exc.strerror or exc}). "
            "Choose another port with --openai-port PORT.")
