"""The supervisor's decisions, pure: start options, the step after an attempt, backoffs, what
an attempt's log adds to the snapshot and says about how it ended, and a start that spilled into
shared system memory (Windows' sysmem fallback) told from the log and NVML's readings."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from worker.engines import llamacpp, vllm
from worker.engines.base import (
    ContextSize,
    ContextTooLong,
    FreeMemoryShort,
    KvCachePart,
    KvCacheSize,
    MaxConcurrency,
    OutOfMemory,
    PhaseReached,
    Slots,
)
from worker.contract.events import ContextNumbers, EngineSnapshot
from worker.plan.planner import EnginePlan
from worker.serve.restart_policy import (
    MEMORY_WAIT_REASON,
    AttemptFacts,
    CardMemory,
    DeviceBufferLog,
    RequestCrashes,
    RestartBackoff,
    Ended,
    Step,
    SupervisorTiming,
    context_refusal,
    crashed_by_request,
    next_step,
    spill,
    start_options,
)

TIMING = SupervisorTiming(max_fast_failures=3)
BACKOFF = RestartBackoff()


def plan(engine: str = "vllm", *, tier: str | None = "40000", fallbacks: tuple = ()) -> EnginePlan:
    return EnginePlan(engine_id="e0", engine=engine, gpu_indices=(0,), layout="single", memory_mib=48000, tier=tier,
                      args=("--a", "40"), fallbacks=fallbacks, port=18100, env={}, executable=("vllm",),
                      model="/m", served_name="m")


def step(ended: Ended, *, option: int = 0, options: int = 1, fast: int = 1):
    return next_step(ended, option=option, options=options, fast_failures=fast, tier="40000", next_tier="24000",
                     timing=TIMING, backoff=BACKOFF)


def test_backoff_doubles_from_two_seconds_to_five_minutes() -> None:
    assert [RestartBackoff().delay(n) for n in (1, 2, 3, 4, 8, 9, 30)] == [2, 4, 8, 16, 256, 300, 300]


def test_start_options_are_the_plan_then_the_next_tier_then_base() -> None:
    fallbacks = (("24000", ("--a", "24")), ("16000", ("--a", "16")), (None, ()))
    assert start_options(plan(fallbacks=fallbacks)) == (("40000", ("--a", "40")), ("24000", ("--a", "24")), (None, ()))
    assert start_options(plan(fallbacks=((None, ()),))) == (("40000", ("--a", "40")), (None, ()))
    assert start_options(plan(tier=None)) == ((None, ("--a", "40")),)


def test_out_of_memory_at_start_falls_back_then_fails() -> None:
    oom = Ended("oom", "CUDA out of memory", 3.0, was_ready=False)
    fallback = step(oom, option=0, options=3)
    assert fallback.action == "fallback" and fallback.delay_s == 0
    assert fallback.reason == "out of memory while starting on tier 40000; retrying on tier 24000"
    last = step(oom, option=2, options=3)
    assert last.action == "fail" and "CUDA out of memory" in last.reason and "Free GPU memory" in last.reason


def test_out_of_memory_after_serving_is_a_crash_not_a_fallback() -> None:
    later = step(Ended("oom", "CUDA out of memory", 600.0, was_ready=True), option=0, options=3)
    assert later.action == "retry"


def test_crashes_restart_with_backoff_until_too_many_fast_ones() -> None:
    crash = Ended("crashed", "the engine exited with status 1", 1.0, was_ready=False)
    assert [(s.action, s.delay_s) for s in (step(crash, fast=1), step(crash, fast=2))] == [("retry", 2), ("retry", 4)]
    given_up = step(crash, fast=3)
    assert given_up.action == "fail" and "3 times in a row" in given_up.reason and "status 1" in given_up.reason


def test_refusals_fail_at_once_when_no_lower_option_is_left() -> None:
    refusal = context_refusal(ContextTooLong(131072, 34480))
    assert "131072" in refusal and "34480" in refusal and "--max-model-len" in refusal
    assert step(Ended("context", refusal, 1.0, False)) == Step("fail", refusal)
    assert step(Ended("unstartable", "Could not start vllm", 0.0, False)).action == "fail"


def test_a_context_too_big_for_the_kv_cache_falls_back_a_tier_like_out_of_memory() -> None:
    refusal = context_refusal(ContextTooLong(65536, 34480))
    fallback = step(Ended("context", refusal, 40.0, was_ready=False), option=0, options=3)
    assert fallback.action == "fallback" and fallback.delay_s == 0
    assert fallback.reason == "the KV cache cannot hold the context on tier 40000; retrying on tier 24000"
    assert step(Ended("context", refusal, 40.0, was_ready=False), option=2, options=3) == Step("fail", refusal)


FREE_MEMORY_REFUSAL = ("ValueError: Free memory on device cuda:0 (11.20/23.52 GiB) on startup is less than desired "
                       "GPU memory utilization (0.9, 21.17 GiB).")


def test_a_free_memory_refusal_waits_on_the_same_tier_longer_each_time_up_to_a_minute() -> None:
    short = Ended("free_memory", FREE_MEMORY_REFUSAL, 9.0, was_ready=False)
    steps = [next_step(short, option=0, options=3, fast_failures=n, tier="40000", next_tier="24000", timing=TIMING,
                       backoff=BACKOFF, memory_waits=n) for n in (1, 2, 3, 6, 7, 40)]
    assert [(s.action, s.delay_s) for s in steps] == [("wait", 2), ("wait", 4), ("wait", 8), ("wait", 60),
                                                     ("wait", 60), ("wait", 60)]
    assert steps[0].reason == "Another program is using the GPU's memory; waiting for it to free up"


def test_a_free_memory_refusal_of_ram_says_so_in_plain_words() -> None:
    """vLLM's CPU build found RAM held by other programs: no GPU in the reason a person reads."""
    line = ("(Worker pid=7) ERROR 12-01 23:07:51 [cpu_worker.py:84] ValueError: Available memory on node 0 "
            "(6.9/8.71 GiB) on startup is less than desired CPU memory utilization (0.92, 8.02 GiB).")
    ended = facts_ending_for(line)
    assert ended.kind == "free_memory" and ended.in_ram and ended.message.startswith("ValueError: Available memory")
    step = next_step(ended, option=0, options=3, fast_failures=1, tier=None, next_tier=None, timing=TIMING,
                     backoff=BACKOFF, memory_waits=1)
    assert step.action == "wait" and "GPU" not in step.reason and "graphics" not in step.reason
    assert step.reason == ("Other programs are using the computer's memory (RAM) the model needs; "
                           "waiting for it to free up")
    gpu = facts_ending_for(FREE_MEMORY_REFUSAL)
    assert not gpu.in_ram and next_step(gpu, option=0, options=3, fast_failures=1, tier=None, next_tier=None,
                                        timing=TIMING, backoff=BACKOFF).reason == MEMORY_WAIT_REASON


def facts_ending_for(line: str) -> Ended:
    facts = AttemptFacts()
    fact = vllm.parse_line(line)
    assert fact is not None
    facts.absorb(fact, starting())
    return facts.ending(1, [], 9.0, False)


def test_context_refusal_without_an_estimate_still_says_what_to_do() -> None:
    refusal = context_refusal(ContextTooLong(131072, None))
    assert "131072" in refusal and "Lower --max-model-len, or free GPU memory" in refusal


# --- what an attempt's log says ------------------------------------------------------------------

def starting(**changes: Any) -> EngineSnapshot:
    return EngineSnapshot(engine_id="e0", engine="vllm", gpu_indices=(0,), layout="single", state="starting",
                          **changes)


def test_a_new_phase_shows_only_while_starting() -> None:
    facts = AttemptFacts()
    assert facts.absorb(PhaseReached("loading"), starting(phase="launching")).phase == "loading"
    ready = dataclasses.replace(starting(phase="ready"), state="ready")
    assert facts.absorb(PhaseReached("loading"), ready) == ready


def test_kv_cache_size_gives_tokens_concurrency_and_the_physical_context() -> None:
    snap = starting(max_concurrency=2.0, context=ContextNumbers(requested=4096))
    told = AttemptFacts().absorb(KvCacheSize(44880, MaxConcurrency(131072, 0.34)), snap)
    assert (told.kv_cache_tokens, told.max_concurrency) == (44880, 0.34)
    assert told.context == ContextNumbers(requested=4096, physical=44880)
    untold = AttemptFacts().absorb(KvCacheSize(44880), snap)
    assert untold.max_concurrency == 2.0  # no concurrency line: the last figure stands


def test_llamacpp_cache_parts_add_their_memory_and_take_the_largest_cells_never_a_sum() -> None:
    facts, snap = AttemptFacts(), starting()
    snap = facts.absorb(KvCachePart(mib=512.0, cells=None), snap)
    assert (snap.kv_cache_gib, snap.kv_cache_tokens) == (0.5, None)
    snap = facts.absorb(KvCachePart(mib=1024.0, cells=8192), snap)
    snap = facts.absorb(KvCachePart(mib=256.0, cells=2048), snap)
    assert (snap.kv_cache_gib, snap.kv_cache_tokens, snap.context.physical) == (1.75, 8192, 8192)


def test_slots_and_context_size_fill_concurrency_and_the_requested_context() -> None:
    facts = AttemptFacts()
    snap = facts.absorb(Slots(n_slots=4, n_ctx_slot=2048, kv_unified=False), starting())
    snap = facts.absorb(ContextSize(8192), snap)
    assert (snap.max_concurrency, snap.context.requested) == (4.0, 8192)
    assert facts.slots == Slots(4, 2048, False)


def test_failures_change_nothing_shown_and_explain_the_end_first_free_memory_then_context_then_oom() -> None:
    facts, snap = AttemptFacts(), starting()
    assert facts.absorb(OutOfMemory("CUDA out of memory"), snap) is snap
    assert facts.absorb(OutOfMemory("a second one"), snap) is snap
    assert facts.ending(1, ["x", " "], 3.0, False) == Ended("oom", "CUDA out of memory", 3.0, False, ("x",))
    facts.absorb(ContextTooLong(131072, 34480), snap)
    assert facts.ending(1, [], 3.0, False) == Ended("context", context_refusal(ContextTooLong(131072, 34480)), 3.0,
                                                    False)
    facts.absorb(FreeMemoryShort("Free memory on device"), snap)
    assert facts.ending(1, [], 3.0, True) == Ended("free_memory", "Free memory on device", 3.0, True)


@pytest.mark.parametrize(("tail", "shown"), [
    ([], "(no output)"),
    (["", "boom", "  "], "boom"),
    ([f"line {i}" for i in range(12)], "\n".join(f"line {i}" for i in range(4, 12))),  # the last eight
])
def test_a_crash_the_log_does_not_explain_shows_the_last_lines(tail: list[str], shown: str) -> None:
    ended = AttemptFacts().ending(137, tail, 5.0, True)
    assert ended.kind == "crashed" and ended.uptime_s == 5.0 and ended.was_ready
    assert ended.message == f"the engine exited with status 137; last lines:\n{shown}"


def test_an_ending_keeps_the_last_forty_lines_for_details() -> None:
    tail = ["", *(f"line {i}" for i in range(50))]
    assert AttemptFacts().ending(1, tail, 1.0, False).lines == tuple(f"line {i}" for i in range(10, 50))


# --- a crash a request caused is not a broken engine ---------------------------------------------

SEGFAULT = Ended("crashed", "the engine exited with status -11; last lines:\n(no output)", 30.0, was_ready=True)


@pytest.mark.parametrize(("ended", "in_flight", "since", "by_request"), [
    (SEGFAULT, 1, None, True),  # a request in flight when it died
    (SEGFAULT, 0, 0.4, True),  # the relay saw the broken connection just before the exit was seen
    (SEGFAULT, 0, 1.0, True),
    (SEGFAULT, 0, 1.5, False),  # idle for a while: the engine broke by itself
    (SEGFAULT, 0, None, False),  # no request ever
    (dataclasses.replace(SEGFAULT, kind="oom"), 3, None, True),  # a request that took all the memory
    (dataclasses.replace(SEGFAULT, was_ready=False), 1, None, False),  # never served: a start-up failure
    (dataclasses.replace(SEGFAULT, kind="unhealthy"), 1, None, False),  # the supervisor stopped it
])
def test_a_ready_engine_dying_by_itself_with_requests_in_flight_was_crashed_by_a_request(
        ended: Ended, in_flight: int, since: float | None, by_request: bool) -> None:
    judged = crashed_by_request(ended, in_flight=in_flight, since_last_request_s=since)
    assert judged.by_request is by_request
    if by_request:
        assert "a request crashed the engine" in judged.message and "status -11" in judged.message
    else:
        assert judged == ended


def test_a_crash_a_request_caused_restarts_at_once_however_many_came_before() -> None:
    crashed = crashed_by_request(SEGFAULT, in_flight=1, since_last_request_s=None)
    for fast in (0, 1, 3, 50):  # at and past `max_fast_failures`: no giving up
        restart = step(crashed, fast=fast)
        assert (restart.action, restart.delay_s) == ("retry", 0.0)
        assert restart.reason.startswith("restarting at once: a request crashed the engine")
    assert step(SEGFAULT, fast=3).action == "fail"  # the same crash, no request in flight: the engine's own


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_three_request_crashes_in_ten_minutes_refuse_constrained_decoding_for_the_rest_of_the_run() -> None:
    clock = Clock()
    crashes = RequestCrashes(clock=clock)
    assert crashes.record() is False and crashes.refusal is None
    clock.now += 300
    assert crashes.record() is False and crashes.refusal is None
    clock.now += 299
    assert crashes.record() is True  # the third within 599 s
    assert crashes.refusal is not None and "3 times within 10 minutes" in crashes.refusal
    assert "grammars, JSON schemas, regexes or tools" in crashes.refusal
    clock.now += 10**6
    assert crashes.record() is False and crashes.refusal is not None  # for the rest of the run


def test_request_crashes_spread_wider_than_ten_minutes_refuse_nothing() -> None:
    clock = Clock()
    crashes = RequestCrashes(clock=clock)
    for _ in range(10):
        assert crashes.record() is False
        clock.now += 301  # any three span more than 600 s
    assert crashes.refusal is None


# --- Windows' sysmem fallback ------------------------------------------------------------------

LOGS = Path(__file__).parents[2] / "fixtures" / "llamacpp"
RTX_4090_MIB = 24_564
DESKTOP_MIB = 1_850  # what the desktop held on the card before the engine started
# A 27B Q4_K_M at a 64k context on a 4090: more than the card holds. Under WDDM the driver keeps
# the allocations that do not fit in shared system memory, and llama-server logs them as if on CUDA0.
SPILLED_START = [
    "0.02.411.950 I load_tensors:        CUDA0 model buffer size = 15850.25 MiB",
    "0.02.411.990 I load_tensors:   CPU_Mapped model buffer size =   417.66 MiB",
    "0.03.104.016 I llama_kv_cache:      CUDA0 KV buffer size =  8192.00 MiB",
    "0.03.231.877 I sched_reserve:      CUDA0 compute buffer size =  1200.50 MiB",
    "0.03.231.901 I sched_reserve:  CUDA_Host compute buffer size =   140.01 MiB",
]


def logged(lines: list[str]) -> AttemptFacts:
    """An attempt's facts after llama.cpp's output, read as the supervisor reads it."""
    assert isinstance(llamacpp, DeviceBufferLog)
    facts = AttemptFacts()
    for line in lines:
        facts.note_device_buffer(llamacpp.device_buffer(line))
    return facts


def card(used_mib: int) -> dict[int, CardMemory]:
    return {0: CardMemory(used_mib, RTX_4090_MIB)}


def test_a_start_that_spilled_into_shared_memory_ends_as_out_of_memory_and_falls_back() -> None:
    facts = logged(SPILLED_START)
    assert facts.device_mib == {0: 25242.75}  # the host's buffers (CPU_Mapped, CUDA_Host) are not on the card

    ended = facts.spilled((0,), card(DESKTOP_MIB), card(24_310), uptime_s=41.0)

    assert ended is not None and (ended.kind, ended.was_ready) == ("oom", False)
    assert ended.message.startswith("the model does not fit in GPU 0's memory: the engine put 25,243 MiB on it, "
                                    "but the card's memory grew by only 22,460 MiB")
    assert step(ended, option=0, options=3).action == "fallback"


def test_a_start_that_fit_is_no_spill() -> None:
    """The recorded start of a sliding-window model on one card: what the card's memory grew by is
    what llama.cpp allocated there, and its CUDA context besides."""
    facts = logged((LOGS / "startup-iswa.log").read_text().splitlines())
    assert facts.device_mib == {0: pytest.approx(7988.0)}

    assert facts.spilled((0,), card(DESKTOP_MIB), card(DESKTOP_MIB + 7988 + 386), uptime_s=9.0) is None


def test_a_card_with_room_left_did_not_spill_whatever_others_freed() -> None:
    """A game closed while the engine started makes the card's memory grow by less than was
    allocated; the driver spills only on a (nearly) full card."""
    facts = logged(SPILLED_START[:1])
    assert facts.spilled((0,), card(9_000), card(15_850 + 2_000), uptime_s=9.0) is None


def test_each_cuda_device_is_judged_against_its_own_card() -> None:
    """CUDA numbers the engine's cards in CUDA_VISIBLE_DEVICES order: CUDA1 is the plan's second GPU."""
    device_mib = {0: 12_000.0, 1: 23_900.0}
    before = {2: CardMemory(500, RTX_4090_MIB), 3: CardMemory(1_900, RTX_4090_MIB)}
    after = {2: CardMemory(12_800, RTX_4090_MIB), 3: CardMemory(24_400, RTX_4090_MIB)}

    message = spill(device_mib, (2, 3), before, after)

    assert message is not None and "GPU 3's memory" in message
    assert spill(device_mib, (2, 3), before, {**after, 3: CardMemory(1_900 + 24_300, 26_000)}) is None
    assert spill(device_mib, (2, 3), before, {2: after[2]}) is None  # a card NVML did not read: nothing said


def test_without_a_reading_from_before_the_card_counts_as_empty() -> None:
    assert spill({0: 25_242.75}, (0,), {}, card(24_310)) is not None
    assert spill({0: 7_988.0}, (0,), {}, card(DESKTOP_MIB + 7_988 + 386)) is None
