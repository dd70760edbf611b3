"""The lender's limits as the node carries them out: the relay's cap and the limits from each
second's readings, the guard's pause asked for (and a person's override), downloads held while
the node is paused."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.contract import protocol
from worker.contract.events import LimitsSnapshot, MeasuredCapacity
from worker.hardware import GpuSample
from worker.node import policy
from worker.node.lender import Lender
from worker.node.view import Pause
from worker.provision.transfer import BudgetExceeded
from worker.system.config import Paths, Settings


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def card(index: int, temperature: float | None, power: float | None = 300.0) -> GpuSample:
    return GpuSample(index=index, util_pct=90.0, memory_used_mib=1, power_w=power, temperature_c=temperature,
                     energy_mj=None)


def lender(tmp_path: Path, settings: Settings, caps: list[int | None]) -> tuple[Lender, Clock]:
    clock = Clock()
    return Lender(settings, Paths.under(tmp_path).ensure(), caps.append, monotonic=clock), clock


def judge(it: Lender, pause: Pause | None, *samples: GpuSample, capacity: float | None = None,
          price: protocol.Price | None = None, serving: bool = True) -> policy.Event | None:
    measured = MeasuredCapacity(capacity, "m", 0.0) if capacity is not None else None
    return it.judge(pause, samples=samples, capacity=measured, price=price, serving=serving, in_flight=0)


def test_the_lenders_own_cap_holds_from_the_start(tmp_path: Path) -> None:
    caps: list[int | None] = []
    it, _ = lender(tmp_path, Settings(max_requests=4, memory_share_pct=((0, 80),)), caps)
    assert caps == [4] and it.limits == LimitsSnapshot(4, ((0, 80),))


def test_a_hot_lent_card_lowers_the_cap_then_asks_a_pause_an_unlent_one_does_not(tmp_path: Path) -> None:
    caps: list[int | None] = []
    it, _ = lender(tmp_path, Settings(max_requests=4, temperature_limit_c=80, gpus_to_lend=(0,)), caps)
    assert judge(it, None, card(0, 60), card(1, 99)) is None  # GPU 1 is not lent: not judged
    assert caps[-1] == 4 and it.limits.reason is None
    assert judge(it, None, card(0, 82), card(1, 99)) is None
    assert caps[-1] == 2 and it.limits.reason == "too_hot" and "GPU 0 at 82 °C" in (it.limits.words or "")
    event = judge(it, None, card(0, 86))
    assert event == policy.Paused("too_hot", None, "GPU 0 at 86 °C")
    assert judge(it, Pause("too_hot", None, "GPU 0 at 86 °C"), card(0, 86)) is None
    assert judge(it, Pause("too_hot", None, "GPU 0 at 86 °C"), card(0, 74)) == policy.Resumed("guard")


def test_the_persons_resume_over_a_guards_pause_stands_until_the_reason_clears(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    battery = [True]
    monkeypatch.setattr("worker.node.lender.on_battery", lambda: battery[0])
    it, _ = lender(tmp_path, Settings(pause_on_battery=True), [])
    paused = Pause("battery", None, "on battery")
    assert judge(it, None) == policy.Paused("battery", None, "on battery")
    it.person_resumed(paused)
    assert judge(it, None) is None  # the person said serve on battery
    battery[0] = False
    assert judge(it, None) is None
    battery[0] = True
    assert judge(it, None) == policy.Paused("battery", None, "on battery")  # a new episode: paused again


def test_gross_is_the_price_times_the_last_measured_speed_and_costs_need_measured_power(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    it, clock = lender(tmp_path, Settings(electricity_price_per_kwh=1.0), [])
    real = it._guard.judge
    monkeypatch.setattr(it._guard, "judge", lambda given: seen.append(given) or real(given))
    price = protocol.Price(currency="USD", per_million_output_tokens=2.5, per_million_input_tokens=0.5)
    judge(it, None, card(0, 50, 200.0), card(1, 50, 100.0), capacity=100.0, price=price)
    assert seen[-1].gross_per_hour == pytest.approx(100 * 3600 * 2.5 / 1e6) and seen[-1].power_w == 300.0
    judge(it, None, card(0, 50, 200.0), card(1, 50, None), capacity=100.0, price=None)
    assert seen[-1].gross_per_hour is None and seen[-1].power_w is None  # one card unread: power not measured
    assert seen[-1].now == clock.now


def test_downloads_wait_while_paused_a_game_named_and_a_resume_releases_them_at_once(tmp_path: Path) -> None:
    it, _ = lender(tmp_path, Settings(), [])
    it.follow_pause(Pause("user", None))
    assert it.downloads.held() == ("paused", None)
    it.follow_pause(Pause("game", None, "Cyberpunk2077.exe"))
    assert it.downloads.held() == ("game", "Cyberpunk2077.exe")
    it.release_downloads()
    assert it.downloads.held() is None
    it.follow_pause(Pause("game", None, "Cyberpunk2077.exe"))
    assert it.downloads.held() == ("game", "Cyberpunk2077.exe")  # held again: the pause still stands
    it.downloads.hold("paused_by_you")
    it.follow_pause(None)
    assert it.downloads.held() == ("paused_by_you", None)  # the person's own hold is theirs to lift


def test_new_settings_reach_the_guard_and_the_downloads(tmp_path: Path) -> None:
    caps: list[int | None] = []
    it, _ = lender(tmp_path, Settings(), caps)
    it.update_settings(Settings(max_requests=3, monthly_download_gib=1.0))
    judge(it, None)
    assert caps[-1] == 3 and it.limits.max_requests == 3
    assert it.downloads.free_for(1024)
    with pytest.raises(BudgetExceeded):  # the new monthly budget is in force
        it.downloads.free_for(2 * 1024**3)
