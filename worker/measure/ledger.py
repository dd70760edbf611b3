"""Earnings, energy and chart history in SQLite (WAL), so the figures survive crashes and restarts.

Every write is its own committed transaction: a SIGKILL loses at most the write in progress and
never leaves the file inconsistent. Requests are keyed by request id and inserted with
`INSERT OR IGNORE`, so a reconnect or a replayed `response.end` never counts twice. The API is
synchronous and thread-safe (one connection behind a lock); the node uses it through `Books`,
which keeps it off the event loop and never uses it closed.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import date, datetime, timedelta, tzinfo
from pathlib import Path
from typing import Any, TypeVar

from worker.system.config import DataFolderUnsafe, narrow_existing, private_opener
from worker.contract.events import DayEarnings, EarningsSnapshot
from worker.contract.protocol import Price

SCHEMA_VERSION = 1
JOULES_PER_KWH = 3_600_000.0
COARSE_STEP_S = 60
DETAIL_DAYS = 2  # requests kept one by one (for idempotency) for today and yesterday, then per day
CHART_WINDOW_S = 3600.0  # the chart history the GUI may ask for, kept in memory: a point a second a series
SAMPLES_FLUSH_S = 10.0  # chart points reach the file this often (the GUI reads them from memory at once)
EARNINGS_REFRESH_S = 60.0  # earnings are re-read after each credit, and this often for electricity and the day
EARNINGS_DAYS = 30  # the days the earnings chart shows, today included
CREDIT_READ_S = 1.0  # a stream of credits re-reads the earnings once a second, not once a request
RATE_WINDOW_S = 86_400.0  # the net rate is over the serving minutes of the last day
RATE_MIN_SERVED_MIN = 15  # fewer serving minutes than this make no rate: one request in a minute is not "per hour"
PROJECTION_WINDOW_S = 7 * 86_400.0  # how many hours a day the node serves, judged over the last week
POWER_SERIES_SUFFIX = ".power_w"  # the per-card power chart series (`gpu{index}.power_w`), read where NVML reads power
SERVING_SERIES = "tokens_per_s"
"""The chart series the node records every second an engine serves (its live rate, 0 when idle)
and never while none does: its per-minute points are the ledger's record of serving time."""
T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    request_id TEXT PRIMARY KEY,
    run_id TEXT NOT NULL,
    model TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    currency TEXT NOT NULL,
    amount REAL NOT NULL,
    at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS requests_by_time ON requests (currency, at);
CREATE TABLE IF NOT EXISTS earnings_by_day (
    day REAL NOT NULL,
    currency TEXT NOT NULL,
    requests INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    amount REAL NOT NULL,
    PRIMARY KEY (day, currency)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS energy (
    minute INTEGER NOT NULL,
    currency TEXT NOT NULL,
    joules REAL NOT NULL,
    cost REAL NOT NULL,
    PRIMARY KEY (minute, currency)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS samples_fine (
    series TEXT NOT NULL,
    t INTEGER NOT NULL,
    value REAL NOT NULL,
    PRIMARY KEY (series, t)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS samples_coarse (
    series TEXT NOT NULL,
    t INTEGER NOT NULL,
    total REAL NOT NULL,
    count INTEGER NOT NULL,
    PRIMARY KEY (series, t)
) WITHOUT ROWID;
"""


@dataclass(frozen=True)
class Retention:
    """How long chart points are kept: per second for `fine_s`, as per-minute means for `coarse_s`."""

    fine_s: int = 3_600
    coarse_s: int = 7 * 86_400

    def max_rows(self, series: int) -> int:
        """The most points the store can hold for this many series (pruning runs once a minute)."""
        return series * (self.fine_s + COARSE_STEP_S + self.coarse_s // COARSE_STEP_S + 1)


@dataclass(frozen=True)
class _ServingRate:
    served_minutes: int  # in the rate's window
    net_per_hour: float | None
    power_measured: bool  # energy was recorded in those minutes


class LedgerError(Exception):
    """The ledger file cannot be used; the message says which file and what to do."""


def _make_private(path: Path) -> None:
    """The ledger file exists, 0600, before SQLite opens it: SQLite gives its `-wal` and `-shm`
    files the database file's mode, so they are private too. Older, wider ones are narrowed, through
    their descriptors. SQLite follows links, so a link at any of them is refused first
    (`DataFolderUnsafe`), and SQLite never writes, nor narrows, what it points to."""
    os.close(private_opener(str(path), os.O_RDWR | os.O_CREAT))
    for companion in ("-wal", "-shm", "-journal"):
        narrow_existing(Path(f"{path}{companion}"))


def earned(price: Price, prompt_tokens: int, completion_tokens: int) -> float:
    """What one request earns at the coordinator's price (per million tokens)."""
    return (
        prompt_tokens * price.per_million_input_tokens + completion_tokens * price.per_million_output_tokens
    ) / 1e6


class Ledger:
    """Earnings by request, energy by minute, chart series at 1 s / 1 min resolution."""

    def __init__(
        self,
        path: Path | str,
        clock: Callable[[], float] = time.time,
        tz: tzinfo | None = None,
        retention: Retention = Retention(),
    ) -> None:
        """`tz` None = the system's local time, for day and week boundaries."""
        self._clock = clock
        self._retention = retention
        self._tz = tz
        self._lock = threading.Lock()
        self._pruned_minute: int | None = None
        self._series: set[str] | None = None  # the chart series the file holds, read at the first write
        self._compacted_before: float | None = None
        try:
            _make_private(Path(path))
            self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            # NORMAL in WAL mode survives an application crash; only a power cut can lose the
            # last commits, and even then the file stays consistent.
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA busy_timeout=5000")
            with self._db:
                self._db.executescript(_SCHEMA)
                self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except DataFolderUnsafe as exc:  # a link or a stranger at its path: the message says what to do
            raise LedgerError(f"the earnings ledger cannot be opened: {exc}") from None
        except (sqlite3.DatabaseError, OSError) as exc:
            raise LedgerError(
                f"the earnings ledger {path} cannot be opened ({exc}); "
                "move it aside and restart to begin a new one"
            ) from None

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _write(self, sql: str, params: tuple[object, ...]) -> int:
        with self._lock, self._db:
            return self._db.execute(sql, params).rowcount

    # --- earnings ---------------------------------------------------------------------------

    def record_request(
        self,
        request_id: str,
        run_id: str,
        model: str,
        prompt_tokens: int,
        completion_tokens: int,
        price: Price,
        at: float | None = None,
    ) -> bool:
        """Credit one finished request; `False` when this request id was already credited."""
        if prompt_tokens < 0 or completion_tokens < 0:
            raise ValueError(f"request {request_id}: token counts cannot be negative")
        at = self._clock() if at is None else at
        amount = earned(price, prompt_tokens, completion_tokens)
        with self._lock, self._db:
            inserted = self._db.execute(
                "INSERT OR IGNORE INTO requests VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (request_id, run_id, model, prompt_tokens, completion_tokens, price.currency, amount, at),
            ).rowcount
            self._compact(at)
        return inserted == 1

    def _compact(self, now: float) -> None:
        """Fold requests older than yesterday into per-day totals, so the file grows by a row a day.

        Request ids are therefore remembered (for idempotency) for today and yesterday: far longer
        than any reconnect replays a `response.end`. Runs in the caller's transaction, once a day.
        """
        cutoff = self._local_midnight(self._local_date(now) - timedelta(days=DETAIL_DAYS - 1))
        if self._compacted_before is not None and cutoff <= self._compacted_before:
            return
        while (oldest := self._oldest_request_before(cutoff)) is not None:
            day = self._local_date(oldest)
            start, end = self._local_midnight(day), self._local_midnight(day + timedelta(days=1))
            self._db.execute(
                "INSERT INTO earnings_by_day SELECT ?, currency, COUNT(*), SUM(prompt_tokens),"
                " SUM(completion_tokens), SUM(amount) FROM requests"
                " WHERE at >= ? AND at < ? GROUP BY currency"
                " ON CONFLICT (day, currency) DO UPDATE SET requests = requests + excluded.requests,"
                " prompt_tokens = prompt_tokens + excluded.prompt_tokens,"
                " completion_tokens = completion_tokens + excluded.completion_tokens,"
                " amount = amount + excluded.amount",
                (start, start, end),
            )
            self._db.execute("DELETE FROM requests WHERE at >= ? AND at < ?", (start, end))
        self._compacted_before = cutoff

    def record_energy(self, joules: float, at: float | None, price_per_kwh: float, currency: str) -> None:
        """Add energy drawn (and its cost at today's price) to the minute it ended in."""
        if joules < 0 or not math.isfinite(joules):
            raise ValueError(f"energy must be a finite, non-negative number of joules, not {joules}")
        if joules == 0:
            return
        at = self._clock() if at is None else at
        cost = joules / JOULES_PER_KWH * price_per_kwh
        self._write(
            "INSERT INTO energy VALUES (?, ?, ?, ?) ON CONFLICT (minute, currency) DO UPDATE SET "
            "joules = joules + excluded.joules, cost = cost + excluded.cost",
            (int(at // COARSE_STEP_S) * COARSE_STEP_S, currency, joules, cost),
        )

    def _oldest_request_before(self, cutoff: float) -> float | None:
        row = self._db.execute("SELECT MIN(at) FROM requests WHERE at < ?", (cutoff,)).fetchone()
        return None if row[0] is None else float(row[0])

    def summary(self, now: float | None = None, currency: str = "USD", price_per_kwh: float = 0.0) -> EarningsSnapshot:
        """Today, this week (from Monday), all time and the last `EARNINGS_DAYS` days, in local time,
        the net earned per serving hour and a day's projection, and whether this machine's serving
        power is measured at all; other currencies left out. `price_per_kwh`: the electricity price
        the node charges energy at, passed through for the app to show."""
        now = self._clock() if now is None else now
        day = self._day_start(now)
        week = self._week_start(now)
        with self._lock:
            earned_ = self._db.execute(
                "SELECT COALESCE(SUM(CASE WHEN at >= ? THEN amount END), 0),"
                " COALESCE(SUM(CASE WHEN at >= ? THEN amount END), 0), COALESCE(SUM(amount), 0)"
                " FROM (SELECT at, amount, currency FROM requests"
                " UNION ALL SELECT day, amount, currency FROM earnings_by_day) WHERE currency = ?",
                (day, week, currency),
            ).fetchone()
            energy = self._db.execute(
                "SELECT COALESCE(SUM(CASE WHEN minute >= ? THEN cost END), 0),"
                " COALESCE(SUM(CASE WHEN minute >= ? THEN cost END), 0), COALESCE(SUM(cost), 0),"
                " COALESCE(SUM(CASE WHEN minute >= ? THEN joules END), 0)"
                " FROM energy WHERE currency = ?",
                (day, week, day, currency),
            ).fetchone()
            days = self._days(now, currency)
            rate = self._serving_rate(now, currency)
            projected = self._projected_per_day(now, rate.net_per_hour)
        return EarningsSnapshot(
            currency=currency,
            today=earned_[0],
            week=earned_[1],
            all_time=earned_[2],
            energy_cost_today=energy[0],
            energy_cost_week=energy[1],
            energy_cost_all_time=energy[2],
            energy_kwh_today=energy[3] / JOULES_PER_KWH,
            days=days,
            net_per_hour=rate.net_per_hour,
            electricity_price_per_kwh=price_per_kwh,
            power_measured=rate.power_measured if rate.served_minutes else self._power_read_lately(now),
            projected_per_day=projected,
        )

    def _days(self, now: float, currency: str) -> tuple[DayEarnings, ...]:
        """The last `EARNINGS_DAYS` local days, oldest first, days without earnings included: one
        statement of indexed range sums, a day at a time (DST makes days 23 to 25 hours long)."""
        today = self._local_date(now)
        dates = [today - timedelta(days=back) for back in range(EARNINGS_DAYS - 1, -1, -1)]
        bounds = [(self._local_midnight(d), self._local_midnight(d + timedelta(days=1))) for d in dates]
        rows = self._db.execute(
            f"WITH d(i, lo, hi) AS (VALUES {', '.join(['(?, ?, ?)'] * len(bounds))}) SELECT"
            " (SELECT COALESCE(SUM(amount), 0) FROM requests WHERE currency = ? AND at >= d.lo AND at < d.hi)"
            " + (SELECT COALESCE(SUM(amount), 0) FROM earnings_by_day"
            " WHERE day >= d.lo AND day < d.hi AND currency = ?),"
            " (SELECT COALESCE(SUM(cost), 0) FROM energy WHERE minute >= d.lo AND minute < d.hi AND currency = ?)"
            " FROM d ORDER BY d.i",
            (*(v for i, (lo, hi) in enumerate(bounds) for v in (i, lo, hi)), currency, currency, currency),
        ).fetchall()
        return tuple(DayEarnings(d.isoformat(), gross, cost) for d, (gross, cost) in zip(dates, rows, strict=True))

    def _serving_rate(self, now: float, currency: str) -> _ServingRate:
        """Net earned in the last day ÷ the hours served in it, and whether serving's power was
        measured in those minutes.

        Served = the minutes the node recorded a `SERVING_SERIES` point: an engine was up to take
        requests, busy or idle (an idle hour that draws power and earns nothing lowers the figure,
        as it would a gamer's bill). The earnings are every request of the day; the energy is the
        serving minutes' only, not what a game drew while the node was paused. Under
        `RATE_MIN_SERVED_MIN` there is no rate: a minute's one request is no hourly figure.
        Measured = energy was recorded in those minutes (NVML power or energy on the cards): a Mac
        or a CPU node records none, and its net is its gross.
        """
        since = now - RATE_WINDOW_S
        minutes, energy_cost, joules = self._db.execute(
            "SELECT COUNT(DISTINCT s.t), COALESCE(SUM(CASE WHEN e.currency = ? THEN e.cost END), 0),"
            " COALESCE(SUM(e.joules), 0) FROM samples_coarse AS s LEFT JOIN energy AS e ON e.minute = s.t"
            " WHERE s.series = ? AND s.t >= ?",
            (currency, SERVING_SERIES, since),
        ).fetchone()
        minutes, measured = int(minutes), float(joules) > 0
        if minutes < RATE_MIN_SERVED_MIN:
            return _ServingRate(minutes, None, measured)
        gross = self._db.execute(
            "SELECT COALESCE(SUM(amount), 0) FROM requests WHERE currency = ? AND at >= ?", (currency, since)
        ).fetchone()[0]
        return _ServingRate(minutes, (float(gross) - float(energy_cost)) / (minutes / 60), measured)

    def _projected_per_day(self, now: float, net_per_hour: float | None) -> float | None:
        """The net rate × the hours a day the node has served lately: the share of the time since
        its first serving minute of the last week (a node serving evenings projects evenings, one
        started an hour ago and serving since projects all day)."""
        if net_per_hour is None:
            return None
        first, minutes = self._db.execute(
            "SELECT MIN(t), COUNT(*) FROM samples_coarse WHERE series = ? AND t >= ?",
            (SERVING_SERIES, now - min(PROJECTION_WINDOW_S, self._retention.coarse_s)),
        ).fetchone()
        if first is None:
            return None
        served_s = int(minutes) * COARSE_STEP_S
        share = served_s / max(now - float(first), served_s)
        return net_per_hour * 24 * share

    def _power_read_lately(self, now: float) -> bool:
        """Before anything was served today: whether this machine's power can be measured, from
        the last week's records (energy drawn, or a card's power charted). Call under the lock."""
        since = now - self._retention.coarse_s
        row = self._db.execute(
            "SELECT EXISTS (SELECT 1 FROM energy WHERE minute >= ? AND joules > 0)"
            " OR EXISTS (SELECT 1 FROM samples_coarse WHERE series GLOB ? AND t >= ?)",
            (since, f"gpu*{POWER_SERIES_SUFFIX}", since),
        ).fetchone()
        return bool(row[0])

    def _local_midnight(self, day: date) -> float:
        # A naive datetime's timestamp() uses the system's local rules, DST included.
        return datetime(day.year, day.month, day.day, tzinfo=self._tz).timestamp()

    def _local_date(self, now: float) -> date:
        return datetime.fromtimestamp(now, self._tz).date()

    def _day_start(self, now: float) -> float:
        return self._local_midnight(self._local_date(now))

    def _week_start(self, now: float) -> float:
        today = self._local_date(now)
        return self._local_midnight(today - timedelta(days=today.weekday()))

    # --- history ----------------------------------------------------------------------------

    def record_sample(self, series: str, value: float, at: float | None = None) -> None:
        """One chart point: kept per second for an hour and as per-minute means for a week."""
        self.record_samples({series: value}, at)

    def record_samples(self, values: Mapping[str, float], at: float | None = None) -> None:
        """Several series' points of one instant, in one transaction."""
        self.record_batch([(self._clock() if at is None else at, values)])

    def record_batch(self, instants: Sequence[tuple[float, Mapping[str, float]]]) -> None:
        """The points of several instants (the node's last seconds), in one transaction."""
        with self._lock, self._db:
            series = self._known_series()
            for at, values in instants:
                second, minute = int(at), int(at // COARSE_STEP_S) * COARSE_STEP_S
                points = [(name, value) for name, value in values.items() if math.isfinite(value)]
                series.update(name for name, _ in points)
                for name, value in points:
                    self._db.execute(
                        "INSERT INTO samples_fine VALUES (?, ?, ?) ON CONFLICT (series, t) DO UPDATE SET"
                        " value = excluded.value",
                        (name, second, value),
                    )
                    self._db.execute(
                        "INSERT INTO samples_coarse VALUES (?, ?, ?, 1) ON CONFLICT (series, t) DO UPDATE SET "
                        "total = total + excluded.total, count = count + 1",
                        (name, minute, value),
                    )
                if self._pruned_minute != minute:
                    self._prune(series, second)
                    self._pruned_minute = minute

    def _known_series(self) -> set[str]:
        """Every series the file holds points of (read once), so one no longer recorded (a card
        taken out, a renamed series) is pruned too. Call under the lock."""
        if self._series is None:
            self._series = {str(name) for (name,) in self._db.execute("SELECT DISTINCT series FROM samples_coarse")}
        return self._series

    def _prune(self, series: set[str], now: int) -> None:
        """Drop every series' points past their retention, once a minute, so the tables stay
        bounded; a series with none left is forgotten."""
        fine_cutoff, coarse_cutoff = now - self._retention.fine_s, now - self._retention.coarse_s
        for name in list(series):
            self._db.execute("DELETE FROM samples_fine WHERE series = ? AND t < ?", (name, fine_cutoff))
            self._db.execute("DELETE FROM samples_coarse WHERE series = ? AND t < ?", (name, coarse_cutoff))
            if self._db.execute("SELECT 1 FROM samples_coarse WHERE series = ? LIMIT 1", (name,)).fetchone() is None:
                series.discard(name)

    def series_names(self) -> list[str]:
        with self._lock:
            return [str(name) for (name,) in self._db.execute("SELECT DISTINCT series FROM samples_fine")]

    def series(self, name: str, since: float, now: float | None = None) -> list[tuple[float, float]]:
        """Points from `since`: per second if that lies within the last hour, else per-minute means."""
        now = self._clock() if now is None else now
        with self._lock:
            if since >= now - self._retention.fine_s:
                rows = self._db.execute(
                    "SELECT t, value FROM samples_fine WHERE series = ? AND t >= ? ORDER BY t", (name, since)
                ).fetchall()
            else:
                rows = self._db.execute(
                    "SELECT t, total / count FROM samples_coarse WHERE series = ? AND t >= ? ORDER BY t",
                    (name, int(since // COARSE_STEP_S) * COARSE_STEP_S),
                ).fetchall()
        return [(float(t), float(v)) for t, v in rows]

    def sample_rows(self) -> int:
        """Stored chart points, both resolutions (the size bound is checked against this)."""
        with self._lock:
            fine = self._db.execute("SELECT COUNT(*) FROM samples_fine").fetchone()[0]
            coarse = self._db.execute("SELECT COUNT(*) FROM samples_coarse").fetchone()[0]
        return int(fine) + int(coarse)


# --- the node's books ---------------------------------------------------------------------------


class Books:
    """The node's ledger while it runs: used from threads (never on the event loop), never once it
    is closed, credits written in the executor at once and awaited (never cancelled) before it
    closes. Holds the latest earnings summary, so a snapshot never touches SQLite."""

    def __init__(self, path: Path, currency: Callable[[], str], price: Callable[[], float] = lambda: 0.0) -> None:
        self._path = path
        self._currency = currency  # the user's, read at each summary (settings change)
        self._price = price  # the user's electricity price per kWh, likewise
        self._ledger: Ledger | None = None
        self._guard = threading.Lock()  # held while the ledger is used, so it is never used closed
        self._writes: set[asyncio.Future[Any]] = set()  # credits still being written
        self._earnings_read_at = float("-inf")
        self._credit_lock = threading.Lock()
        self._credit_read_at = float("-inf")  # monotonic: when a credit last re-read the earnings
        self._unread_credit = False  # a credit since then waits for the next flush's re-read
        self.earnings: EarningsSnapshot | None = None
        self._charts: dict[str, deque[tuple[float, float]]] = {}  # the last CHART_WINDOW_S, in memory
        self._pending: list[tuple[float, dict[str, float]]] = []  # chart points not yet on disk
        self._energy: list[tuple[float, float, float, str]] = []  # (joules, at, price, currency) likewise
        self._flushed_at = float("-inf")
        self._charts_lock = threading.Lock()

    def open(self) -> None:
        """Opens the file, reads the earnings and the last hour of chart points (in a thread)."""
        ledger = Ledger(self._path)
        with self._guard:
            self._ledger = ledger
        self.read_earnings()
        now = time.time()  # the same instant for both, so the hour is read per second, not as minute means
        loaded = {name: deque(ledger.series(name, now - CHART_WINDOW_S, now)) for name in ledger.series_names()}
        with self._charts_lock:
            self._charts = loaded

    def chart(self, series: str, since: float) -> list[tuple[float, float]]:
        """Chart points from `since` (within the last hour) from memory: the GUI thread asks every
        second, and must never wait on SQLite (or on a credit being written)."""
        with self._charts_lock:
            points = self._charts.get(series)
            if not points:
                return []
            newest_first = list(itertools.takewhile(lambda point: point[0] >= since, reversed(points)))
        newest_first.reverse()  # from the newest end: asking for the last seconds costs a few points, not the hour
        return newest_first

    def use(self, use: Callable[[Ledger], T]) -> T | None:
        """`use(ledger)` while the ledger is open; None (and nothing done) once it is closed."""
        with self._guard:
            return use(self._ledger) if self._ledger is not None else None

    def read_earnings(self) -> None:
        currency, price = self._currency(), self._price()
        self.earnings = self.use(lambda ledger: ledger.summary(currency=currency, price_per_kwh=price)) or self.earnings

    def add_samples(self, rows: Sequence[tuple[str, float | None]], now: float) -> bool:
        """This second's chart points: in memory at once (what the GUI reads), on disk at the next
        `flush`. True when one is due: the points kept since the last (every `SAMPLES_FLUSH_S`),
        or the earnings' re-read (every `EARNINGS_REFRESH_S`). On the event loop, no SQLite."""
        values = {name: value for name, value in rows if value is not None and math.isfinite(value)}
        if values:
            self._remember(values, now)
            with self._charts_lock:
                self._pending.append((now, values))
        return now - self._flushed_at >= SAMPLES_FLUSH_S or now - self._earnings_read_at >= EARNINGS_REFRESH_S

    def add_energy(self, joules: float, now: float, price_per_kwh: float, currency: str) -> None:
        """Energy serving drew this second, on disk at the next `flush` (on the event loop)."""
        with self._charts_lock:
            self._energy.append((joules, now, price_per_kwh, currency))

    def flush(self, now: float) -> None:
        """In a thread: the chart points and energy kept since the last flush, and the earnings
        re-read when due. One thread hand-off every few seconds, not every second: on an idle
        node those hand-offs were a good part of its CPU."""
        with self._charts_lock:
            pending, self._pending = self._pending, []
            energy, self._energy = self._energy, []

        def write(ledger: Ledger) -> None:
            for joules, at, price, currency in energy:
                ledger.record_energy(joules, at, price, currency)
            if pending:
                ledger.record_batch(pending)

        self.use(write)
        self._flushed_at = now
        with self._credit_lock:
            unread, self._unread_credit = self._unread_credit, False
        if unread or now - self._earnings_read_at >= EARNINGS_REFRESH_S:
            self._earnings_read_at = now
            self.read_earnings()

    def _remember(self, values: Mapping[str, float], now: float) -> None:
        """This second's points, and every series trimmed to the window: one no longer recorded
        (a card taken out) empties within the hour and is dropped."""
        with self._charts_lock:
            for name, value in values.items():
                self._charts.setdefault(name, deque()).append((float(int(now)), value))  # per second, as kept
            for name, points in list(self._charts.items()):
                while points and points[0][0] < now - CHART_WINDOW_S:
                    points.popleft()
                if not points:
                    del self._charts[name]

    def credit(self, request_id: str, run_id: str, model: str, prompt_tokens: int, completion_tokens: int,
               price: Price) -> None:
        """On the event loop: one finished request's earnings, written in the executor at once,
        then the earnings read again, at most once a second (`CREDIT_READ_S`): a summary per request
        would cost a busy node a good part of a core. A credit that falls in between shows at the
        next flush, within `SAMPLES_FLUSH_S`."""

        def write() -> None:
            self.use(lambda ledger: ledger.record_request(
                request_id, run_id, model, prompt_tokens, completion_tokens, price))
            with self._credit_lock:
                due = time.monotonic() - self._credit_read_at >= CREDIT_READ_S
                if due:
                    self._credit_read_at = time.monotonic()
                self._unread_credit = not due
            if due:
                self.read_earnings()

        future = asyncio.get_running_loop().run_in_executor(None, write)
        self._writes.add(future)
        future.add_done_callback(self._writes.discard)

    async def close(self) -> None:
        """After the credits still being written."""
        await asyncio.gather(*self._writes, return_exceptions=True)
        await asyncio.to_thread(self._close)

    def _close(self) -> None:
        self.flush(time.time())  # the last seconds' chart points too
        with self._guard:
            ledger, self._ledger = self._ledger, None
        with self._charts_lock:
            self._charts = {}  # closed books show nothing, from memory or from the file
        if ledger is not None:
            ledger.close()
