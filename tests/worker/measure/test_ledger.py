from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from worker.measure.energy import EnergyIntegrator
from worker.measure.ledger import (
    CHART_WINDOW_S,
    CREDIT_READ_S,
    SAMPLES_FLUSH_S,
    SERVING_SERIES,
    Books,
    Ledger,
    LedgerError,
    Retention,
    earned,
)
from worker.contract.protocol import Price

PRICE = Price(currency="USD", per_million_output_tokens=0.40, per_million_input_tokens=0.05)
BERLIN = ZoneInfo("Europe/Berlin")


def at(text: str, tz: timezone | ZoneInfo = BERLIN) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=tz).timestamp()


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    with Ledger(tmp_path / "ledger.sqlite3", clock=lambda: at("2026-11-25 12:00"), tz=BERLIN) as opened:
        yield opened


def test_earned_uses_both_prices_per_million() -> None:
    assert earned(PRICE, 1_000_000, 2_000_000) == pytest.approx(0.05 + 0.80)


def test_a_replayed_request_is_not_counted_twice(ledger: Ledger) -> None:
    first = ledger.record_request("r-91", "run-1", "qwen", 9, 256, PRICE, at("2026-11-25 10:00"))
    # The link reconnected and the same response.end was handed over again.
    again = ledger.record_request("r-91", "run-1", "qwen", 9, 256, PRICE, at("2026-11-25 10:01"))

    assert (first, again) == (True, False)
    assert ledger.summary().all_time == pytest.approx(earned(PRICE, 9, 256))


def test_earnings_survive_reopening(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    with Ledger(path, tz=BERLIN) as first:
        first.record_request("r-1", "run-1", "qwen", 0, 1_000_000, PRICE, at("2026-11-25 10:00"))
    with Ledger(path, tz=BERLIN) as reopened:
        assert (
            reopened.record_request("r-1", "run-2", "qwen", 0, 1_000_000, PRICE, at("2026-11-25 11:00"))
            is False
        )
        assert reopened.summary(at("2026-11-25 12:00")).all_time == pytest.approx(0.40)


def test_today_and_week_follow_local_midnight_and_monday(ledger: Ledger) -> None:
    million = 1_000_000  # 0.40 USD each
    ledger.record_request(
        "sun-late", "run", "m", 0, million, PRICE, at("2026-11-22 23:59")
    )  # Sunday: last week
    ledger.record_request(
        "mon-early", "run", "m", 0, million, PRICE, at("2026-11-23 00:01")
    )  # Monday: this week
    ledger.record_request("wed", "run", "m", 0, million, PRICE, at("2026-11-25 00:00"))  # today, at midnight
    ledger.record_request("tue-late", "run", "m", 0, million, PRICE, at("2026-11-24 23:59:59"))

    snap = ledger.summary(at("2026-11-25 12:00"), "USD")

    assert snap.today == pytest.approx(0.40)
    assert snap.week == pytest.approx(1.20)
    assert snap.all_time == pytest.approx(1.60)


def test_day_boundaries_hold_across_a_dst_change(tmp_path: Path) -> None:
    # Berlin went from UTC+2 to UTC+1 on Sunday 2026-10-25; the day is 25 hours long.
    with Ledger(tmp_path / "l.sqlite3", tz=BERLIN) as ledger:
        ledger.record_request("before", "run", "m", 0, 1_000_000, PRICE, at("2026-10-24 23:30"))
        ledger.record_request("after", "run", "m", 0, 1_000_000, PRICE, at("2026-10-25 00:30"))
        snap = ledger.summary(at("2026-10-25 23:30"))
    assert snap.today == pytest.approx(0.40)


def test_other_currencies_are_left_out_not_mixed(ledger: Ledger) -> None:
    ledger.record_request("usd", "run", "m", 0, 1_000_000, PRICE, at("2026-11-25 10:00"))
    ledger.record_request(
        "eur",
        "run",
        "m",
        0,
        1_000_000,
        Price(currency="EUR", per_million_output_tokens=9.0),
        at("2026-11-25 10:00"),
    )

    assert ledger.summary(currency="USD").today == pytest.approx(0.40)
    assert ledger.summary(currency="EUR").today == pytest.approx(9.0)


def test_energy_cost_and_net(ledger: Ledger) -> None:
    ledger.record_request("r", "run", "m", 0, 10_000_000, PRICE, at("2026-11-25 10:00"))  # 4.00
    ledger.record_energy(3_600_000 * 2, at("2026-11-25 10:00"), 0.30, "USD")  # 2 kWh → 0.60
    ledger.record_energy(3_600_000, at("2026-11-23 09:00"), 0.30, "USD")  # Monday: 1 kWh → 0.30
    ledger.record_energy(3_600_000, at("2026-11-10 09:00"), 0.50, "USD")  # earlier: 0.50

    snap = ledger.summary()

    assert snap.energy_kwh_today == pytest.approx(2.0)
    assert snap.energy_cost_today == pytest.approx(0.60)
    assert snap.energy_cost_week == pytest.approx(0.90)
    assert snap.energy_cost_all_time == pytest.approx(1.40)
    assert snap.net_today == pytest.approx(3.40)


def test_bad_figures_are_refused_with_a_clear_error(ledger: Ledger) -> None:
    with pytest.raises(ValueError, match="negative"):
        ledger.record_request("r", "run", "m", -1, 5, PRICE)
    with pytest.raises(ValueError, match="joules"):
        ledger.record_energy(float("nan"), None, 0.3, "USD")
    assert ledger.summary().all_time == 0.0


def test_old_requests_fold_into_daily_totals_without_changing_sums(tmp_path: Path) -> None:
    with Ledger(tmp_path / "l.sqlite3", tz=BERLIN) as ledger:
        for day in range(1, 21):
            for index in range(3):
                ledger.record_request(
                    f"d{day}-{index}", "run", "m", 0, 1_000_000, PRICE, at(f"2026-11-{day:02d} 0{index}:30")
                )
        snap = ledger.summary(at("2026-11-20 12:00"))
        detail = (
            sqlite3.connect(tmp_path / "l.sqlite3").execute("SELECT COUNT(*) FROM requests").fetchone()[0]
        )

    assert detail == 6  # today and yesterday, one by one
    assert snap.all_time == pytest.approx(60 * 0.40)
    assert snap.week == pytest.approx(5 * 3 * 0.40)  # Monday 16th to Friday 20th
    assert snap.today == pytest.approx(3 * 0.40)


def test_concurrent_writers_from_threads_lose_nothing(ledger: Ledger) -> None:
    def write(worker: int) -> None:
        for index in range(50):
            ledger.record_request(
                f"w{worker}-{index}", "run", "m", 0, 1_000_000, PRICE, at("2026-11-25 10:00")
            )
            ledger.record_request(
                f"w{worker}-{index}", "run", "m", 0, 1_000_000, PRICE, at("2026-11-25 10:00")
            )

    threads = [threading.Thread(target=write, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert ledger.summary().today == pytest.approx(200 * 0.40)


def test_a_file_that_is_not_a_database_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    path.write_bytes(b"not a database at all, just some text" * 200)
    with pytest.raises(LedgerError, match="move it aside"):
        Ledger(path)


def test_history_is_per_second_for_an_hour_and_per_minute_beyond(ledger: Ledger) -> None:
    start = at("2026-11-25 10:00")
    for second in range(180):
        ledger.record_sample("tokens_per_s", float(second), start + second)

    fine = ledger.series("tokens_per_s", start + 100, now=start + 180)
    coarse = ledger.series("tokens_per_s", start - 7200, now=start + 180)

    assert fine[0] == (start + 100, 100.0)
    assert len(fine) == 80
    assert coarse == [(start, 29.5), (start + 60, 89.5), (start + 120, 149.5)]
    assert ledger.series("gpu0.power_w", start, now=start + 180) == []


def test_history_stays_bounded(tmp_path: Path) -> None:
    cards = [f"gpu{i}.{kind}" for i in range(8) for kind in ("util_pct", "power_w", "temperature_c")]
    series = ("tokens_per_s", "kv_usage", *cards)  # eight cards, three series each
    retention = Retention(fine_s=120, coarse_s=1_800)  # scaled down: an hour of 1 s, a week of 1 min
    start = at("2026-11-01 00:00")
    with Ledger(tmp_path / "h.sqlite3", tz=BERLIN, retention=retention) as ledger:
        t = start
        while t < start + 4 * retention.coarse_s:  # a point a minute, long past the coarse retention…
            ledger.record_samples(dict.fromkeys(series, 1.0), t)
            t += 60.0
        for _ in range(2 * retention.fine_s):  # …then every second, past the fine retention
            ledger.record_samples(dict.fromkeys(series, 1.0), t)
            t += 1.0
        rows = ledger.sample_rows()
        oldest = ledger.series("kv_usage", start, now=t)[0][0]
        newest_second = ledger.series("kv_usage", t - 60, now=t)

    assert rows <= retention.max_rows(len(series))
    assert rows >= len(series) * (retention.fine_s + retention.coarse_s // 60)  # kept, not over-pruned
    assert oldest >= t - retention.coarse_s - 60
    assert len(newest_second) == 60


def test_series_no_longer_recorded_are_pruned_too_even_after_a_restart(tmp_path: Path) -> None:
    """The merged `gpu_util` of older versions, or a card taken out, must not stay in the file forever."""
    retention = Retention(fine_s=120, coarse_s=1_800)
    start = at("2026-11-01 00:00")
    with Ledger(tmp_path / "h.sqlite3", tz=BERLIN, retention=retention) as old:
        for minute in range(5):
            old.record_samples({"gpu_util": 50.0, "gpu1.power_w": 300.0, "kv_usage": 1.0}, start + 60 * minute)
    with Ledger(tmp_path / "h.sqlite3", tz=BERLIN, retention=retention) as ledger:
        t = start + 300
        while t < start + 300 + 2 * retention.coarse_s:  # only kv_usage from now on
            ledger.record_samples({"kv_usage": 1.0}, t)
            t += 60.0
        assert ledger.series("gpu_util", start, now=t) == []
        assert ledger.series("gpu1.power_w", start, now=t) == []
        assert ledger.sample_rows() <= retention.max_rows(1)
        assert ledger.series_names() == ["kv_usage"]


def test_the_default_retention_is_an_hour_of_seconds_and_a_week_of_minutes() -> None:
    assert (Retention().fine_s, Retention().coarse_s) == (3_600, 7 * 86_400)
    assert Retention().max_rows(4) == 4 * (3_600 + 60 + 10_080 + 1)


def test_energy_from_the_nvml_counter_is_exact_across_gaps() -> None:
    integrator = EnergyIntegrator(max_gap_s=5.0)

    assert integrator.add(0, 0.0, 300.0, energy_mj=1_000_000) == 0.0
    assert integrator.add(0, 1.0, 300.0, energy_mj=1_300_000) == pytest.approx(300.0)
    assert integrator.add(0, 61.0, 300.0, energy_mj=19_300_000) == pytest.approx(18_000.0)


def test_energy_from_power_is_trapezoid_and_skips_long_gaps() -> None:
    integrator = EnergyIntegrator(max_gap_s=5.0)
    integrator.add(0, 0.0, 100.0)

    assert integrator.add(0, 2.0, 300.0) == pytest.approx(400.0)
    assert integrator.add(0, 60.0, 300.0) == 0.0  # the app slept: unknown, not invented
    assert integrator.add(0, 60.0, 300.0) == 0.0  # no time passed
    assert integrator.add(0, 61.0, None) == 0.0  # no reading
    assert integrator.add(1, 61.0, 250.0) == 0.0  # another GPU's first sample


def test_a_counter_reset_falls_back_to_power() -> None:
    integrator = EnergyIntegrator(max_gap_s=5.0)
    integrator.add(0, 0.0, 200.0, energy_mj=50_000_000)

    assert integrator.add(0, 1.0, 200.0, energy_mj=100) == pytest.approx(200.0)  # driver reloaded
    assert integrator.add(0, 2.0, 200.0, energy_mj=200_100) == pytest.approx(200.0)


def test_the_last_thirty_days_oldest_first_with_empty_days_filled(tmp_path: Path) -> None:
    with Ledger(tmp_path / "l.sqlite3", tz=BERLIN) as ledger:
        for day in (1, 2, 20, 25):
            ledger.record_request(f"d{day}", "run", "m", 0, 1_000_000, PRICE, at(f"2026-11-{day:02d} 22:30"))
        ledger.record_request("eur", "run", "m", 0, 1_000_000, Price(currency="EUR", per_million_output_tokens=9.0),
                              at("2026-11-25 10:00"))
        ledger.record_energy(3_600_000, at("2026-11-24 23:59:30"), 0.30, "USD")  # 1 kWh late on the 24th
        ledger.record_energy(3_600_000, at("2026-11-01 09:00"), 0.30, "USD")  # before the thirty days
        days = ledger.summary(at("2026-11-25 12:00"), "USD").days  # the 1st was compacted into a day total

    assert len(days) == 30
    assert days[0].day == "2026-10-27" and days[-1].day == "2026-11-25"
    assert (days[-1].day, days[-1].energy_cost, days[-2].day, days[-2].gross) == ("2026-11-25", 0.0, "2026-11-24", 0.0)
    assert days[-1].gross == pytest.approx(0.40) and days[-2].energy_cost == pytest.approx(0.30)
    by_day = {d.day: d.gross for d in days}
    assert by_day["2026-11-01"] == pytest.approx(0.40) and by_day["2026-11-02"] == pytest.approx(0.40)
    assert by_day["2026-11-20"] == pytest.approx(0.40) and by_day["2026-11-03"] == 0.0
    assert sum(by_day.values()) == pytest.approx(4 * 0.40)  # the euro request left out
    assert next(d for d in days if d.day == "2026-11-01").energy_cost == pytest.approx(0.30)


def test_days_follow_local_midnight_across_a_dst_change(tmp_path: Path) -> None:
    with Ledger(tmp_path / "l.sqlite3", tz=BERLIN) as ledger:
        ledger.record_request("before", "run", "m", 0, 1_000_000, PRICE, at("2026-10-24 23:30"))
        ledger.record_request("after", "run", "m", 0, 1_000_000, PRICE, at("2026-10-25 23:30"))  # a 25-h day
        days = ledger.summary(at("2026-10-26 12:00")).days
    assert [(d.day, d.gross) for d in days[-3:]] == [
        ("2026-10-24", pytest.approx(0.40)), ("2026-10-25", pytest.approx(0.40)), ("2026-10-26", 0.0)]


def test_net_per_hour_is_over_the_hours_served_in_the_last_day(ledger: Ledger) -> None:
    assert ledger.summary().net_per_hour is None  # nothing served
    now = at("2026-11-25 12:00")
    for minute in range(120):  # two hours with an engine up, busy or idle, 30 h ago and today
        ledger.record_sample(SERVING_SERIES, 0.0, now - 30 * 3600 + 60 * minute)
        ledger.record_sample(SERVING_SERIES, 5.0, now - 4 * 3600 + 60 * minute)
    ledger.record_request("r", "run", "m", 0, 10_000_000, PRICE, now - 3 * 3600)  # 4.00 earned
    ledger.record_energy(3_600_000, now - 3 * 3600, 0.50, "USD")  # 0.50 while serving
    ledger.record_energy(3_600_000 * 4, now - 3600, 0.50, "USD")  # 2.00 while a game ran: not the node's

    snap = ledger.summary(now, price_per_kwh=0.50)

    assert snap.net_per_hour == pytest.approx((4.00 - 0.50) / 2)
    assert snap.electricity_price_per_kwh == 0.50
    assert ledger.summary(now + 86_400).net_per_hour is None  # a day later: nothing served in the last 24 h


def test_midnight_utc_offsets_without_zoneinfo(tmp_path: Path) -> None:
    eastern = timezone(timedelta(hours=-5))
    with Ledger(tmp_path / "l.sqlite3", tz=eastern) as ledger:
        ledger.record_request("late", "run", "m", 0, 1_000_000, PRICE, at("2026-11-24 23:00", eastern))
        ledger.record_request("early", "run", "m", 0, 1_000_000, PRICE, at("2026-11-25 01:00", eastern))
        assert ledger.summary(at("2026-11-25 02:00", eastern)).today == pytest.approx(0.40)


# --- the node's books ----------------------------------------------------------------------------


async def test_books_credit_off_the_loop_and_wait_for_every_credit_before_closing(tmp_path: Path) -> None:
    books = Books(tmp_path / "ledger.sqlite3", lambda: "USD")
    assert books.use(lambda ledger: ledger.summary()) is None  # not open yet: nothing done
    books.open()
    assert books.earnings is not None and books.earnings.all_time == 0.0
    for n in range(20):
        books.credit(f"r-{n}", "run-1", "qwen", 0, 1_000_000, PRICE)
    await books.close()  # every credit written first
    assert books.use(lambda ledger: ledger.summary()) is None  # closed: never used again
    assert books.earnings is not None and books.earnings.all_time == pytest.approx(20 * 0.40)
    with Ledger(tmp_path / "ledger.sqlite3") as ledger:
        assert ledger.summary().all_time == pytest.approx(20 * 0.40)


async def test_a_stream_of_credits_reads_the_earnings_once_a_second_not_once_a_request(tmp_path: Path) -> None:
    """A summary is a dozen queries over the day's and week's rows: one per request would cost a
    busy node a good part of a core. The credits in between show at the next flush."""
    books = Books(tmp_path / "ledger.sqlite3", lambda: "USD")
    books.open()
    summaries: list[str] = []
    books.use(lambda ledger: ledger._db.set_trace_callback(
        lambda sql: summaries.append(sql) if sql.startswith("WITH d(i, lo, hi)") else None))
    started = time.monotonic()
    for n in range(100):
        books.credit(f"r-{n}", "run-1", "qwen", 0, 1_000_000, PRICE)
    await asyncio.gather(*books._writes)
    took = time.monotonic() - started
    assert 1 <= len(summaries) <= 2 + took / CREDIT_READ_S  # the first credit's, then one a second at most
    assert books.earnings is not None
    books.flush(time.time())  # the node's next flush: the credits since are read
    assert books.earnings is not None and books.earnings.all_time == pytest.approx(100 * 0.40)
    await books.close()


async def test_books_read_earnings_in_the_users_currency_and_chart_points_without_gaps(tmp_path: Path) -> None:
    currency = ["USD"]
    books = Books(tmp_path / "ledger.sqlite3", lambda: currency[0])
    books.open()
    books.use(lambda ledger: ledger.record_request("r-1", "run-1", "qwen", 0, 1_000_000,
                                                   Price(currency="EUR", per_million_output_tokens=1.0)))
    books.read_earnings()
    assert books.earnings is not None and (books.earnings.currency, books.earnings.all_time) == ("USD", 0.0)
    currency[0] = "EUR"
    now = at("2026-11-25 12:00")
    assert books.add_samples([("tokens_per_s", 42.0), ("kv_usage", None)], now)  # the first: a flush is due
    books.flush(now)  # earnings re-read
    assert books.earnings.currency == "EUR" and books.earnings.all_time == pytest.approx(1.0)
    assert books.use(lambda ledger: ledger.series("tokens_per_s", now - 1, now)) == [(float(int(now)), 42.0)]
    assert books.use(lambda ledger: ledger.series("kv_usage", now - 1, now)) == []
    await books.close()


async def test_chart_history_is_served_from_memory_and_survives_a_restart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dashboard asks for its charts every second on the GUI thread: never through SQLite."""
    now = time.time()
    first = Books(tmp_path / "ledger.sqlite3", lambda: "USD")
    first.open()
    for second in range(5):
        first.add_samples([("tokens_per_s", 10.0 + second), ("gpu_util", None)], now - 5 + second)
    await first.close()  # what was not on disk yet is written as it closes

    again = Books(tmp_path / "ledger.sqlite3", lambda: "USD")
    again.open()  # the last hour comes back from the file, once, off the GUI thread
    again.add_samples([("tokens_per_s", 99.0)], now)

    def no_sqlite(*args: object, **kwargs: object) -> None:
        raise AssertionError("chart history read SQLite")

    monkeypatch.setattr(Ledger, "series", no_sqlite)
    points = again.chart("tokens_per_s", int(now) - 3)
    assert [v for _, v in points] == [12.0, 13.0, 14.0, 99.0]
    assert again.chart("gpu_util", now - 60) == [] and again.chart("never", now - 60) == []
    await again.close()
    assert again.chart("tokens_per_s", now - 60) == []  # closed: nothing shown


async def test_books_give_the_electricity_price_and_forget_cards_no_longer_sampled(tmp_path: Path) -> None:
    price = [0.0]
    books = Books(tmp_path / "ledger.sqlite3", lambda: "USD", lambda: price[0])
    books.open()
    assert books.earnings is not None and books.earnings.electricity_price_per_kwh == 0.0  # not set: the app nudges
    price[0] = 0.32
    now = time.time()
    books.add_samples([("gpu1.power_w", 300.0), ("tokens_per_s", 1.0)], now)
    books.flush(now)
    assert books.earnings.electricity_price_per_kwh == 0.32 and len(books.earnings.days) == 30
    books.add_samples([("tokens_per_s", 2.0)], now + CHART_WINDOW_S + 1)  # the card is gone
    assert books.chart("gpu1.power_w", 0.0) == [] and "gpu1.power_w" not in books._charts
    assert [v for _, v in books.chart("tokens_per_s", 0.0)] == [2.0]
    await books.close()


async def test_chart_points_reach_the_file_every_few_seconds_in_one_go(tmp_path: Path) -> None:
    """An idle node records a point a second: memory at once, the file every `SAMPLES_FLUSH_S`
    (one thread hand-off and one transaction, not one a second)."""
    books = Books(tmp_path / "ledger.sqlite3", lambda: "USD")
    books.open()
    now = time.time()
    assert books.add_samples([("tokens_per_s", 0.0)], now)  # nothing flushed yet: due at once
    books.flush(now)
    due = [books.add_samples([("tokens_per_s", float(s))], now + s) for s in range(1, int(SAMPLES_FLUSH_S) + 1)]
    assert due == [False] * (int(SAMPLES_FLUSH_S) - 1) + [True]
    on_disk = books.use(lambda ledger: ledger.series("tokens_per_s", now - 1, now + 60))
    assert [v for _, v in on_disk] == [0.0]  # the rest waits in memory ...
    assert len(books.chart("tokens_per_s", now - 1)) == int(SAMPLES_FLUSH_S) + 1  # ... where the GUI reads it
    books.flush(now + SAMPLES_FLUSH_S)
    on_disk = books.use(lambda ledger: ledger.series("tokens_per_s", now - 1, now + 60))
    assert [v for _, v in on_disk] == [float(s) for s in range(int(SAMPLES_FLUSH_S) + 1)]
    await books.close()


async def test_energy_waits_in_memory_with_the_chart_points(tmp_path: Path) -> None:
    books = Books(tmp_path / "ledger.sqlite3", lambda: "USD", lambda: 0.5)
    books.open()
    now = at("2026-11-25 12:00")  # midday: the day cannot turn during the test
    books.add_energy(3_600_000.0, now, 0.5, "USD")  # 1 kWh
    assert books.use(lambda ledger: ledger.summary(now + 1)).energy_kwh_today == 0.0  # not on disk yet
    books.flush(now)
    summary = books.use(lambda ledger: ledger.summary(now + 1))
    assert (summary.energy_kwh_today, summary.energy_cost_today) == (pytest.approx(1.0), pytest.approx(0.5))
    books.add_energy(3_600_000.0, now + 1, 0.5, "USD")
    await books.close()  # written as it closes
    again = Ledger(tmp_path / "ledger.sqlite3")
    assert again.summary(now + 2).energy_kwh_today == pytest.approx(2.0)
    again.close()


# --- honest earnings: power measured, the rate, the projection ------------------------------------


def serve(ledger: Ledger, start: float, minutes: int) -> None:
    """An engine up (busy or idle) for `minutes` from `start`: a serving point a minute, as the node
    records one every second it serves."""
    ledger.record_batch([(start + 60 * m, {SERVING_SERIES: 3.0}) for m in range(minutes)])


def test_net_of_electricity_only_where_serving_power_was_measured(ledger: Ledger) -> None:
    now = at("2026-11-25 12:00")
    serve(ledger, now - 2 * 3600, 120)
    ledger.record_request("r", "run", "m", 0, 10_000_000, PRICE, now - 3600)  # 4.00
    cpu = ledger.summary(now, price_per_kwh=0.30)
    assert not cpu.power_measured  # a Mac or a CPU node: no energy recorded while it served ...
    assert cpu.net_today == cpu.today == pytest.approx(4.00)  # ... so net is gross
    assert cpu.net_per_hour == pytest.approx(4.00 / 2)

    ledger.record_energy(3_600_000, now - 1800, 0.30, "USD")  # the cards' power, read while serving
    gpu = ledger.summary(now, price_per_kwh=0.30)
    assert gpu.power_measured
    assert gpu.net_per_hour == pytest.approx((4.00 - 0.30) / 2)


def test_before_serving_a_card_whose_power_reads_counts_as_measured(ledger: Ledger) -> None:
    now = at("2026-11-25 12:00")
    assert not ledger.summary(now).power_measured  # nothing known yet
    ledger.record_sample("gpu0.util_pct", 3.0, now - 600)  # a card without a power reading
    assert not ledger.summary(now).power_measured
    ledger.record_sample("gpu0.power_w", 31.0, now - 600)
    assert ledger.summary(now).power_measured


def test_no_hourly_rate_from_a_few_minutes(ledger: Ledger) -> None:
    now = at("2026-11-25 12:00")
    serve(ledger, now - 600, 5)
    ledger.record_request("r", "run", "m", 0, 1_000_000, PRICE, now - 300)
    snap = ledger.summary(now)
    assert snap.net_per_hour is None and snap.projected_per_day is None  # 0.40 in 5 minutes is no "4.80 an hour"
    assert snap.today == pytest.approx(0.40)


def test_the_projection_follows_the_hours_a_day_it_serves(ledger: Ledger) -> None:
    now = at("2026-11-25 12:00")
    for days_ago in (2, 1, 0):  # six hours each of the last three days
        serve(ledger, now - days_ago * 86_400 - 6 * 3600, 360)
    ledger.record_request("r", "run", "m", 0, 7_500_000, PRICE, now - 3600)  # 3.00 today
    ledger.record_energy(2 * 3_600_000, now - 1800, 0.30, "USD")  # 0.60 while serving
    snap = ledger.summary(now, price_per_kwh=0.30)
    assert snap.net_per_hour == pytest.approx((3.00 - 0.60) / 6)
    # 18 of the 54 hours since it first served: 8 hours a day at 0.40 an hour
    assert snap.projected_per_day == pytest.approx(0.40 * 8)


def test_a_node_serving_since_it_started_projects_a_whole_day(ledger: Ledger) -> None:
    now = at("2026-11-25 12:00")
    serve(ledger, now - 1800, 30)
    ledger.record_request("r", "run", "m", 0, 1_000_000, PRICE, now - 60)  # 0.40 in half an hour
    ledger.record_energy(3_600_000, now - 60, 1.00, "USD")  # 1.00 of electricity: losing money
    snap = ledger.summary(now, price_per_kwh=1.00)
    assert snap.net_per_hour == pytest.approx((0.40 - 1.00) * 2)
    assert snap.projected_per_day == pytest.approx((0.40 - 1.00) * 2 * 24)
