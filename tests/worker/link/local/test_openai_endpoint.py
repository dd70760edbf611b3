"""The OpenAI-compatible endpoint: HTTP in front of the reference coordinator, for this computer only
and for callers with its key."""

from __future__ import annotations

import asyncio
import errno
import json
import socket
from collections.abc import AsyncIterator

import httpx
import pytest

from tests.support.fake_engine import Behaviour, FakeEngine
from tests.worker.link.local.nodes import KEY, MiniNode, ScriptedNode
from worker.contract import protocol
from worker.link.local import OpenAIEndpoint, ReferenceCoordinator, host_problem, openai_endpoint, origin_problem
from worker.link.local.coordinator import DEFAULT_DEADLINE_S


def client(key: str | None = KEY) -> httpx.AsyncClient:
    """A program on this computer that sends `key` (None: no Authorization header)."""
    return httpx.AsyncClient(trust_env=False, headers={"Authorization": f"Bearer {key}"} if key is not None else {})


async def direct_stream(engine: FakeEngine, http: httpx.AsyncClient, body: dict[str, object]) -> str:
    response = await http.post(f"{engine.base_url}/v1/chat/completions", json=body,
                               headers={"Authorization": f"Bearer {engine.api_key}"})
    return response.text


def port_of(endpoint: OpenAIEndpoint) -> int:
    return int(endpoint.url.rsplit(":", 1)[1].split("/")[0])


async def raw_exchange(endpoint: OpenAIEndpoint, raw: bytes) -> tuple[int, bytes]:
    """Sends `raw` (PORT and KEY replaced by the endpoint's); the answer's status and body."""
    port = port_of(endpoint)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw.replace(b"PORT", str(port).encode()).replace(b"KEY", KEY.encode()))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines if ":" in line)}
        body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", "0"))), 5)
    finally:
        writer.close()
    return int(status_line.split(" ")[1]), body


# --- relaying --------------------------------------------------------------------------------

async def test_curl_streaming_chat_through_the_node_is_byte_for_byte(
        coordinator: ReferenceCoordinator, endpoint: OpenAIEndpoint, node: MiniNode, engine: FakeEngine,
        http: httpx.AsyncClient) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with client() as http_client:
        response = await http_client.post(f"{endpoint.url}/chat/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["transfer-encoding"] == "chunked"
    assert response.text == await direct_stream(engine, http, {**body, "model": "served-tiny"})
    end = await coordinator.wait_for("response.end")
    assert end.usage == protocol.Usage(prompt_tokens=9, completion_tokens=16)


async def test_curl_non_streaming_completion_and_models(endpoint: OpenAIEndpoint, node: MiniNode) -> None:
    async with client() as http_client:
        answer = await http_client.post(f"{endpoint.url}/completions", json={"prompt": "x", "max_tokens": 3})
        models = await http_client.get(f"{endpoint.url}/models")
    assert answer.status_code == 200
    assert answer.json()["usage"]["completion_tokens"] == 3
    assert [m["id"] for m in models.json()["data"]] == ["tiny"]
    assert [r.path for r in node.requests] == ["/v1/completions"]  # /v1/models is answered here


async def test_a_chunked_body_is_relayed_like_any_other(endpoint: OpenAIEndpoint, node: MiniNode) -> None:
    async def parts() -> AsyncIterator[bytes]:
        yield b'{"prompt": "x", '
        yield b'"max_tokens": 2}'

    async with client() as http_client:
        answer = await http_client.post(f"{endpoint.url}/completions", content=parts())
    assert answer.status_code == 200, answer.text
    assert node.requests[0].body == {"prompt": "x", "max_tokens": 2}


@pytest.mark.parametrize("sent, deadline", [("7", 7.0), ("0.5", 0.5), ("9999", DEFAULT_DEADLINE_S),
                                             ("0", DEFAULT_DEADLINE_S), ("soon", DEFAULT_DEADLINE_S)])
async def test_x_deadline_s_can_only_shorten_the_deadline(endpoint: OpenAIEndpoint, node: MiniNode,
                                                          sent: str, deadline: float) -> None:
    async with client() as http_client:
        answer = await http_client.post(f"{endpoint.url}/completions", json={"prompt": "x", "max_tokens": 1},
                                        headers={"X-Deadline-S": sent})
    assert answer.status_code == 200
    assert (node.requests[0].path, node.requests[0].deadline_s) == ("/v1/completions", deadline)


async def test_http_without_a_node_is_503(endpoint: OpenAIEndpoint) -> None:
    async with client() as http_client:
        response = await http_client.post(f"{endpoint.url}/chat/completions", json={"messages": []})
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "no_node"


async def test_http_bad_json_is_400(endpoint: OpenAIEndpoint, node: MiniNode) -> None:
    async with client() as http_client:
        response = await http_client.post(f"{endpoint.url}/chat/completions", content=b"{nope",
                                          headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert "not JSON" in response.json()["error"]["message"]
    assert node.requests == []


async def test_paused_node_answers_http_with_503_paused(endpoint: OpenAIEndpoint, node: MiniNode) -> None:
    node.paused = True
    async with client() as http_client:
        response = await http_client.post(f"{endpoint.url}/chat/completions", json={"stream": True})
    assert response.status_code == 503
    assert response.json()["error"] == {"message": response.json()["error"]["message"], "type": "paused",
                                         "code": "paused"}


async def test_http_client_leaving_mid_stream_cancels_the_generation(
        coordinator: ReferenceCoordinator, endpoint: OpenAIEndpoint, node: MiniNode, engine: FakeEngine) -> None:
    engine.behaviour = Behaviour(tokens=1000, token_delay_s=0.01)
    async with (
        client() as http_client,
        http_client.stream("POST", f"{endpoint.url}/chat/completions", json={"stream": True}) as response,
    ):
        async for _ in response.aiter_raw():
            break
    await asyncio.wait_for(engine.records[0].finished.wait(), 5)
    assert engine.records[0].disconnected and engine.records[0].tokens_sent < 1000
    cancelled = await coordinator.wait_for("response.error")
    assert (cancelled.status, cancelled.code) == (499, "cancelled")
    assert node.relay.in_flight == 0


async def test_http_client_leaving_before_the_first_byte_cancels_the_request(
        coordinator: ReferenceCoordinator, endpoint: OpenAIEndpoint, node: MiniNode, engine: FakeEngine) -> None:
    """No frame arrives while the engine thinks; the client's leaving alone must reach the node."""
    engine.behaviour = Behaviour(head_delay_s=30)
    async with client() as http_client:
        with pytest.raises(httpx.ReadTimeout):
            await http_client.post(f"{endpoint.url}/chat/completions", json={"stream": True}, timeout=0.5)
    cancelled = await coordinator.wait_for("response.error", timeout=5)
    assert (cancelled.status, cancelled.code) == (499, "cancelled")
    await asyncio.wait_for(engine.records[0].finished.wait(), 5)
    assert engine.records[0].disconnected


async def test_engine_crash_mid_stream_reaches_an_sse_client_as_an_error_event(
        endpoint: OpenAIEndpoint, node: MiniNode, engine: FakeEngine) -> None:
    engine.behaviour = Behaviour(tokens=50, crash_after=3)
    async with client() as http_client:
        response = await http_client.post(f"{endpoint.url}/chat/completions", json={"stream": True})
    events = [line for line in response.text.split("\n\n") if line]
    assert len(events) == 4
    assert json.loads(events[-1].removeprefix("data: "))["error"]["code"] == "engine_failed"


async def test_a_json_answer_cut_short_reaches_the_client_as_a_broken_response(
        coordinator: ReferenceCoordinator, endpoint: OpenAIEndpoint) -> None:
    """A JSON body cannot carry an error after its start: the client must see it incomplete."""
    def script(request_id: str) -> list[protocol.NodeMessage]:
        return [protocol.ResponseHead(id=request_id, status=200, content_type="application/json"),
                protocol.ResponseChunk(id=request_id, data='{"choices": ['),
                protocol.ResponseError(id=request_id, status=502, code="engine_failed", message="the engine died")]

    async with ScriptedNode(coordinator.url, script):
        await coordinator.wait_for_connections(1)
        async with client() as http_client:
            with pytest.raises(httpx.RemoteProtocolError):
                await http_client.post(f"{endpoint.url}/completions", json={"prompt": "x"})


async def test_an_answer_without_a_head_is_a_502(coordinator: ReferenceCoordinator,
                                                 endpoint: OpenAIEndpoint) -> None:
    def script(request_id: str) -> list[protocol.NodeMessage]:
        return [protocol.ResponseChunk(id=request_id, data="stray"), protocol.ResponseEnd(id=request_id)]

    async with ScriptedNode(coordinator.url, script):
        await coordinator.wait_for_connections(1)
        async with client() as http_client:
            response = await http_client.post(f"{endpoint.url}/completions", json={"prompt": "x"})
    assert response.status_code == 502
    assert "no response.head" in response.json()["error"]["message"]


# --- what it refuses ---------------------------------------------------------------------------

@pytest.mark.parametrize("raw, status, reason", [
    (b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:PORT\r\nAuthorization: Bearer KEY\r\n\r\n", 404,
     b"no route GET /metrics"),
    (b"DELETE /v1/models HTTP/1.1\r\nHost: 127.0.0.1:PORT\r\nAuthorization: Bearer KEY\r\n\r\n", 404,
     b"no route DELETE /v1/models"),
    (b"GET /v1/models HTTP/1.1\r\nHost: \r\n\r\n", 400, b"no Host header"),
    (b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1:PORT\r\nOrigin: http://localhost\r\nOrigin: https://evil.example"
     b"\r\n\r\n", 400, b"repeats its Origin header"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:PORT\r\nAuthorization: Bearer KEY\r\n"
     b"Content-Length: 99999999\r\n\r\n", 413, b"the body is over"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:PORT\r\nContent-Length: 99999999\r\n\r\n", 401,
     b"needs its key"),
    (b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1:PORT\r\nAuthorization: Bearer KEY\r\n"
     b"Authorization: Bearer wrong\r\n\r\n", 400, b"repeats its Authorization header"),
])
async def test_http_endpoint_refuses_what_it_cannot_serve(endpoint: OpenAIEndpoint, node: MiniNode, raw: bytes,
                                                          status: int, reason: bytes) -> None:
    answered, body = await raw_exchange(endpoint, raw)
    assert answered == status
    assert reason in json.loads(body)["error"]["message"].encode()
    assert node.requests == []


@pytest.mark.parametrize("raw", [
    b"GARBAGE\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:PORT\r\nContent-Length: nope\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1:PORT\r\nHost: evil.example\r\n\r\n",
])
async def test_malformed_http_is_refused_by_the_server(endpoint: OpenAIEndpoint, node: MiniNode,
                                                       raw: bytes) -> None:
    answered, _ = await raw_exchange(endpoint, raw)
    assert answered == 400
    assert node.requests == []


@pytest.mark.parametrize("chunked", [False, True])
async def test_a_body_too_large_for_one_frame_is_refused(coordinator: ReferenceCoordinator, node: MiniNode,
                                                         monkeypatch: pytest.MonkeyPatch, chunked: bool) -> None:
    monkeypatch.setattr(openai_endpoint, "MAX_BODY_BYTES", 1000)

    async def parts() -> AsyncIterator[bytes]:
        yield b'{"prompt": "' + b"x" * 2000 + b'"}'

    async with OpenAIEndpoint(coordinator, key=KEY) as small, client() as http_client:
        content = parts() if chunked else b'{"prompt": "' + b"x" * 2000 + b'"}'
        refused = await http_client.post(f"{small.url}/completions", content=content)
    assert refused.status_code == 413
    assert refused.json()["error"]["code"] == "too_large"
    assert node.requests == []


async def test_a_dns_rebinding_request_is_refused_and_never_reaches_the_node(
        endpoint: OpenAIEndpoint, node: MiniNode) -> None:
    """A page at evil.example that rebinds its name to 127.0.0.1 sends `Host: evil.example:PORT`."""
    port = port_of(endpoint)
    async with client() as http_client:
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.nip.io", f"127.0.0.1:{port + 1}"):
            refused = await http_client.post(f"{endpoint.url}/chat/completions", json={"messages": []},
                                             headers={"Host": host})
            assert refused.status_code == 403, host
            assert "only answers programs on this computer" in refused.json()["error"]["message"]
            assert repr(host) in refused.json()["error"]["message"]
            assert "access-control-allow-origin" not in refused.headers
        served = await http_client.post(f"{endpoint.url}/completions", json={"prompt": "x", "max_tokens": 1})
    assert served.status_code == 200
    assert [r.path for r in node.requests] == ["/v1/completions"]  # the refused ones never came before it


async def test_a_request_from_a_foreign_web_page_is_refused(endpoint: OpenAIEndpoint, node: MiniNode) -> None:
    async with client() as http_client:
        refused = await http_client.post(f"{endpoint.url}/chat/completions", json={"messages": []},
                                         headers={"Origin": "https://evil.example"})
        from_a_sandbox = await http_client.get(f"{endpoint.url}/models", headers={"Origin": "null"})
    assert refused.status_code == 403
    assert "the web page at 'https://evil.example'" in refused.json()["error"]["message"]
    assert "access-control-allow-origin" not in refused.headers
    assert from_a_sandbox.status_code == 403
    assert node.requests == []


async def test_a_cors_preflight_from_a_foreign_origin_is_refused(endpoint: OpenAIEndpoint, node: MiniNode) -> None:
    async with client() as http_client:
        preflight = await http_client.options(f"{endpoint.url}/chat/completions", headers={
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
async def test_programs_and_pages_on_this_computer_are_served(endpoint: OpenAIEndpoint, node: MiniNode,
                                                              headers: dict[str, str]) -> None:
    port = str(port_of(endpoint))
    sent = {name: value.replace("PORT", port) for name, value in headers.items()}
    async with client() as http_client:
        answer = await http_client.post(f"{endpoint.url}/completions", json={"prompt": "x", "max_tokens": 2},
                                        headers=sent)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 2
    assert not [name for name in answer.headers if name.startswith("access-control-")]


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


async def test_the_http_endpoint_listens_on_loopback_only(endpoint: OpenAIEndpoint) -> None:
    assert endpoint.url.startswith("http://127.0.0.1:")
    port = port_of(endpoint)
    assert sorted((address[0], address[1]) for address in endpoint.addresses) == [("127.0.0.1", port), ("::1", port)]


async def test_a_taken_port_raises_and_leaves_nothing_behind(coordinator: ReferenceCoordinator,
                                                             endpoint: OpenAIEndpoint) -> None:
    with pytest.raises(OSError):
        await OpenAIEndpoint(coordinator, key=KEY, port=port_of(endpoint)).start()


@pytest.mark.parametrize("family, loopback", [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")])
async def test_a_port_another_program_holds_on_either_loopback_is_an_error(
        coordinator: ReferenceCoordinator, family: socket.AddressFamily, loopback: str) -> None:
    """A squatter on ::1 would get what a client of `localhost:PORT` sends (key and prompts) first."""
    with socket.socket(family) as squatter:
        squatter.bind((loopback, 0))
        squatter.listen()
        with pytest.raises(OSError) as raised:
            await OpenAIEndpoint(coordinator, key=KEY, port=squatter.getsockname()[1]).start()
    assert raised.value.errno == errno.EADDRINUSE


# --- the key ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("authorization", [
    None, "", "Bearer", f"Bearer {KEY[:-1]}", f"Bearer {KEY}x", f"bearer {KEY}", KEY, f"Basic {KEY}",
    f"Bearer {KEY[:-1]}\u00e9".encode(),
])
async def test_a_request_without_the_key_is_401_on_every_path_and_never_reaches_the_node(
        endpoint: OpenAIEndpoint, node: MiniNode, engine: FakeEngine, authorization: str | bytes | None) -> None:
    headers = {"Authorization": authorization} if authorization is not None else {}
    async with client(None) as http_client:
        for method, path in (("POST", "/chat/completions"), ("POST", "/completions"), ("GET", "/models"),
                             ("GET", "/../metrics"), ("OPTIONS", "/chat/completions")):
            refused = await http_client.request(method, f"{endpoint.url}{path}", json={"prompt": "x"},
                                                headers=headers)
            assert refused.status_code == 401, (method, path, refused.text)
            assert refused.json()["error"]["code"] == "unauthorized"
            assert "gpu-provider status" in refused.json()["error"]["message"]
            assert refused.headers["www-authenticate"] == "Bearer"
    assert node.requests == [] and engine.records == []


async def test_with_the_key_the_same_request_is_served(endpoint: OpenAIEndpoint, node: MiniNode) -> None:
    async with client() as http_client:
        served = await http_client.post(f"{endpoint.url}/completions", json={"prompt": "x", "max_tokens": 1})
    assert served.status_code == 200, served.text
    assert [r.path for r in node.requests] == ["/v1/completions"]


def test_an_endpoint_without_a_key_cannot_be_made(coordinator: ReferenceCoordinator) -> None:
    with pytest.raises(ValueError, match="key"):
        OpenAIEndpoint(coordinator, key="")
