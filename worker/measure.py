"""Throughput, context and roofline figures that stay true: one run at a time, warm-up left out.

A *run* is one engine process serving one model since it became ready; the supervisor makes a new
`RunMeter` on every ready, so a restart reads empty instead of mixing a cold engine's figures
with the old ones. Pure math: every time is given or read from an injected clock.
"""

from __future__ import annotations

import re
import time
from bisect import insort
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import chain
from typing import Any

from worker.events import ContextNumbers, ThroughputSnapshot
from worker.metrics import EngineMetrics
from worker.protocol import Usage

DEFAULT_WARMUP_REQUESTS = 2
DEFAULT_WINDOW_S = 60.0
MIN_RATE_WINDOW_S = 10.0  # the contract: a run younger than this is divided by it, so it never reads high


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
        if self.tokens_so_far < 2 or span <= 0:
            return None
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


class RunMeter:
    """Per-request timelines of one run → rates, medians and totals for that run only.

    The first `warmup_requests` requests to start, and any that start within `settle_s` of ready,
    are warm-up (torch.compile, kernel JIT, cold caches): counted in `requests` and `run_tokens`,
    left out of both rates and of TTFT. Finished requests are folded into totals and sorted
    per-request figures, so memory grows by two floats a request, not by timelines. Not
    thread-safe: call it from the core's loop.
    """

    def __init__(
        self,
        run_id: str,
        *,
        started_at: float | None = None,
        warmup_requests: int = DEFAULT_WARMUP_REQUESTS,
        settle_s: float = 0.0,
        window_s: float = DEFAULT_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.run_id = run_id
        self._clock = clock
        self.started_at = clock() if started_at is None else started_at
        self._warmup_left = warmup_requests
        self._settle_until = self.started_at + settle_s
        self._window_s = window_s
        self._in_flight: dict[str, _Request] = {}
        self._recent: deque[_Request] = deque()  # finished, measured, may still fall in the window
        self._measured_since: float | None = None
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
        if not request.warmup:
            self._fold_measured(request, now)

    def _fold_measured(self, request: _Request, now: float) -> None:
        self._recent.append(request)
        self._forget_before(now - self._window_s)
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
        self._forget_before(now - self._window_s)
        measured = chain(self._recent, (r for r in self._in_flight.values() if not r.warmup))
        return sum(r.tokens_between(start, now) for r in measured) / max(now - start, MIN_RATE_WINDOW_S)

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
        figures = ThroughputSnapshot(
            tokens_per_s=self.tokens_per_s(now),
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

    The roofline is per engine (each has its own GPUs), so the node-level snapshot leaves it out.
    """
    now = clock() if now is None else now
    meters = list(meters)
    rates = [r for r in (m.tokens_per_s(now) for m in meters) if r is not None]
    return ThroughputSnapshot(
        tokens_per_s=sum(rates) if rates else None,
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
