"""A tuning candidate's checks against the baseline, before its speed counts (the contract's
"Tuning": a faster-looking configuration that changes answers, starves a single request or loses
KV is no gain). Pure.

The reason keys are the contract's: a trap the engine's log showed, `failed`, `gate` (greedy text
differs beyond a near-tie), `regressed:decode`, `regressed:ttft`, `kv_floor`.

Per-request speed at 1 and 2 concurrent requests (a long prefill beside) may not fall below the
baseline's by more than `DECODE_SLACK` both in decode and as the request sees it (its tokens over
the time since it was sent: "tokens per second is not answer speed", field note 004). Decode
alone would flatter a baseline that queues: llama-server with one slot decodes each request
alone, fast, while the next waits (measured here at 2 requests: 99 tok/s decode against 44 for
4 slots, whose answers came as soon and whose aggregate at 4 requests was twice as high).
Batching two requests, or a prefill sharing their steps, costs a sound configuration a little;
the trap this guards against (a drafter's graph turned off) costs most of both, 109 → 19 tok/s.
"""

from __future__ import annotations

from collections.abc import Sequence

from worker.contract import protocol
from worker.measure.load import Greedy, LevelFigures, Measurement

NEAR_TIE_NATS = 0.5  # a greedy choice this close to the runner-up may flip with the batch's shape
DECODE_SLACK = 0.3  # the share of per-request speed a candidate may lose at 1 and 2 requests
GUARDED_LEVELS = (1, 2)
KV_FLOOR = 0.9  # of the baseline's KV tokens


def check(baseline: Measurement, candidate: Measurement, objective: protocol.TuneObjective | None,
          traps_seen: Sequence[str]) -> str | None:
    """None where the candidate passes; else the first reason it loses."""
    if traps_seen:
        return traps_seen[0]
    if any(level.failed for level in candidate.levels):
        return "failed"
    if not same_answers(baseline, candidate):
        return "gate"
    if _decode_regressed(baseline, candidate, objective):
        return "regressed:decode"
    if _ttft_regressed(baseline, candidate, objective):
        return "regressed:ttft"
    if baseline.kv_tokens and candidate.kv_tokens is not None and candidate.kv_tokens < KV_FLOOR * baseline.kv_tokens:
        return "kv_floor"
    return None


def same_answers(baseline: Measurement, candidate: Measurement) -> bool:
    """Every probe's greedy answer matches the baseline's, or first differs at a near-tie."""
    if len(baseline.greedy) != len(candidate.greedy):
        return False
    if len(baseline.greedy_detail) != len(baseline.greedy) or len(candidate.greedy_detail) != len(candidate.greedy):
        return baseline.greedy == candidate.greedy
    return all(_same(mine, theirs) for mine, theirs in zip(baseline.greedy_detail, candidate.greedy_detail))


def _same(baseline: Greedy, candidate: Greedy) -> bool:
    """Equal token by token up to the shorter answer's end, or first apart where the baseline's
    choice led its runner-up by less than `NEAR_TIE_NATS` (what follows a flipped tie differs anyway)."""
    for i, (mine, theirs) in enumerate(zip(baseline.tokens, candidate.tokens)):
        if mine != theirs:
            margin = baseline.margins[i] if i < len(baseline.margins) else None
            return margin is not None and margin < NEAR_TIE_NATS
    return len(baseline.tokens) == len(candidate.tokens)


def _decode_regressed(baseline: Measurement, candidate: Measurement, objective: protocol.TuneObjective | None) -> bool:
    for level in candidate.levels:
        before = baseline.level(level.concurrency)
        if before is None:
            continue
        if level.concurrency in GUARDED_LEVELS and _slower(level, before):
            return True
        floor = objective.per_request_floor_tok_s if objective is not None else None
        measured = level.per_request_tok_s > 0  # 0: no request's decode could be timed at this level
        if floor is not None and measured and level.per_request_tok_s < floor <= before.per_request_tok_s:
            return True  # below the floor where the baseline held it
    return False


def _slower(level: LevelFigures, before: LevelFigures) -> bool:
    """Slower per request by both measures, decode and answer speed: one alone moves with how the
    baseline queues, and with where the long prefill fell in a short run."""
    keep = 1 - DECODE_SLACK
    slower_answers = level.answer_tok_s < keep * before.answer_tok_s
    if level.per_request_tok_s <= 0 or before.per_request_tok_s <= 0:
        return slower_answers  # decode not timed on one side (its tokens came in bursts): answer speed alone
    return slower_answers and level.per_request_tok_s < keep * before.per_request_tok_s


def _ttft_regressed(baseline: Measurement, candidate: Measurement, objective: protocol.TuneObjective | None) -> bool:
    """Over the ceiling at a level where the baseline was under it (a baseline already over it
    cannot make every candidate lose)."""
    ceiling = objective.ttft_p90_ceiling_ms if objective is not None else None
    if ceiling is None:
        return False
    return any(_over(level, baseline.level(level.concurrency), ceiling) for level in candidate.levels)


def _over(level: LevelFigures, before: LevelFigures | None, ceiling: float) -> bool:
    return before is not None and level.ttft_p90_ms > ceiling >= before.ttft_p90_ms
