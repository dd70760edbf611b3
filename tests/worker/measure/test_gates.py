"""The tuner's gate: a candidate that changes answers, starves one request, slows the first token
past the ceiling, loses KV, fails a request or shows a trap loses, with the contract's reason."""

from __future__ import annotations

import dataclasses

from worker.contract import protocol
from worker.measure.gates import check, same_answers
from worker.measure.load import Greedy, LevelFigures, Measurement

LEVELS = (LevelFigures(1, 50.0, 50.0, 100.0, 0, 45.0), LevelFigures(2, 95.0, 48.0, 120.0, 0, 44.0),
          LevelFigures(4, 160.0, 40.0, 300.0, 0, 30.0))
ANSWER = Greedy(("Mer", "cury", ",", " Venus"), (9.0, 0.2, 7.0, 6.0))  # a near-tie at "cury"
BASELINE = Measurement(LEVELS, ("Mercury, Venus",), 4096, (ANSWER,))


def with_level(m: Measurement, concurrency: int, **changes: float) -> Measurement:
    return dataclasses.replace(m, levels=tuple(dataclasses.replace(lv, **changes) if lv.concurrency == concurrency
                                               else lv for lv in m.levels))


def answering(*tokens: str) -> Measurement:
    return dataclasses.replace(BASELINE, greedy=("".join(tokens),), greedy_detail=(Greedy(tokens, (5.0,) * len(tokens)),))


def test_the_same_figures_pass() -> None:
    assert check(BASELINE, BASELINE, None, ()) is None


def test_a_changed_answer_loses_with_gate() -> None:
    assert check(BASELINE, answering("Ven", "us", ",", " Mars"), None, ()) == "gate"
    assert check(BASELINE, answering("Mer", "cury"), None, ()) == "gate"  # cut short


def test_a_flipped_near_tie_is_no_change() -> None:
    assert same_answers(BASELINE, answering("Mer", "maid", " and", " more"))  # the baseline led by 0.2 nats there


def test_without_alternatives_the_text_must_match_exactly() -> None:
    bare = dataclasses.replace(BASELINE, greedy_detail=())
    assert check(bare, dataclasses.replace(bare, greedy=("Mermaid",)), None, ()) == "gate"
    assert check(bare, bare, None, ()) is None


def test_speed_at_one_and_two_requests_may_not_fall_by_more_than_the_slack() -> None:
    assert check(BASELINE, with_level(BASELINE, 2, answer_tok_s=36.0, per_request_tok_s=40.0), None, ()) is None
    trap = with_level(BASELINE, 2, answer_tok_s=8.0, per_request_tok_s=9.0)  # decode 109 → 19 in the notes
    assert check(BASELINE, trap, None, ()) == "regressed:decode"
    slow = with_level(BASELINE, 1, answer_tok_s=30.0, per_request_tok_s=30.0)
    assert check(BASELINE, slow, None, ()) == "regressed:decode"
    assert check(BASELINE, with_level(BASELINE, 4, answer_tok_s=5.0, per_request_tok_s=5.0), None, ()) is None


def test_one_measure_alone_falling_is_no_regression() -> None:
    assert check(BASELINE, with_level(BASELINE, 1, answer_tok_s=30.0), None, ()) is None  # decode held
    assert check(BASELINE, with_level(BASELINE, 1, per_request_tok_s=30.0), None, ()) is None  # answers held


def test_a_baseline_that_queues_is_judged_by_its_answers_not_its_decode() -> None:
    # one slot: each request decodes alone at 86 tok/s while the other waits; two slots decode at 60
    queued = with_level(BASELINE, 2, per_request_tok_s=86.0, answer_tok_s=40.0)
    batched = with_level(BASELINE, 2, per_request_tok_s=60.0, answer_tok_s=45.0)
    assert check(queued, batched, None, ()) is None


def test_the_floor_holds_where_the_baseline_held_it() -> None:
    floor = protocol.TuneObjective(per_request_floor_tok_s=20.0)
    assert check(BASELINE, with_level(BASELINE, 4, per_request_tok_s=15.0), floor, ()) == "regressed:decode"
    slow = with_level(BASELINE, 4, per_request_tok_s=15.0)
    assert check(slow, with_level(slow, 4, per_request_tok_s=14.0), floor, ()) is None


def test_time_to_first_token_over_the_ceiling_loses() -> None:
    ceiling = protocol.TuneObjective(ttft_p90_ceiling_ms=1000.0)
    assert check(BASELINE, with_level(BASELINE, 4, ttft_p90_ms=1500.0), ceiling, ()) == "regressed:ttft"
    assert check(BASELINE, with_level(BASELINE, 4, ttft_p90_ms=1500.0), None, ()) is None
    over = with_level(BASELINE, 4, ttft_p90_ms=1200.0)
    assert check(over, with_level(over, 4, ttft_p90_ms=1300.0), ceiling, ()) is None  # the baseline was over too


def test_kv_below_ninety_percent_of_the_baseline_loses() -> None:
    assert check(BASELINE, dataclasses.replace(BASELINE, kv_tokens=3687), None, ()) is None
    assert check(BASELINE, dataclasses.replace(BASELINE, kv_tokens=3686), None, ()) == "kv_floor"


def test_a_failed_request_and_a_trap_lose_first() -> None:
    assert check(BASELINE, with_level(BASELINE, 4, failed=1), None, ()) == "failed"
    assert check(BASELINE, answering("x"), None, ("trap:drafter_graph_off",)) == "trap:drafter_graph_off"


def test_a_decode_nobody_could_time_is_judged_by_answer_speed_alone() -> None:
    """0 per-request tok/s means no request's decode was timed (its tokens came in one burst): it is
    neither slow against a floor nor a free pass when answers got slower."""
    floor = protocol.TuneObjective(per_request_floor_tok_s=20.0)
    assert check(BASELINE, with_level(BASELINE, 4, per_request_tok_s=0.0), floor, ()) is None
    untimed = with_level(BASELINE, 1, per_request_tok_s=0.0)
    assert check(untimed, with_level(untimed, 1, answer_tok_s=30.0), None, ()) == "regressed:decode"
    assert check(untimed, untimed, None, ()) is None
