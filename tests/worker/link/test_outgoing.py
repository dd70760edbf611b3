"""The send queue of one connection: order, batching, and what a sender learns when it ends.

The double is at the lowest level, the websocket's own `send`: like websockets', it puts the frame
on the wire before it first waits, and it waits only while the socket's buffer is full (`held`).
"""

from __future__ import annotations

import asyncio
import json

import pytest
from websockets.exceptions import ConnectionClosedError

from worker.contract import protocol
from worker.link.outgoing import BATCH_MAX_MESSAGES, Outgoing


@pytest.fixture(autouse=True)
def no_age_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loaded test machine must not split a batch by its 1 ms age (`test_link` tests the age)."""
    monkeypatch.setattr("worker.link.outgoing.BATCH_MAX_WAIT_S", 60.0)


class Socket:
    """Frames as written, in order; `held` plays a full buffer, `closed` a dropped connection."""

    def __init__(self) -> None:
        self.frames: list[str] = []
        self.held: asyncio.Event | None = None
        self.closed = False

    async def send(self, frame: str) -> None:
        if self.closed:
            raise ConnectionClosedError(None, None)
        self.frames.append(frame)
        if self.held is not None:
            await self.held.wait()

    def messages(self) -> list[str]:
        """Every message's data, batches unpacked, in the order they reached the wire."""
        out = []
        for frame in self.frames:
            document = json.loads(frame)
            for message in document["messages"] if document["type"] == "batch" else [document]:
                out.append(message["data"])
        return out

    def sizes(self) -> list[int]:
        return [len(json.loads(f).get("messages", [None])) for f in self.frames]


def chunk(n: int) -> protocol.ResponseChunk:
    return protocol.ResponseChunk(id="r-1", data=str(n))


def frame(n: int) -> str:
    return protocol.encode(chunk(n))


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


@pytest.mark.parametrize("batching", [True, False])
async def test_a_lone_send_is_written_at_once_and_what_follows_it_in_the_iteration_waits_for_one_task(
        batching: bool) -> None:
    socket = Socket()
    out = Outgoing(socket.send)
    out.batching = batching
    assert await out.send(chunk(0))
    assert socket.frames == [frame(0)]  # written within the call, no task in between
    assert all(out.post(frame(n)) for n in (1, 2, 3))
    assert socket.messages() == ["0"]
    await settle()
    assert socket.messages() == ["0", "1", "2", "3"]
    assert socket.sizes() == ([1, 3] if batching else [1, 1, 1, 1])


async def test_a_send_behind_queued_posts_goes_after_them_and_waits_for_its_frame() -> None:
    socket = Socket()
    out = Outgoing(socket.send)
    out.batching = True

    async def post_then_send() -> bool:
        out.post(frame(1))
        return await out.send(chunk(2))

    assert await post_then_send()
    assert socket.messages() == ["1", "2"] and socket.sizes() == [2]


async def test_order_holds_while_the_socket_is_full_in_the_middle_of_a_batch() -> None:
    socket = Socket()
    out = Outgoing(socket.send)  # unbatched: a batch is written frame by frame
    for n in (1, 2, 3):
        out.post(frame(n))
    socket.held = asyncio.Event()
    await settle()
    assert socket.messages() == ["1"]  # the buffer filled after the first
    late = asyncio.create_task(out.send(chunk(4)))  # must not overtake 2 and 3
    await asyncio.sleep(0)
    out.post(frame(5))
    await settle()
    assert socket.messages() == ["1"] and not late.done()
    socket.held.set()
    assert await late
    await settle()
    assert socket.messages() == ["1", "2", "3", "4", "5"]


async def test_a_full_batch_closes_and_the_rest_follow_in_a_second_frame() -> None:
    socket = Socket()
    out = Outgoing(socket.send)
    out.batching = True
    for n in range(BATCH_MAX_MESSAGES + 44):
        out.post(frame(n))
    await settle()
    assert socket.sizes() == [BATCH_MAX_MESSAGES, 44]
    assert socket.messages() == [str(n) for n in range(BATCH_MAX_MESSAGES + 44)]


async def test_a_dropped_connection_answers_false_to_everyone_waiting_and_every_later_call() -> None:
    socket = Socket()
    out = Outgoing(socket.send)
    out.batching = True
    assert await out.send(chunk(0))
    waiting = [asyncio.create_task(out.send(chunk(n))) for n in (1, 2)]
    socket.closed = True
    assert await asyncio.gather(*waiting) == [False, False]
    assert out.closed and out.post(frame(3)) is False and await out.send(chunk(4)) is False


async def test_closing_drops_what_is_queued_and_tells_its_senders() -> None:
    socket = Socket()
    out = Outgoing(socket.send)

    async def post_then_send() -> bool:
        out.post(frame(1))
        return await out.send(chunk(2))

    waiting = asyncio.create_task(post_then_send())
    await asyncio.sleep(0)  # queued, not yet written: the writer's turn comes after this one
    out.close()
    assert await waiting is False
    await settle()
    assert socket.frames == []


async def test_nowhere_refuses_everything() -> None:
    nowhere = Outgoing.nowhere()
    assert nowhere.post(frame(1)) is False and await nowhere.send(chunk(1)) is False


async def test_a_backlog_over_the_high_water_mark_congests_until_written_down_to_the_low(monkeypatch) -> None:
    monkeypatch.setattr("worker.link.outgoing.HIGH_WATER_CHARS", 10 * len(frame(0)))
    monkeypatch.setattr("worker.link.outgoing.LOW_WATER_CHARS", 2 * len(frame(0)))
    socket = Socket()
    out = Outgoing(socket.send)
    socket.held = asyncio.Event()  # a coordinator that reads slowly
    drained: list[str] = []
    for n in range(10):
        out.post(frame(n))
    assert not out.congested
    out.post(frame(10))
    assert out.congested
    out.when_drained(lambda: drained.append("resumed"))
    await settle()
    assert drained == [] and out.congested  # one frame out, the rest still queued
    socket.held.set()
    await settle()
    assert drained == ["resumed"] and not out.congested
    assert socket.messages() == [str(n) for n in range(11)]
    out.when_drained(lambda: drained.append("at once"))
    assert drained == ["resumed", "at once"]


async def test_the_end_of_the_connection_relieves_whoever_waits_for_a_drain(monkeypatch) -> None:
    monkeypatch.setattr("worker.link.outgoing.HIGH_WATER_CHARS", 1)
    out = Outgoing(Socket().send)
    out.post(frame(1))
    drained: list[bool] = []
    out.when_drained(lambda: drained.append(out.post(frame(2))))
    out.close()
    assert drained == [False]  # woken, and told on its next post that the connection is gone
