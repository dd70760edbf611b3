from __future__ import annotations

import pytest

from worker.contract.events import ThroughputSnapshot
from worker.contract.events import LIVE_WINDOW_S
from worker.measure.runs import (
    CAPACITY_WINDOW_S,
    RunMeter,
    aggregate,
    context_numbers,
    cross_check,
    declared_context,
    requested_context,
    roofline,
)
from worker.measure.metrics import EngineMetrics
from worker.contract.protocol import Usage


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def stream(meter: RunMeter, request_id: str, start: float, ttft: float, tokens: int, decode_s: float) -> None:
    """One streamed request: started, first token after `ttft`, last token `decode_s` later."""
    meter.request_started(request_id, start)
    meter.first_token(request_id, start + ttft)
    meter.request_finished(
        request_id, start + ttft + decode_s, Usage(prompt_tokens=10, completion_tokens=tokens)
    )


def test_a_new_run_reads_empty_not_zero() -> None:
    meter = RunMeter("run-1", started_at=0.0, clock=FakeClock(5.0))

    snap = meter.snapshot()

    assert snap.tokens_per_s is None
    assert snap.per_request_tokens_per_s is None
    assert snap.ttft_p50_s is None
    assert (snap.requests, snap.run_tokens, snap.run_seconds) == (0, 0, 5.0)


def test_warmup_requests_count_in_totals_but_not_in_rates() -> None:
    meter = RunMeter("run-1", started_at=0.0, warmup_requests=2)
    stream(meter, "cold-1", 0.0, 5.0, 78, 10.0)  # torch.compile: 7.7 tok/s
    stream(meter, "cold-2", 15.0, 2.0, 78, 10.0)

    assert meter.snapshot(30.0).tokens_per_s is None  # only warm-up so far
    assert meter.snapshot(30.0).per_request_tokens_per_s is None

    stream(meter, "warm", 30.0, 0.5, 61, 1.0)  # 60 tokens after the first in 1 s

    snap = meter.snapshot(31.5)
    assert snap.requests == 3
    assert snap.run_tokens == 78 + 78 + 61
    assert snap.per_request_tokens_per_s == pytest.approx(60.0)
    assert snap.ttft_p50_s == pytest.approx(0.5)
    assert snap.tokens_per_s == pytest.approx(61 / 10.0)  # measuring began 1.5 s ago: divided by 10 s at least


def test_settle_time_also_marks_early_requests_as_warmup() -> None:
    meter = RunMeter("run-1", started_at=0.0, warmup_requests=0, settle_s=20.0)
    stream(meter, "early", 1.0, 1.0, 11, 10.0)
    assert meter.snapshot(15.0).per_request_tokens_per_s is None

    stream(meter, "settled", 21.0, 1.0, 11, 1.0)
    assert meter.snapshot(25.0).per_request_tokens_per_s == pytest.approx(10.0)


def test_a_young_run_is_divided_by_at_least_ten_seconds() -> None:
    """Contract, Status: a run's first seconds never read high (100 tokens in 2 s is not 50 tok/s)."""
    meter = RunMeter("run-1", started_at=0.0, warmup_requests=0)
    stream(meter, "r", 0.0, 0.1, 100, 1.9)
    assert meter.tokens_per_s(2.0) == pytest.approx(100 / 10.0)
    assert meter.tokens_per_s(20.0) == pytest.approx(100 / 20.0)  # past ten seconds: the run's age


def test_the_sliding_window_keeps_only_the_last_minute() -> None:
    meter = RunMeter("run-1", started_at=0.0, warmup_requests=0, window_s=60.0)
    stream(meter, "old", 0.0, 0.0, 601, 10.0)  # 601 tokens in [0, 10]
    assert meter.tokens_per_s(10.0) == pytest.approx(601 / 10.0)  # shorter than the window

    stream(meter, "new", 100.0, 0.0, 121, 20.0)  # 121 tokens in [100, 120]
    assert meter.tokens_per_s(120.0) == pytest.approx(121 / 60.0)
    # Half of "new" falls in a window that starts at 110.
    assert meter.tokens_per_s(170.0) == pytest.approx((120 * 10 / 20) / 60.0)
    assert meter.tokens_per_s(500.0) == 0.0  # idle for a minute: truly nothing produced


def test_in_flight_progress_counts_before_the_stream_ends() -> None:
    meter = RunMeter("run-1", started_at=0.0, warmup_requests=0)
    stream(meter, "done", 0.0, 0.0, 11, 10.0)
    meter.request_started("long", 10.0)
    meter.first_token("long", 10.0)
    meter.token_progress("long", 201, 30.0)

    assert meter.tokens_per_s(30.0) == pytest.approx((11 + 201) / 30.0)
    assert meter.requests == 1


def test_the_per_request_rate_is_a_median_over_completed_requests() -> None:
    meter = RunMeter("run-1", started_at=0.0, warmup_requests=0)
    for index, speed in enumerate([10.0, 30.0, 20.0, 1000.0]):
        stream(meter, f"r{index}", index * 10.0, 0.1, 101, 100 / speed)

    assert meter.snapshot(100.0).per_request_tokens_per_s == pytest.approx(25.0)


def test_tokens_that_arrive_in_one_burst_give_no_per_request_speed() -> None:
    """A whole (non-streamed) body, or a stream whose chunks came together, times no decode: the
    request counts, but it never reads as thousands of tok/s beside the real figure."""
    meter = RunMeter("run-1", started_at=0.0, warmup_requests=0)
    stream(meter, "burst", 0.0, 0.5, 300, 0.004)  # 299 tokens "decoded" in 4 ms
    meter.request_started("whole", 10.0)
    meter.request_finished("whole", 12.0, Usage(prompt_tokens=10, completion_tokens=256))
    stream(meter, "real", 20.0, 0.5, 101, 2.0)

    snap = meter.snapshot(30.0)
    assert snap.requests == 3 and snap.run_tokens == 657
    assert snap.per_request_tokens_per_s == pytest.approx(50.0)


def test_failed_and_cancelled_requests_count_tokens_but_give_no_speed() -> None:
    meter = RunMeter("run-1", started_at=0.0, warmup_requests=0)
    meter.request_started("cancelled", 0.0)
    meter.first_token("cancelled", 1.0)
    meter.token_progress("cancelled", 40, 3.0)
    meter.request_finished("cancelled", 3.0, usage=None, ok=False)

    snap = meter.snapshot(4.0)
    assert (snap.requests, snap.run_tokens) == (1, 40)
    assert snap.per_request_tokens_per_s is None
    assert snap.tokens_per_s is None  # nothing measured has completed well yet


def test_unknown_and_repeated_events_change_nothing() -> None:
    meter = RunMeter("run-1", started_at=0.0, warmup_requests=0)
    stream(meter, "r", 0.0, 0.1, 11, 1.0)
    meter.request_finished("r", 5.0, Usage(completion_tokens=999))
    meter.first_token("nobody", 1.0)
    meter.request_finished("nobody", 2.0, Usage(completion_tokens=5))

    assert (meter.requests, meter.run_tokens) == (1, 11)


def test_a_restart_starts_a_run_that_reads_empty_and_old_figures_do_not_leak() -> None:
    clock = FakeClock(0.0)
    first = RunMeter("run-1", clock=clock, warmup_requests=1)
    for index in range(5):
        stream(first, f"a{index}", index * 2.0, 0.1, 101, 1.0)
    clock.now = 12.0
    assert first.snapshot().per_request_tokens_per_s == pytest.approx(100.0)

    clock.now = 20.0  # the engine crashed and came back ready
    second = RunMeter("run-2", clock=clock, warmup_requests=1)
    assert second.snapshot() == ThroughputSnapshot(run_seconds=0.0, live_tokens_per_s=0.0)  # ready, idle

    stream(second, "b0", 21.0, 3.0, 101, 10.0)  # warm-up of the new run
    stream(second, "b1", 35.0, 0.2, 51, 1.0)
    clock.now = 40.0
    snap = second.snapshot()
    assert snap.per_request_tokens_per_s == pytest.approx(50.0)
    assert (snap.requests, snap.run_tokens) == (2, 152)
    assert snap.tokens_per_s == pytest.approx(51 / 10.0)  # measured for 5 s: divided by 10 s at least


def test_aggregate_sums_rates_and_merges_medians() -> None:
    one = RunMeter("e0", started_at=0.0, warmup_requests=0)
    two = RunMeter("e1", started_at=5.0, warmup_requests=0)
    stream(one, "a", 0.0, 0.0, 11, 1.0)  # 10 tok/s
    stream(one, "b", 0.0, 0.0, 31, 1.0)  # 30 tok/s
    stream(two, "c", 5.0, 0.0, 21, 1.0)  # 20 tok/s
    idle = RunMeter("e2", started_at=9.0)

    node = aggregate([one, two, idle], now=10.0)

    assert node.tokens_per_s == pytest.approx((11 + 31) / 10.0 + 21 / 10.0)  # a 5-s run divides by 10 s
    assert node.per_request_tokens_per_s == pytest.approx(20.0)
    assert (node.requests, node.run_tokens, node.run_seconds) == (3, 63, 10.0)
    assert aggregate([idle], now=10.0).tokens_per_s is None


def steady(meter: RunMeter, start: float, seconds: int, streams: int = 1, tokens_per_s: int = 20) -> float:
    """Back-to-back 5-s streams of `tokens_per_s` (plus each one's first token), `streams` at once,
    from `start` for `seconds`; returns the end."""
    t = start
    while t < start + seconds:
        for n in range(streams):
            stream(meter, f"s{t}-{n}", t, 0.0, 5 * tokens_per_s + 1, 5.0)
        t += 5.0
    return t


def test_the_live_rate_is_the_last_ten_seconds_and_reads_zero_once_the_load_stops() -> None:
    meter = RunMeter("run-1", started_at=0.0, warmup_requests=0)
    assert meter.live_tokens_per_s(1.0) == 0.0  # ready and idle: zero, not unknown
    end = steady(meter, 0.0, 120)  # two minutes at ~20 tok/s
    assert meter.live_tokens_per_s(end) == pytest.approx(2 * 101 / LIVE_WINDOW_S)
    assert meter.tokens_per_s(end) == pytest.approx(12 * 101 / 60.0)  # the coordinator's figure is unchanged

    assert meter.live_tokens_per_s(end + 7.5) == pytest.approx(50 / LIVE_WINDOW_S)  # half of the last stream
    assert meter.live_tokens_per_s(end + LIVE_WINDOW_S + 0.5) == 0.0  # stopped: zero within the window
    assert (meter.tokens_per_s(end + LIVE_WINDOW_S + 0.5) or 0.0) > 10.0  # while the run's average still decays


def test_the_live_rate_never_reads_high_and_counts_warm_up() -> None:
    meter = RunMeter("run-1", started_at=0.0, warmup_requests=1)
    stream(meter, "cold", 0.0, 0.1, 100, 1.9)  # 100 tokens in a run's first 2 s
    assert meter.live_tokens_per_s(2.0) == pytest.approx(100 / LIVE_WINDOW_S)  # not 50 tok/s
    assert meter.tokens_per_s(2.0) is None  # warm-up stays out of the run's rate


def test_capacity_is_the_best_full_window_of_the_run() -> None:
    meter = RunMeter("run-1", started_at=0.0, warmup_requests=0)
    steady(meter, 0.0, 25)
    assert meter.capacity(29.0) is None  # no full window yet
    t = steady(meter, 25.0, 35)  # 60 s at 20.2 tok/s
    assert meter.capacity(t) == pytest.approx((6 * 101 / CAPACITY_WINDOW_S, 30.0))  # the first full window
    t = steady(meter, t, 60, streams=3)  # a minute of three streams at once
    steady(meter, t, 60)  # then one again
    best = 3 * 6 * 101 / CAPACITY_WINDOW_S
    assert meter.capacity(t + 60) == pytest.approx((best, t - 30.0))  # first reached half-way through
    assert meter.capacity(t + 3600) == pytest.approx((best, t - 30.0))  # an idle hour: still the best it did
    assert meter.snapshot(t + 3600).capacity_tokens_per_s == pytest.approx(best)


def test_capacity_waits_for_open_streams_and_leaves_warm_up_out() -> None:
    meter = RunMeter("run-1", started_at=0.0, warmup_requests=1)
    stream(meter, "cold", 0.0, 5.0, 1000, 5.0)  # torch.compile's slow request: not measured
    meter.request_started("long", 10.0)
    meter.first_token("long", 10.0)
    assert meter.capacity(70.0) is None  # a window the open stream overlaps is not measured yet
    meter.request_finished("long", 70.0, Usage(completion_tokens=1201))  # 20 tok/s over the minute
    capacity = meter.capacity(70.0)
    assert capacity is not None and capacity[0] == pytest.approx(20.0, abs=0.05)


def test_the_capacity_of_a_long_run_keeps_a_bounded_memory() -> None:
    meter = RunMeter("run-1", started_at=0.0, warmup_requests=0)
    t = 0.0
    for _ in range(60):
        t = steady(meter, t, 60)
        meter.capacity(t)
    assert meter._best is not None and len(meter._best._seconds) <= CAPACITY_WINDOW_S + 1


def test_aggregate_gives_live_and_capacity_per_node() -> None:
    one = RunMeter("e0", started_at=0.0, warmup_requests=0)
    two = RunMeter("e1", started_at=0.0, warmup_requests=0)
    steady(one, 0.0, 60)
    steady(two, 0.0, 60, streams=2)

    node = aggregate([one, two], now=60.0)

    assert node.live_tokens_per_s == pytest.approx(3 * 2 * 101 / LIVE_WINDOW_S)
    assert node.capacity_tokens_per_s == pytest.approx(3 * 6 * 101 / CAPACITY_WINDOW_S)
    assert aggregate([], now=60.0).live_tokens_per_s is None  # no engine run: unknown, not zero
    assert aggregate([RunMeter("e2", started_at=0.0)], now=60.0).capacity_tokens_per_s is None


def test_roofline_share_against_bandwidth_over_weights() -> None:
    weights = 17_800 * 2**20
    single = roofline(30.0, [1008.0], weights)
    tensor = roofline(110.0, [1008.0, 1008.0], weights)

    assert single is not None
    assert tensor is not None
    assert single.ceiling_tokens_per_s == pytest.approx(1008e9 / weights)
    assert single.share == pytest.approx(30.0 / (1008e9 / weights))
    assert tensor.ceiling_tokens_per_s == pytest.approx(2 * single.ceiling_tokens_per_s)
    assert single.comparable
    assert roofline(30.0, [], weights) is None


def test_speculative_decoding_marks_the_share_not_comparable() -> None:
    at_ready = EngineMetrics(engine="vllm", spec_drafts=0, spec_draft_tokens=0, spec_accepted_tokens=0)
    now = EngineMetrics(engine="vllm", spec_drafts=100, spec_draft_tokens=200, spec_accepted_tokens=150)
    meter = RunMeter("run", started_at=0.0, warmup_requests=0)
    stream(meter, "r", 0.0, 0.1, 121, 1.0)  # 120 tok/s after the first token

    line = roofline(meter.per_request_tokens_per_s(), [1008.0], 18 * 10**9, now.since(at_ready))
    snap = meter.snapshot(2.0, roofline=line)

    assert not snap.roofline_comparable
    assert snap.tokens_per_forward == pytest.approx(2.5)
    assert snap.spec_acceptance_rate == pytest.approx(0.75)
    assert snap.roofline_share == pytest.approx(120.0 / (1008e9 / 18e9))


def test_batching_marks_the_share_not_comparable() -> None:
    """Two requests decoding at once share each weight read: no longer a single-stream figure."""
    alone = RunMeter("run", started_at=0.0, warmup_requests=0)
    stream(alone, "a", 0.0, 0.1, 121, 1.0)
    stream(alone, "b", 2.0, 2.1, 121, 3.0)
    batched = RunMeter("run", started_at=0.0, warmup_requests=0)
    batched.request_started("a", 0.0)
    stream(batched, "b", 0.0, 0.1, 121, 1.0)
    batched.first_token("a", 0.1)
    batched.request_finished("a", 1.0, Usage(prompt_tokens=1, completion_tokens=121))

    assert (alone.peak_concurrency, batched.peak_concurrency) == (1, 2)
    single = roofline(alone.per_request_tokens_per_s(), [1008.0], 18 * 10**9, concurrency=alone.peak_concurrency)
    shared = roofline(batched.per_request_tokens_per_s(), [1008.0], 18 * 10**9, concurrency=batched.peak_concurrency)
    assert single is not None and single.comparable
    assert shared is not None and not shared.comparable
    assert not batched.snapshot(2.0, roofline=shared).roofline_comparable


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["vllm", "serve", "m", "--max-model-len", "32768", "--max-model-len", "65536"], 65536),
        (["vllm", "serve", "m", "--max_model_len=8192"], 8192),
        (["vllm", "serve", "m", "--max-model-len", "25.6k"], 25_600),
        (["vllm", "serve", "m", "--max-model-len", "32K"], 32_768),
        (["vllm", "serve", "m", "--max-model-len", "auto"], None),
        (["vllm", "serve", "m", "--max-model-len", "-1"], None),
        (["llama-server", "-m", "x.gguf", "-c", "4096", "--ctx-size", "16384"], 16384),
        (["llama-server", "-m", "x.gguf", "-c", "0"], None),
        (["llama-server", "-m", "x.gguf"], None),
        (["llama-server", "-c"], None),
    ],
)
def test_requested_context_from_argv(argv: list[str], expected: int | None) -> None:
    assert requested_context(argv) == expected


def test_declared_context_from_vllm_and_llamacpp_model_lists() -> None:
    vllm = {
        "object": "list",
        "data": [
            {"id": "qwen", "object": "model", "max_model_len": 131072},
            {"id": "lora-a", "object": "model", "parent": "qwen"},
        ],
    }
    llamacpp = {"object": "list", "data": [{"id": "x.gguf", "meta": {"n_ctx": 8192, "n_ctx_train": 40960}}]}

    assert declared_context(vllm, "qwen") == 131072
    assert declared_context(vllm, "lora-a") is None
    assert declared_context(llamacpp) == 8192
    assert declared_context({"error": "x"}) is None


def test_context_numbers_servable_is_the_smaller_of_declared_and_physical() -> None:
    numbers = context_numbers(
        ["vllm", "serve", "m", "--max-model-len", "262144"],
        {"data": [{"id": "m", "max_model_len": 131072}]},
        kv_cache_tokens=38229,
        served_name="m",
    )

    assert (numbers.requested, numbers.declared, numbers.physical) == (262144, 131072, 38229)
    assert numbers.servable == 38229


def test_cross_check_against_the_engine_counter_over_the_same_run() -> None:
    at_ready = EngineMetrics(engine="vllm", generation_tokens=1_000)
    now = EngineMetrics(engine="vllm", generation_tokens=1_500)

    agreeing = cross_check(500, at_ready, now)
    off = cross_check(560, at_ready, now)

    assert agreeing.discrepancy == 0
    assert agreeing.agrees()
    assert off.discrepancy == 60
    assert off.relative == pytest.approx(60 / 560)
    assert off.agrees(tolerance=0.05) is False
    assert cross_check(500, now, at_ready).agrees() is None  # the counter went back: engine restarted
    assert cross_check(500, EngineMetrics(), EngineMetrics()).engine_tokens is None
