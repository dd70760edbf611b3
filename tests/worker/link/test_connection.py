from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from worker.contract import events
from worker.contract import protocol
from tests.support.engines import free_port
from worker.link.connection import Backoff, Link, url_problem
from worker.link.local import ReferenceCoordinator

TOKEN = "tok-123"
HELLO = protocol.Hello(
    node_id="node-1", app_version="0.1.0",
    platform=protocol.PlatformInfo(os="linux", runtime="cpu", arch="x86_64"),
    hardware=protocol.HardwareInfo(ram_mib=16000, cpu=protocol.CpuInfo(model="test cpu", cores=4)),
    engines={"vllm": None, "llamacpp": "b1"},
)


class Node:
    """What the node would do with a link: collect messages and connection states."""

    def __init__(self) -> None:
        self.messages: list[Any] = []
        self.states: list[events.ConnectionSnapshot] = []
        self.fail_on: str | None = None

    async def on_message(self, message: Any) -> None:
        if message.type == self.fail_on:
            raise RuntimeError("handler broke")
        self.messages.append(message)

    async def wait_state(self, state: str, timeout: float = 5.0) -> events.ConnectionSnapshot:
        async with asyncio.timeout(timeout):
            while not self.states or self.states[-1].state != state:
                await asyncio.sleep(0.005)
        return self.states[-1]


@pytest.fixture
async def coordinator() -> AsyncIterator[ReferenceCoordinator]:
    async with ReferenceCoordinator(token=TOKEN) as reference:
        yield reference


@pytest.fixture
async def running() -> AsyncIterator[Callable[..., tuple[Link, Node]]]:
    started: list[tuple[Link, asyncio.Task[None]]] = []

    def start(url: str, token: str | None = TOKEN, **options: Any) -> tuple[Link, Node]:
        node = Node()
        options.setdefault("backoff", Backoff(base_s=0.01, cap_s=0.05, random_source=lambda: 1.0))
        link = Link(url, lambda: token, lambda: HELLO, node.on_message, on_state=node.states.append, **options)
        started.append((link, asyncio.create_task(link.run())))
        return link, node

    yield start
    for link, task in started:
        await link.close()
        await asyncio.wait_for(task, 5)


async def test_hello_is_the_first_frame_and_carries_the_token(coordinator, running) -> None:
    link, node = running(coordinator.url)
    hello = await coordinator.wait_for_connections(1)
    assert hello == HELLO
    assert coordinator.received[0] == HELLO
    assert coordinator.handshake_headers[0]["Authorization"] == f"Bearer {TOKEN}"
    await node.wait_state("connected")
    await asyncio.sleep(0.05)
    assert link.welcome == protocol.Welcome(node_id="node-1", heartbeat_s=10.0, features=["batch", "autotune"])
    assert isinstance(node.messages[0], protocol.Welcome)
    assert link.generation == 1 and link.connected


async def test_welcome_carries_heartbeat_and_price() -> None:
    price = protocol.Price(currency="EUR", per_million_output_tokens=0.4, per_million_input_tokens=0.05)
    async with ReferenceCoordinator(heartbeat_s=2.5, price=price) as coordinator:
        node = Node()
        link = Link(coordinator.url, lambda: "any", lambda: HELLO, node.on_message)
        task = asyncio.create_task(link.run())
        async with asyncio.timeout(5):
            while link.welcome is None:
                await asyncio.sleep(0.005)
        assert (link.welcome.heartbeat_s, link.welcome.price) == (2.5, price)
        await link.close()
        await task


async def test_no_token_means_signed_out_without_connecting(coordinator, running) -> None:
    _link, node = running(coordinator.url, token=None)
    snapshot = await node.wait_state("signed_out")
    assert snapshot.problem is not None and snapshot.problem.action == "sign_in"
    await asyncio.sleep(0.05)
    assert coordinator.handshake_headers == []


@pytest.mark.parametrize("url", ["ws://example.com/v1/provider", "ws://10.0.0.1/v1/provider", "http://127.0.0.1/x"])
async def test_plain_ws_off_loopback_is_refused_before_connecting(running, url: str) -> None:
    link, node = running(url)
    snapshot = await node.wait_state("offline")
    assert snapshot.problem is not None and snapshot.problem.action == "settings"
    assert url in snapshot.problem.message
    assert link.generation == 0


@pytest.mark.parametrize("url, allowed", [
    ("wss://coordinator.example/v1/provider", True), ("ws://127.0.0.1:9/v1/provider", True),
    ("ws://[::1]:9/v1/provider", True), ("ws://localhost:9/v1/provider", True),
    ("ws://127.0.0.2:9/v1/provider", True), ("ws://192.168.1.2/v1/provider", False),
    ("ws://localhost.example.com/x", False), ("https://example.com", False),
])
def test_url_problem(url: str, allowed: bool) -> None:
    assert (url_problem(url) is None) is allowed


async def test_malformed_unknown_and_binary_frames_get_error_replies_and_the_link_stays(coordinator, running) -> None:
    link, node = running(coordinator.url)
    await coordinator.wait_for_connections(1)
    await node.wait_state("connected")
    await coordinator.send_raw("not json")
    await coordinator.send_raw('{"type": "cancel"}')
    await coordinator.send_raw('{"type": "telemetry.v9", "x": 1}')
    await coordinator.send_raw(b"\x00\x01")
    await coordinator.send(protocol.Pause())
    errors = []
    for _ in range(3):
        errors.append(await coordinator.wait_for(
            lambda m: isinstance(m, protocol.Error) and m not in errors, after=0))
    assert [e.code for e in errors] == ["bad_message"] * 3
    assert "not valid JSON" in errors[0].message and "binary" in errors[2].message
    await asyncio.sleep(0.05)
    assert [m.type for m in node.messages] == ["welcome", "pause"]
    assert link.generation == 1 and link.connected


async def test_a_frame_over_16_mib_is_refused_and_the_link_stays(coordinator, running) -> None:
    link, node = running(coordinator.url)
    await coordinator.wait_for_connections(1)
    await coordinator.send_raw('{"type": "pause", "pad": "' + "x" * (protocol.MAX_FRAME_BYTES + 10) + '"}')
    error = await coordinator.wait_for("error", timeout=15)
    assert "over the" in error.message
    await coordinator.send(protocol.Resume())
    async with asyncio.timeout(5):
        while not any(m.type == "resume" for m in node.messages):
            await asyncio.sleep(0.01)
    assert link.generation == 1


async def test_a_failing_handler_gets_an_error_reply_and_the_link_stays(coordinator, running) -> None:
    link, node = running(coordinator.url)
    node.fail_on = "cancel"
    await coordinator.wait_for_connections(1)
    await coordinator.send(protocol.Cancel(id="r-5"))
    error = await coordinator.wait_for("error")
    assert (error.code, error.ref) == ("handling_failed", "r-5")
    assert link.connected


@pytest.mark.parametrize("code, state, action", [
    (4401, "signed_out", "sign_in"), (4403, "banned", "sign_in"), (4426, "update_required", "update"),
])
async def test_close_codes_that_stop_retries(coordinator, running, code: int, state: str, action: str) -> None:
    _link, node = running(coordinator.url)
    await coordinator.wait_for_connections(1)
    await coordinator.close_node(code, "test")
    snapshot = await node.wait_state(state)
    assert snapshot.problem is not None and snapshot.problem.action == action
    assert snapshot.retry_in_s is None
    await asyncio.sleep(0.2)
    assert len(coordinator.handshake_headers) == 1
    assert node.states[-1].state == state


async def test_sign_in_again_resumes_after_4401(coordinator, running) -> None:
    link, node = running(coordinator.url)
    await coordinator.wait_for_connections(1)
    await coordinator.close_node(4401)
    await node.wait_state("signed_out")
    link.resume_after_sign_in()
    await coordinator.wait_for_connections(2)
    await node.wait_state("connected")


async def test_a_wrong_token_is_shown_as_signed_out(coordinator, running) -> None:
    _link, node = running(coordinator.url, token="wrong")
    snapshot = await node.wait_state("signed_out")
    assert "Sign in again" in snapshot.problem.message
    assert coordinator.hellos == []


async def test_taken_over_is_shown_then_retried_after_a_long_pause(coordinator, running) -> None:
    _link, node = running(coordinator.url, taken_over_pause_s=0.2)
    await coordinator.wait_for_connections(1)
    await coordinator.close_node(4409)
    snapshot = await node.wait_state("taken_over")
    assert snapshot.retry_in_s == 0.2 and snapshot.problem.title == "Another connection took over"
    await asyncio.sleep(0.1)
    assert len(coordinator.hellos) == 1
    await coordinator.wait_for_connections(2)


async def test_a_second_connection_with_the_same_node_takes_over(coordinator, running) -> None:
    _first, first_node = running(coordinator.url, taken_over_pause_s=30)
    await coordinator.wait_for_connections(1)
    _second, second_node = running(coordinator.url)
    await coordinator.wait_for_connections(2)
    await first_node.wait_state("taken_over")
    await second_node.wait_state("connected")


async def test_coordinator_restart_means_reconnect_and_a_new_generation(coordinator, running) -> None:
    link, node = running(coordinator.url)
    await coordinator.wait_for_connections(1)
    stale = link.sender()
    assert await stale.send(protocol.Error(code="x"))
    await coordinator.restart()
    await coordinator.wait_for_connections(2)
    await node.wait_state("connected")
    assert link.generation == 2
    assert await stale.send(protocol.Error(code="x")) is False
    assert stale.post(protocol.encode(protocol.Error(code="x"))) is False  # never onto the next connection
    assert await link.sender().send(protocol.Error(code="y"))
    assert offline_seen(node)


async def test_a_try_after_an_outage_keeps_why_the_link_is_down(running) -> None:
    """Each reconnect try is `connecting` with the outage's problem still on it, so the person keeps
    reading Offline between tries rather than the state it had before the outage."""
    _link, node = running(f"ws://127.0.0.1:{free_port()}/v1/node")  # nothing listens there
    await node.wait_state("offline")
    await eventually_true(lambda: sum(s.state == "connecting" for s in node.states) >= 2)
    assert node.states[0].state == "offline"  # the first try was `connecting` from the start, with no outage yet
    retries = [s for s in node.states if s.state == "connecting"]
    assert retries and all(s.problem is not None and s.problem == node.states[0].problem for s in retries)


async def test_no_pong_in_time_means_dead_and_reconnect(running) -> None:
    async with ReferenceCoordinator(close_timeout=0.05) as coordinator:
        link, node = running(coordinator.url, ping_interval=0.05, ping_timeout=0.05, close_timeout=0.05)
        await coordinator.wait_for_connections(1)
        coordinator.freeze_node()
        await coordinator.wait_for_connections(2, timeout=10)
        assert link.generation == 2
        assert offline_seen(node)


async def test_on_disconnect_is_called_once_per_ended_connection_before_the_pause(coordinator) -> None:
    ended: list[int] = []
    link = Link(coordinator.url, lambda: TOKEN, lambda: HELLO, Node().on_message,
                backoff=Backoff(base_s=10, random_source=lambda: 1.0),
                on_disconnect=lambda: ended.append(link.generation))
    task = asyncio.create_task(link.run())
    await coordinator.wait_for_connections(1)
    await coordinator.close_node(1011, "bye")
    async with asyncio.timeout(5):
        while not ended:
            await asyncio.sleep(0.005)
    assert ended == [1] and not link.connected  # told at once, while the 10 s pause runs
    await link.close()
    await asyncio.wait_for(task, 5)
    assert ended == [1]


async def eventually_true(test: Callable[[], bool], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not test():
            await asyncio.sleep(0.005)


def offline_seen(node: Node) -> bool:
    return any(s.state == "offline" and s.retry_in_s is not None for s in node.states)


async def test_send_is_false_when_not_connected(coordinator) -> None:
    link = Link(coordinator.url, lambda: TOKEN, lambda: HELLO, Node().on_message)
    assert await link.send(protocol.Error(code="x")) is False


def test_backoff_doubles_to_the_cap_with_full_jitter() -> None:
    backoff = Backoff(base_s=1, cap_s=60, random_source=lambda: 1.0)
    assert [backoff.next_delay() for _ in range(8)] == [1, 2, 4, 8, 16, 32, 60, 60]
    halves = Backoff(base_s=1, cap_s=60, random_source=lambda: 0.5)
    assert [halves.next_delay() for _ in range(3)] == [0.5, 1, 2]


def test_backoff_resets_only_after_a_connection_stayed_up_long_enough() -> None:
    backoff = Backoff(base_s=1, cap_s=60, reset_after_s=60, random_source=lambda: 1.0)
    for _ in range(4):
        backoff.next_delay()
    backoff.connection_lasted(59.9)
    assert backoff.next_delay() == 16
    backoff.connection_lasted(60)
    assert backoff.next_delay() == 1


async def test_accept_then_close_coordinator_meets_growing_delays(coordinator, running) -> None:
    coordinator.reject_with = 1000
    _link, node = running(coordinator.url, backoff=Backoff(base_s=0.01, cap_s=10, random_source=lambda: 1.0))
    async with asyncio.timeout(5):
        while len(delays := [s.retry_in_s for s in node.states if s.state == "offline"]) < 5:
            await asyncio.sleep(0.005)
    assert delays[:5] == [0.01, 0.02, 0.04, 0.08, 0.16]
    assert len(coordinator.handshake_headers) <= len(delays) + 1  # one attempt per pause, no tight loop


async def test_backoff_resets_after_a_connection_that_lasted(coordinator, running) -> None:
    coordinator.reject_with = 1000
    ticks = itertools.count(step=100.0)  # every connection appears to last 100 s
    _link, node = running(coordinator.url, clock=lambda: next(ticks),
                         backoff=Backoff(base_s=0.01, cap_s=10, reset_after_s=60, random_source=lambda: 1.0))
    async with asyncio.timeout(5):
        while len([s for s in node.states if s.state == "offline"]) < 4:
            await asyncio.sleep(0.005)
    assert {s.retry_in_s for s in node.states if s.state == "offline"} == {0.01}


async def test_close_ends_run(coordinator) -> None:
    node = Node()
    link = Link(coordinator.url, lambda: TOKEN, lambda: HELLO, node.on_message, on_state=node.states.append)
    task = asyncio.create_task(link.run())
    await coordinator.wait_for_connections(1)
    await link.close()
    await asyncio.wait_for(task, 5)
    assert node.states[-1].state == "disabled"
    assert not link.connected


async def test_a_reopened_link_connects_again(coordinator) -> None:
    """After an update was rolled back the node serves on: the same link says hello again."""
    node = Node()
    link = Link(coordinator.url, lambda: TOKEN, lambda: HELLO, node.on_message, on_state=node.states.append)
    first = asyncio.create_task(link.run())
    await node.wait_state("connected")
    await link.close()
    await asyncio.wait_for(first, 5)
    assert node.states[-1].state == "disabled"
    link.reopen()
    second = asyncio.create_task(link.run())
    assert await coordinator.wait_for_connections(2) == HELLO
    await node.wait_state("connected")
    assert link.generation == 2
    await link.close()
    await asyncio.wait_for(second, 5)


async def test_run_while_a_loop_runs_starts_no_second_one(coordinator) -> None:
    """`reopen()` before the closed loop noticed: that loop carries on, and a new `run()` returns."""
    node = Node()
    link = Link(coordinator.url, lambda: TOKEN, lambda: HELLO, node.on_message, on_state=node.states.append)
    first = asyncio.create_task(link.run())
    await node.wait_state("connected")
    closing = asyncio.create_task(link.close())
    await asyncio.sleep(0)  # the close has begun: the loop will see its connection end
    link.reopen()
    await asyncio.wait_for(link.run(), 1)  # returns at once: the first loop is still running
    await closing
    await coordinator.wait_for_connections(2, timeout=15.0)  # the first loop reconnected (within its backoff)
    await asyncio.sleep(0.2)
    assert len(coordinator.hellos) == 2 and not first.done()
    await link.close()
    await asyncio.wait_for(first, 5)


# --- batching (protocol: Relay, "Batching") ------------------------------------------------------


async def _connected(coordinator: ReferenceCoordinator, running: Callable[..., tuple[Link, Node]]) -> Link:
    link, node = running(coordinator.url)
    await coordinator.wait_for_connections(1)
    async with asyncio.timeout(5):
        while link.welcome is None:
            await asyncio.sleep(0.005)
    return link


def _chunks(count: int, request_id: str = "r-1") -> list[protocol.ResponseChunk]:
    return [protocol.ResponseChunk(id=request_id, data=f"data: {n}\n\n") for n in range(count)]


async def test_the_first_message_of_an_iteration_goes_at_once_and_the_rest_as_one_batch_in_order(
        coordinator, running, monkeypatch) -> None:
    monkeypatch.setattr("worker.link.outgoing.BATCH_MAX_WAIT_S", 60.0)  # a loaded test machine must not split it
    link = await _connected(coordinator, running)
    assert link.welcome is not None and "batch" in link.welcome.features
    after = len(coordinator.received)
    messages = [*_chunks(5), protocol.ResponseEnd(id="r-1")]
    assert await asyncio.gather(*(link.send(m) for m in messages)) == [True] * 6
    await coordinator.wait_for("response.end", after=after)
    assert coordinator.received[after:] == messages
    assert coordinator.frame_sizes == [1, 5]


async def test_a_full_batch_is_flushed_and_the_rest_follows_in_order(coordinator, running, monkeypatch) -> None:
    monkeypatch.setattr("worker.link.outgoing.BATCH_MAX_WAIT_S", 60.0)  # only the count cap splits it
    link = await _connected(coordinator, running)
    after = len(coordinator.received)
    messages = _chunks(300)
    assert all(await asyncio.gather(*(link.send(m) for m in messages)))
    await coordinator.wait_for(lambda m: m == messages[-1], after=after)
    assert coordinator.received[after:] == messages
    assert coordinator.frame_sizes == [1, 256, 43]  # none goes at once while a full batch is unwritten


async def test_a_batch_older_than_1_ms_takes_no_more_messages(coordinator, running) -> None:
    link = await _connected(coordinator, running)
    after = len(coordinator.received)
    messages = _chunks(4)

    async def hold_the_loop() -> bool:
        time.sleep(0.002)  # the rest of this loop iteration runs 2 ms later
        return True

    sends = [link.send(messages[0]), link.send(messages[1]), hold_the_loop(), link.send(messages[2]),
             link.send(messages[3])]
    assert await asyncio.gather(*sends) == [True] * 5
    await coordinator.wait_for(lambda m: m == messages[-1], after=after)
    assert coordinator.received[after:] == messages
    assert coordinator.frame_sizes == [1, 2, 1]  # at once; the message that found the batch too old closed it


async def test_a_lone_message_goes_out_at_once_without_waiting_for_a_timer(coordinator, running) -> None:
    link = await _connected(coordinator, running)
    loop = asyncio.get_running_loop()
    ticks = 0

    async def ticker() -> None:  # counts loop iterations while the send is under way
        nonlocal ticks
        while True:
            await asyncio.sleep(0)
            ticks += 1

    counting = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    started, ticks = loop.time(), 0
    assert await link.send(protocol.ResponseEnd(id="r-1"))
    elapsed, iterations = loop.time() - started, ticks
    counting.cancel()
    await coordinator.wait_for("response.end")
    # as unbatched: written to the socket within the caller's own step, no task and no flush to wait for
    assert iterations == 0, f"the send took {iterations} loop iterations ({elapsed * 1e3:.2f} ms)"
    assert coordinator.frame_sizes == [1]


async def test_without_the_feature_every_message_is_its_own_frame(running) -> None:
    async with ReferenceCoordinator(token=TOKEN, batch=False) as coordinator:
        link = await _connected(coordinator, running)
        assert link.welcome is not None and "batch" not in link.welcome.features
        after = len(coordinator.received)
        messages = [*_chunks(5), protocol.ResponseEnd(id="r-1")]
        assert await asyncio.gather(*(link.send(m) for m in messages)) == [True] * 6
        await coordinator.wait_for("response.end", after=after)
        assert coordinator.received[after:] == messages
        assert coordinator.frame_sizes == [1] * 6


@pytest.mark.parametrize("batch", [True, False])
async def test_send_is_false_once_the_connection_dropped_batched_or_not(running, batch: bool) -> None:
    async with ReferenceCoordinator(token=TOKEN, batch=batch) as coordinator:
        link = await _connected(coordinator, running)
        send = link.sender()
        coordinator.drop_node()
        await coordinator.wait_for_connections(2)
        assert await asyncio.gather(*(send.send(m) for m in _chunks(3))) == [False] * 3  # never onto the next one
        assert await asyncio.gather(*(link.sender().send(m) for m in _chunks(3))) == [True] * 3


async def test_a_batch_whose_socket_dies_before_its_flush_answers_false(coordinator, running) -> None:
    link = await _connected(coordinator, running)
    sends = [asyncio.create_task(link.send(m)) for m in _chunks(3)]
    assert link._ws is not None
    link._ws.transport.abort()  # lost before the batch's frame is written
    results = await asyncio.gather(*sends)
    # the first went out at once, as unbatched, before the loss was seen; its batch-mates learn of it
    assert results[1:] == [False, False]


async def test_a_sender_cancelled_while_its_batch_waits_does_not_lose_its_batch_mates(coordinator, running) -> None:
    link = await _connected(coordinator, running)
    after = len(coordinator.received)
    lone, first, second = (asyncio.create_task(link.send(m)) for m in _chunks(3))
    await asyncio.sleep(0)  # the first went out at once, the other two joined a batch
    first.cancel()
    assert await lone and await second
    await coordinator.wait_for(lambda m: m == _chunks(3)[2], after=after)
    assert coordinator.received[after:] == _chunks(3)


class Requests:
    """What the relay is handed by the link: each request with its outlet, each cancel."""

    def __init__(self) -> None:
        self.handled: list[tuple[protocol.Request, Any]] = []
        self.cancelled: list[str] = []

    def handle(self, request: protocol.Request, outlet: Any = None) -> asyncio.Task[None]:
        self.handled.append((request, outlet))
        return asyncio.create_task(outlet.send(protocol.ResponseError(id=request.id, status=503, code="paused",
                                                                      message="paused")))

    def cancel(self, request_id: str) -> bool:
        self.cancelled.append(request_id)
        return True


async def test_requests_and_cancels_go_to_the_relay_with_the_connections_outlet_not_the_node(
        coordinator, running) -> None:
    requests = Requests()
    link, node = running(coordinator.url, requests=requests)
    await coordinator.wait_for_connections(1)
    await node.wait_state("connected")
    exchange = await coordinator.request({"model": "m", "messages": []})
    await coordinator.cancel(exchange.id)
    answer = await coordinator.wait_for(lambda m: isinstance(m, protocol.ResponseError))
    assert answer.id == exchange.id  # answered through the outlet the link handed over
    async with asyncio.timeout(5):
        while not requests.cancelled:
            await asyncio.sleep(0.005)
    assert [r.id for r, _ in requests.handled] == [exchange.id] and requests.cancelled == [exchange.id]
    assert requests.handled[0][1] is link.sender()
    assert [m.type for m in node.messages] == ["welcome"]  # neither climbed through the node
