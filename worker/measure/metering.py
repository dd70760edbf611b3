"""What the relay's generations did, per engine run: the meters, the engines' `/metrics`, and the
throughput figures the node shows and reports.

A *run* is one engine process since it became ready: each has its own `RunMeter`, so a restart
reads empty instead of mixing figures. The relay tells `Metering` (its hooks) when a generation
starts, streams its first bytes and ends; each finished generation with usage is credited to the
books at the current terms. The engines' `/metrics` give KV usage and queues for the dashboard,
the speculative-decoding figures of the run, and counters to cross-check the relay's tokens.
Everything here runs on the node's event loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

import httpx

from worker.contract import protocol
from worker.contract.events import MeasuredCapacity, ThroughputSnapshot
from worker.hardware import Machine
from worker.measure.ledger import Books
from worker.measure.runs import RunMeter, aggregate, cross_check, roofline
from worker.measure.metrics import EngineMetrics, MetricsUnavailable, scrape
from worker.plan.planner import Plan
from worker.relay.forward import EngineTarget, RelayHooks
from worker.serve.supervisor import EngineSupervisor

log = logging.getLogger(__name__)

IDLE_SCRAPE_S = 30.0  # engine /metrics while nothing is in flight: an idle node stays near 0 % CPU
# What a finished generation earns under: the served model's name and the price; None while
# nothing is assigned.
Terms = Callable[[], tuple[str, protocol.Price] | None]


class Metering(RelayHooks):
    """The meters of the engines' current runs, the generations in flight on them, and the
    engines' latest `/metrics` with the baselines they are compared with."""

    def __init__(self, engines: Callable[[str], EngineSupervisor | None], books: Books, terms: Terms,
                 monotonic: Callable[[], float] = time.monotonic, clock: Callable[[], float] = time.time) -> None:
        """`engines` finds a running engine's supervisor by id; `clock` dates measured capacities."""
        self._engine = engines
        self._books = books
        self._terms = terms
        self._monotonic = monotonic
        self._clock = clock
        self._meters: dict[str, RunMeter] = {}
        self._wall_offset: dict[str, float] = {}  # wall clock minus monotonic, per run: stable dates
        self._ended: dict[str, MeasuredCapacity] = {}  # each engine's last ended run's capacity
        self._request_engine: dict[str, str] = {}  # generations handed to an engine, by request id
        self._latest: dict[str, EngineMetrics] = {}  # latest /metrics per engine
        self._at_ready: dict[str, EngineMetrics] = {}  # the run's baseline, for spec-decode figures
        self._token_baseline: dict[str, tuple[EngineMetrics, int]] = {}  # /metrics and relay tokens, engine idle
        self._last_scrape = float("-inf")
        self._was_busy = False

    # --- runs -------------------------------------------------------------------------------

    def start_run(self, engine_id: str, run_id: str) -> bool:
        """The engine is ready as run `run_id`; True when that is a new run (its figures start empty)."""
        meter = self._meters.get(engine_id)
        if meter is not None and meter.run_id == run_id:
            return False
        self.forget(engine_id)
        terms = self._terms()
        self._meters[engine_id] = RunMeter(run_id, model=terms[0] if terms else None, clock=self._monotonic)
        self._wall_offset[engine_id] = self._clock() - self._monotonic()
        return True

    def forget(self, engine_id: str) -> None:
        """A run's figures end with it: nothing of an old run leaks into the next, but its measured
        capacity is kept (`last_capacity`)."""
        capacity = self._capacity(engine_id)
        if capacity is not None:
            self._ended[engine_id] = capacity
        self._meters.pop(engine_id, None)
        self._wall_offset.pop(engine_id, None)
        self._latest.pop(engine_id, None)
        self._at_ready.pop(engine_id, None)
        self._token_baseline.pop(engine_id, None)

    # --- the relay's hooks (generations only) --------------------------------------------------

    def on_start(self, request_id: str, engine_id: str, t: float) -> None:
        self._request_engine[request_id] = engine_id
        sup = self._engine(engine_id)
        if sup:
            sup.request_started()
        meter = self._meters.get(engine_id)
        if meter:
            meter.request_started(request_id, t)

    def on_first_token(self, request_id: str, t: float) -> None:
        meter = self._meters.get(self._request_engine.get(request_id, ""))
        if meter:
            meter.first_token(request_id, t)

    def on_progress(self, request_id: str, events: int, t: float) -> None:
        meter = self._meters.get(self._request_engine.get(request_id, ""))
        if meter:
            meter.token_progress(request_id, events, t)

    def on_end(self, request_id: str, engine_id: str, t: float, usage: protocol.Usage | None, ok: bool) -> None:
        started = self._request_engine.pop(request_id, None) is not None  # False: cancelled before it ran
        sup = self._engine(engine_id)
        if sup and started:
            sup.request_finished()
        meter = self._meters.get(engine_id)
        if meter:
            meter.request_finished(request_id, t, usage, ok)
        terms = self._terms() if usage else None
        if usage and terms is not None:
            model, price = terms
            self._books.credit(request_id, meter.run_id if meter else "", model, usage.prompt_tokens,
                               usage.completion_tokens, price)

    # --- the engines' /metrics -------------------------------------------------------------------

    async def scrape(self, targets: Sequence[EngineTarget], *, busy: bool) -> None:
        """Each ready engine's /metrics: at every call while requests are in flight (`busy`), else
        every `IDLE_SCRAPE_S`, and once as it turns idle (so what the last requests left, the KV
        cache in use, is not shown for half a minute after they ended)."""
        turned_idle, self._was_busy = self._was_busy and not busy, busy
        if not busy and not turned_idle and self._monotonic() - self._last_scrape < IDLE_SCRAPE_S:
            return
        self._last_scrape = self._monotonic()
        for target in targets:
            sup = self._engine(target.engine_id)
            if sup is None:
                continue
            try:  # through the supervisor's client: it reaches the engine's socket
                metrics = await scrape(sup.http, f"{target.base_url}/metrics", target.api_key, sup.plan.engine)
            except (MetricsUnavailable, httpx.HTTPError) as exc:
                log.debug("engine %s: /metrics unavailable: %s", target.engine_id, exc)
                continue
            self._latest[target.engine_id] = metrics
            self._at_ready.setdefault(target.engine_id, metrics)
            self._cross_check(target.engine_id, sup, metrics)

    def _cross_check(self, engine_id: str, sup: EngineSupervisor, metrics: EngineMetrics) -> None:
        """The relay's tokens against the engine's counter, between two scrapes with nothing in
        flight: the engine counts a stream's tokens as it goes, the relay at `response.end`, and
        the first scrape may come after the first requests."""
        meter = self._meters.get(engine_id)
        if meter is None or sup.in_flight:
            return
        before = self._token_baseline.get(engine_id)
        self._token_baseline[engine_id] = (metrics, meter.run_tokens)
        if before is None or meter.run_tokens == before[1]:
            return
        relayed = meter.run_tokens - before[1]
        check = cross_check(relayed, before[0], metrics)
        if not check.agrees():
            log.warning("engine %s: the relay counted %d tokens since the last check, the engine %s",
                        engine_id, relayed, check)

    @property
    def latest(self) -> Mapping[str, EngineMetrics]:
        """The latest /metrics per engine (of its current run)."""
        return self._latest

    # --- figures -----------------------------------------------------------------------------------

    def figures(self) -> ThroughputSnapshot:
        """All engines' current runs together."""
        return aggregate(self._meters.values(), clock=self._monotonic)

    def _capacity(self, engine_id: str) -> MeasuredCapacity | None:
        meter = self._meters.get(engine_id)
        best = meter.capacity(self._monotonic()) if meter else None
        if meter is None or best is None:
            return None
        return MeasuredCapacity(best[0], meter.model, best[1] + self._wall_offset[engine_id])

    @property
    def last_capacity(self) -> MeasuredCapacity | None:
        """The node's latest measured capacity, kept across pauses and restarts: per engine, its
        current run's, else its last ended run's; summed over the engines that measured the model
        measured last (another model's figure says nothing of this one)."""
        latest = dict(self._ended)
        for engine_id in self._meters:
            capacity = self._capacity(engine_id)
            if capacity is not None:
                latest[engine_id] = capacity
        if not latest:
            return None
        newest = max(latest.values(), key=lambda c: c.measured_at)
        same = [c.tokens_per_s for c in latest.values() if c.model == newest.model]
        return MeasuredCapacity(sum(same), newest.model, newest.measured_at)

    def mean_kv_usage(self) -> float | None:
        """Percent of KV cache in use, averaged over the engines that report it."""
        usage = [m.kv_usage for m in self._latest.values() if m.kv_usage is not None]
        return 100.0 * sum(usage) / len(usage) if usage else None

    def throughput(self, machine: Machine | None, plan: Plan | None) -> ThroughputSnapshot:
        """The node's figures; with one engine, its roofline share too (per engine by nature)."""
        if len(self._meters) != 1 or machine is None or plan is None:
            return self.figures()
        engine_id, meter = next(iter(self._meters.items()))
        sup = self._engine(engine_id)
        if sup is None:
            return meter.snapshot(self._monotonic())
        bandwidths = [g.memory_bandwidth_gbps for g in machine.gpus
                      if g.index in sup.plan.gpu_indices and g.memory_bandwidth_gbps]
        baseline, latest = self._at_ready.get(engine_id), self._latest.get(engine_id)
        spec = latest.since(baseline) if latest is not None and baseline is not None else None
        line = roofline(meter.per_request_tokens_per_s(), bandwidths, plan.engine_model.weights_mib * 2**20, spec,
                        concurrency=meter.peak_concurrency)
        return meter.snapshot(self._monotonic(), line)
