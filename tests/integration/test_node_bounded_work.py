"""A node checking a costly assignment keeps answering (issue 21): the assignments that took 15 s
or 46 s to check on the node's event loop, or killed the planning task, are each refused within
2 s, with a status naming the limit, while a request relayed right behind each is answered and the
loop never stalls; a frame nested 100,000 deep gets an `error` reply and the connection stays.

The Node runs in-process on the test's loop, so a stall of its loop is measured directly."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from tests.integration.test_node import STATE_TIMEOUT_S, running_node
from tests.security.test_hostile_assignments import BOUNDED_S, COSTLY_CASES
from worker.contract import protocol

pytestmark = pytest.mark.integration

TICK_S = 0.01
COMPLETION = {"model": "tiny-1b", "prompt": "hi", "max_tokens": 1}


class StallWatch:
    """The longest time the loop let pass between two ticks of a 10 ms sleep, beyond the sleep."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> StallWatch:
        self._task = asyncio.create_task(self._tick())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()

    async def _tick(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            self.longest = max(self.longest, now - last - TICK_S)
            last = now


def refusal_of(assignment_id: str) -> Any:
    def test(message: Any) -> bool:
        return (isinstance(message, protocol.Status) and message.refused is not None
                and message.refused.assignment_id == assignment_id)

    return test


async def test_costly_assignments_are_refused_within_2_s_while_requests_are_answered(tmp_path: Any) -> None:
    frames = [(f"costly-{n}", case, json.dumps(case.message(f"costly-{n}"))) for n, case in enumerate(COSTLY_CASES)]
    async with running_node(tmp_path, {}) as run:
        await run.coordinator.wait_for_connections(1, timeout=STATE_TIMEOUT_S)
        await run.status("idle")
        async with StallWatch() as watch:
            for assignment_id, case, frame in frames:
                after, started = run.mark(), time.monotonic()
                await run.coordinator.send_raw(frame)
                exchange = await run.coordinator.request(COMPLETION, path="/v1/completions")
                answer = await exchange.collect(timeout=BOUNDED_S)  # while the assignment is checked
                answered_s = time.monotonic() - started
                status = await run.coordinator.wait_for(refusal_of(assignment_id), after=after, timeout=BOUNDED_S)
                refused_s = time.monotonic() - started
                print(f"\n{case.engine}: {case.label} ({len(frame):,} bytes): request answered in "
                      f"{answered_s:.3f} s, refused in {refused_s:.3f} s: {status.refused.reason}")
                assert answer.error is not None and answer.error.code == "not_ready"
                assert status.state == "failed"
                assert all(name.lower() in status.refused.reason.lower() for name in case.names)
        print(f"longest loop stall: {watch.longest:.3f} s")
        assert watch.longest < 1.0


async def test_a_frame_nested_100_000_deep_is_answered_with_an_error_and_the_link_stays(tmp_path: Any) -> None:
    async with running_node(tmp_path, {}) as run:
        await run.coordinator.wait_for_connections(1, timeout=STATE_TIMEOUT_S)
        after = run.mark()
        await run.coordinator.send_raw(
            '{"type": "assign", "assignment_id": "deep", "model": ' + "[" * 100_000 + "]" * 100_000 + "}")
        error = await run.coordinator.wait_for("error", after=after, timeout=BOUNDED_S)
        assert error.code == "bad_message" and "not valid JSON" in error.message
        answer = await (await run.coordinator.request(COMPLETION, path="/v1/completions")).collect(timeout=BOUNDED_S)
        assert answer.error is not None and answer.error.code == "not_ready"
        assert len(run.coordinator.hellos) == 1  # the same connection: no reconnect, no second hello
