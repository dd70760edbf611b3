"""Hostile requests against a real node serving the tiny model with a real llama-server, through
the reference coordinator (contract, Relay, "Bounded requests"):

- the grammar 20,000 parentheses deep (40 kB) that crashed llama-server with SIGSEGV, sent six
  times while a bystander streams: each refused with 400 before the engine sees it, the
  bystander's stream completes, the node and its engine stay ready throughout (before the bound,
  five of these and the node gave up, answering 503 until a person clicked Retry);
- an engine that dies anyway while it serves (SIGSEGV to the real llama-server under a
  constrained request and a bystander's stream): one 502 `engine_failed` to each, the engine
  restarted at once without counting toward giving up, and from the third such crash within ten
  minutes constrained requests are refused with 400 while plain ones are still served.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from tests.integration.test_node import STATE_TIMEOUT_S, Running, running_node
from tests.support.engines import LlamaServer
from worker.contract import protocol
from worker.contract.events import EngineSnapshot
from worker.link.local.coordinator import Exchange

pytestmark = pytest.mark.integration

DEEP_GRAMMAR = "root ::= " + "(" * 20_000 + '"a"' + ")" * 20_000
HOSTILE = {"prompt": "Hello", "max_tokens": 8, "grammar": DEEP_GRAMMAR}
CONTEXT = 2048  # the tiny model's own: llama-server serves no more
LONG = 2000  # tokens: a stream of about a second from the tiny model
BYSTANDER = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": LONG, "stream": True,
             "ignore_eos": True}
# A constrained request that runs as long as the bystander: any letters and spaces.
CONSTRAINED = {"prompt": "Hello", "max_tokens": LONG, "stream": True, "ignore_eos": True,
               "grammar": 'root ::= [a-z ]+'}
PLAIN = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
TERMINAL = (protocol.ResponseEnd, protocol.ResponseError)


def assignment(model: Path) -> protocol.Assign:
    spec = protocol.EngineModel(source=str(model), weights_mib=1,
                                base_args=["--ctx-size", str(CONTEXT), "--threads", "1"])
    return protocol.Assign(assignment_id="hostile-1", model=protocol.ModelSpec(name="tiny-llama", llamacpp=spec))


class Answer:
    """One request's frames as they arrive, read in the background so the test can act meanwhile."""

    def __init__(self, exchange: Exchange) -> None:
        self.frames: list[BaseModel] = []
        self.first_chunk = asyncio.Event()
        self.task = asyncio.create_task(self._read(exchange))

    async def _read(self, exchange: Exchange) -> None:
        async for frame in exchange.frames():
            self.frames.append(frame)
            if isinstance(frame, protocol.ResponseChunk):
                self.first_chunk.set()

    async def streaming(self) -> None:
        """Returns once the first tokens have arrived (the request is in flight on the engine)."""
        chunk = asyncio.create_task(self.first_chunk.wait())
        await asyncio.wait([chunk, self.task], timeout=STATE_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
        chunk.cancel()
        assert self.first_chunk.is_set(), f"no tokens streamed: {self.frames}"

    async def whole(self) -> list[BaseModel]:
        await asyncio.wait_for(self.task, STATE_TIMEOUT_S)
        return self.frames

    @property
    def terminals(self) -> list[BaseModel]:
        return [f for f in self.frames if isinstance(f, TERMINAL)]

    @property
    def data(self) -> str:
        return "".join(f.data for f in self.frames if isinstance(f, protocol.ResponseChunk))


async def send(run: Running, body: dict[str, Any], path: str = "/v1/chat/completions") -> Answer:
    return Answer(await run.coordinator.request(body, path=path, deadline_s=STATE_TIMEOUT_S))


def engine(run: Running) -> EngineSnapshot:
    [snap] = run.node.snapshot().engines
    return snap


async def test_the_grammar_that_crashed_llama_server_is_refused_six_times_while_a_bystander_streams(
        llama_server_bin: LlamaServer, tiny_gguf: Path, tmp_path: Path) -> None:
    bins = {"llamacpp": str(llama_server_bin.executable)}
    async with running_node(tmp_path, bins, fixture="no-gpu.json", assign=assignment(tiny_gguf)) as run:
        assert (await run.status("ready", "failed")).state == "ready"
        serving = engine(run)
        seen_from = len(run.snapshots)
        bystander = await send(run, BYSTANDER)
        await bystander.streaming()
        hostile = [await send(run, HOSTILE, "/v1/completions") for _ in range(6)]
        refusals = [await answer.whole() for answer in hostile]
        assert not bystander.task.done(), "the bystander must still be streaming while the grammars arrive"
        for frames in refusals:
            [error] = frames
            assert isinstance(error, protocol.ResponseError)
            assert (error.status, error.code) == (400, "bad_request")
            assert "grammar" in error.message and "128" in error.message
        await bystander.whole()
        [end] = bystander.terminals
        assert isinstance(end, protocol.ResponseEnd) and end.usage is not None
        assert end.usage.completion_tokens == LONG and bystander.data.rstrip().endswith("data: [DONE]")
        after = engine(run)
        assert (after.state, after.pid, after.restarts, after.failures_in_a_row) == ("ready", serving.pid, 0, 0)
        assert all(s.state == "ready" and all(e.state == "ready" for e in s.engines)
                   for s in run.snapshots[seen_from:])
        plain = await run.ask(PLAIN)
        assert plain.end is not None and plain.error is None


async def crash_under(run: Running, *answers: Answer) -> float:
    """SIGSEGV to the engine while `answers` stream on it; the seconds until it is ready again."""
    for answer in answers:
        await answer.streaming()
    pid = engine(run).pid
    assert pid is not None
    mark = run.mark()
    killed = time.monotonic()
    os.kill(pid, signal.SIGSEGV)
    starting = await run.status("starting", after=mark)
    await run.status("ready", after=run.coordinator.received.index(starting, mark))
    return time.monotonic() - killed


async def test_an_engine_crashed_under_requests_restarts_at_once_and_three_crashes_refuse_constraints(
        llama_server_bin: LlamaServer, tiny_gguf: Path, tmp_path: Path) -> None:
    bins = {"llamacpp": str(llama_server_bin.executable)}
    async with running_node(tmp_path, bins, fixture="no-gpu.json", assign=assignment(tiny_gguf)) as run:
        assert (await run.status("ready", "failed")).state == "ready"
        first_pid = engine(run).pid
        constrained = await send(run, CONSTRAINED, "/v1/completions")
        bystander = await send(run, BYSTANDER)
        back_in = await crash_under(run, constrained, bystander)
        for answer in (constrained, bystander):
            await answer.whole()
            [error] = answer.terminals  # exactly one terminal message each
            assert isinstance(error, protocol.ResponseError)
            assert (error.status, error.code) == (502, "engine_failed")
        restarted = engine(run)
        assert restarted.pid not in (None, first_pid)
        assert (restarted.restarts, restarted.failures_in_a_row) == (1, 0)  # not counted toward giving up
        assert "a request crashed the engine" in (restarted.last_error or "")
        assert back_in < 20.0, "restarted at once, not after a backoff"
        assert run.node.snapshot().problem is None  # nothing for the person to do
        still = await send(run, CONSTRAINED | {"max_tokens": 4}, "/v1/completions")
        assert isinstance((await still.whole())[-1], protocol.ResponseEnd)  # one crash is not yet three

        for crash in (2, 3):
            victim = await send(run, CONSTRAINED, "/v1/completions")
            await crash_under(run, victim)
            await victim.whole()
            [error] = victim.terminals
            assert isinstance(error, protocol.ResponseError) and (error.status, error.code) == (502, "engine_failed")
            assert (engine(run).restarts, engine(run).failures_in_a_row) == (crash, 0)

        refused = await send(run, CONSTRAINED | {"max_tokens": 4}, "/v1/completions")
        [error] = await refused.whole()
        assert isinstance(error, protocol.ResponseError) and (error.status, error.code) == (400, "bad_request")
        assert "crashed its engine 3 times within 10 minutes" in error.message
        plain = await run.ask(PLAIN)
        assert plain.end is not None and plain.error is None and engine(run).state == "ready"
