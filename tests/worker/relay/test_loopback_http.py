from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Self

import httpx
import pytest

from tests.support.fake_engine import Behaviour, FakeEngine
from worker.relay.loopback_http import (
    IDLE_LIMIT_S,
    KEEP_LIMIT,
    READ_SIZE,
    LoopbackClient,
    LoopbackHTTPError,
    decode_chunks,
)

CHAT = "/v1/chat/completions"
OK_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"


@dataclass(frozen=True)
class Reply:
    data: bytes
    then_close: bool = False


def sized(body: bytes) -> Reply:
    return Reply(OK_HEAD + b"Content-Length: %d\r\n\r\n%b" % (len(body), body))


class ScriptedServer:
    """An HTTP/1.1 server on 127.0.0.1 (or the Unix socket `socket_path`) that answers request n
    with `answer(n)`, optionally only once `hold` is set, and counts the connections it accepted
    and saw closed by the client."""

    def __init__(self, answer: Callable[[int], Reply], hold: asyncio.Event | None = None,
                 socket_path: str | None = None) -> None:
        self._answer = answer
        self._hold = hold
        self.socket_path = socket_path
        self._server: asyncio.Server | None = None
        self.accepted = 0
        self.closed_by_client = 0
        self.heads: list[bytes] = []
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        assert self._server is not None
        if self.socket_path is not None:
            return "http://localhost"
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def __aenter__(self) -> Self:
        if self.socket_path is not None:
            self._server = await asyncio.start_unix_server(self._serve, self.socket_path)
        else:
            self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.transport.abort()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self._writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                self.heads.append(head)
                if self._hold is not None:
                    await self._hold.wait()
                reply = self._answer(len(self.heads))
                writer.write(reply.data)
                await writer.drain()
                if reply.then_close:
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_client += 1
            writer.close()


async def eventually(condition: Callable[[], bool], timeout: float = 2.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.005)


@pytest.fixture
async def client() -> AsyncIterator[LoopbackClient]:
    async with LoopbackClient() as lean:
        yield lean


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    async with FakeEngine(served_name="served-m") as fake:
        yield fake


def chat(engine: FakeEngine, client: LoopbackClient, **body: Any) -> Awaitable[Any]:
    document = {"model": engine.served_name, "messages": [], "stream": True, **body}
    request = client.build_request("POST", engine.base_url + CHAT, content=json.dumps(document).encode(),
                                   headers={"Authorization": f"Bearer {engine.api_key}", "Content-Type": "application/json"})
    return client.send(request, stream=True)


async def read_with_httpx(engine: FakeEngine, **body: Any) -> bytes:
    async with httpx.AsyncClient(trust_env=False) as reference:
        response = await reference.post(engine.base_url + CHAT, headers={"Authorization": f"Bearer {engine.api_key}"},
                                        json={"model": engine.served_name, "messages": [], "stream": True, **body})
        return response.content


async def test_chunked_event_stream_matches_what_httpx_reads(engine, client) -> None:
    response = await chat(engine, client)
    body = b"".join([part async for part in response.aiter_raw()])
    await response.aclose()
    assert response.status_code == 200
    assert response.headers.get("Content-Type") == "text/event-stream; charset=utf-8"
    assert body == await read_with_httpx(engine)
    assert body.endswith(b"data: [DONE]\n\n") and body.count(b"data: ") == 18


async def test_chunks_split_byte_by_byte_across_reads_are_joined(engine, client) -> None:
    engine.behaviour = Behaviour(tokens=3, byte_writes=True)
    response = await chat(engine, client)
    body = await response.aread()
    await response.aclose()
    assert body == await read_with_httpx(engine) and "wörld".encode() in body


async def test_content_length_body_and_authorization_reach_the_engine(engine, client) -> None:
    response = await client.post(engine.base_url + CHAT, json={"model": "served-m", "stream": False},
                                 headers={"Authorization": f"Bearer {engine.api_key}"})
    assert response.status_code == 200 and response.headers["content-length"] == str(len(response.content))
    assert '"completion_tokens": 16' in response.text
    assert engine.records[0].headers["authorization"] == f"Bearer {engine.api_key}"


async def test_sequential_requests_reuse_one_connection() -> None:
    async with ScriptedServer(lambda n: sized(b"answer %d" % n)) as server, LoopbackClient() as client:
        texts = [(await client.post(server.url + "/v1/x", content=b"{}")).text for _ in range(3)]
    assert texts == ["answer 1", "answer 2", "answer 3"]
    assert server.accepted == 1
    assert server.heads[0].startswith(b"POST /v1/x HTTP/1.1\r\nHost: 127.0.0.1:")


async def test_connection_close_from_the_server_is_not_reused() -> None:
    close = Reply(OK_HEAD + b"Connection: close\r\nContent-Length: 2\r\n\r\nok")
    async with ScriptedServer(lambda n: close) as server, LoopbackClient() as client:
        for _ in range(2):
            assert (await client.post(server.url + "/v1/x")).text == "ok"
    assert server.accepted == 2


@pytest.mark.parametrize("reply", [
    Reply(OK_HEAD + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n10\r\nabc", then_close=True),
    Reply(OK_HEAD + b"Content-Length: 10\r\n\r\nabc", then_close=True),
    Reply(OK_HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n"),
    Reply(b"HTTP/1.1 200 OK\r\nContent-Le", then_close=True),
    Reply(b"SSH-2.0-OpenSSH\r\n\r\n"),
], ids=["cut-mid-chunk", "cut-content-length", "bad-chunk-size", "cut-head", "not-http"])
async def test_broken_answers_raise_the_one_error(reply: Reply) -> None:
    async with ScriptedServer(lambda n: reply) as server, LoopbackClient() as client:
        with pytest.raises(LoopbackHTTPError):
            response = await client.send(client.build_request("GET", server.url + "/v1/models"))
            await response.aread()


async def test_nothing_listening_raises_the_one_error(engine, client) -> None:
    url = engine.base_url
    await engine.stop()
    with pytest.raises(LoopbackHTTPError, match="could not connect"):
        await client.send(client.build_request("GET", url + "/v1/models"))


async def test_closing_early_disconnects_so_the_engine_stops(engine, client) -> None:
    engine.behaviour = Behaviour(tokens=500, token_delay_s=0.01)
    response = await chat(engine, client)
    async for _ in response.aiter_raw():
        break
    await response.aclose()
    await asyncio.wait_for(engine.records[0].finished.wait(), 2)
    assert engine.records[0].disconnected and engine.records[0].tokens_sent < 500


async def test_cancel_while_waiting_for_the_head_disconnects(engine, client) -> None:
    engine.behaviour = Behaviour(head_delay_s=5.0)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.1):
            await chat(engine, client)
    await asyncio.wait_for(engine.records[0].finished.wait(), 2)
    assert engine.records[0].disconnected


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000/v1/models", "https://127.0.0.1:8000/v1/models",
                                 "http://example.com/v1/models", "http://127.0.0.1.evil.test/v1/models",
                                 "http://user@[::1]:80/"])
def test_anything_but_loopback_http_is_refused(client, url: str) -> None:
    with pytest.raises(ValueError, match="only talks to http://127.0.0.1"):
        client.build_request("GET", url)


def test_a_line_break_in_a_header_is_refused(client) -> None:
    with pytest.raises(ValueError, match="holds a line break"):
        client.build_request("GET", "http://localhost:80/v1/models", headers={"Authorization": "Bearer k\r\nX: y"})


async def test_idle_pool_is_bounded_and_reused() -> None:
    hold = asyncio.Event()
    async with ScriptedServer(lambda n: sized(b"ok"), hold) as server, LoopbackClient(max_idle_per_engine=2) as client:
        pending = [asyncio.create_task(client.post(server.url + "/v1/x")) for _ in range(5)]
        await eventually(lambda: len(server.heads) == 5)
        hold.set()
        assert [r.text for r in await asyncio.gather(*pending)] == ["ok"] * 5
        await eventually(lambda: server.closed_by_client == 3)
        await asyncio.gather(*(client.post(server.url + "/v1/x") for _ in range(2)))
        assert server.accepted == 5  # the two kept idle were used again


async def test_a_connection_idle_near_the_engines_keep_alive_limit_is_not_reused() -> None:
    now = [0.0]
    async with ScriptedServer(lambda n: sized(b"ok")) as server, LoopbackClient(clock=lambda: now[0]) as client:
        await client.post(server.url + "/v1/x")
        now[0] += IDLE_LIMIT_S
        await client.post(server.url + "/v1/x")
        await eventually(lambda: server.closed_by_client == 1)
    assert server.accepted == 2


async def test_giving_a_connection_back_closes_older_ones_gone_stale() -> None:
    now = [0.0]
    hold = asyncio.Event()
    async with ScriptedServer(lambda n: sized(b"ok"), hold) as server, LoopbackClient(clock=lambda: now[0]) as client:
        pending = [asyncio.create_task(client.post(server.url + "/v1/x")) for _ in range(2)]
        await eventually(lambda: len(server.heads) == 2)
        hold.set()
        await asyncio.gather(*pending)
        now[0] = IDLE_LIMIT_S - 1
        await client.post(server.url + "/v1/x")  # takes the newer idle one; the older is still fresh
        assert server.closed_by_client == 0
        now[0] = IDLE_LIMIT_S + 1
        await client.post(server.url + "/v1/x")  # the newer one again; giving it back drops the older
        await eventually(lambda: server.closed_by_client == 1)
    assert server.accepted == 2


async def test_an_http_1_0_answer_is_not_reused() -> None:
    old = Reply(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok")
    async with ScriptedServer(lambda n: old) as server, LoopbackClient() as client:
        for _ in range(2):
            assert (await client.post(server.url + "/v1/x")).text == "ok"
    assert server.accepted == 2


def test_decode_chunks_keeps_partial_chunks_and_reads_past_extensions_and_trailers() -> None:
    assert decode_chunks(b"3;ext=1\r\nabc\r\n4\r\nde") == (b"abc", 14, False)
    with_trailer = b"2\r\nhi\r\n0\r\nX-Trailer: 1\r\n\r\n"
    assert decode_chunks(with_trailer + b"HTTP/1.1") == (b"hi", len(with_trailer), True)
    assert decode_chunks(b"2\r\nhi\r\n0\r\n") == (b"hi", 7, False)
    with pytest.raises(ValueError):
        decode_chunks(b"3\r\nabcXY")


async def test_an_engine_on_a_unix_socket_answers_as_over_tcp(tmp_path, client) -> None:
    socket_path = str(tmp_path / "e0.sock")
    async with FakeEngine(served_name="served-m", socket_path=socket_path) as engine:
        request = client.build_request("POST", engine.base_url + CHAT, socket_path=socket_path,
                                       content=json.dumps({"model": "served-m", "messages": [], "stream": True}).encode(),
                                       headers={"Authorization": f"Bearer {engine.api_key}"})
        response = await client.send(request)
        body = await response.aread()
        await response.aclose()
        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=socket_path), trust_env=False) as ref:
            reference = await ref.post(engine.base_url + CHAT, headers={"Authorization": f"Bearer {engine.api_key}"},
                                       json={"model": "served-m", "messages": [], "stream": True})
    assert response.status_code == 200 and body == reference.content and body.endswith(b"data: [DONE]\n\n")


async def test_each_socket_has_its_own_pool_of_reused_connections(tmp_path) -> None:
    first, second = str(tmp_path / "e0.sock"), str(tmp_path / "e1.sock")
    async with (ScriptedServer(lambda n: sized(b"zero %d" % n), socket_path=first) as zero,
                ScriptedServer(lambda n: sized(b"one %d" % n), socket_path=second) as one,
                LoopbackClient() as client):
        texts = [(await client.post("http://localhost/v1/x", content=b"{}", socket_path=path)).text
                 for path in (first, second, first, second, first)]
    assert texts == ["zero 1", "one 1", "zero 2", "one 2", "zero 3"]
    assert (zero.accepted, one.accepted) == (1, 1)
    assert zero.heads[0].startswith(b"POST /v1/x HTTP/1.1\r\nHost: localhost:80\r\n")


async def test_nothing_at_the_socket_raises_the_one_error(tmp_path, client) -> None:
    missing = str(tmp_path / "gone.sock")
    with pytest.raises(LoopbackHTTPError, match=f"could not connect to the engine at {missing}"):
        await client.send(client.build_request("GET", "http://localhost/v1/models", socket_path=missing))


def test_a_socket_request_still_names_a_loopback_host(tmp_path, client) -> None:
    with pytest.raises(ValueError, match="only talks to http://127.0.0.1"):
        client.build_request("GET", "http://192.168.1.1/v1/models", socket_path=str(tmp_path / "e0.sock"))


# --- stream_to: the body handed on from the socket's read callback (the relay's hot path) -------


async def test_stream_to_hands_on_the_body_read_by_read_as_httpx_reads_it(engine, client) -> None:
    engine.behaviour = Behaviour(tokens=8, token_delay_s=0.005)
    parts: list[bytes] = []
    response = await chat(engine, client)
    await response.stream_to(parts.append)
    await response.aclose()
    assert b"".join(parts) == await read_with_httpx(engine)
    assert len(parts) >= 8  # token by token, as the reads came


async def test_stream_to_after_the_body_arrived_hands_on_what_was_kept() -> None:
    body = b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    reply = Reply(OK_HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + body)
    async with ScriptedServer(lambda n: reply) as server, LoopbackClient() as client:
        response = await client.send(client.build_request("GET", server.url + "/v1/models"))
        await asyncio.sleep(0.05)  # the whole body is read, and kept
        parts: list[bytes] = []
        await response.stream_to(parts.append)
        await response.aclose()
        assert b"".join(parts) == b"hello world"
        assert (await client.post(server.url + "/v1/x")).status_code == 200
    assert server.accepted == 1


async def test_a_sink_that_raises_ends_the_answer_with_its_error_and_the_engine_stops(engine, client) -> None:
    engine.behaviour = Behaviour(tokens=500, token_delay_s=0.01)

    class Gone(Exception):
        pass

    def sink(data: bytes) -> None:
        raise Gone

    response = await chat(engine, client)
    with pytest.raises(Gone):
        await response.stream_to(sink)
    await response.aclose()
    await asyncio.wait_for(engine.records[0].finished.wait(), 2)
    assert engine.records[0].disconnected and engine.records[0].tokens_sent < 500


async def test_a_body_cut_short_fails_stream_to_with_the_one_error() -> None:
    cut = Reply(OK_HEAD + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n10\r\nabc", then_close=True)
    async with ScriptedServer(lambda n: cut) as server, LoopbackClient() as client:
        response = await client.send(client.build_request("GET", server.url + "/v1/models"))
        parts: list[bytes] = []
        with pytest.raises(LoopbackHTTPError, match="broke off"):
            await response.stream_to(parts.append)
        assert b"".join(parts) == b"hello"  # what did arrive was handed on first


async def test_a_slow_reader_holds_a_bounded_backlog_and_loses_nothing() -> None:
    body = bytes(range(256)) * (6 * 4096)  # 6 MiB
    async with ScriptedServer(lambda n: sized(body)) as server, LoopbackClient() as client:
        response = await client.send(client.build_request("GET", server.url + "/v1/models"))
        received, most_kept = bytearray(), 0
        async for part in response.aiter_raw():
            received += part
            await asyncio.sleep(0.01)  # a reader slower than loopback
            most_kept = max(most_kept, response._answer._kept)  # body bytes held, not yet taken
        await response.aclose()
    assert bytes(received) == body
    assert most_kept <= KEEP_LIMIT + READ_SIZE  # reading paused instead of holding the whole body


async def test_a_full_unix_socket_backlog_is_waited_out_not_failed(tmp_path) -> None:
    path = str(tmp_path / "busy.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)  # a burst beyond this gets EAGAIN on Linux, not a queue
    listener.setblocking(False)
    loop = asyncio.get_running_loop()

    async def answer_one() -> None:
        connection, _ = await loop.sock_accept(listener)
        await loop.sock_recv(connection, 65536)
        await loop.sock_sendall(connection, OK_HEAD + b"Connection: close\r\nContent-Length: 2\r\n\r\nok")
        connection.close()

    try:
        async with LoopbackClient() as client:
            requests = [asyncio.create_task(client.post("http://localhost/v1/x", socket_path=path)) for _ in range(4)]
            await asyncio.sleep(0.1)
            assert not any(r.done() for r in requests)  # waiting their turn, none failed
            for _ in requests:
                await answer_one()
            assert [r.text for r in await asyncio.gather(*requests)] == ["ok"] * 4
    finally:
        listener.close()
