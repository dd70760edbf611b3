"""The lender's limits judged each second: heat, battery, and serving that costs more than it earns.

Pure: the node hands in one `GuardInput` a second and acts on the `GuardVerdict` (a pause with its
reason, the relay's limit of requests at once, the contract's `limits.reason`, and the step taken
in a person's words). Every rule holds its state here, so a verdict never flips on one reading:

- Heat (`Settings.temperature_limit_c`): a lent card over the limit halves the requests served at
  once (from the lender's own limit, or from what runs when it first gets hot), one step at once
  and another each `STEP_HOLD_S` it stays over, down to one; still over at one request, or
  `PAUSE_ABOVE_C` over the limit at any time, pauses. A pause ends once every card is
  `COOL_BELOW_C` under the limit; then the requests climb back one step each `STEP_HOLD_S` they
  stay that cool.
- Battery (`Settings.pause_on_battery`): paused while the machine runs on battery.
- Costs (`Settings.stop_when_unprofitable`; only with a measured power draw and a price set):
  the mean of `COSTS_WINDOW_S` of serving's readings, electricity (power × price) against gross
  (the price × the measured speed); paused when it costs more. A paused node measures no power:
  it resumes once the gross from the last measured speed beats the power measured before the
  pause, at today's price, by `RESUME_MARGIN`, and is judged over a whole window again after.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from worker.contract import protocol
from worker.contract.events import PauseReason
from worker.contract.protocol import LimitReason
from worker.system.config import Settings

STEP_HOLD_S = 60.0  # each step of fewer requests is held this long before the next one (down or up)
PAUSE_ABOVE_C = 5.0  # this far over the limit pauses at once, without the steps
COOL_BELOW_C = 5.0  # a pause for heat ends, and the requests climb back, this far under the limit
COSTS_WINDOW_S = 300.0  # serving is judged unprofitable over five minutes of readings, never one
RESUME_MARGIN = 0.10  # a pause for costs ends once gross beats electricity by a tenth
_REASONS: dict[str, LimitReason] = {"too_hot": "too_hot", "battery": "on_battery", "costs": "costs_more_than_it_earns"}


@dataclass(frozen=True)
class GuardInput:
    now: float  # monotonic seconds of these readings
    temperatures_c: Mapping[int, float | None]  # lent GPUs' readings this second
    on_battery: bool
    gross_per_hour: float | None  # price × the last measured tok/s (the run's or last capacity); None = unknown
    power_w: float | None  # measured serving power; None = not measured
    electricity_price_per_kwh: float
    serving: bool  # an engine serves now (a stopped node measures no power)
    in_flight: int = 0  # requests at the relay now: where the steps start when the lender set no limit


@dataclass(frozen=True)
class GuardVerdict:
    pause: PauseReason | None = None  # "too_hot" | "battery" | "costs" | None
    pause_detail: str | None = None  # e.g. "GPU 0 at 86 °C"
    max_requests: int | None = None  # requests at once now: the lender's, lowered step by step while hot
    reason: LimitReason | None = None  # the contract's limits.reason
    words: str | None = None  # the step taken in a person's words


@dataclass(frozen=True)
class _Reading:
    at: float
    gross_per_hour: float
    power_w: float


class _Heat:
    """The temperature limit's steps: `lowered` while serving fewer requests at once than the
    lender's own limit (`base`, or what ran when it got hot), `current` at once."""

    def __init__(self) -> None:
        self.lowered = False
        self.base = 1
        self.current = 1
        self.changed_at = 0.0
        self.paused = False

    def limit_now(self, lender: int | None) -> int | None:
        return self.current if self.lowered else lender

    def judge(self, limit: float, temperature: float, given: GuardInput, lender: int | None) -> None:
        held = given.now - self.changed_at >= STEP_HOLD_S
        if self.paused:
            if temperature <= limit - COOL_BELOW_C:
                self.paused, self.changed_at = False, given.now
        elif temperature >= limit + PAUSE_ABOVE_C:
            self._lower(given, lender)
            self.current, self.paused = 1, True
        elif temperature > limit:
            self._hotter(given, held, lender)
        elif temperature <= limit - COOL_BELOW_C and self.lowered and held:
            self.current *= 2
            self.lowered = self.current < self.base
            self.changed_at = given.now

    def _hotter(self, given: GuardInput, held: bool, lender: int | None) -> None:
        if not self.lowered:
            self._lower(given, lender)
            self.current = max(1, self.base // 2)
        elif held and self.current == 1:
            self.paused, self.changed_at = True, given.now
        elif held:
            self.current = max(1, self.current // 2)
            self.changed_at = given.now

    def _lower(self, given: GuardInput, lender: int | None) -> None:
        if not self.lowered:
            self.base = lender if lender is not None else max(2, given.in_flight)
        self.lowered, self.changed_at = True, given.now


class _Costs:
    """Serving's electricity against its gross, over a window of readings."""

    def __init__(self) -> None:
        self.window: deque[_Reading] = deque()
        self.paused = False
        self.power_w = 0.0  # the mean serving power measured before the pause

    def judge(self, given: GuardInput) -> None:
        if self.paused:
            cost = self.power_w / 1000 * given.electricity_price_per_kwh
            if given.gross_per_hour is not None and given.gross_per_hour >= cost * (1 + RESUME_MARGIN):
                self.paused = False
                self.window.clear()
            return
        if not given.serving:
            self.window.clear()  # readings across a pause are not one stretch of serving
            return
        if given.power_w is None or given.gross_per_hour is None:
            return  # this second was not measured: judged on the others
        self.window.append(_Reading(given.now, given.gross_per_hour, given.power_w))
        while len(self.window) > 1 and self.window[1].at <= given.now - COSTS_WINDOW_S:
            self.window.popleft()
        if self.window[0].at > given.now - COSTS_WINDOW_S:
            return  # not yet minutes of readings
        power = sum(r.power_w for r in self.window) / len(self.window)
        gross = sum(r.gross_per_hour for r in self.window) / len(self.window)
        if power / 1000 * given.electricity_price_per_kwh > gross:
            self.paused, self.power_w = True, power

    def figures(self, given: GuardInput) -> tuple[float, float]:
        """Electricity and gross an hour, as the pause was judged."""
        return self.power_w / 1000 * given.electricity_price_per_kwh, given.gross_per_hour or 0.0


class Guard:
    """The lender's heat, battery and costs limits, judged a reading at a time."""

    def __init__(self, settings: Settings, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._settings = settings
        self._clock = clock
        self._heat = _Heat()
        self._costs = _Costs()
        self._last: dict[int, float] = {}  # each lent card's latest temperature read

    def update_settings(self, settings: Settings) -> None:
        """A changed temperature limit or limit of requests starts the steps over from the new
        one (a pause for heat holds until the cards cool); costs switched off ends their pause."""
        old, self._settings = self._settings, settings
        if (old.temperature_limit_c, old.max_requests) != (settings.temperature_limit_c, settings.max_requests):
            paused = self._heat.paused and settings.temperature_limit_c is not None
            self._heat = _Heat()
            self._heat.paused, self._heat.changed_at = paused, self._clock()
        if not settings.stop_when_unprofitable:
            self._costs = _Costs()

    def judge(self, given: GuardInput) -> GuardVerdict:
        settings = self._settings
        hottest = self._hottest(given.temperatures_c)
        if settings.temperature_limit_c is None:
            self._heat = _Heat()
        elif hottest is not None:
            self._heat.judge(settings.temperature_limit_c, hottest[1], given, settings.max_requests)
        if _costs_apply(settings, given):
            self._costs.judge(given)
        else:
            self._costs = _Costs()
        return self._verdict(given, hottest)

    def _hottest(self, temperatures: Mapping[int, float | None]) -> tuple[int, float] | None:
        """The hottest lent card, a card that reads nothing this second taken at its last reading
        (no reading is no news: a pause for heat does not end on a failed read)."""
        self._last = {index: t if t is not None else self._last[index] for index, t in temperatures.items()
                      if t is not None or index in self._last}
        return max(sorted(self._last.items()), key=lambda pair: pair[1]) if self._last else None

    def _verdict(self, given: GuardInput, hottest: tuple[int, float] | None) -> GuardVerdict:
        settings, heat = self._settings, self._heat
        limit = settings.temperature_limit_c
        max_requests = heat.limit_now(settings.max_requests)
        card = f"GPU {hottest[0]} at {hottest[1]:.0f} °C" if hottest else "A GPU"
        if heat.paused and limit is not None:
            return GuardVerdict("too_hot", card, max_requests, "too_hot",
                                f"{card}: paused until every GPU is at {limit - COOL_BELOW_C:.0f} °C or cooler "
                                f"(your limit is {limit} °C)")
        if settings.pause_on_battery and given.on_battery:
            return GuardVerdict("battery", "on battery", max_requests, "on_battery",
                                "Paused while this computer runs on battery; it serves again once plugged in")
        if self._costs.paused:
            cost, gross = self._costs.figures(given)
            return GuardVerdict("costs", "electricity costs more than it earns", max_requests,
                                "costs_more_than_it_earns",
                                f"Paused: electricity ({cost:.2f} {settings.currency} an hour) costs more than "
                                f"serving earns ({gross:.2f} {settings.currency} an hour)")
        if heat.lowered and limit is not None:
            return GuardVerdict(None, None, max_requests, "too_hot",
                                f"{card} (your limit {limit} °C): serving {_requests(max_requests)} at once "
                                "to cool it")
        return GuardVerdict(max_requests=max_requests)


def limits_message(settings: Settings, verdict: GuardVerdict) -> protocol.Limits:
    """The contract's `limits`: what the lender allows now, so the coordinator routes within it."""
    return protocol.Limits(
        max_requests=verdict.max_requests,
        memory_share_pct={str(index): pct for index, pct in settings.memory_share_pct},
        reason=verdict.reason if verdict.reason is not None else _REASONS.get(verdict.pause or ""),
    )


def _costs_apply(settings: Settings, given: GuardInput) -> bool:
    """Judged only where the setting is on and a price is set (and, in `_Costs`, power measured)."""
    return settings.stop_when_unprofitable and given.electricity_price_per_kwh > 0


def _requests(n: int | None) -> str:
    return "as many requests" if n is None else f"{n} request" if n == 1 else f"{n} requests"
