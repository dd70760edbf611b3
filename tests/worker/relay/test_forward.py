from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.support.fake_engine import Behaviour, FakeEngine
from tests.support.wire import TERMINAL, Wire
from worker.contract import protocol
from worker.link.connection import Link
from worker.link.local import ReferenceCoordinator
from worker.relay.forward import PROGRESS_EVERY_S, EngineTarget, Relay, RelayHooks, engine_http_client
from worker.relay.body import MAX_BODY_DEPTH, StreamFilter, media_by_url

CHAT = "/v1/chat/completions"


class Recorder(RelayHooks):
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def on_start(self, request_id: str, engine_id: str, t: float) -> None:
        self.calls.append(("start", request_id, engine_id))

    def on_first_token(self, request_id: str, t: float) -> None:
        self.calls.append(("first", request_id))

    def on_end(self, request_id: str, engine_id: str, t: float, usage: protocol.Usage | None, ok: bool) -> None:
        self.calls.append(("end", request_id, engine_id, usage, ok))


class ProgressRecorder(Recorder):
    def on_progress(self, request_id: str, events: int, t: float) -> None:
        self.calls.append(("progress", request_id, events, t))


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    async with FakeEngine(served_name="served-m") as fake:
        yield fake


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with engine_http_client() as client:
        yield client


def target_of(engine: FakeEngine, engine_id: str = "e0") -> EngineTarget:
    return EngineTarget(engine_id, engine.base_url, engine.api_key, engine.served_name, engine.socket_path)


def make_relay(wire: Wire, http: httpx.AsyncClient, *engines: FakeEngine, gate: Any = None,
               hooks: RelayHooks | None = None) -> Relay:
    targets = [target_of(e, f"e{i}") for i, e in enumerate(engines)]
    return Relay(wire, lambda: targets, gate or (lambda: None), http=http, hooks=hooks)


def request(request_id: str = "r-1", *, stream: bool = True, path: str = CHAT, method: str = "POST",
            deadline_s: float = 30.0, **body: Any) -> protocol.Request:
    document = {"model": "public-name", "messages": [{"role": "user", "content": "hi"}], "stream": stream, **body}
    return protocol.Request(id=request_id, method=method, path=path, body=document, deadline_s=deadline_s)


async def direct(engine: FakeEngine, http: httpx.AsyncClient, body: dict[str, Any], path: str = CHAT) -> str:
    response = await http.post(engine.base_url + path, json={**body, "model": engine.served_name},
                               headers={"Authorization": f"Bearer {engine.api_key}"})
    return response.content.decode("utf-8")


async def test_stream_is_relayed_byte_for_byte_with_usage_asked_for_and_left_out(engine, http) -> None:
    wire = Wire()
    await make_relay(wire, http, engine).handle(request())
    frames = wire.of("r-1")
    assert isinstance(frames[0], protocol.ResponseHead)
    assert (frames[0].status, frames[0].content_type) == (200, "text/event-stream; charset=utf-8")
    assert frames[-1] == protocol.ResponseEnd(id="r-1", usage=protocol.Usage(prompt_tokens=9, completion_tokens=16))
    assert wire.data("r-1") == await direct(engine, http, {"messages": [], "stream": True})
    assert '"usage"' not in wire.data("r-1")
    seen = engine.records[0]
    assert seen.body["model"] == "served-m"
    assert seen.body["stream_options"] == {"include_usage": True}
    assert seen.headers["authorization"] == f"Bearer {engine.api_key}"


async def test_usage_chunk_stays_when_the_caller_asked_for_it(engine, http) -> None:
    wire = Wire()
    options = {"stream_options": {"include_usage": True}}
    await make_relay(wire, http, engine).handle(request(**options))
    assert wire.data("r-1") == await direct(engine, http, {"stream": True, **options})
    assert '"usage"' in wire.data("r-1")
    assert wire.terminals("r-1")[0].usage == protocol.Usage(prompt_tokens=9, completion_tokens=16)


async def test_multibyte_characters_split_across_reads_arrive_whole(engine, http) -> None:
    engine.behaviour = Behaviour(tokens=6, byte_writes=True)
    wire = Wire()
    await make_relay(wire, http, engine).handle(request())
    relayed = wire.data("r-1")
    assert "\ufffd" not in relayed
    assert "😀" in relayed and "€" in relayed
    assert relayed == await direct(engine, http, {"stream": True})


async def test_non_streaming_answer_is_relayed_whole_with_usage(engine, http) -> None:
    wire = Wire()
    await make_relay(wire, http, engine).handle(request(stream=False, path="/v1/completions", max_tokens=5))
    head, *chunks, end = wire.of("r-1")
    assert (head.status, head.content_type) == (200, "application/json")
    assert json.loads("".join(c.data for c in chunks))["usage"]["completion_tokens"] == 5
    assert end.usage == protocol.Usage(prompt_tokens=9, completion_tokens=5)


async def test_get_models_is_relayed(engine, http) -> None:
    wire = Wire()
    await make_relay(wire, http, engine).handle(protocol.Request(id="m", method="GET", path="/v1/models"))
    assert json.loads(wire.data("m"))["data"][0]["id"] == "served-m"
    assert isinstance(wire.terminals("m")[0], protocol.ResponseEnd)


@pytest.mark.parametrize("method, path", [
    ("PUT", CHAT), ("DELETE", CHAT), ("GET", "/metrics"), ("POST", "/v1/../slots"),
    ("POST", "/v1/%2e%2e/slots"), ("GET", "/v1x/models"), ("GET", "/v1/models#x"), ("POST", "/v1/a\\..\\b"),
])
async def test_only_get_and_post_under_v1_are_relayed(engine, http, method: str, path: str) -> None:
    wire = Wire()
    await make_relay(wire, http, engine).handle(protocol.Request(id="x", method=method, path=path))
    (error,) = wire.of("x")
    assert (error.type, error.status, error.code) == ("response.error", 400, "bad_request")
    assert engine.records == []


@pytest.mark.parametrize("code", ["paused", "draining", "tuning", "not_ready"])
async def test_gate_refuses_with_503_and_its_code(engine, http, code: str) -> None:
    wire = Wire()
    await make_relay(wire, http, engine, gate=lambda: code).handle(request())
    (error,) = wire.of("r-1")
    assert (error.status, error.code) == (503, code)
    assert error.message
    assert engine.records == []


async def test_a_tuning_node_without_a_ready_engine_says_tuning(http) -> None:
    """Trial engines are no serving engines: the caller learns why there is none, and that it passes."""
    wire = Wire()
    await make_relay(wire, http, gate=lambda: "tuning").handle(request())
    (error,) = wire.of("r-1")
    assert (error.status, error.code) == (503, "tuning") and "settings" in error.message


async def test_no_ready_engine_is_503_not_ready(http) -> None:
    wire = Wire()
    await make_relay(wire, http).handle(request())
    assert [(f.status, f.code) for f in wire.of("r-1")] == [(503, "not_ready")]


async def test_cancel_closes_the_engine_request_and_ends_with_one_499(engine, http) -> None:
    engine.behaviour = Behaviour(tokens=500, token_delay_s=0.01)
    wire, hooks = Wire(), Recorder()
    relay = make_relay(wire, http, engine, hooks=hooks)
    task = relay.handle(request())
    while not wire.data("r-1"):
        await asyncio.sleep(0.01)
    assert relay.cancel("r-1")
    await task
    await asyncio.wait_for(engine.records[0].finished.wait(), 2)
    assert engine.records[0].disconnected and engine.records[0].tokens_sent < 500
    (terminal,) = wire.terminals("r-1")
    assert (terminal.status, terminal.code) == (499, "cancelled")
    assert relay.in_flight == 0
    assert hooks.calls[-1][:3] == ("end", "r-1", "e0") and hooks.calls[-1][4] is False


async def test_cancel_right_behind_its_request_still_ends_it_once(engine, http) -> None:
    """The cancel arrives before the request's task first runs: one 499, nothing in flight."""
    wire, hooks = Wire(), Recorder()
    relay = make_relay(wire, http, engine, hooks=hooks)
    task = relay.handle(request())
    assert relay.cancel("r-1")
    with contextlib.suppress(asyncio.CancelledError):
        await task
    for _ in range(100):
        if wire.terminals("r-1"):
            break
        await asyncio.sleep(0.01)
    (terminal,) = wire.terminals("r-1")
    assert (terminal.status, terminal.code) == (499, "cancelled")
    assert relay.in_flight == 0 and engine.records == []
    assert hooks.calls == [("end", "r-1", "e0", None, False)]


async def test_cancel_of_an_unknown_request_does_nothing(engine, http) -> None:
    relay = make_relay(Wire(), http, engine)
    assert relay.cancel("nope") is False


async def test_deadline_before_the_head_is_504_and_never_retried(engine, http) -> None:
    engine.behaviour = Behaviour(head_delay_s=1.0)
    wire = Wire()
    await make_relay(wire, http, engine).handle(request(deadline_s=0.1))
    (error,) = wire.of("r-1")
    assert (error.status, error.code) == (504, "deadline")
    assert '"stream": true' in error.message
    await asyncio.wait_for(engine.records[0].finished.wait(), 2)
    assert engine.records[0].disconnected  # the engine request was closed, not left running
    await asyncio.sleep(0.05)
    assert len(engine.records) == 1


async def test_deadline_bounds_a_non_streaming_request_as_a_whole(engine, http) -> None:
    engine.behaviour = Behaviour(tokens=100, token_delay_s=0.01)
    wire = Wire()
    await make_relay(wire, http, engine).handle(request(stream=False, deadline_s=0.2))
    assert [(f.status, f.code) for f in wire.of("r-1")] == [(504, "deadline")]
    assert len(engine.records) == 1


async def test_deadline_does_not_cut_a_stream_after_its_head(engine, http) -> None:
    engine.behaviour = Behaviour(tokens=40, token_delay_s=0.02)
    wire = Wire()
    await make_relay(wire, http, engine).handle(request(deadline_s=0.4))
    assert wire.terminals("r-1")[0].usage.completion_tokens == 40


async def test_engine_dying_mid_stream_is_exactly_one_502(engine, http) -> None:
    engine.behaviour = Behaviour(tokens=50, crash_after=5)
    wire, hooks = Wire(), Recorder()
    await make_relay(wire, http, engine, hooks=hooks).handle(request())
    frames = wire.of("r-1")
    assert isinstance(frames[0], protocol.ResponseHead)
    assert wire.data("r-1").count("data: ") == 5
    (error,) = wire.terminals("r-1")
    assert (error.status, error.code) == (502, "engine_failed")
    assert frames[-1] is error
    assert hooks.calls[-1][4] is False


async def test_engine_not_listening_is_502(engine, http) -> None:
    target = target_of(engine)
    await engine.stop()
    wire = Wire()
    relay = Relay(wire, lambda: [target], lambda: None, http=http)
    await relay.handle(request())
    assert [(f.status, f.code) for f in wire.of("r-1")] == [(502, "engine_failed")]


async def test_socket_drop_cancels_upstream_and_sends_nothing(engine, http) -> None:
    engine.behaviour = Behaviour(tokens=500, token_delay_s=0.01)
    wire = Wire()
    relay = make_relay(wire, http, engine)
    tasks = [relay.handle(request(f"r-{i}")) for i in range(3)]
    while len(engine.records) < 3 or not all(r.tokens_sent for r in engine.records):
        await asyncio.sleep(0.01)
    wire.open = False
    sent_before = len(wire.frames)
    assert relay.cancel_all("the coordinator is gone") == 3
    await asyncio.gather(*tasks)
    await asyncio.wait_for(asyncio.gather(*(r.finished.wait() for r in engine.records)), 2)
    assert all(r.disconnected for r in engine.records)
    assert len(wire.frames) == sent_before
    assert relay.in_flight == 0


async def test_a_closed_connection_stops_the_request_without_a_terminal(engine, http) -> None:
    engine.behaviour = Behaviour(tokens=500, token_delay_s=0.01)
    wire = Wire()
    relay = make_relay(wire, http, engine)
    task = relay.handle(request())
    while not wire.data("r-1"):
        await asyncio.sleep(0.01)
    wire.open = False
    await asyncio.wait_for(task, 2)
    await asyncio.wait_for(engine.records[0].finished.wait(), 2)
    assert engine.records[0].disconnected
    assert wire.terminals("r-1") == []


async def test_a_congested_connection_stops_the_engine_reads_until_it_drains(engine, http) -> None:
    engine.behaviour = Behaviour(tokens=30, token_delay_s=0.005)

    class SlowCoordinator(Wire):
        def post(self, frame: str) -> bool:
            self.congested = True  # every chunk fills the connection up
            return super().post(frame)

    wire = SlowCoordinator()
    task = make_relay(wire, http, engine).handle(request())
    async with asyncio.timeout(5):
        while not wire.data("r-1"):
            await asyncio.sleep(0.005)
    await asyncio.sleep(0.2)  # the engine streams on; the relay reads none of it
    assert len(wire.of("r-1")) == 2 and not task.done()  # the head and the one chunk
    while not task.done():
        wire.drain()  # the coordinator catches up, each time
        await asyncio.sleep(0.01)
    assert wire.data("r-1") == await direct(engine, http, {"messages": [], "stream": True})  # on the same connection
    assert wire.terminals("r-1") == [protocol.ResponseEnd(
        id="r-1", usage=protocol.Usage(prompt_tokens=9, completion_tokens=30))]


async def test_answer_goes_to_the_outlet_it_arrived_with(engine, http) -> None:
    default, bound = Wire(), Wire()
    await make_relay(default, http, engine).handle(request(), bound)
    assert default.frames == []
    assert isinstance(bound.terminals("r-1")[0], protocol.ResponseEnd)


async def test_drain_lets_in_flight_finish_and_refuses_new_ones(engine, http) -> None:
    engine.behaviour = Behaviour(tokens=20, token_delay_s=0.01)
    wire = Wire()
    relay = make_relay(wire, http, engine)
    first = relay.handle(request("r-1"))
    await asyncio.sleep(0.02)
    drained = asyncio.create_task(relay.drain(timeout=5))
    await asyncio.sleep(0)
    await relay.handle(request("r-2"))
    assert await drained == 0
    await first
    assert isinstance(wire.terminals("r-1")[0], protocol.ResponseEnd)
    assert [(f.status, f.code) for f in wire.of("r-2")] == [(503, "paused")]


async def test_drain_timeout_ends_the_rest_with_one_503(engine, http) -> None:
    engine.behaviour = Behaviour(tokens=500, token_delay_s=0.01)
    wire = Wire()
    relay = make_relay(wire, http, engine)
    task = relay.handle(request())
    await asyncio.sleep(0.05)
    assert await relay.drain(timeout=0.05, code="draining") == 1
    await task
    (terminal,) = wire.terminals("r-1")
    assert (terminal.status, terminal.code) == (503, "draining")
    await asyncio.wait_for(engine.records[0].finished.wait(), 2)
    assert engine.records[0].disconnected


async def test_requests_go_to_the_least_loaded_engine(http) -> None:
    slow = Behaviour(tokens=50, token_delay_s=0.01)
    async with FakeEngine(behaviour=slow) as one, FakeEngine(behaviour=slow) as two:
        wire = Wire()
        relay = make_relay(wire, http, one, two)
        tasks = [relay.handle(request(f"r-{i}")) for i in range(4)]
        assert relay.in_flight_by_engine() == {"e0": 2, "e1": 2}
        await asyncio.gather(*tasks)
        assert (len(one.records), len(two.records)) == (2, 2)
        assert relay.in_flight_by_engine() == {}


async def test_hooks_see_start_first_token_and_end(engine, http) -> None:
    hooks = Recorder()
    await make_relay(Wire(), http, engine, hooks=hooks).handle(request())
    assert hooks.calls == [
        ("start", "r-1", "e0"), ("first", "r-1"),
        ("end", "r-1", "e0", protocol.Usage(prompt_tokens=9, completion_tokens=16), True),
    ]



async def test_a_long_stream_reports_its_progress_about_once_a_second(engine, http) -> None:
    """So the live tok/s counts a long answer while it streams, not only once it has ended."""
    engine.behaviour = Behaviour(tokens=20, token_delay_s=0.005)
    ticks = iter(range(1000))
    hooks = ProgressRecorder()
    relay = Relay(Wire(), lambda: [target_of(engine)], lambda: None, http=http, hooks=hooks,
                  clock=lambda: next(ticks) * 0.4)  # each read 0.4 s after the one before
    await relay.handle(request())
    progress = [call for call in hooks.calls if call[0] == "progress"]
    counts, times = [call[2] for call in progress], [call[3] for call in progress]
    assert len(progress) >= 3 and counts == sorted(counts) and counts[-1] <= 20 + 2  # tokens, usage, [DONE]
    assert all(later - earlier >= PROGRESS_EVERY_S for earlier, later in zip(times, times[1:]))
    assert [call[0] for call in hooks.calls][:2] == ["start", "first"] and hooks.calls[-1][0] == "end"


async def test_only_generations_reach_the_hooks(engine, http) -> None:
    """The relay decides what is metered (and paid): a POST to a completions path, nothing else."""
    wire, hooks = Wire(), Recorder()
    relay = make_relay(wire, http, engine, hooks=hooks)
    await relay.handle(protocol.Request(id="m", method="GET", path="/v1/models"))
    await relay.handle(request("c", path="/v1/completions", stream=False, prompt="hi"))
    assert wire.terminals("m") == [protocol.ResponseEnd(id="m")]
    # a whole body has no first-token time: its tokens arrive together and would time nothing
    assert [call[:2] for call in hooks.calls] == [("start", "c"), ("end", "c")]


async def test_a_duplicate_request_id_gets_an_error_and_the_first_goes_on(engine, http) -> None:
    engine.behaviour = Behaviour(tokens=20, token_delay_s=0.005)
    wire = Wire()
    relay = make_relay(wire, http, engine)
    first = relay.handle(request())
    await relay.handle(request())
    await first
    errors = [f for f in wire.frames if isinstance(f, protocol.Error)]
    assert [(e.code, e.ref) for e in errors] == [("duplicate_request", "r-1")]
    assert len(wire.terminals("r-1")) == 1


async def test_every_request_gets_exactly_one_terminal_under_mixed_trouble(engine, http) -> None:
    engine.behaviour = Behaviour(tokens=40, token_delay_s=0.002)
    wire = Wire()
    relay = make_relay(wire, http, engine)
    tasks = [relay.handle(request(f"r-{i}", stream=i % 3 != 0, deadline_s=0.05 if i % 5 == 0 else 30))
             for i in range(30)]
    await asyncio.sleep(0.03)
    for i in range(0, 30, 4):
        relay.cancel(f"r-{i}")
    await asyncio.gather(*tasks)
    assert all(len(wire.terminals(f"r-{i}")) == 1 for i in range(30))
    assert all(isinstance(wire.of(f"r-{i}")[-1], TERMINAL) for i in range(30))
    assert relay.in_flight == 0


def test_stream_filter_holds_a_partial_event_until_it_is_whole() -> None:
    filter_ = StreamFilter(events=True, strip_usage=False)
    event = 'data: {"x": "é"}\n\n'.encode()
    assert filter_.feed(event[:12]) == ""
    assert filter_.feed(event[12:] + event[:3]) == event.decode()
    assert filter_.finish() == "dat"


def test_stream_filter_strips_only_the_usage_only_chunk_it_asked_for() -> None:
    stream = (b'data: {"choices": [{"delta": {"content": "usage"}}]}\r\n\r\n'
              b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}\r\n\r\n'
              b"data: [DONE]\r\n\r\n")
    stripping = StreamFilter(events=True, strip_usage=True)
    kept = stripping.feed(stream) + stripping.finish()
    assert kept == stream.decode().replace(
        'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}\r\n\r\n', "")
    assert stripping.usage == protocol.Usage(prompt_tokens=3, completion_tokens=4)
    keeping = StreamFilter(events=True, strip_usage=False)
    assert keeping.feed(stream) + keeping.finish() == stream.decode()
    assert keeping.usage == stripping.usage


def _whole_block_reference(block: bytes, strip_usage: bool) -> tuple[bytes, protocol.Usage | None]:
    """The filter's rule applied to every event of `block` (what it did before it split only the
    tail that holds "usage"): drop usage-only events it asked for, keep the last usage seen."""
    parts = re.split(rb"(\r?\n\r?\n)", block)
    kept, usage = [], None
    for event, separator in zip(parts[0::2], parts[1::2] + [b""]):
        payload = b"\n".join(line[5:].removeprefix(b" ") for line in event.splitlines() if line.startswith(b"data:"))
        try:
            document = json.loads(payload) if b'"usage"' in event else None
        except ValueError:
            document = None
        if isinstance(document, dict) and isinstance(document.get("usage"), dict):
            usage = protocol.Usage.model_validate(document["usage"])
            if strip_usage and document.get("choices") == []:
                continue
        kept.append(event + separator)
    return b"".join(kept), usage


def test_stream_filter_cuts_events_as_a_whole_block_split_would_whatever_the_line_breaks() -> None:
    separators = [b"\n\n", b"\r\n\r\n", b"\n\r\n", b"\r\n\n", b"\n\n\n", b"\r\r\n\n", b"\n\r\n\r\n", b"\r\n"]
    events = [b'data: {"choices": [{"delta": {"content": "h\xc3\xa9"}}]}',
              b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}',
              b'data: {"choices": [{"delta": {}}], "usage": {"prompt_tokens": 5, "completion_tokens": 6}}',
              b"data: [DONE]", b": keep-alive", b"\r", b""]
    rng = random.Random(16)
    for _ in range(3000):
        block = b"".join(rng.choice(events) + rng.choice(separators) for _ in range(rng.randint(1, 8)))
        block += b"data: [DONE]\n\n"  # a whole block: one read, no event held back
        strip = rng.random() < 0.5
        filter_ = StreamFilter(events=True, strip_usage=strip)
        relayed = filter_.feed(block) + filter_.finish()
        expected, usage = _whole_block_reference(block, strip)
        assert (relayed, filter_.usage) == (expected.decode(), usage), block


def test_stream_filter_relays_a_boundless_stream_without_splitting_characters() -> None:
    filter_ = StreamFilter(events=True, strip_usage=False)
    blob = ("€" * 400_000).encode()  # 1.2 MB and no blank line
    out = filter_.feed(blob[:-1]) + filter_.feed(blob[-1:]) + filter_.finish()
    assert out == "€" * 400_000


def test_stream_filter_decodes_raw_bodies_incrementally() -> None:
    filter_ = StreamFilter(events=False, strip_usage=False)
    text = "ok 😀".encode()
    assert filter_.feed(text[:-2]) + filter_.feed(text[-2:]) + filter_.finish() == "ok 😀"



def image(url: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": "what is in https://example.org/x.png?"},
                                         {"type": "image_url", "image_url": {"url": url, "detail": "low"}}]}]


@pytest.mark.parametrize("url", ["http://192.168.1.1/cam.jpg", "  HTTPS://example.org/a.png", "file:///etc/passwd",
                                 "//192.168.1.1/a.png"])
async def test_media_by_url_is_refused_and_never_reaches_the_engine(engine, http, url: str) -> None:
    wire = Wire()
    await make_relay(wire, http, engine).handle(request(messages=image(url)))
    (error,) = wire.of("r-1")
    assert (error.type, error.status, error.code) == ("response.error", 400, "bad_request")
    assert "messages[0].content[1].image_url.url" in error.message and "data: URL" in error.message
    assert engine.records == []


async def test_inline_media_as_a_data_url_is_relayed(engine, http) -> None:
    wire = Wire()
    inline = "data:image/png;base64,iVBORw0KGgo="
    await make_relay(wire, http, engine).handle(request(messages=image(inline)))
    assert isinstance(wire.terminals("r-1")[0], protocol.ResponseEnd)
    assert engine.records[0].body["messages"][0]["content"][1]["image_url"]["url"] == inline


@pytest.mark.parametrize(("body", "where"), [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://10.0.0.1/x"}]}]},
     "body.input[0].content[0].image_url"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "https://a/b"}}]}]},
     "body.messages[0].content[0].source.url"),
    ({"messages": [{"content": [{"type": "file", "file": {"file_data": "https://a/b.pdf"}}]}]},
     "body.messages[0].content[0].file.file_data"),
    ({"messages": [{"content": [{"type": "video_url", "video_url": {"url": "rtsp://cam.local/live"}}]}]},
     "body.messages[0].content[0].video_url.url"),
    ({"documents": [{"content": [{"type": "audio_url", "audio_url": {"url": " http://printer.local/a.wav"}}]}]},
     "body.documents[0].content[0].audio_url.url"),
])
def test_media_urls_are_found_wherever_a_body_names_media(body: Any, where: str) -> None:
    problem = media_by_url(body)
    assert problem is not None and problem.startswith(f"{where} gives media by URL")


@pytest.mark.parametrize("body", [
    None, "text", {"prompt": "fetch https://example.org for me"},
    {"messages": [{"role": "user", "content": "see https://example.org"}]},
    {"messages": [{"content": [{"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}]}]},
    {"messages": [{"content": [{"type": "file", "file": {"file_data": "data:application/pdf;base64,JVBE",
                                                          "filename": "a.pdf"}}]}]},
    {"tools": [{"type": "function", "function": {"name": "fetch", "parameters": {"type": "object", "properties": {
        "url": {"type": "string", "description": "a page such as https://example.org", "default": "https://x"}}}}}]},
])
def test_bodies_without_fetched_media_pass(body: Any) -> None:
    assert media_by_url(body) is None


def test_a_body_nested_deeper_than_the_bound_is_refused_unread() -> None:
    deep: dict[str, Any] = {}
    inner = deep
    for _ in range(MAX_BODY_DEPTH + 1):
        inner["a"] = {}
        inner = inner["a"]
    assert "nested more than" in (media_by_url(deep) or "")
    assert media_by_url({"messages": [{"content": [{"text": "x"}]}]}) is None


async def test_an_engine_on_a_unix_socket_is_relayed_to(tmp_path, http) -> None:
    async with FakeEngine(served_name="served-m", socket_path=str(tmp_path / "e0.sock")) as on_socket:
        wire = Wire()
        await make_relay(wire, http, on_socket).handle(request())
    assert wire.terminals("r-1") == [protocol.ResponseEnd(
        id="r-1", usage=protocol.Usage(prompt_tokens=9, completion_tokens=16))]
    assert on_socket.records[0].headers["authorization"] == f"Bearer {on_socket.api_key}"


def test_an_engine_target_made_the_old_way_has_no_socket() -> None:
    assert EngineTarget("e0", "http://127.0.0.1:1", "k", "m").socket_path is None


async def test_streams_through_a_batching_link_arrive_byte_for_byte_in_order_with_one_terminal(engine, http) -> None:
    engine.behaviour = Behaviour(tokens=200, batch=4)
    hello = protocol.Hello(node_id="n", app_version="0", engines={},
                           platform=protocol.PlatformInfo(os="linux", runtime="cpu", arch="x86_64"),
                           hardware=protocol.HardwareInfo(ram_mib=1, cpu=protocol.CpuInfo(model="c", cores=1)))
    async with ReferenceCoordinator(token="t") as coordinator:
        link: Link | None = None

        async def on_message(message: Any) -> None:
            if isinstance(message, protocol.Request):
                assert link is not None
                relay.handle(message, link.sender())

        link = Link(coordinator.url, lambda: "t", lambda: hello, on_message)
        relay = Relay(link, lambda: [target_of(engine)], lambda: None, http=http)
        running = asyncio.create_task(link.run())
        try:
            await coordinator.wait_for_connections(1)
            await coordinator.wait_for("hello")
            while link.welcome is None:
                await asyncio.sleep(0.005)
            assert "batch" in link.welcome.features
            exchanges = [await coordinator.request(request().body) for _ in range(8)]
            expected = await direct(engine, http, {"messages": [], "stream": True, "max_tokens": 200})
            for exchange in exchanges:
                frames = [f async for f in exchange.frames()]
                assert isinstance(frames[0], protocol.ResponseHead) and isinstance(frames[-1], protocol.ResponseEnd)
                assert not any(isinstance(f, TERMINAL) for f in frames[:-1])
                assert "".join(f.data for f in frames if isinstance(f, protocol.ResponseChunk)) == expected
            assert max(coordinator.frame_sizes) > 1  # the streams really shared frames
        finally:
            await link.close()
            await running


# --- bounded requests (contract, Relay, "Bounded requests") -------------------------------------

DEEP_GRAMMAR = "root ::= " + "(" * 20_000 + '"a"' + ")" * 20_000  # crashed llama-server with SIGSEGV


@pytest.mark.parametrize("body", [
    {"grammar": DEEP_GRAMMAR},
    {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "string",
                                                                           "pattern": "(" * 200 + ")" * 200}}}},
    {"guided_regex": "[" * 129},
    {"grammar": "x" * (64 * 1024 + 1)},
    {"n": 17},
    {"logprobs": True, "top_logprobs": 21},
])
async def test_a_body_asking_too_much_of_an_engine_is_refused_before_it_reaches_one(engine, http,
                                                                                  body: dict[str, Any]) -> None:
    wire, hooks, load = Wire(), Recorder(), []
    target = dataclasses.replace(target_of(engine), on_load=load.append)
    relay = Relay(wire, lambda: [target], lambda: None, http=http, hooks=hooks)
    await relay.handle(request(path="/v1/completions", stream=False, prompt="hi", **body))
    (error,) = wire.of("r-1")
    assert (error.status, error.code) == (400, "bad_request") and "this node" in error.message
    assert engine.records == [] and hooks.calls == [] and load == [] and relay.in_flight == 0


async def test_more_tokens_than_the_engines_context_are_refused_where_it_is_known(engine, http) -> None:
    wire = Wire()
    known = dataclasses.replace(target_of(engine), context=1024)
    await Relay(wire, lambda: [known], lambda: None, http=http).handle(request(max_tokens=1025))
    (error,) = wire.of("r-1")
    assert (error.status, error.code) == (400, "bad_request") and "context of 1024 tokens" in error.message
    assert engine.records == []
    await Relay(wire, lambda: [known], lambda: None, http=http).handle(request("r-2", max_tokens=1024))
    unknown = target_of(engine)
    await Relay(wire, lambda: [unknown], lambda: None, http=http).handle(request("r-3", max_tokens=10**6))
    assert [type(f) for f in wire.terminals("r-2") + wire.terminals("r-3")] == [protocol.ResponseEnd] * 2


async def test_where_the_node_refuses_constrained_decoding_only_constrained_requests_are_refused(engine, http) -> None:
    wire = Wire()
    refusing = dataclasses.replace(target_of(engine), constraints_refused="no constraints on this node any more")
    relay = Relay(wire, lambda: [refusing], lambda: None, http=http)
    await relay.handle(request("grammar", grammar='root ::= "a"'))
    await relay.handle(request("tools", tools=[{"type": "function", "function": {"name": "f"}}]))
    await relay.handle(request("plain"))
    await relay.handle(request("text", response_format={"type": "text"}))
    for refused in ("grammar", "tools"):
        (error,) = wire.of(refused)
        assert (error.status, error.code, error.message) == (400, "bad_request", "no constraints on this node any more")
    assert [type(f) for f in wire.terminals("plain") + wire.terminals("text")] == [protocol.ResponseEnd] * 2
    assert len(engine.records) == 2


async def test_the_engine_is_told_of_every_request_on_it_whatever_its_path(engine, http) -> None:
    """The supervisor tells a crash a request caused by the requests on the engine: each is
    counted from hand-over to its end, generations or not, a 502 included."""
    wire, load = Wire(), []
    target = dataclasses.replace(target_of(engine), on_load=load.append)
    relay = Relay(wire, lambda: [target], lambda: None, http=http)
    await relay.handle(protocol.Request(id="m", method="GET", path="/v1/models"))
    assert load == [1, -1]
    engine.behaviour = Behaviour(tokens=50, crash_after=5)
    await relay.handle(request())
    assert load == [1, -1, 1, -1] and wire.terminals("r-1")[0].code == "engine_failed"
    engine.behaviour = Behaviour(tokens=500, token_delay_s=0.01)
    task = relay.handle(request("r-2"))
    await asyncio.sleep(0.05)
    assert load == [1, -1, 1, -1, 1]
    relay.cancel("r-2")
    await task
    assert load == [1, -1, 1, -1, 1, -1]


async def wait_for_streams(engine: FakeEngine, n: int) -> None:
    for _ in range(500):
        if len(engine.records) >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the engine saw {len(engine.records)} requests, not {n}")


async def test_a_request_over_the_lenders_limit_is_503_at_capacity_before_the_engine_sees_it(engine, http) -> None:
    engine.behaviour = Behaviour(tokens=300, token_delay_s=0.01)
    wire = Wire()
    relay = make_relay(wire, http, engine)
    relay.set_max_requests(2)
    held = [relay.handle(request(f"r-{i}")) for i in range(2)]
    await wait_for_streams(engine, 2)
    await relay.handle(request("r-over"))
    (error,) = wire.of("r-over")
    assert (error.status, error.code) == (503, "at_capacity")
    assert "2 requests at once" in error.message
    assert len(engine.records) == 2 and relay.in_flight == 2
    relay.cancel("r-0")
    await held[0]
    await relay.handle(request("r-after", stream=False, max_tokens=3))  # room again: served
    assert isinstance(wire.terminals("r-after")[0], protocol.ResponseEnd)
    relay.cancel("r-1")
    await held[1]


async def test_lowering_the_limit_lets_requests_in_flight_finish_and_lifting_it_takes_more(engine, http) -> None:
    engine.behaviour = Behaviour(tokens=40, token_delay_s=0.01)
    wire = Wire()
    relay = make_relay(wire, http, engine)
    running = [relay.handle(request(f"r-{i}")) for i in range(3)]
    await wait_for_streams(engine, 3)
    relay.set_max_requests(1)  # a card ran hot: fewer at once from now on
    await relay.handle(request("r-hot"))
    assert [(f.status, f.code) for f in wire.of("r-hot")] == [(503, "at_capacity")]
    assert "1 request at once" in wire.of("r-hot")[0].message
    await asyncio.gather(*running)
    assert all(isinstance(wire.terminals(f"r-{i}")[0], protocol.ResponseEnd) for i in range(3))
    relay.set_max_requests(None)
    more = [relay.handle(request(f"r-cool-{i}")) for i in range(4)]
    await asyncio.gather(*more)
    assert all(isinstance(wire.terminals(f"r-cool-{i}")[0], protocol.ResponseEnd) for i in range(4))


async def test_a_paused_node_says_paused_not_at_capacity(engine, http) -> None:
    wire = Wire()
    relay = make_relay(wire, http, engine, gate=lambda: "paused")
    relay.set_max_requests(1)
    await relay.handle(request())
    assert [(f.status, f.code) for f in wire.of("r-1")] == [(503, "paused")]


def test_a_limit_below_one_request_is_refused(http) -> None:
    relay = Relay(Wire(), lambda: [], lambda: None, http=http)
    with pytest.raises(ValueError):
        relay.set_max_requests(0)
