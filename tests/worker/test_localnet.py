from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from tests.support.fake_engine import Behaviour, FakeEngine
from worker import protocol
from worker.link import Backoff, Link
from worker.localnet import (
    DEFAULT_LOCAL_MODEL,
    LocalCoordinator,
    LocalModelError,
    ReferenceCoordinator,
    host_problem,
    local_assignment,
    origin_problem,
)
from worker.relay import EngineTarget, Relay, engine_http_client

TOKEN = "local-token"
HELLO = protocol.Hello(
    node_id="node-1", app_version="0.1.0",
    platform=protocol.PlatformInfo(os="linux", runtime="cpu", arch="x86_64"),
    hardware=protocol.HardwareInfo(ram_mib=16000, cpu=protocol.CpuInfo(model="test cpu", cores=4)),
    engines={"vllm": None, "llamacpp": "b1"},
)
ASSIGN = protocol.Assign(assignment_id="a-1", model=protocol.ModelSpec(
    name="tiny", llamacpp=protocol.EngineModel(source="/models/tiny.gguf", weights_mib=10)))


class MiniNode:
    """The wiring `worker/node.py` does, reduced to the link and the relay."""

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


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    async with FakeEngine(served_name="served-tiny") as fake:
        yield fake


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with engine_http_client() as client:
        yield client


@pytest.fixture
async def coordinator() -> AsyncIterator[ReferenceCoordinator]:
    async with ReferenceCoordinator(token=TOKEN, http_port=0, assign=ASSIGN) as reference:
        yield reference


@pytest.fixture
async def node(coordinator, engine, http) -> AsyncIterator[MiniNode]:
    mini = MiniNode(coordinator.url, engine, http)
    task = asyncio.create_task(mini.link.run())
    await coordinator.wait_for_connections(1)
    yield mini
    await mini.link.close()
    await asyncio.wait_for(task, 5)


async def direct_stream(engine: FakeEngine, http: httpx.AsyncClient, body: dict[str, Any]) -> str:
    response = await http.post(f"{engine.base_url}/v1/chat/completions", json=body,
                               headers={"Authorization": f"Bearer {engine.api_key}"})
    return response.text


async def test_assignment_follows_welcome(node) -> None:
    async with asyncio.timeout(5):
        while not node.assigned:
            await asyncio.sleep(0.01)
    assert node.assigned == [ASSIGN]
    assert node.link.welcome is not None


async def test_curl_streaming_chat_through_the_node_is_byte_for_byte(coordinator, node, engine, http) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with httpx.AsyncClient(trust_env=False) as client:
        response = await client.post(f"{coordinator.http_url}/chat/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.text == await direct_stream(engine, http, {**body, "model": "served-tiny"})
    end = await coordinator.wait_for("response.end")
    assert end.usage == protocol.Usage(prompt_tokens=9, completion_tokens=16)


async def test_exchange_api_collects_head_chunks_and_end(coordinator, node) -> None:
    exchange = await coordinator.request({"messages": [], "stream": True, "max_tokens": 4})
    collected = await exchange.collect()
    assert collected.head.status == 200 and collected.error is None
    assert collected.data.count("data: ") == 6 and collected.data.endswith("data: [DONE]\n\n")
    assert collected.end.usage.completion_tokens == 4


async def test_curl_non_streaming_completion_and_models(coordinator, node) -> None:
    async with httpx.AsyncClient(trust_env=False) as client:
        answer = await client.post(f"{coordinator.http_url}/completions", json={"prompt": "x", "max_tokens": 3})
        models = await client.get(f"{coordinator.http_url}/models")
    assert answer.status_code == 200
    assert answer.json()["usage"]["completion_tokens"] == 3
    assert [m["id"] for m in models.json()["data"]] == ["tiny"]


async def test_http_without_a_node_is_503(coordinator) -> None:
    async with httpx.AsyncClient(trust_env=False) as client:
        response = await client.post(f"{coordinator.http_url}/chat/completions", json={"messages": []})
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "no_node"


async def test_http_bad_json_is_400(coordinator, node) -> None:
    async with httpx.AsyncClient(trust_env=False) as client:
        response = await client.post(f"{coordinator.http_url}/chat/completions", content=b"{nope",
                                     headers={"Content-Type": "application/json"})
    assert response.status_code == 400


async def test_paused_node_answers_http_with_503_paused(coordinator, node) -> None:
    node.paused = True
    async with httpx.AsyncClient(trust_env=False) as client:
        response = await client.post(f"{coordinator.http_url}/chat/completions", json={"stream": True})
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "paused"


async def test_http_client_leaving_cancels_the_generation(coordinator, node, engine) -> None:
    engine.behaviour = Behaviour(tokens=1000, token_delay_s=0.01)
    async with (
        httpx.AsyncClient(trust_env=False) as client,
        client.stream("POST", f"{coordinator.http_url}/chat/completions", json={"stream": True}) as response,
    ):
        async for _ in response.aiter_raw():
            break
    await asyncio.wait_for(engine.records[0].finished.wait(), 5)
    assert engine.records[0].disconnected and engine.records[0].tokens_sent < 1000
    cancelled = await coordinator.wait_for("response.error")
    assert (cancelled.status, cancelled.code) == (499, "cancelled")
    assert node.relay.in_flight == 0


async def test_cancel_frame_stops_generation_upstream(coordinator, node, engine) -> None:
    engine.behaviour = Behaviour(tokens=1000, token_delay_s=0.01)
    exchange = await coordinator.request({"stream": True})
    await coordinator.wait_for("response.chunk")
    await coordinator.cancel(exchange.id)
    collected = await exchange.collect()
    assert (collected.error.status, collected.error.code) == (499, "cancelled")
    await asyncio.wait_for(engine.records[0].finished.wait(), 5)
    assert engine.records[0].disconnected


async def test_socket_drop_cancels_upstream_and_nothing_leaks_onto_the_next_connection(
        coordinator, node, engine) -> None:
    engine.behaviour = Behaviour(tokens=1000, token_delay_s=0.01)
    exchange = await coordinator.request({"stream": True})
    await coordinator.wait_for("response.chunk")
    coordinator.drop_node()
    collected = await exchange.collect()
    assert collected.error.code == "node_gone"  # the coordinator's own note, not a frame from the node
    await asyncio.wait_for(engine.records[0].finished.wait(), 5)
    assert engine.records[0].disconnected
    await coordinator.wait_for_connections(2)
    after = len(coordinator.received)
    await asyncio.sleep(0.1)
    assert [m for m in coordinator.received[after:] if getattr(m, "id", None) == exchange.id] == []


async def test_engine_crash_mid_stream_reaches_an_sse_client_as_an_error_event(coordinator, node, engine) -> None:
    engine.behaviour = Behaviour(tokens=50, crash_after=3)
    async with httpx.AsyncClient(trust_env=False) as client:
        response = await client.post(f"{coordinator.http_url}/chat/completions", json={"stream": True})
    events_ = [line for line in response.text.split("\n\n") if line]
    assert len(events_) == 4
    assert json.loads(events_[-1].removeprefix("data: "))["error"]["code"] == "engine_failed"


async def test_coordinator_rejects_a_bad_hello_with_4400(coordinator) -> None:
    async with connect(coordinator.url, additional_headers={"Authorization": f"Bearer {TOKEN}"}) as ws:
        await ws.send('{"type": "status", "state": "idle"}')
        with pytest.raises(ConnectionClosed):
            await ws.recv()
    assert ws.close_code == 4400


async def test_coordinator_rejects_another_protocol_with_4426(coordinator) -> None:
    async with connect(coordinator.url, additional_headers={"Authorization": f"Bearer {TOKEN}"}) as ws:
        await ws.send(protocol.encode(HELLO.model_copy(update={"protocol": 2})))
        with pytest.raises(ConnectionClosed):
            await ws.recv()
    assert ws.close_code == 4426


async def test_coordinator_answers_a_bad_frame_from_the_node_with_error(coordinator) -> None:
    async with connect(coordinator.url, additional_headers={"Authorization": f"Bearer {TOKEN}"}) as ws:
        await ws.send(protocol.encode(HELLO))
        assert json.loads(await ws.recv())["type"] == "welcome"
        assert json.loads(await ws.recv())["type"] == "assign"
        await ws.send("{broken")
        reply = json.loads(await ws.recv())
    assert (reply["type"], reply["code"]) == ("error", "bad_message")
    assert coordinator.bad_frames


def test_local_assignment_for_a_gguf_file_uses_llamacpp_and_its_size(tmp_path: Path) -> None:
    model = tmp_path / "Tiny-Chat-Q4_K_M.gguf"
    model.write_bytes(b"\0" * (3 * 2**20))
    assign = local_assignment("cpu", str(model))
    assert assign.model.name == "tiny-chat-q4_k_m"
    assert assign.model.vllm is None
    assert (assign.model.llamacpp.source, assign.model.llamacpp.weights_mib) == (str(model), 3)


def test_local_assignment_default_is_a_small_instruct_gguf() -> None:
    assign = local_assignment("cpu")
    assert assign.model.llamacpp is not None
    assert f"{assign.model.llamacpp.source}#sha256={assign.model.llamacpp.sha256}" == DEFAULT_LOCAL_MODEL
    assert assign.model.name == "qwen2.5-0.5b-instruct-q4_k_m"
    assert 300 < assign.model.llamacpp.weights_mib < 1000


def test_local_assignment_of_a_url_needs_its_hash() -> None:
    url = "https://example.org/files/Tiny-1B-Q4_K_M.gguf"
    with pytest.raises(LocalModelError, match="without its sha256"):
        local_assignment("cpu", url)
    with pytest.raises(LocalModelError, match="not a sha256"):
        local_assignment("cpu", url + "#sha256=abc")
    assign = local_assignment("cpu", url + "#sha256=" + "AB" * 32)
    assert assign.model.llamacpp is not None and assign.model.llamacpp.sha256 == "ab" * 32
    assert assign.model.name == "tiny-1b-q4_k_m"


def test_local_assignment_for_a_repo_estimates_from_its_name() -> None:
    assign = local_assignment("native", "Qwen/Qwen2.5-7B-Instruct-AWQ")
    assert assign.model.llamacpp is None
    assert 3500 < assign.model.vllm.weights_mib < 5000


@pytest.mark.parametrize("runtime, model, fragment", [
    ("cpu", "Qwen/Qwen2.5-7B-Instruct", "llama.cpp only"),
    ("native", "Qwen/Qwen2.5-0.5B-Instruct-GGUF", "name one file"),
    ("native", "org/mystery-model", "can't tell how large"),
    ("cpu", "ftp://example.org/m.gguf", "only https://"),
    ("cpu", "/nowhere/at/all.gguf", "does not exist"),
])
def test_local_assignment_refuses_with_a_reason(runtime: str, model: str, fragment: str) -> None:
    with pytest.raises(LocalModelError, match=fragment):
        local_assignment(runtime, model)


def http_port(coordinator: ReferenceCoordinator) -> int:
    return int(coordinator.http_url.rsplit(":", 1)[1].split("/")[0])


async def raw_exchange(coordinator: ReferenceCoordinator, raw: bytes) -> tuple[bytes, bytes]:
    """Sends `raw` (PORT replaced by the endpoint's port) and returns the status line and the rest."""
    port = http_port(coordinator)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw.replace(b"PORT", str(port).encode()))
    status_line = await asyncio.wait_for(reader.readline(), 5)
    rest = await asyncio.wait_for(reader.read(), 5)  # refusals close the connection
    writer.close()
    return status_line, rest


@pytest.mark.parametrize("raw, status, reason", [
    (b"GARBAGE\r\n\r\n", b"400", b"speaks HTTP/1.1"),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:PORT\r\nContent-Length: nope\r\n\r\n", b"400",
     b"not a number"),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:PORT\r\nTransfer-Encoding: chunked\r\n\r\n", b"411",
     b"Content-Length"),
    (b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:PORT\r\nConnection: close\r\n\r\n", b"404", b"no route"),
    (b"GET /v1/models HTTP/1.1\r\n\r\n", b"400", b"no Host header"),
    (b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1:PORT\r\nHost: evil.example\r\n\r\n", b"400",
     b"repeats its Host header"),
])
async def test_http_endpoint_refuses_what_it_cannot_serve(coordinator: ReferenceCoordinator, raw: bytes,
                                                          status: bytes, reason: bytes) -> None:
    status_line, rest = await raw_exchange(coordinator, raw)
    assert status_line.split(b" ")[1] == status
    assert reason in rest


async def test_a_dns_rebinding_request_is_refused_and_never_reaches_the_node(
        coordinator: ReferenceCoordinator, node: MiniNode) -> None:
    """A page at evil.example that rebinds its name to 127.0.0.1 sends `Host: evil.example:PORT`."""
    port = http_port(coordinator)
    async with httpx.AsyncClient(trust_env=False) as client:
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.nip.io", f"127.0.0.1:{port + 1}"):
            refused = await client.post(f"{coordinator.http_url}/chat/completions", json={"messages": []},
                                        headers={"Host": host})
            assert refused.status_code == 403, host
            assert "only answers programs on this computer" in refused.json()["error"]["message"]
            assert repr(host) in refused.json()["error"]["message"]
            assert "access-control-allow-origin" not in refused.headers
        served = await client.post(f"{coordinator.http_url}/completions", json={"prompt": "x", "max_tokens": 1})
    assert served.status_code == 200
    assert [r.path for r in node.requests] == ["/v1/completions"]  # the refused ones never came before it


async def test_a_request_from_a_foreign_web_page_is_refused(coordinator: ReferenceCoordinator,
                                                             node: MiniNode) -> None:
    async with httpx.AsyncClient(trust_env=False) as client:
        refused = await client.post(f"{coordinator.http_url}/chat/completions", json={"messages": []},
                                    headers={"Origin": "https://evil.example"})
        from_a_sandbox = await client.get(f"{coordinator.http_url}/models", headers={"Origin": "null"})
    assert refused.status_code == 403
    assert "the web page at 'https://evil.example'" in refused.json()["error"]["message"]
    assert "access-control-allow-origin" not in refused.headers
    assert from_a_sandbox.status_code == 403
    assert node.requests == []


async def test_a_cors_preflight_from_a_foreign_origin_is_refused(coordinator: ReferenceCoordinator,
                                                                 node: MiniNode) -> None:
    async with httpx.AsyncClient(trust_env=False) as client:
        preflight = await client.options(f"{coordinator.http_url}/chat/completions", headers={
            "Origin": "https://evil.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type"})
    assert preflight.status_code == 403
    assert not [name for name in preflight.headers if name.startswith("access-control-")]
    assert node.requests == []


@pytest.mark.parametrize("headers", [
    {},  # httpx sends Host: 127.0.0.1:PORT
    {"Host": "localhost:PORT"},
    {"Host": "LocalHost"},
    {"Host": "[::1]:PORT"},
    {"Origin": "http://localhost:3000"},
    {"Origin": "https://127.0.0.1"},
    {"Origin": "http://[::1]:PORT"},
])
async def test_programs_and_pages_on_this_computer_are_served(coordinator: ReferenceCoordinator, node: MiniNode,
                                                              headers: dict[str, str]) -> None:
    port = str(http_port(coordinator))
    sent = {name: value.replace("PORT", port) for name, value in headers.items()}
    async with httpx.AsyncClient(trust_env=False) as client:
        answer = await client.post(f"{coordinator.http_url}/completions", json={"prompt": "x", "max_tokens": 2},
                                   headers=sent)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("host, fine", [
    ("127.0.0.1:8090", True), ("localhost", True), ("[::1]:8090", True), ("LOCALHOST:8090", True),
    ("127.0.0.1:8091", False), ("localhost.:8090", False), ("127.0.0.2:8090", False), ("0.0.0.0:8090", False),
    ("::1", False), ("localhost:08090", False), ("evil.example", False), ("localhost.evil.example", False),
])
def test_host_problem_takes_only_loopback_names_on_this_port(host: str, fine: bool) -> None:
    assert (host_problem({"host": host}, 8090) is None) == fine


@pytest.mark.parametrize("origin, fine", [
    ("http://localhost", True), ("https://localhost:3000", True), ("http://127.0.0.1:8090", True),
    ("http://[::1]:1", True), ("http://localhost:0", False), ("http://localhost:65536", False),
    ("http://localhost.evil.example", False), ("http://127.0.0.1.nip.io", False), ("file://", False),
    ("null", False), ("chrome-extension://abc", False), ("http://localhost/path", False), ("", False),
])
def test_origin_problem_takes_only_loopback_origins(origin: str, fine: bool) -> None:
    assert (origin_problem({"origin": origin}) is None) == fine
    assert origin_problem({}) is None  # no Origin: not a browser


async def test_the_http_endpoint_listens_on_loopback_only(coordinator: ReferenceCoordinator) -> None:
    assert coordinator.http_url.startswith("http://127.0.0.1:")
    assert coordinator._http_server is not None
    assert [s.getsockname()[0] for s in coordinator._http_server.sockets] == ["127.0.0.1"]


class _Machine:
    runtime = "cpu"


async def test_local_coordinator_assigns_and_serves_openai(tmp_path: Path, engine, http) -> None:
    model = tmp_path / "tiny.gguf"
    model.write_bytes(b"\0" * 2**20)
    local = await LocalCoordinator(token=TOKEN, machine=_Machine(), model=str(model), openai_port=0).start()
    try:
        assert local.assignment.model.llamacpp.source == str(model)
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


async def test_local_coordinator_falls_back_to_a_free_port_when_8090_is_taken(tmp_path: Path) -> None:
    model = tmp_path / "tiny.gguf"
    model.write_bytes(b"\0" * 2**20)
    first = await LocalCoordinator(token=TOKEN, machine=_Machine(), model=str(model)).start()
    second = await LocalCoordinator(token=TOKEN, machine=_Machine(), model=str(model)).start()
    try:
        assert first.openai_url != second.openai_url
    finally:
        await second.stop()
        await first.stop()


async def test_a_coordinator_that_does_not_record_keeps_nothing_while_relaying(engine, http) -> None:
    """Local mode runs for days: relayed chunks must not pile up in memory."""
    async with ReferenceCoordinator(token=TOKEN, http_port=0, assign=ASSIGN, record=False) as reference:
        mini = MiniNode(reference.url, engine, http)
        task = asyncio.create_task(mini.link.run())
        await reference.wait_for_connections(1)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        async with httpx.AsyncClient(trust_env=False) as client:
            for _ in range(3):
                response = await client.post(f"{reference.http_url}/chat/completions", json=body)
                assert response.status_code == 200 and "[DONE]" in response.text
        assert reference.received == reference.hellos  # one hello a connection; no chunks, no status
        await mini.link.close()
        await asyncio.wait_for(task, 5)
