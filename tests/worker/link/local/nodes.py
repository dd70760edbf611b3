"""Nodes for the localnet tests: the real link and relay, or a script of frames."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
from websockets.asyncio.client import ClientConnection, connect

from tests.support.fake_engine import FakeEngine
from worker.contract import protocol
from worker.link.connection import Backoff, Link
from worker.relay.forward import EngineTarget, Relay

TOKEN = "local-token"
KEY = "endpoint-key-0123456789abcdef0123456789abcdef"  # what callers of the OpenAI endpoint send
HELLO = protocol.Hello(
    node_id="node-1", app_version="0.1.0",
    platform=protocol.PlatformInfo(os="linux", runtime="cpu", arch="x86_64"),
    hardware=protocol.HardwareInfo(ram_mib=16000, cpu=protocol.CpuInfo(model="test cpu", cores=4)),
    engines={"vllm": None, "llamacpp": "b1"},
)
ASSIGN = protocol.Assign(assignment_id="a-1", model=protocol.ModelSpec(
    name="tiny", llamacpp=protocol.EngineModel(source="/models/tiny.gguf", weights_mib=10)))


class MiniNode:
    """The wiring `worker/node/node.py` does, reduced to the link and the relay."""

    def __init__(self, url: str, engine: FakeEngine, http: httpx.AsyncClient) -> None:
        self.paused = False
        self.assigned: list[protocol.Assign] = []
        self.requests: list[protocol.Request] = []  # every `request` frame that reached the node
        target = EngineTarget("e0", engine.base_url, engine.api_key, engine.served_name)
        self.link = Link(url, lambda: TOKEN, lambda: HELLO, self.on_message, on_disconnect=self.on_disconnect,
                         backoff=Backoff(base_s=0.01, cap_s=0.05))
        self.relay = Relay(self.link.send, lambda: [target], lambda: "paused" if self.paused else None, http=http)

    async def on_message(self, message: Any) -> None:
        if isinstance(message, protocol.Request):
            self.requests.append(message)
            self.relay.handle(message, self.link.sender())
        elif isinstance(message, protocol.Cancel):
            self.relay.cancel(message.id)
        elif isinstance(message, protocol.Assign):
            self.assigned.append(message)

    def on_disconnect(self) -> None:
        self.relay.cancel_all("the coordinator connection ended")


class ScriptedNode:
    """A node that answers every `request` with the frames `script` gives for its id: a node
    that breaks the protocol in ways the real relay never does."""

    def __init__(self, url: str, script: Callable[[str], list[protocol.NodeMessage]]) -> None:
        self._url = url
        self._script = script
        self.cancelled: list[str] = []
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> ScriptedNode:
        ws = await connect(self._url, additional_headers={"Authorization": f"Bearer {TOKEN}"})
        await ws.send(protocol.encode(HELLO))
        self._task = asyncio.create_task(self._answer(ws))
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.wait([self._task])

    async def _answer(self, ws: ClientConnection) -> None:
        async with ws:
            async for raw in ws:
                frame = json.loads(raw)
                if frame["type"] == "request":
                    for message in self._script(frame["id"]):
                        await ws.send(protocol.encode(message))
                elif frame["type"] == "cancel":
                    self.cancelled.append(frame["id"])
