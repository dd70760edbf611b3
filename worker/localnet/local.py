"""`--coordinator local`: the reference coordinator, assigning a model that suits this machine,
with the OpenAI-compatible endpoint in front of it. The three parts of local mode, together."""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol, Self

from worker import protocol
from worker.localnet.coordinator import ReferenceCoordinator
from worker.localnet.openai_endpoint import OpenAIEndpoint
from worker.localnet.sizing import local_assignment

log = logging.getLogger(__name__)

DEFAULT_OPENAI_PORT = 8090


class HasRuntime(Protocol):
    """What local mode needs to know of the machine (`hardware.Machine` has it)."""

    @property
    def runtime(self) -> str: ...


class LocalCoordinator:
    """The coordinator and its endpoint on 127.0.0.1 (port 8090 unless taken or given)."""

    def __init__(self, *, token: str, machine: HasRuntime, model: str | None = None,
                 openai_port: int | None = None, port: int = 0, batch: bool = True) -> None:
        self._token = token
        self._runtime = machine.runtime
        self._model = model
        self._openai_port = openai_port
        self._port = port
        self._batch = batch  # welcome lists "batch": the node may pack its messages into one frame
        self._coordinator: ReferenceCoordinator | None = None
        self._endpoint: OpenAIEndpoint | None = None

    async def start(self) -> Self:
        """Builds the assignment (raises `LocalModelError` with what to do) and starts serving."""
        assign = await asyncio.to_thread(local_assignment, self._runtime, self._model)
        coordinator = await ReferenceCoordinator(token=self._token, port=self._port, assign=assign,
                                                 record=False, batch=self._batch).start()
        try:
            self._endpoint = await self._start_endpoint(coordinator)
        except BaseException:
            await coordinator.stop()
            raise
        self._coordinator = coordinator
        return self

    async def _start_endpoint(self, coordinator: ReferenceCoordinator) -> OpenAIEndpoint:
        if self._openai_port is not None:
            return await OpenAIEndpoint(coordinator, port=self._openai_port).start()
        try:
            return await OpenAIEndpoint(coordinator, port=DEFAULT_OPENAI_PORT).start()
        except OSError as exc:
            log.warning("port %d is taken (%s); the OpenAI endpoint gets a free port instead", DEFAULT_OPENAI_PORT, exc)
            return await OpenAIEndpoint(coordinator, port=0).start()

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
    def openai_url(self) -> str:
        """The base URL an OpenAI client takes (`…/v1`)."""
        if self._endpoint is None:
            raise RuntimeError("start() the local coordinator first")
        return self._endpoint.url
