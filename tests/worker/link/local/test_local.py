"""`--coordinator local`: the coordinator, its OpenAI endpoint and the model rules, together: the
endpoint on its port or not at all, and only for callers with the data folder's key."""

from __future__ import annotations

import asyncio
import errno
import json
import socket
import stat
from pathlib import Path

import httpx
import pytest

from tests.support.fake_engine import FakeEngine
from tests.worker.link.local.nodes import TOKEN, MiniNode
from worker.system.config import Paths, read_local_endpoint
from worker.link.local import DEFAULT_OPENAI_PORT, LocalCoordinator, LocalEndpointError, LocalModelError


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
            answer = await client.post(f"{local.openai_url}/chat/completions", json={"messages": [], "max_tokens": 2},
                                       headers={"Authorization": f"Bearer {local.api_key}"})
        assert answer.json()["usage"]["completion_tokens"] == 2
        assert node.assigned[0].model.name == "tiny"
        await node.link.close()
        await task
    finally:
        await local.stop()


async def test_local_coordinator_with_a_bad_model_says_why() -> None:
    with pytest.raises(LocalModelError, match="does not exist"):
        await LocalCoordinator(token=TOKEN, machine=_Machine(), model="/no/such.gguf", openai_port=0).start()


def squat(port: int) -> socket.socket:
    """Another local program listening on `port` of 127.0.0.1 before the node starts."""
    squatter = socket.socket()
    try:
        squatter.bind(("127.0.0.1", port))
    except OSError:
        squatter.close()
        raise
    squatter.listen()
    return squatter


async def test_8090_taken_is_an_error_that_says_what_to_do_and_nothing_serves_elsewhere(model: Path) -> None:
    try:
        squatter: socket.socket | None = squat(DEFAULT_OPENAI_PORT)
    except OSError:  # another program (a node of another test run) holds it already: taken all the same
        squatter = None
    try:
        local = LocalCoordinator(token=TOKEN, machine=_Machine(), model=str(model))
        with pytest.raises(LocalEndpointError) as refused:
            await local.start()
        if squatter is not None:
            squatter.settimeout(0.2)
            with pytest.raises(TimeoutError):
                squatter.accept()  # nothing reached the squatter either
    finally:
        if squatter is not None:
            squatter.close()
    message = str(refused.value)
    assert "Port 8090 on this computer is in use by another program" in message
    assert "--openai-port" in message and refused.value.title == "The local endpoint cannot start"
    assert isinstance(refused.value, LocalModelError)  # the node shows it as the problem that stops local mode
    with pytest.raises(RuntimeError, match="start"):
        local.openai_url  # no endpoint on any other port
    with pytest.raises(RuntimeError, match="start"):
        local.coordinator  # and the coordinator stopped with it


async def test_a_port_given_and_taken_is_an_error_and_stops_the_coordinator(model: Path) -> None:
    with squat(0) as squatter:
        port = squatter.getsockname()[1]
        local = LocalCoordinator(token=TOKEN, machine=_Machine(), model=str(model), openai_port=port)
        with pytest.raises(LocalEndpointError, match=f"Port {port} on this computer is in use"):
            await local.start()
    with pytest.raises(RuntimeError, match="start"):
        local.coordinator


async def test_the_key_is_the_data_folders_kept_private_across_runs_and_checked(
        model: Path, tmp_path: Path, engine: FakeEngine, http: httpx.AsyncClient) -> None:
    paths = Paths.under(tmp_path / "node").ensure()
    first = await LocalCoordinator(token=TOKEN, machine=_Machine(), model=str(model), openai_port=0,
                                   paths=paths).start()
    await first.stop()
    local = await LocalCoordinator(token=TOKEN, machine=_Machine(), model=str(model), openai_port=0,
                                   paths=paths).start()
    try:
        shown = read_local_endpoint(paths)
        assert shown is not None and shown.url == local.openai_url and shown.key == local.api_key == first.api_key
        assert len(shown.key) >= 32 and stat.S_IMODE(paths.local_endpoint_file.stat().st_mode) == 0o600
        assert json.loads(paths.local_endpoint_file.read_text()) == {
            "url": local.openai_url, "key": local.api_key, "coordinator_url": local.ws_url}
        node = MiniNode(local.ws_url, engine, http)
        task = asyncio.create_task(node.link.run())
        await local.coordinator.wait_for_connections(1)
        body = {"prompt": "x", "max_tokens": 1}
        async with httpx.AsyncClient(trust_env=False) as client:
            without = await client.post(f"{local.openai_url}/completions", json=body)
            wrong = await client.post(f"{local.openai_url}/completions", json=body,
                                      headers={"Authorization": "Bearer " + "x" * len(local.api_key)})
            assert (without.status_code, wrong.status_code) == (401, 401)
            assert engine.records == []
            served = await client.post(f"{local.openai_url}/completions", json=body,
                                       headers={"Authorization": f"Bearer {local.api_key}"})
        assert served.status_code == 200 and len(engine.records) == 1
        await node.link.close()
        await task
    finally:
        await local.stop()


async def test_another_data_folder_has_another_key(model: Path, tmp_path: Path) -> None:
    keys = []
    for name in ("a", "b"):
        local = await LocalCoordinator(token=TOKEN, machine=_Machine(), model=str(model), openai_port=0,
                                       paths=Paths.under(tmp_path / name).ensure()).start()
        keys.append(local.api_key)
        await local.stop()
    assert keys[0] != keys[1]


def test_a_port_that_cannot_be_opened_for_another_reason_says_so() -> None:
    from worker.link.local.local import port_problem

    message = port_problem(80, OSError(errno.EACCES, "Permission denied"))
    assert "cannot open its local endpoint on port 80 (Permission denied)" in message and "--openai-port" in message
