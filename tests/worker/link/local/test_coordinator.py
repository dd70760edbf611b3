"""The reference coordinator's websocket side, against the real link and relay."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from tests.support.fake_engine import Behaviour, FakeEngine
from tests.worker.link.local.nodes import ASSIGN, HELLO, TOKEN, MiniNode
from worker.contract import protocol
from worker.link.local import NoNode, ReferenceCoordinator


async def test_assignment_follows_welcome(node: MiniNode) -> None:
    async with asyncio.timeout(5):
        while not node.assigned:
            await asyncio.sleep(0.01)
    assert node.assigned == [ASSIGN]
    assert node.link.welcome is not None


async def test_exchange_api_collects_head_chunks_and_end(coordinator: ReferenceCoordinator, node: MiniNode) -> None:
    exchange = await coordinator.request({"messages": [], "stream": True, "max_tokens": 4})
    collected = await exchange.collect()
    assert collected.head is not None and collected.head.status == 200 and collected.error is None
    assert collected.data.count("data: ") == 6 and collected.data.endswith("data: [DONE]\n\n")
    assert collected.end is not None and collected.end.usage.completion_tokens == 4


async def test_a_request_without_a_node_raises_no_node(coordinator: ReferenceCoordinator) -> None:
    with pytest.raises(NoNode):
        await coordinator.request({"messages": []})
    assert coordinator._exchanges == {}  # nothing is left waiting for an answer that cannot come


async def test_cancel_frame_stops_generation_upstream(coordinator: ReferenceCoordinator, node: MiniNode,
                                                      engine: FakeEngine) -> None:
    engine.behaviour = Behaviour(tokens=1000, token_delay_s=0.01)
    exchange = await coordinator.request({"stream": True})
    await coordinator.wait_for("response.chunk")
    await coordinator.cancel(exchange.id)
    collected = await exchange.collect()
    assert collected.error is not None and (collected.error.status, collected.error.code) == (499, "cancelled")
    await asyncio.wait_for(engine.records[0].finished.wait(), 5)
    assert engine.records[0].disconnected


async def test_socket_drop_cancels_upstream_and_nothing_leaks_onto_the_next_connection(
        coordinator: ReferenceCoordinator, node: MiniNode, engine: FakeEngine) -> None:
    engine.behaviour = Behaviour(tokens=1000, token_delay_s=0.01)
    exchange = await coordinator.request({"stream": True})
    await coordinator.wait_for("response.chunk")
    coordinator.drop_node()
    collected = await exchange.collect()
    assert collected.error is not None and collected.error.code == "node_gone"  # the coordinator's own note
    await asyncio.wait_for(engine.records[0].finished.wait(), 5)
    assert engine.records[0].disconnected
    await coordinator.wait_for_connections(2)
    after = len(coordinator.received)
    await asyncio.sleep(0.1)
    assert [m for m in coordinator.received[after:] if getattr(m, "id", None) == exchange.id] == []


async def test_coordinator_rejects_a_bad_hello_with_4400(coordinator: ReferenceCoordinator) -> None:
    async with connect(coordinator.url, additional_headers={"Authorization": f"Bearer {TOKEN}"}) as ws:
        await ws.send('{"type": "status", "state": "idle"}')
        with pytest.raises(ConnectionClosed):
            await ws.recv()
    assert ws.close_code == 4400


async def test_coordinator_rejects_another_protocol_with_4426(coordinator: ReferenceCoordinator) -> None:
    async with connect(coordinator.url, additional_headers={"Authorization": f"Bearer {TOKEN}"}) as ws:
        await ws.send(protocol.encode(HELLO.model_copy(update={"protocol": 2})))
        with pytest.raises(ConnectionClosed):
            await ws.recv()
    assert ws.close_code == 4426


async def test_coordinator_refuses_a_wrong_token_with_4401(coordinator: ReferenceCoordinator) -> None:
    async with connect(coordinator.url, additional_headers={"Authorization": "Bearer wrong"}) as ws:
        with pytest.raises(ConnectionClosed):
            await ws.recv()
    assert ws.close_code == 4401
    assert coordinator.hellos == []


async def test_coordinator_answers_a_bad_frame_from_the_node_with_error(coordinator: ReferenceCoordinator) -> None:
    async with connect(coordinator.url, additional_headers={"Authorization": f"Bearer {TOKEN}"}) as ws:
        await ws.send(protocol.encode(HELLO))
        assert json.loads(await ws.recv())["type"] == "welcome"
        assert json.loads(await ws.recv())["type"] == "assign"
        await ws.send("{broken")
        reply = json.loads(await ws.recv())
    assert (reply["type"], reply["code"]) == ("error", "bad_message")
    assert coordinator.bad_frames


async def test_a_coordinator_that_does_not_record_keeps_nothing_while_relaying(
        engine: FakeEngine, http: httpx.AsyncClient) -> None:
    """Local mode runs for days: relayed chunks must not pile up in memory."""
    async with ReferenceCoordinator(token=TOKEN, assign=ASSIGN, record=False) as reference:
        mini = MiniNode(reference.url, engine, http)
        task = asyncio.create_task(mini.link.run())
        await reference.wait_for_connections(1)
        for _ in range(3):
            exchange = await reference.request({"messages": [{"role": "user", "content": "hi"}], "stream": True})
            collected = await exchange.collect()
            assert collected.end is not None and "[DONE]" in collected.data
        assert reference.received == reference.hellos  # one hello a connection; no chunks, no status
        assert reference._exchanges == {}
        await mini.link.close()
        await asyncio.wait_for(task, 5)


@pytest.mark.parametrize(("batch", "autotune", "features"), [
    (True, True, ["batch", "autotune"]), (False, True, ["autotune"]), (True, False, ["batch"]), (False, False, [])])
async def test_welcome_lists_what_the_coordinator_offers(batch: bool, autotune: bool, features: list[str]) -> None:
    async with ReferenceCoordinator(token=TOKEN, batch=batch, autotune=autotune) as reference, \
            connect(reference.url, additional_headers={"Authorization": f"Bearer {TOKEN}"}) as ws:
        await ws.send(protocol.encode(HELLO))
        welcome = protocol.parse_from_coordinator(await ws.recv(), engine_names=())
        assert isinstance(welcome, protocol.Welcome) and welcome.features == features


async def test_tune_blocks_and_tune_messages_reach_the_node_as_sent() -> None:
    block = {"when": ["on_request"], "budget": {"max_trials": 4}, "space": {"-np": {"min": 1, "max": 8}}}
    engine = protocol.EngineModel(source="/m.gguf", weights_mib=10, tune=block)
    assign = protocol.Assign(assignment_id="a-7", model=protocol.ModelSpec(name="m", llamacpp=engine))
    async with ReferenceCoordinator(token=TOKEN, assign=assign) as reference, \
            connect(reference.url, additional_headers={"Authorization": f"Bearer {TOKEN}"}) as ws:
        await ws.send(protocol.encode(HELLO))
        await ws.recv()  # welcome
        sent = protocol.parse_from_coordinator(await ws.recv(), engine_names=("llamacpp",))
        assert isinstance(sent, protocol.Assign)
        tune = protocol.parse_tune(sent.model.engines["llamacpp"].tune)
        assert isinstance(tune, protocol.TuneSpec) and tune.when == ("on_request",) and tune.budget.max_trials == 4
        await reference.wait_for_connections(1)
        for action in ("start", "cancel", "forget"):
            await reference.tune("a-7", action)  # type: ignore[arg-type]
            message = protocol.parse_from_coordinator(await ws.recv(), engine_names=())
            assert message == protocol.Tune(assignment_id="a-7", action=action)


async def test_a_batch_is_unpacked_for_exchanges_and_received_in_order(coordinator: ReferenceCoordinator) -> None:
    async with connect(coordinator.url, additional_headers={"Authorization": f"Bearer {TOKEN}"}) as ws:
        await ws.send(protocol.encode(HELLO))
        assert json.loads(await ws.recv())["type"] == "welcome"
        assert json.loads(await ws.recv())["type"] == "assign"
        exchange = await coordinator.request({"stream": True})
        assert json.loads(await ws.recv())["id"] == exchange.id
        answer = [protocol.ResponseHead(id=exchange.id, status=200, content_type="text/event-stream"),
                  protocol.ResponseChunk(id=exchange.id, data="data: 1\n\n"),
                  protocol.ResponseChunk(id=exchange.id, data="data: 2\n\n"),
                  protocol.ResponseEnd(id=exchange.id)]
        status = protocol.Status(state="ready")
        await ws.send(protocol.encode(protocol.Batch(messages=[answer[0], status, *answer[1:3]])))
        await ws.send(protocol.encode(answer[3]))
        collected = await exchange.collect()
        assert (collected.head, collected.data, collected.chunks, collected.end) == (
            answer[0], "data: 1\n\ndata: 2\n\n", 2, answer[3])
        await coordinator.wait_for("response.end")
        assert coordinator.received[1:] == [answer[0], status, *answer[1:]]
        assert coordinator.frame_sizes == [4, 1]


async def test_a_batch_inside_a_batch_is_refused_whole(coordinator: ReferenceCoordinator) -> None:
    async with connect(coordinator.url, additional_headers={"Authorization": f"Bearer {TOKEN}"}) as ws:
        await ws.send(protocol.encode(HELLO))
        await ws.recv(), await ws.recv()  # welcome, assign
        inner = {"type": "batch", "messages": [{"type": "status", "state": "idle"}]}
        await ws.send(json.dumps({"type": "batch", "messages": [{"type": "status", "state": "idle"}, inner]}))
        reply = json.loads(await ws.recv())
        assert (reply["type"], reply["code"]) == ("error", "bad_message")
        assert coordinator.received == [HELLO] and len(coordinator.bad_frames) == 1
