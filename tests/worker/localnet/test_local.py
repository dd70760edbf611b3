"""`--coordinator local`: the coordinator, its OpenAI endpoint and the model rules, together."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import httpx
import pytest

from tests.support.fake_engine import FakeEngine
from tests.worker.localnet.nodes import TOKEN, MiniNode
from worker.localnet import DEFAULT_OPENAI_PORT, LocalCoordinator, LocalModelError


class _Machine:
    runtime = "cpu"


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"\0" * 2**20)
    return path


async def test_local_coordinator_assigns_and_serves_openai(model: Path, engine: FakeEngine,
                                                           http: httpx.AsyncClient) -> None:
    local = await LocalCoordinator(token=TOKEN, machine=_Machine(), model=str(model), openai_port=0).start()
    try:
        assert local.assignment is not None and local.assignment.model.for_engine("llamacpp") is not None
        assert local.assignment.model.for_engine("llamacpp").source == str(model)
        node = MiniNode(local.ws_url, engine, http)
        task = asyncio.create_task(node.link.run())
        await local.coordinator.wait_for_connections(1)
        async with httpx.AsyncClient(trust_env=False) as client:
            answer = await client.post(f"{local.openai_url}/chat/completions", json={"messages": [], "max_tokens": 2})
        assert answer.json()["usage"]["completion_tokens"] == 2
        assert node.assigned[0].model.name == "tiny"
        await node.link.close()
        await task
    finally:
        await local.stop()


async def test_local_coordinator_with_a_bad_model_says_why() -> None:
    with pytest.raises(LocalModelError, match="does not exist"):
        await LocalCoordinator(token=TOKEN, machine=_Machine(), model="/no/such.gguf", openai_port=0).start()


async def test_local_coordinator_falls_back_to_a_free_port_when_8090_is_taken(model: Path) -> None:
    first = await LocalCoordinator(token=TOKEN, machine=_Machine(), model=str(model)).start()
    second = await LocalCoordinator(token=TOKEN, machine=_Machine(), model=str(model)).start()
    try:
        assert first.openai_url != second.openai_url
        assert f":{DEFAULT_OPENAI_PORT}/" in first.openai_url + second.openai_url
    finally:
        await second.stop()
        await first.stop()


async def test_a_port_given_and_taken_is_an_error_and_stops_the_coordinator(model: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        local = LocalCoordinator(token=TOKEN, machine=_Machine(), model=str(model),
                                 openai_port=taken.getsockname()[1])
        with pytest.raises(OSError):
            await local.start()
    with pytest.raises(RuntimeError, match="start"):
        local.coordinator
