"""The lender's limits judged through sequences of readings: each threshold, each hold, each way back."""

from __future__ import annotations

from collections.abc import Mapping

from worker.contract import protocol
from worker.node.guard import (
    COOL_BELOW_C,
    COSTS_WINDOW_S,
    PAUSE_ABOVE_C,
    STEP_HOLD_S,
    Guard,
    GuardInput,
    GuardVerdict,
    limits_message,
)
from worker.system.config import Settings

HOT = Settings(temperature_limit_c=80, max_requests=8, stop_when_unprofitable=False)


def reading(now: float, temps: Mapping[int, float | None] | float = 60.0, *, on_battery: bool = False,
            gross: float | None = None, power: float | None = None, price: float = 0.0, serving: bool = True,
            in_flight: int = 0) -> GuardInput:
    temperatures = temps if isinstance(temps, Mapping) else {0: temps}
    return GuardInput(now=now, temperatures_c=temperatures, on_battery=on_battery, gross_per_hour=gross,
                      power_w=power, electricity_price_per_kwh=price, serving=serving, in_flight=in_flight)


def test_under_the_limit_the_lenders_own_limit_holds() -> None:
    guard = Guard(HOT)
    assert guard.judge(reading(0, 79)) == GuardVerdict(max_requests=8)
    assert guard.judge(reading(1, 80)) == GuardVerdict(max_requests=8)  # at the limit is not over it


def test_over_the_limit_the_requests_halve_step_by_step_then_pause_naming_the_gpu() -> None:
    guard = Guard(HOT)
    first = guard.judge(reading(0, 81))
    assert (first.pause, first.max_requests, first.reason) == (None, 4, "too_hot")
    assert first.words is not None and "GPU 0 at 81 °C" in first.words and "4 requests at once" in first.words
    assert guard.judge(reading(STEP_HOLD_S - 1, 82)).max_requests == 4  # each step is held a while
    assert guard.judge(reading(STEP_HOLD_S, 82)).max_requests == 2
    assert guard.judge(reading(2 * STEP_HOLD_S - 1, 82)).max_requests == 2
    one = guard.judge(reading(2 * STEP_HOLD_S, 82))
    assert one.max_requests == 1 and one.words is not None and "1 request at once" in one.words
    assert guard.judge(reading(3 * STEP_HOLD_S - 1, 82)).pause is None
    paused = guard.judge(reading(3 * STEP_HOLD_S, 82))  # still over at one request: pause
    assert (paused.pause, paused.pause_detail, paused.reason) == ("too_hot", "GPU 0 at 82 °C", "too_hot")
    assert paused.words is not None and "75 °C" in paused.words


def test_a_pause_for_heat_ends_only_a_few_degrees_under_and_the_requests_climb_back() -> None:
    guard = Guard(HOT)
    assert guard.judge(reading(0, 80 + PAUSE_ABOVE_C)).pause == "too_hot"
    assert guard.judge(reading(500, 80 - COOL_BELOW_C + 1)).pause == "too_hot"  # under the limit, not enough
    back = guard.judge(reading(501, 80 - COOL_BELOW_C))
    assert (back.pause, back.max_requests, back.reason) == (None, 1, "too_hot")
    assert guard.judge(reading(501 + STEP_HOLD_S - 1, 70)).max_requests == 1
    assert guard.judge(reading(501 + STEP_HOLD_S, 70)).max_requests == 2
    assert guard.judge(reading(501 + 2 * STEP_HOLD_S, 70)).max_requests == 4
    assert guard.judge(reading(501 + 3 * STEP_HOLD_S, 70)) == GuardVerdict(max_requests=8)


def test_between_the_limit_and_a_few_degrees_under_the_step_is_held() -> None:
    guard = Guard(HOT)
    guard.judge(reading(0, 81))
    assert guard.judge(reading(10 * STEP_HOLD_S, 80 - COOL_BELOW_C + 0.5)).max_requests == 4
    assert guard.judge(reading(11 * STEP_HOLD_S, 80 - COOL_BELOW_C)).max_requests == 8


def test_five_degrees_over_pauses_at_once_just_under_it_takes_the_first_step() -> None:
    assert Guard(HOT).judge(reading(0, 85)).pause == "too_hot"
    just_under = Guard(HOT).judge(reading(0, 84.9))
    assert (just_under.pause, just_under.max_requests) == (None, 4)


def test_every_card_must_cool_and_the_hottest_is_named() -> None:
    guard = Guard(HOT)
    paused = guard.judge(reading(0, {0: 70, 1: 86, 2: None}))
    assert paused.pause_detail == "GPU 1 at 86 °C"
    assert guard.judge(reading(100, {0: 60, 1: 76})).pause == "too_hot"
    assert guard.judge(reading(101, {0: 60, 1: None})).pause == "too_hot"  # no reading is no news
    assert guard.judge(reading(102, {0: 60, 1: 75})).pause is None
    assert guard.judge(reading(103, {0: 60})).pause is None  # a card no longer lent is no longer judged


def test_without_a_limit_of_the_lenders_the_steps_start_from_what_runs_and_end_without_a_limit() -> None:
    guard = Guard(Settings(temperature_limit_c=70))
    assert guard.judge(reading(0, 71, in_flight=6)).max_requests == 3
    assert guard.judge(reading(STEP_HOLD_S, 71, in_flight=1)).max_requests == 1
    assert guard.judge(reading(2 * STEP_HOLD_S, 60)).max_requests == 2
    assert guard.judge(reading(3 * STEP_HOLD_S, 60)).max_requests == 4
    assert guard.judge(reading(4 * STEP_HOLD_S, 60)) == GuardVerdict(max_requests=None)  # 8 ≥ the 6 it began at


def test_a_lender_who_allows_one_request_gets_a_hold_before_the_pause() -> None:
    guard = Guard(Settings(temperature_limit_c=70, max_requests=1, stop_when_unprofitable=False))
    assert (guard.judge(reading(0, 71)).pause, guard.judge(reading(1, 71)).max_requests) == (None, 1)
    assert guard.judge(reading(STEP_HOLD_S, 71)).pause == "too_hot"


def test_no_temperature_limit_means_no_steps_and_lifting_it_resumes() -> None:
    assert Guard(Settings(max_requests=4)).judge(reading(0, 99)) == GuardVerdict(max_requests=4)
    guard = Guard(HOT, clock=lambda: 0.0)
    assert guard.judge(reading(0, 90)).pause == "too_hot"
    guard.update_settings(HOT.with_changes(temperature_limit_c=None))
    assert guard.judge(reading(1, 90)) == GuardVerdict(max_requests=8)


def test_a_new_limit_of_requests_starts_the_steps_over_from_it() -> None:
    guard = Guard(HOT, clock=lambda: 100.0)
    guard.judge(reading(0, 81))
    guard.update_settings(HOT.with_changes(max_requests=16))
    assert guard.judge(reading(101, 81)).max_requests == 8


def test_a_changed_temperature_limit_keeps_a_heat_pause_until_the_cards_cool() -> None:
    guard = Guard(HOT, clock=lambda: 10.0)
    guard.judge(reading(0, 90))
    guard.update_settings(HOT.with_changes(temperature_limit_c=90))
    assert guard.judge(reading(11, 86)).pause == "too_hot"
    assert guard.judge(reading(12, 85)).pause is None


def test_battery_pauses_only_where_the_lender_asked() -> None:
    on = Guard(Settings(pause_on_battery=True))
    verdict = on.judge(reading(0, on_battery=True))
    assert (verdict.pause, verdict.reason) == ("battery", "on_battery") and verdict.words
    assert on.judge(reading(1, on_battery=False)).pause is None
    assert Guard(Settings(pause_on_battery=False)).judge(reading(0, on_battery=True)).pause is None


# Costs: 400 W at 0.30 a kWh is 0.12 an hour.
COSTS = Settings(stop_when_unprofitable=True)


def stopped(now: float, *, gross: float, price: float = 0.30) -> GuardInput:
    """A node paused for costs: no engine, no power measured, the gross from its last speed."""
    return reading(now, gross=gross, power=None, price=price, serving=False)


def serve_for(guard: Guard, seconds: float, *, start: float = 0.0, gross: float = 0.08, power: float | None = 400.0,
              price: float = 0.30) -> GuardVerdict:
    verdict = GuardVerdict()
    for second in range(int(seconds) + 1):
        verdict = guard.judge(reading(start + second, gross=gross, power=power, price=price))
    return verdict


def test_serving_that_costs_more_than_it_earns_pauses_only_after_minutes() -> None:
    guard = Guard(COSTS)
    assert serve_for(guard, COSTS_WINDOW_S - 1).pause is None
    paused = guard.judge(reading(COSTS_WINDOW_S, gross=0.08, power=400, price=0.30))
    assert (paused.pause, paused.reason) == ("costs", "costs_more_than_it_earns")
    assert paused.words is not None and "0.12 USD an hour" in paused.words and "0.08 USD an hour" in paused.words


def test_a_moment_of_high_power_among_minutes_that_pay_is_no_pause() -> None:
    guard = Guard(COSTS)
    serve_for(guard, COSTS_WINDOW_S / 2, gross=0.20)
    assert guard.judge(reading(COSTS_WINDOW_S / 2 + 1, gross=0.20, power=2000, price=0.30)).pause is None
    assert serve_for(guard, COSTS_WINDOW_S, start=COSTS_WINDOW_S / 2 + 2, gross=0.20).pause is None


def test_a_stopped_node_resumes_from_its_last_measured_speed_with_a_margin() -> None:
    guard = Guard(COSTS)
    assert serve_for(guard, COSTS_WINDOW_S).pause == "costs"
    assert guard.judge(stopped(400, gross=0.08)).pause == "costs"
    assert guard.judge(stopped(401, gross=0.13)).pause == "costs"
    assert guard.judge(stopped(402, gross=0.14)).pause is None  # 0.14 ≥ 0.12 × 1.1
    # judged over a whole window again: the first unprofitable minutes are no pause
    assert serve_for(guard, COSTS_WINDOW_S - 1, start=403).pause is None


def test_a_lower_electricity_price_ends_a_pause_for_costs() -> None:
    guard = Guard(COSTS)
    serve_for(guard, COSTS_WINDOW_S)
    assert guard.judge(stopped(400, gross=0.08, price=0.15)).pause is None  # 0.06 an hour now


def test_costs_are_judged_only_with_power_measured_a_price_and_the_setting_on() -> None:
    assert serve_for(Guard(COSTS), 2 * COSTS_WINDOW_S, power=None).pause is None
    assert serve_for(Guard(COSTS), 2 * COSTS_WINDOW_S, price=0.0).pause is None
    off = Settings(stop_when_unprofitable=False)
    assert serve_for(Guard(off), 2 * COSTS_WINDOW_S).pause is None
    guard = Guard(COSTS)
    serve_for(guard, COSTS_WINDOW_S)
    guard.update_settings(off)
    assert guard.judge(stopped(400, gross=0.08)).pause is None


def test_readings_across_a_pause_of_another_kind_are_not_one_stretch() -> None:
    guard = Guard(COSTS)
    serve_for(guard, COSTS_WINDOW_S - 10)
    guard.judge(reading(COSTS_WINDOW_S - 5, gross=0.08, power=None, price=0.30, serving=False))  # a game
    assert serve_for(guard, COSTS_WINDOW_S - 1, start=COSTS_WINDOW_S).pause is None


def test_heat_is_named_before_battery_and_battery_before_costs() -> None:
    guard = Guard(COSTS.with_changes(temperature_limit_c=80))
    serve_for(guard, COSTS_WINDOW_S)
    assert guard.judge(reading(400, on_battery=True, gross=0.08, price=0.3, serving=False)).pause == "battery"
    assert guard.judge(reading(401, 90, on_battery=True, gross=0.08, price=0.3, serving=False)).pause == "too_hot"


def test_limits_message_is_the_contracts_limits() -> None:
    settings = Settings(memory_share_pct=((0, 80), (1, 50)), max_requests=4)
    assert limits_message(settings, GuardVerdict(max_requests=4)) == protocol.Limits(
        max_requests=4, memory_share_pct={"0": 80, "1": 50}, reason=None)
    hot = limits_message(settings, GuardVerdict(max_requests=2, reason="too_hot"))
    assert (hot.max_requests, hot.reason) == (2, "too_hot")
    battery = limits_message(Settings(), GuardVerdict(pause="battery", reason="on_battery"))
    assert battery.model_dump() == {"max_requests": None, "memory_share_pct": {}, "reason": "on_battery"}
