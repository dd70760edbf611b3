"""The tuner's load: closed loop (N requests in flight, never more), warm-up sent and not counted,
figures per level, a long prefill beside at levels 1 and 2 only, failures counted, greedy probes
at temperature 0; against the fake engine on a Unix socket, as the app reaches its engines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.fake_engine import Behaviour, FakeEngine
from worker.measure.load import (Endpoint, decode_tok_s, kv_slots, ladder, measure, prompt_set, read_prompts,
                                 shipped_prompts)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "tune"
DELAY_S = 0.01


def endpoint(engine: FakeEngine) -> Endpoint:
    return Endpoint(engine.base_url, engine.api_key, engine.served_name, engine.socket_path)


@pytest.fixture
async def engine(tmp_path: Path) -> FakeEngine:
    async with FakeEngine(behaviour=Behaviour(tokens=10, token_delay_s=DELAY_S),
                          socket_path=str(tmp_path / "e.sock")) as fake:
        yield fake


async def test_each_level_holds_exactly_its_requests_in_flight(engine: FakeEngine) -> None:
    prompts = read_prompts(FIXTURES / "prompts-bytes.json")
    m = await measure(endpoint(engine), (1, 4), repeats=1, warmup=2, prompts=prompts, long_prefill_beside=False,
                      run_s=0.3)
    assert [lv.concurrency for lv in m.levels] == [1, 4] and all(lv.failed == 0 for lv in m.levels)
    one, four = m.levels
    # 10 tokens 10 ms apart: about 100 tok/s per request, four at once about four times that
    assert 50 < one.per_request_tok_s < 120 and 50 < four.per_request_tok_s < 120
    assert 2.5 < four.aggregate_tok_s / one.aggregate_tok_s < 4.5
    assert 0 < one.ttft_p90_ms < 200
    bodies = [r.body for r in engine.records]
    assert all(b["temperature"] == 0.0 and b["model"] == "fake-model" for b in bodies)
    assert all(r.headers.get("authorization") == f"Bearer {engine.api_key}" for r in engine.records)
    assert sum(1 for b in bodies if not b["stream"]) == len(prompts.probes)  # the greedy probes, whole
    assert m.greedy and len(m.greedy) == len(prompts.probes)


async def test_chunks_read_together_leave_decode_unmeasured_not_fast(tmp_path: Path) -> None:
    """An engine that writes a whole answer at once: its chunks arrive in one read, microseconds
    apart, and dividing by that would read thousands of tok/s; decode is not measured (0) instead,
    while the aggregate and the answer speed still count every token."""
    async with FakeEngine(behaviour=Behaviour(tokens=20), socket_path=str(tmp_path / "e.sock")) as fake:
        m = await measure(endpoint(fake), (1, 2), repeats=2, warmup=1, prompts=read_prompts(FIXTURES / "prompts-bytes.json"),
                          long_prefill_beside=False, run_s=0.2)
    assert all(lv.per_request_tok_s == 0.0 and lv.aggregate_tok_s > 0 and lv.answer_tok_s > 0 for lv in m.levels)


def test_decode_is_timed_only_over_a_span_of_separate_arrivals() -> None:
    steady = [1.0 + 0.01 * i for i in range(11)]  # 11 tokens 10 ms apart
    assert decode_tok_s(11, steady) == pytest.approx(100.0)
    assert decode_tok_s(11, [1.0 + 1e-6 * i for i in range(11)]) is None  # one read
    assert decode_tok_s(11, [1.0] + [1.03 + 1e-6 * i for i in range(10)]) is None  # two reads, 30 ms apart
    assert decode_tok_s(4, [1.0, 1.004, 1.008, 1.012]) is None  # 12 ms: too short to time
    assert decode_tok_s(1, [1.0]) is None and decode_tok_s(5, [1.0]) is None
    uneven = [1.0, 1.01, 1.02, 1.02, 1.03, 1.04]  # one pair together among steady ones: still timed
    assert decode_tok_s(6, uneven) == pytest.approx(125.0)


async def test_a_long_prefill_runs_beside_levels_one_and_two_only(engine: FakeEngine) -> None:
    prompts = read_prompts(FIXTURES / "prompts-bytes.json")
    long_text = prompts.long_prefill.messages[-1][1]
    await measure(endpoint(engine), (1, 2, 4), repeats=1, warmup=0, prompts=prompts, run_s=0.1)
    beside = [r for r in engine.records if r.body["messages"][-1]["content"] == long_text]
    assert len(beside) == 2


async def test_failed_requests_are_counted(tmp_path: Path) -> None:
    async with FakeEngine(behaviour=Behaviour(tokens=10, crash_after=3), socket_path=str(tmp_path / "e.sock")) as fake:
        m = await measure(endpoint(fake), (2,), repeats=1, warmup=0, prompts=shipped_prompts(),
                          long_prefill_beside=False, run_s=0.05)
    assert m.levels[0].failed >= 2


def test_the_ladder_doubles_up_to_the_top_and_the_kv() -> None:
    assert ladder(16) == (1, 2, 4, 8, 16) and ladder(12) == (1, 2, 4, 8) and ladder(16, 3) == (1, 2)
    prompts = prompt_set(json.loads((FIXTURES / "prompts-bytes.json").read_text()))
    assert kv_slots(None, prompts) is None and kv_slots(10, prompts) == 1
    assert kv_slots(100_000, prompts) > kv_slots(10_000, prompts) > 1


def test_the_shipped_set_has_every_class_and_short_answers() -> None:
    prompts = shipped_prompts()
    assert {p.cls for p in prompts.load} == {"chat", "long", "shared_prefix", "tool_call"}
    assert prompts.probes and all(p.max_tokens <= 64 for p in (*prompts.load, *prompts.probes))


def test_the_prompt_set_is_cut_to_what_one_request_may_hold() -> None:
    """A 2,048-token engine cannot take the shipped long prompt: it is left out (every request with
    it would fail, whatever the arguments), the long prefill is shortened to fit, the rest kept."""
    from worker.measure.load import TEMPLATE_TOKENS, fitting, shipped_prompts

    shipped = shipped_prompts()
    cut = fitting(shipped, 2048)
    size = lambda p: sum(len(c.encode()) for _, c in p.messages)  # noqa: E731
    assert all(size(p) + p.max_tokens + TEMPLATE_TOKENS <= 2048 for p in (*cut.load, *cut.probes, cut.long_prefill))
    assert {p.cls for p in cut.load} == {p.cls for p in shipped.load} - {"long"}
    assert size(cut.long_prefill) > 1500  # still a long prefill
    assert fitting(shipped, None) == shipped and fitting(shipped, 1_000_000) == shipped
