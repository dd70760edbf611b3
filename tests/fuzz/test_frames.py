"""Fuzzed coordinator frames over a real websocket: the node-side `Link` never crashes or drops.

The reference coordinator sends hypothesis-made frames (random JSON, wrong field types, huge
strings, deep nesting, unknown types, binary frames) to a `Link` whose handler only records.
The protocol says: a frame that is not JSON or does not fit its schema gets one `error` reply; a
message of an unknown type is ignored; a valid one reaches the node; the connection stays up.

Each frame is followed by a probe (a `request` with no method, so one `error` whose `ref` is the
probe's id): every reply before the probe's belongs to the fuzzed frame, with no waiting for
silence. The loop, coordinator and link live in one background thread for the whole module, so
"the connection kept" is literally one connection: one `hello`, link generation 1, at the end.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from worker.contract import protocol
from worker.link.connection import Backoff, Link
from worker.link.local import ReferenceCoordinator

T = TypeVar("T")
TOKEN = "fuzz-token"
HELLO = protocol.Hello(
    node_id="fuzz-node", app_version="0.0.0",
    platform=protocol.PlatformInfo(os="linux", runtime="cpu", arch="x86_64"),
    hardware=protocol.HardwareInfo(ram_mib=1024, cpu=protocol.CpuInfo(model="fuzz", cores=1)),
    engines={"vllm": None, "llamacpp": None},
)
KNOWN_TYPES = ("welcome", "assign", "unassign", "pause", "resume", "request", "cancel", "update", "error")
VALID: dict[str, dict[str, Any]] = {
    "welcome": {"type": "welcome", "node_id": "fuzz-node", "heartbeat_s": 10},
    "assign": {"type": "assign", "assignment_id": "a-1",
               "model": {"name": "m", "llamacpp": {"source": "/models/m.gguf", "weights_mib": 10}}},
    "unassign": {"type": "unassign", "assignment_id": "a-1"},
    "pause": {"type": "pause"},
    "resume": {"type": "resume"},
    "request": {"type": "request", "id": "r-1", "method": "POST", "path": "/v1/completions",
                "body": {"prompt": "hi"}, "deadline_s": 30},
    "cancel": {"type": "cancel", "id": "r-1"},
    "update": {"type": "update", "version": "9.9.9", "url": "https://example.org/u.tar.gz",
               "sha256": "0" * 64, "signature": "c2ln"},
    "error": {"type": "error", "code": "oops", "message": "m", "ref": None},
}
FUZZ = settings(max_examples=40, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@dataclass(frozen=True)
class Outcome:
    """What one frame caused: `error` replies sent back, and messages handed to the node."""

    errors: list[protocol.Error]
    delivered: list[Any]


class Harness:
    """A reference coordinator and a connected `Link` on a loop in a background thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-loop", daemon=True)
        self.delivered: list[Any] = []
        self._probes = itertools.count(1)
        self.coordinator = ReferenceCoordinator(token=TOKEN, ping_interval=None)
        self.link = Link("ws://unused", lambda: TOKEN, lambda: HELLO, self._record,
                         backoff=Backoff(base_s=0.01, cap_s=0.02))
        self.link_task: asyncio.Task[None] | None = None

    async def _record(self, message: Any) -> None:
        self.delivered.append(message)

    def call(self, coroutine: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def start(self) -> None:
        self.thread.start()
        self.call(self._start())

    async def _start(self) -> None:
        await self.coordinator.start()
        self.link.url = self.coordinator.url
        self.link_task = asyncio.create_task(self.link.run())
        await self.coordinator.wait_for_connections(1)

    def stop(self) -> None:
        self.call(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    async def _stop(self) -> None:
        await self.link.close()
        if self.link_task is not None:
            await asyncio.wait_for(self.link_task, 5)
        await self.coordinator.stop()

    def send(self, frame: str | bytes) -> Outcome:
        return self.call(self._send(frame))

    async def _send(self, frame: str | bytes) -> Outcome:
        delivered_before, received_before = len(self.delivered), len(self.coordinator.received)
        probe = f"probe-{next(self._probes)}"
        await self.coordinator.send_raw(frame)
        await self.coordinator.send_raw(json.dumps({"type": "request", "id": probe}))
        await self.coordinator.wait_for(
            lambda m: isinstance(m, protocol.Error) and m.ref == probe, after=received_before, timeout=20)
        received = self.coordinator.received[received_before:]
        cut = next(i for i, m in enumerate(received) if isinstance(m, protocol.Error) and m.ref == probe)
        errors = [m for m in received[:cut] if isinstance(m, protocol.Error)]
        return Outcome(errors, self.delivered[delivered_before:])

    def connection_kept(self) -> bool:
        running = self.link_task is not None and not self.link_task.done()
        return running and self.link.connected and self.link.generation == 1 and len(self.coordinator.hellos) == 1


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    running = Harness()
    running.start()
    yield running
    assert running.connection_kept(), "the fuzzed frames cost the connection"
    running.stop()


def _json_values() -> st.SearchStrategy[Any]:
    text = st.text(st.characters(codec="utf-8"), max_size=40)
    scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | text
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
                        max_leaves=20)


def _assert_by_the_protocol(frame_type: Any, outcome: Outcome) -> None:
    """Unknown string type: ignored. Known type: exactly one of delivered / `error` reply.
    No string type (or not an object): one `error` reply."""
    codes = [e.code for e in outcome.errors]
    if isinstance(frame_type, str) and frame_type not in KNOWN_TYPES:
        assert outcome.errors == [] and outcome.delivered == []
    elif isinstance(frame_type, str):
        assert (len(outcome.delivered), codes) in ((1, []), (0, ["bad_message"])), outcome
    else:
        assert codes == ["bad_message"] and outcome.delivered == [], outcome


@FUZZ
@given(value=_json_values())
def test_random_json_gets_an_error_or_is_handled(harness: Harness, value: Any) -> None:
    outcome = harness.send(json.dumps(value))
    frame_type = value.get("type") if isinstance(value, dict) else None
    _assert_by_the_protocol(frame_type, outcome)


@FUZZ
@given(kind=st.sampled_from(KNOWN_TYPES), data=st.data())
def test_known_types_with_wrong_field_types(harness: Harness, kind: str, data: st.DataObject) -> None:
    message = dict(VALID[kind])
    fields = [f for f in message if f != "type"]
    if fields:
        field = data.draw(st.sampled_from(fields))
        message[field] = data.draw(_json_values())
    extra = data.draw(st.dictionaries(st.text(max_size=8).filter(lambda k: k not in message), _json_values(), max_size=2))
    outcome = harness.send(json.dumps(message | extra))
    _assert_by_the_protocol(kind, outcome)


@FUZZ
@given(kind=st.sampled_from(KNOWN_TYPES))
def test_every_valid_message_reaches_the_node(harness: Harness, kind: str) -> None:
    outcome = harness.send(json.dumps(VALID[kind]))
    assert outcome.errors == [] and [m.type for m in outcome.delivered] == [kind]


@FUZZ
@given(name=st.text(st.characters(codec="utf-8"), max_size=30).filter(lambda t: t not in KNOWN_TYPES),
       payload=st.dictionaries(st.text(max_size=8), _json_values(), max_size=3))
def test_unknown_types_are_ignored(harness: Harness, name: str, payload: dict[str, Any]) -> None:
    outcome = harness.send(json.dumps(payload | {"type": name}))
    assert outcome.errors == [] and outcome.delivered == []


@FUZZ
@given(blob=st.binary(max_size=2048))
def test_binary_frames_get_an_error(harness: Harness, blob: bytes) -> None:
    outcome = harness.send(blob)
    assert [e.code for e in outcome.errors] == ["bad_message"] and outcome.delivered == []
    assert "binary" in outcome.errors[0].message


@settings(FUZZ, max_examples=12)
@given(depth=st.integers(min_value=1, max_value=200_000), inside=st.sampled_from(["array", "body"]))
def test_deep_nesting(harness: Harness, depth: int, inside: str) -> None:
    nested = "[" * depth + "]" * depth
    frame = nested if inside == "array" else (
        '{"type":"request","id":"r-deep","method":"POST","path":"/v1/completions","body":' + nested + "}")
    outcome = harness.send(frame)
    if inside == "array":
        assert [e.code for e in outcome.errors] == ["bad_message"]
    else:
        _assert_by_the_protocol("request", outcome)


@settings(FUZZ, max_examples=6)
@given(size=st.integers(min_value=100_000, max_value=4_000_000), kind=st.sampled_from(["id", "body", "type"]))
def test_huge_strings(harness: Harness, size: int, kind: str) -> None:
    huge = "é" * size
    message = dict(VALID["request"])
    if kind == "type":
        outcome = harness.send(json.dumps({"type": huge}, ensure_ascii=False))
        assert outcome.errors == [] and outcome.delivered == []
        return
    message[kind] = huge if kind == "id" else {"prompt": huge}
    outcome = harness.send(json.dumps(message, ensure_ascii=False))
    assert outcome.errors == [] and len(outcome.delivered) == 1


@pytest.mark.parametrize("binary", [False, True])
def test_over_size_frames_get_an_error_and_the_connection_stays(harness: Harness, binary: bool) -> None:
    """A frame over the protocol's 16 MiB (up to the link's 64 MiB transport cap) is refused with
    `bad_message`, not by closing the connection."""
    filler = "x" * (protocol.MAX_FRAME_BYTES + 1024)
    frame = json.dumps({"type": "request", "id": "r-big", "method": "POST", "path": "/v1/x", "body": filler})
    outcome = harness.send(frame.encode() if binary else frame)
    assert [e.code for e in outcome.errors] == ["bad_message"] and outcome.delivered == []
    assert "limit" in outcome.errors[0].message or "binary" in outcome.errors[0].message
    assert harness.connection_kept()


def test_the_connection_is_the_one_opened_first(harness: Harness) -> None:
    """After everything above (module order), one connection, and a plain request still arrives."""
    outcome = harness.send(json.dumps(VALID["request"]))
    assert [m.type for m in outcome.delivered] == ["request"]
    assert harness.connection_kept()
