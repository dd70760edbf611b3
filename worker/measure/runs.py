"""Throughput, context and roofline figures that stay true: one run at a time, warm-up left out.

A *run* is one engine process serving one model since it became ready; the supervisor makes a new
`RunMeter` on every ready, so a restart reads empty instead of mixing a cold engine's figures
with the old ones. Pure math: every time is given or read from an injected clock.
"""

from __future__ import annotations

import math
import re
import time
from bisect import insort
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import chain
from typing import Any

from worker.contract.events import LIVE_WINDOW_S, ContextNumbers, ThroughputSnapshot
from worker.measure.metrics import EngineMetrics
from worker.contract.protocol import Usage

DEFAULT_WARMUP_REQUESTS = 2
DEFAULT_WINDOW_S = 60.0
MIN_RATE_WINDOW_S = 10.0  # the contract: a run younger than this is divided by it, so it never reads high
CAPACITY_WINDOW_S = 30
"""The measured capacity is the best rate over this many whole seconds. Three times the contract's
10-s minimum: one burst (a batch of streams that all end at once) cannot pass for a rate the card
sustains, yet half a minute of real load is enough to find it."""


MIN_DECODE_SPAN_S = 0.05  # first to last token: under it the tokens came in one burst, not at decode speed


@dataclass
class _Request:
    """One request's timeline, as the relay saw it."""

    started_at: float
    warmup: bool
    first_token_at: float | None = None
    last_token_at: float | None = None
    tokens_so_far: int = 0
    finished_at: float | None = None
    ok: bool = False

    def decode_tokens_per_s(self) -> float | None:
        """(completion tokens - 1) ÷ (last token - first token): the speed one caller saw."""
        if not self.ok or self.first_token_at is None or self.last_token_at is None:
            return None
        span = self.last_token_at - self.first_token_at
        if self.tokens_so_far < 2 or span < MIN_DECODE_SPAN_S:
            return None  # tokens that arrived together time nothing a caller saw
        return (self.tokens_so_far - 1) / span

    def tokens_between(self, start: float, end: float) -> float:
        """Output tokens produced in [start, end]: the first at first-token time, the rest evenly after."""
        if self.first_token_at is None or self.last_token_at is None or self.tokens_so_far <= 0:
            return 0.0
        first = 1.0 if start <= self.first_token_at <= end else 0.0
        rest = self.tokens_so_far - 1
        span = self.last_token_at - self.first_token_at
        if rest <= 0:
            return first
        if span <= 0:
            return first + (rest if start <= self.last_token_at <= end else 0.0)
        overlap = min(end, self.last_token_at) - max(start, self.first_token_at)
        return first + rest * max(0.0, overlap) / span

    def tokens_by_second(self) -> dict[int, float]:
        """Output tokens per whole second [s, s + 1), spread as `tokens_between` spreads them."""
        if self.first_token_at is None or self.last_token_at is None or self.tokens_so_far <= 0:
            return {}
        first, last = self.first_token_at, self.last_token_at
        seconds = {math.floor(first): 1.0}
        rest, span = self.tokens_so_far - 1, last - first
        if rest <= 0:
            return seconds
        if span <= 0:
            seconds[math.floor(last)] = seconds.get(math.floor(last), 0.0) + rest
            return seconds
        for second in range(math.floor(first), math.floor(last) + 1):
            overlap = min(last, second + 1) - max(first, second)
            seconds[second] = seconds.get(second, 0.0) + rest * max(0.0, overlap) / span
        return seconds


class _BestWindow:
    """Measured tokens per whole second → the best `window_s` seconds so far (the run's capacity).

    A request's tokens are known when it ends and are spread back over its stream, so a window is
    summed only once no stream still open can add to it: it ended before the oldest open stream
    began. Only full windows after measuring began count, and each is summed once; the seconds
    kept are the last window's and those of streams since, a few floats a second.
    """

    def __init__(self, since: float, window_s: int = CAPACITY_WINDOW_S) -> None:
        self._window = window_s
        self._seconds: dict[int, float] = {}
        self._filled_until = math.ceil(since) - 1  # the last second holding tokens
        self._summed_until = math.ceil(since) + window_s - 1  # windows ending up to here were summed
        self.best: float | None = None  # tokens per second
        self.best_at: float | None = None  # the end of the best window (the meter's clock)

    def add(self, tokens: Mapping[int, float]) -> None:
        """A finished request's tokens by second (all after the windows already summed)."""
        for second, count in tokens.items():
            self._seconds[second] = self._seconds.get(second, 0.0) + count
            self._filled_until = max(self._filled_until, second)

    def advance(self, now: float, open_since: float | None) -> None:
        """Sums the windows that ended by `now`, and before `open_since` (the oldest open stream's start)."""
        end = math.floor(now if open_since is None else min(now, open_since))
        if end <= self._summed_until:
            return
        # Windows that begin after the last token known hold none: they cannot be the best.
        self._sum(self._summed_until + 1, min(end, self._filled_until + self._window))
        self._summed_until = end
        keep_from = end + 1 - self._window
        for second in [s for s in self._seconds if s < keep_from]:
            del self._seconds[second]

    def _sum(self, first_end: int, last_end: int) -> None:
        """The windows [end - window, end) for `end` in [first_end, last_end], as a running sum."""
        if last_end < first_end:
            return
        total = sum(self._seconds.get(s, 0.0) for s in range(first_end - self._window, first_end))
        for end in range(first_end, last_end + 1):
            if end > first_end:
                total += self._seconds.get(end - 1, 0.0) - self._seconds.get(end - 1 - self._window, 0.0)
            rate = total / self._window
            if rate > 0 and (self.best is None or rate > self.best):
                self.best, self.best_at = rate, float(end)


class RunMeter:
    """Per-request timelines of one run → rates, medians and totals for that run only.

    The first `warmup_requests` requests to start, and any that start within `settle_s` of ready,
    are warm-up (torch.compile, kernel JIT, cold caches): counted in `requests`, `run_tokens` and
    the live rate (what the card is doing now), left out of the run's rate, its capacity and TTFT.
    Finished requests are folded into totals and sorted per-request figures, so memory grows by
    two floats a request, not by timelines. Not thread-safe: call it from the core's loop.
    """

    def __init__(
        self,
        run_id: str,
        *,
        model: str | None = None,
        started_at: float | None = None,
        warmup_requests: int = DEFAULT_WARMUP_REQUESTS,
        settle_s: float = 0.0,
        window_s: float = DEFAULT_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.run_id = run_id
        self.model = model  # the served model's name, when the caller knows it
        self._clock = clock
        self.started_at = clock() if started_at is None else started_at
        self._warmup_left = warmup_requests
        self._settle_until = self.started_at + settle_s
        self._window_s = window_s
        self._keep_s = max(window_s, LIVE_WINDOW_S)  # finished requests kept for either window
        self._in_flight: dict[str, _Request] = {}
        self._recent: deque[_Request] = deque()  # finished, may still fall in a window
        self._measured_since: float | None = None
        self._best: _BestWindow | None = None  # from the first measured request on
        self._measured_ok = False
        self.requests = 0  # completed requests of this run, warm-up included
        self.run_tokens = 0  # output tokens this run streamed, warm-up and failed requests included
        self._speeds: list[float] = []  # sorted
        self._ttfts: list[float] = []  # sorted
        self.peak_concurrency = 0  # most measured requests in flight at once (batching when > 1)

    def _now(self, t: float | None) -> float:
        return self._clock() if t is None else t

    def request_started(self, request_id: str, t: float | None = None) -> None:
        now = self._now(t)
        warmup = self._warmup_left > 0 or now < self._settle_until
        if self._warmup_left > 0:
            self._warmup_left -= 1
        if not warmup and self._measured_since is None:
            self._measured_since = now
            self._best = _BestWindow(now)
        self._in_flight[request_id] = _Request(started_at=now, warmup=warmup)
        if not warmup:
            self.peak_concurrency = max(self.peak_concurrency, sum(not r.warmup for r in self._in_flight.values()))

    def first_token(self, request_id: str, t: float | None = None) -> None:
        request = self._in_flight.get(request_id)
        if request is None or request.first_token_at is not None:
            return
        request.first_token_at = request.last_token_at = self._now(t)
        request.tokens_so_far = max(request.tokens_so_far, 1)

    def token_progress(self, request_id: str, tokens_so_far: int, t: float | None = None) -> None:
        """Optional: tokens streamed so far, so a long stream counts in the window before it ends."""
        request = self._in_flight.get(request_id)
        if request is None:
            return
        now = self._now(t)
        if request.first_token_at is None:
            request.first_token_at = now
        request.last_token_at = now
        request.tokens_so_far = max(request.tokens_so_far, tokens_so_far)

    def request_finished(
        self, request_id: str, t: float | None = None, usage: Usage | None = None, ok: bool = True
    ) -> None:
        """The end of a request; `usage` (from `response.end`) is the authoritative token count.

        Without usage (an error, a cancel) the tokens seen streaming still count in the totals and
        the window, but the request gives no per-request speed.
        """
        request = self._in_flight.pop(request_id, None)
        if request is None:
            return
        now = self._now(t)
        request.finished_at = now
        request.ok = ok and usage is not None
        if usage is not None:
            request.tokens_so_far = usage.completion_tokens
        if request.tokens_so_far > 0:
            if request.first_token_at is None:
                request.first_token_at = now
            request.last_token_at = now
        self.requests += 1
        self.run_tokens += request.tokens_so_far
        self._recent.append(request)
        self._forget_before(now - self._keep_s)
        if not request.warmup:
            self._fold_measured(request)

    def _fold_measured(self, request: _Request) -> None:
        if self._best is not None:
            self._best.add(request.tokens_by_second())
        speed = request.decode_tokens_per_s()
        if speed is not None:
            insort(self._speeds, speed)
        if request.ok:
            self._measured_ok = True
            if request.first_token_at is not None:
                insort(self._ttfts, request.first_token_at - request.started_at)

    # --- figures --------------------------------------------------------------------------

    def decode_speeds(self) -> list[float]:
        """Per-request decode speeds of completed, measured requests, sorted (for merged medians)."""
        return list(self._speeds)

    def ttfts(self) -> list[float]:
        """Times to first token of completed, measured requests, sorted."""
        return list(self._ttfts)

    def tokens_per_s(self, now: float | None = None) -> float | None:
        """Output tokens of measured requests in the last `window_s` (or since measuring began) ÷ that
        time, but never ÷ less than `MIN_RATE_WINDOW_S`: a few requests in a run's first second would
        otherwise read as a huge rate.

        `None` until a measured request has completed: an idle new run reads empty, not zero.
        """
        now = self._now(now)
        if self._measured_since is None or not self._measured_ok:
            return None
        start = max(now - self._window_s, self._measured_since)
        if now <= start:
            return None
        self._forget_before(now - self._keep_s)
        measured = (r for r in chain(self._recent, self._in_flight.values()) if not r.warmup)
        return sum(r.tokens_between(start, now) for r in measured) / max(now - start, MIN_RATE_WINDOW_S)

    def live_tokens_per_s(self, now: float | None = None) -> float:
        """Output tokens of the last `LIVE_WINDOW_S` ÷ that window, warm-up included: what the card
        does now. Always ÷ the whole window (the contract's minimum), so a run's first seconds never
        read high, and it reads 0 one window after the load stops. A stream's tokens count as the
        relay reports its progress (about once a second), its usage settling the count at the end."""
        now = self._now(now)
        self._forget_before(now - self._keep_s)
        start = now - LIVE_WINDOW_S
        return sum(r.tokens_between(start, now) for r in chain(self._recent, self._in_flight.values())) / LIVE_WINDOW_S

    def capacity(self, now: float | None = None) -> tuple[float, float] | None:
        """The best sustained rate of this run so far: the most measured tokens per second over any
        full `CAPACITY_WINDOW_S` window, and when (this meter's clock) that window ended. `None`
        until one full window was measured."""
        if self._best is None:
            return None
        opened = [r.started_at for r in self._in_flight.values() if not r.warmup]
        self._best.advance(self._now(now), min(opened, default=None))
        if self._best.best is None or self._best.best_at is None:
            return None
        return self._best.best, self._best.best_at

    def _forget_before(self, cutoff: float) -> None:
        """Drop finished requests whose last token came before the window (finish order)."""
        while self._recent and (self._recent[0].finished_at or 0.0) < cutoff:
            self._recent.popleft()

    def per_request_tokens_per_s(self) -> float | None:
        """Median decode speed of this run's completed, measured requests (the roofline's input)."""
        return _median(self._speeds)

    def snapshot(self, now: float | None = None, roofline: Roofline | None = None) -> ThroughputSnapshot:
        """The run's figures; pass `roofline(meter.per_request_tokens_per_s(), …)` to include it."""
        now = self._now(now)
        capacity = self.capacity(now)
        figures = ThroughputSnapshot(
            tokens_per_s=self.tokens_per_s(now),
            live_tokens_per_s=self.live_tokens_per_s(now),
            capacity_tokens_per_s=capacity[0] if capacity else None,
            per_request_tokens_per_s=self.per_request_tokens_per_s(),
            ttft_p50_s=_median(self._ttfts),
            run_tokens=self.run_tokens,
            run_seconds=max(0.0, now - self.started_at),
            requests=self.requests,
        )
        return _with_roofline(figures, roofline)


def _median(values: Sequence[float]) -> float | None:
    """Median of values that are already sorted (O(1) on every snapshot)."""
    if not values:
        return None
    middle = len(values) // 2
    return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2


def aggregate(
    meters: Iterable[RunMeter], now: float | None = None, clock: Callable[[], float] = time.monotonic
) -> ThroughputSnapshot:
    """The node's figures over several engines' current runs: rates summed, medians merged.

    Capacity is the sum of the engines' that measured one (each card's best, found apart). The
    roofline is per engine (each has its own GPUs), so the node-level snapshot leaves it out.
    """
    now = clock() if now is None else now
    meters = list(meters)
    rates = [r for r in (m.tokens_per_s(now) for m in meters) if r is not None]
    capacities = [c[0] for c in (m.capacity(now) for m in meters) if c is not None]
    return ThroughputSnapshot(
        tokens_per_s=sum(rates) if rates else None,
        live_tokens_per_s=sum(m.live_tokens_per_s(now) for m in meters) if meters else None,
        capacity_tokens_per_s=sum(capacities) if capacities else None,
        per_request_tokens_per_s=_median(sorted(s for m in meters for s in m.decode_speeds())),
        ttft_p50_s=_median(sorted(t for m in meters for t in m.ttfts())),
        run_tokens=sum(m.run_tokens for m in meters),
        run_seconds=max((max(0.0, now - m.started_at) for m in meters), default=0.0),
        requests=sum(m.requests for m in meters),
    )


# --- roofline --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Roofline:
    """Single-stream decode speed against the memory-bandwidth ceiling (one weight read per token).

    With speculative decoding one weight read can yield several tokens, and under batching
    (`concurrency` > 1) one weight read serves several requests, so in both cases the share is
    marked not comparable; tokens per forward pass and the acceptance rate are given beside it.
    """

    ceiling_tokens_per_s: float
    share: float | None
    comparable: bool = True
    spec_acceptance_rate: float | None = None
    tokens_per_forward: float | None = None


def roofline(
    decode_tokens_per_s: float | None,
    bandwidths_gbps: Sequence[float],
    weight_bytes: int,
    spec: EngineMetrics | None = None,
    concurrency: int = 1,
) -> Roofline | None:
    """`bandwidths_gbps`: the engine's GPUs (summed: tensor-parallel shards are read in parallel).

    `None` when the ceiling is unknown (no bandwidth figure or no weight size).
    """
    bandwidth_bytes_per_s = sum(bandwidths_gbps) * 1e9
    if bandwidth_bytes_per_s <= 0 or weight_bytes <= 0:
        return None
    ceiling = bandwidth_bytes_per_s / weight_bytes
    share = None if decode_tokens_per_s is None else decode_tokens_per_s / ceiling
    if spec is None or not spec.speculative:
        return Roofline(ceiling_tokens_per_s=ceiling, share=share, comparable=concurrency <= 1)
    return Roofline(
        ceiling_tokens_per_s=ceiling,
        share=share,
        comparable=False,
        spec_acceptance_rate=spec.spec_acceptance_rate,
        tokens_per_forward=spec.tokens_per_forward,
    )


def _with_roofline(figures: ThroughputSnapshot, line: Roofline | None) -> ThroughputSnapshot:
    if line is None:
        return figures
    return replace(
        figures,
        roofline_share=line.share,
        roofline_comparable=line.comparable,
        spec_acceptance_rate=line.spec_acceptance_rate,
        tokens_per_forward=line.tokens_per_forward,
    )


# --- context ---------------------------------------------------------------------------------

_CONTEXT_FLAGS = frozenset({"--max-model-len", "--max_model_len", "--ctx-size", "--ctx_size", "-c"})
_HUMAN_INT = re.compile(r"^(?P<number>\d+(?:\.\d+)?)(?P<suffix>[kmgKMG]?)$")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30}


def requested_context(argv: Sequence[str]) -> int | None:
    """The context the command line asks for; the last occurrence wins, as in both engines.

    `None` when the engine picks it itself: absent, vLLM's `auto`/`-1`, llama.cpp's `-c 0`.
    """
    requested: int | None = None
    args = list(argv)
    for index, arg in enumerate(args):
        flag, has_value, inline = arg.partition("=")
        if flag not in _CONTEXT_FLAGS:
            continue
        value = inline if has_value else (args[index + 1] if index + 1 < len(args) else "")
        requested = _context_value(value)
    return requested


def _context_value(text: str) -> int | None:
    """vLLM's human-readable ints: `25.6k` = 25 600 (decimal), `1K` = 1 024 (binary)."""
    match = _HUMAN_INT.match(text.strip())
    if match is None:
        return None
    number, suffix = match["number"], match["suffix"]
    if suffix in _BINARY:
        value = int(number) * _BINARY[suffix] if number.isdigit() else None
    else:
        value = round(float(number) * _DECIMAL.get(suffix, 1))
    return value if value and value > 0 else None


def declared_context(models: Mapping[str, Any], served_name: str | None = None) -> int | None:
    """`/v1/models` → the context the engine declares for the served model.

    vLLM: the card's `max_model_len` (after auto-fit); llama.cpp: the card's `meta.n_ctx` (per slot).
    LoRA cards carry no length and are passed over.
    """
    cards = models.get("data") if isinstance(models, Mapping) else None
    if not isinstance(cards, list):
        return None
    for card in cards:
        if not isinstance(card, Mapping) or (served_name is not None and card.get("id") != served_name):
            continue
        meta = card.get("meta")
        length = card.get("max_model_len")
        if length is None and isinstance(meta, Mapping):
            length = meta.get("n_ctx")
        if isinstance(length, int) and not isinstance(length, bool) and length > 0:
            return length
    return None


def context_numbers(
    argv: Sequence[str],
    models: Mapping[str, Any] | None = None,
    kv_cache_tokens: int | None = None,
    served_name: str | None = None,
) -> ContextNumbers:
    """Requested (argv), declared (`/v1/models`), physical (KV tokens the engine printed)."""
    return ContextNumbers(
        requested=requested_context(argv),
        declared=declared_context(models, served_name) if models is not None else None,
        physical=kv_cache_tokens,
    )


# --- cross-check -----------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenCrossCheck:
    """What the relay counted for a run against the engine's own generation-token counter."""

    relay_tokens: int
    engine_tokens: int | None  # None: the engine exports no counter, or it restarted (went down)

    @property
    def discrepancy(self) -> int | None:
        """Relay minus engine: positive = the relay counted tokens the engine did not report."""
        return None if self.engine_tokens is None else self.relay_tokens - self.engine_tokens

    @property
    def relative(self) -> float | None:
        if self.discrepancy is None:
            return None
        return self.discrepancy / max(self.engine_tokens or 0, self.relay_tokens, 1)

    def agrees(self, tolerance: float = 0.01) -> bool | None:
        """Within `tolerance` of the larger count; `None` when there is nothing to compare."""
        return None if self.relative is None else abs(self.relative) <= tolerance


def cross_check(relay_tokens: int, at_run_start: EngineMetrics, now: EngineMetrics) -> TokenCrossCheck:
    """Compare over the same run: the engine counter's delta since the scrape taken at ready.

    Scrape at ready *after* the supervisor's readiness completion, or its tokens show up here.
    """
    return TokenCrossCheck(relay_tokens, now.since(at_run_start).generation_tokens)
