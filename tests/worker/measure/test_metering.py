"""What the relay's generations did, per engine run: meters, in-flight counts on the supervisor,
credits in the ledger, the engines' /metrics (scraped at the HTTP edge) and the figures."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from worker.contract import protocol
from worker.system.config import Paths
from worker.hardware import Gpu, Machine
from worker.measure.ledger import Books, Ledger
from worker.measure.metering import IDLE_SCRAPE_S, Metering
from worker.plan.planner import EnginePlan, Plan
from worker.relay.forward import EngineTarget
from worker.serve.supervisor import EngineSupervisor

PRICE = protocol.Price(currency="USD", per_million_output_tokens=2_000_000.0)  # two dollars a token: easy sums
PLAN = EnginePlan(engine_id="e0", engine="vllm", gpu_indices=(0,), layout="single", memory_mib=20000, tier=None,
                  args=(), fallbacks=(), port=18100, env={}, executable=("vllm",), model="/m", served_name="m")
MODEL = protocol.EngineModel(source="hf:Qwen/Qwen3-8B", weights_mib=16000)
CARD = Gpu(index=0, uuid="GPU-0", name="NVIDIA GeForce RTX 4090", memory_total_mib=24564, memory_free_mib=23000,
           usable_mib=20188, memory_bandwidth_gbps=1008.0)
MACHINE = Machine(os="linux", runtime="native", arch="x86_64", cpu_model="cpu", cpu_cores=8, ram_mib=65536,
                  gpus=(CARD,))
TARGET = EngineTarget("e0", "http://127.0.0.1:18100", "key", "m")
WALL = 1_800_000_000.0  # the wall clock minus the monotonic one, in these tests


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class MetricsPage:
    """The engine's /metrics, served at the HTTP edge; the test moves its counters."""

    def __init__(self) -> None:
        self.generation_tokens = 0
        self.kv_usage = 0.25
        self.scrapes = 0
        self.loading = False

    def handle(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/metrics"
        self.scrapes += 1
        if self.loading:
            return httpx.Response(503)
        return httpx.Response(200, text=(
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f'vllm:kv_cache_usage_perc{{model_name="m"}} {self.kv_usage}\n'
            "# TYPE vllm:num_requests_running gauge\n"
            'vllm:num_requests_running{model_name="m"} 1.0\n'
            "# TYPE vllm:num_requests_waiting gauge\n"
            'vllm:num_requests_waiting{model_name="m"} 0.0\n'
            "# TYPE vllm:generation_tokens_total counter\n"
            f'vllm:generation_tokens_total{{model_name="m"}} {float(self.generation_tokens)}\n'))


class Setup:
    def __init__(self, tmp_path: Path, terms: tuple[str, protocol.Price] | None = ("qwen3-8b", PRICE)) -> None:
        self.page = MetricsPage()
        self.clock = Clock()
        self.http = httpx.AsyncClient(transport=httpx.MockTransport(self.page.handle))
        self.sup = EngineSupervisor(PLAN, paths=Paths.under(tmp_path), http=self.http, unix_socket=False)
        self.books = Books(tmp_path / "ledger.sqlite", lambda: "USD")
        self.books.open()
        self.terms = terms
        self.metering = Metering({"e0": self.sup}.get, self.books, lambda: self.terms, self.clock,
                                 lambda: self.clock.now + WALL)

    def generate(self, request_id: str, tokens: int, *, seconds: float = 1.0, engine: str = "e0") -> None:
        """One streamed generation, as the relay reports it."""
        self.metering.on_start(request_id, engine, self.clock.now)
        self.clock.now += 0.1
        self.metering.on_first_token(request_id, self.clock.now)
        self.clock.now += seconds
        usage = protocol.Usage(prompt_tokens=0, completion_tokens=tokens)
        self.metering.on_end(request_id, engine, self.clock.now, usage, True)

    def load(self, seconds: float, tokens_per_s: int = 20, engine: str = "e0") -> None:
        """Back-to-back generations of `tokens_per_s` for `seconds` (each 5 s long)."""
        end = self.clock.now + seconds
        while self.clock.now < end:
            self.generate(f"r-{self.clock.now}", 5 * tokens_per_s, seconds=4.9, engine=engine)


@pytest.fixture
async def setup(tmp_path: Path) -> AsyncIterator[Setup]:
    made = Setup(tmp_path)
    yield made
    await made.books.close()
    await made.http.aclose()


def earned(tmp_path: Path) -> float:
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        return ledger.summary(currency="USD").all_time


async def test_a_generation_is_counted_on_its_engine_and_credited_at_the_terms(setup: Setup, tmp_path: Path) -> None:
    assert setup.metering.start_run("e0", "run-1")
    setup.metering.on_start("r-1", "e0", setup.clock.now)
    assert setup.sup.in_flight == 1
    setup.metering.on_first_token("r-1", setup.clock.now + 0.1)
    setup.metering.on_end("r-1", "e0", setup.clock.now + 1.1, protocol.Usage(prompt_tokens=5, completion_tokens=3), True)
    assert setup.sup.in_flight == 0
    figures = setup.metering.figures()
    assert (figures.requests, figures.run_tokens) == (1, 3)
    await setup.books.close()  # waits for the credit being written
    assert earned(tmp_path) == 6.0
    assert setup.books.earnings is not None and setup.books.earnings.all_time == 6.0  # read again after the credit


async def test_nothing_is_credited_without_terms_or_usage(setup: Setup, tmp_path: Path) -> None:
    setup.metering.start_run("e0", "run-1")
    setup.metering.on_start("r-1", "e0", 0.0)
    setup.metering.on_end("r-1", "e0", 1.0, None, False)  # an error: no usage
    setup.terms = None  # nothing assigned any more
    setup.generate("r-2", 3)
    await setup.books.close()
    assert earned(tmp_path) == 0.0
    assert setup.metering.figures().requests == 2  # both still counted in the run


async def test_a_generation_cancelled_before_it_started_releases_no_other(setup: Setup) -> None:
    setup.metering.on_start("r-1", "e0", 0.0)
    setup.metering.on_end("r-2", "e0", 0.0, None, False)  # the relay settles r-2, never handed to the engine
    assert setup.sup.in_flight == 1


async def test_a_new_run_starts_empty_and_the_same_run_keeps_its_figures(setup: Setup) -> None:
    setup.metering.start_run("e0", "run-1")
    setup.generate("r-1", 3)
    assert not setup.metering.start_run("e0", "run-1")
    assert setup.metering.figures().requests == 1
    assert setup.metering.start_run("e0", "run-2")
    assert setup.metering.figures().requests == 0
    setup.metering.forget("e0")
    setup.generate("r-2", 3)  # no run: counted on the supervisor, metered nowhere
    assert setup.metering.figures().requests == 0 and setup.sup.in_flight == 0


async def test_metrics_are_scraped_every_call_while_busy_and_seldom_when_idle(setup: Setup) -> None:
    await setup.metering.scrape([TARGET], busy=False)
    await setup.metering.scrape([TARGET], busy=False)
    assert setup.page.scrapes == 1
    setup.clock.now += IDLE_SCRAPE_S
    await setup.metering.scrape([TARGET], busy=False)
    await setup.metering.scrape([TARGET], busy=True)
    await setup.metering.scrape([TARGET], busy=True)
    assert setup.page.scrapes == 4
    await setup.metering.scrape([TARGET], busy=False)  # the requests just ended: what they left is read once
    await setup.metering.scrape([TARGET], busy=False)
    assert setup.page.scrapes == 5
    await setup.metering.scrape([EngineTarget("gone", "http://127.0.0.1:1", "k", "m")], busy=True)
    assert setup.page.scrapes == 5  # an engine without a supervisor is not asked


async def test_latest_metrics_give_kv_usage_and_end_with_the_run(setup: Setup) -> None:
    setup.metering.start_run("e0", "run-1")
    await setup.metering.scrape([TARGET], busy=True)
    assert setup.metering.latest["e0"].requests_running == 1
    assert setup.metering.mean_kv_usage() == 25.0
    setup.metering.forget("e0")
    assert dict(setup.metering.latest) == {} and setup.metering.mean_kv_usage() is None


async def test_unreadable_metrics_leave_the_last_figures(setup: Setup) -> None:
    await setup.metering.scrape([TARGET], busy=True)
    setup.page.loading, setup.page.kv_usage = True, 0.75
    await setup.metering.scrape([TARGET], busy=True)
    assert setup.page.scrapes == 2 and setup.metering.mean_kv_usage() == 25.0


async def test_the_relays_tokens_are_checked_against_the_engines_counter(setup: Setup,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    setup.metering.start_run("e0", "run-1")
    await setup.metering.scrape([TARGET], busy=True)  # the baseline, engine idle
    setup.generate("r-1", 100)
    setup.page.generation_tokens = 100
    with caplog.at_level(logging.WARNING, logger="worker.measure.metering"):
        await setup.metering.scrape([TARGET], busy=True)
        assert not caplog.records
        setup.generate("r-2", 100)
        setup.page.generation_tokens = 250
        await setup.metering.scrape([TARGET], busy=True)
    assert "the relay counted 100 tokens since the last check" in caplog.text


async def test_no_check_while_a_generation_is_in_flight(setup: Setup, caplog: pytest.LogCaptureFixture) -> None:
    setup.metering.start_run("e0", "run-1")
    await setup.metering.scrape([TARGET], busy=True)
    setup.generate("r-1", 100)
    setup.metering.on_start("r-2", "e0", setup.clock.now)  # streaming: the engine counts ahead of the relay
    setup.page.generation_tokens = 180
    with caplog.at_level(logging.WARNING, logger="worker.measure.metering"):
        await setup.metering.scrape([TARGET], busy=True)
    assert not caplog.records


async def test_one_engine_has_its_roofline_share_several_or_none_do_not(setup: Setup) -> None:
    plan = Plan(engine="vllm", model_name="qwen3-8b", engine_model=MODEL, engines=(PLAN,))
    setup.metering.start_run("e0", "run-1")
    for n in range(4):  # two of warm-up, then measured ones
        setup.generate(f"r-{n}", 101, seconds=2.0)
    line = setup.metering.throughput(MACHINE, plan)
    assert line.per_request_tokens_per_s == 50.0
    ceiling = 1008e9 / (16000 * 2**20)
    assert line.roofline_share == pytest.approx(50.0 / ceiling)
    assert setup.metering.throughput(MACHINE, None).roofline_share is None  # nothing planned: no weights known
    assert setup.metering.throughput(None, plan) == setup.metering.figures()


async def test_the_live_rate_follows_the_load_and_is_unknown_without_a_run(setup: Setup) -> None:
    assert setup.metering.figures().live_tokens_per_s is None  # no engine run
    setup.metering.start_run("e0", "run-1")
    assert setup.metering.figures().live_tokens_per_s == 0.0  # ready and idle
    setup.load(60)
    assert setup.metering.figures().live_tokens_per_s == pytest.approx(20.0, rel=0.05)
    setup.clock.now += 11
    assert setup.metering.figures().live_tokens_per_s == 0.0
    assert (setup.metering.figures().tokens_per_s or 0.0) > 10.0  # the coordinator's run average decays slowly


async def test_the_measured_capacity_follows_the_run_and_outlives_it(setup: Setup) -> None:
    setup.metering.start_run("e0", "run-1")
    assert setup.metering.last_capacity is None
    setup.load(90, tokens_per_s=40)
    best = setup.metering.last_capacity
    assert best is not None and best.model == "qwen3-8b" and best.tokens_per_s == pytest.approx(40.0, rel=0.05)
    assert WALL + 100 < best.measured_at <= WALL + setup.clock.now  # a wall-clock date, within the run
    assert setup.metering.figures().capacity_tokens_per_s == best.tokens_per_s
    setup.load(60, tokens_per_s=20)
    assert setup.metering.last_capacity == best  # the best so far, not the latest

    setup.metering.forget("e0")  # paused: the engine stopped
    setup.clock.now += 3600
    assert setup.metering.figures().capacity_tokens_per_s is None
    assert setup.metering.last_capacity == best  # kept while nothing serves

    assert setup.metering.start_run("e0", "run-2")  # resumed: a new run
    setup.load(20, tokens_per_s=10)
    assert setup.metering.last_capacity == best  # no full window yet: still the last run's
    setup.load(60, tokens_per_s=10)
    again = setup.metering.last_capacity
    assert again is not None and again.tokens_per_s == pytest.approx(10.0, rel=0.05)  # follows the new run
    assert again.measured_at > best.measured_at


async def test_engines_capacities_add_up_for_one_model_only(setup: Setup) -> None:
    setup.metering.start_run("e0", "run-1")
    setup.metering.start_run("e1", "run-1")
    setup.load(60, tokens_per_s=40)
    setup.load(60, tokens_per_s=20, engine="e1")
    both = setup.metering.last_capacity
    assert both is not None and both.tokens_per_s == pytest.approx(60.0, rel=0.05)
    setup.metering.forget("e0")  # paused: one engine stops, then the other
    assert setup.metering.last_capacity == both
    setup.metering.forget("e1")
    assert setup.metering.last_capacity == both

    setup.terms = ("llama-70b", PRICE)  # another model, now on one engine
    setup.metering.start_run("e1", "run-2")
    setup.load(60, tokens_per_s=10, engine="e1")
    latest = setup.metering.last_capacity
    assert latest is not None and latest.model == "llama-70b"
    assert latest.tokens_per_s == pytest.approx(10.0, rel=0.05)  # qwen3-8b's e0 left out


async def test_a_long_stream_counts_in_the_live_rate_while_it_streams(setup: Setup) -> None:
    """The relay reports a stream's events about once a second; the live figure does not wait
    for its end (a two-minute answer would otherwise read 0 tok/s all the while)."""
    setup.metering.start_run("e0", "run-1")
    setup.metering.on_start("r-1", "e0", setup.clock.now)
    setup.metering.on_first_token("r-1", setup.clock.now)
    for second in range(1, 21):
        setup.clock.now += 1.0
        setup.metering.on_progress("r-1", 30 * second, setup.clock.now)
    assert setup.metering.figures().live_tokens_per_s == pytest.approx(30.0, rel=0.1)
    setup.metering.on_progress("unknown", 5, setup.clock.now)  # a request no engine runs: nothing happens
