"""What a person controls about downloads, as Steam does: pause, cancel, a speed limit, a monthly budget.

One `TransferControl` belongs to the node; every download obeys it. The node holds downloads (the
person's pause, serving paused, a game running, setup unfinished) and releases them; a download waits
while any hold stands, without reading a byte, so its bandwidth is the game's. A download calls
`take` with every chunk it receives (`take` blocks: for huggingface_hub's worker threads;
`take_async` waits on the event loop: for our own downloader), which counts the bytes against the
monthly budget as they arrive, waits out holds (and a budget used up) and paces to the limit. Before a transfer starts, `wait_until_free`
waits until its announced size fits this month's budget (held "budget", "until 1 January") and
refuses one larger than the whole budget (`BudgetExceeded`): nothing is fetched that must stop half-way.

Pacing is a leaky bucket with no burst: each chunk is paid for at the limit after the bytes before
it (a wait that overran a little is made up), so over a few seconds the rate stays within a chunk of
the limit, and a pause or a slow line earns no credit.
`cancel` makes the running downloads raise `DownloadCancelled` (their callers remove the `.part`).
The budget is a small private JSON file in the data folder (`budget_path`), counted per calendar
month in local time, saved at most once a second while bytes arrive and when a download ends.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from worker.contract.events import DownloadHold
from worker.system.config import Paths, read_private_text, write_private_text

log = logging.getLogger(__name__)

MIB = 1024 * 1024
GIB = 1024 * MIB
POLL_S = 0.25  # how soon a waiting download notices a release, a cancel, a new month
CATCH_UP_S = 0.25  # pacing makes up for waits that overran by less than this, so sleeps' overshoot costs no speed
MIN_SLEEP_S = 0.02  # pacing sleeps no shorter than this: a fast limit is not thousands of wake-ups a second
SAVE_EVERY_S = 1.0  # the budget file is rewritten at most this often while bytes arrive
BUDGET_FILE = "download-budget.json"
HOLD_ORDER: tuple[DownloadHold, ...] = ("paused_by_you", "paused", "game", "budget", "setup")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December")


class BudgetExceeded(Exception):
    """The download alone is larger than the whole monthly budget: waiting would never let it start."""

    def __init__(self, need_bytes: int, limit_bytes: int) -> None:
        super().__init__(f"needs {need_bytes} bytes, the monthly budget is {limit_bytes}")
        self.need_bytes = need_bytes
        self.limit_bytes = limit_bytes


class DownloadCancelled(Exception):
    """The person cancelled the download: not a failure, nothing to retry."""


def budget_path(paths: Paths) -> Path:
    """Where this machine's monthly download count is kept."""
    return paths.data_dir / BUDGET_FILE


def _month_of(epoch: float) -> str:
    local = time.localtime(epoch)
    return f"{local.tm_year:04d}-{local.tm_mon:02d}"


class MonthlyBudget:
    """Bytes downloaded this calendar month (local time), kept across restarts; `limit_gib` None = no limit."""

    def __init__(self, path: Path, limit_gib: float | None, *, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.limit_bytes = None if limit_gib is None else int(limit_gib * GIB)
        self._clock = clock
        self._lock = threading.Lock()
        self._month, self._used = self._load()
        self._saved_at = -math.inf
        self._dirty = False

    def used_bytes(self) -> int:
        with self._lock:
            return self._current()

    def fits(self, nbytes: int) -> bool:
        """Whether `nbytes` more stay within this month's budget."""
        with self._lock:
            return self.limit_bytes is None or self._current() + nbytes <= self.limit_bytes

    def add(self, nbytes: int) -> None:
        """Count `nbytes` that arrived; saved at once unless saved less than a second ago."""
        with self._lock:
            self._used = self._current() + nbytes
            self._dirty = True
            if time.monotonic() - self._saved_at >= SAVE_EVERY_S:
                self._save()

    def flush(self) -> None:
        """Save what was counted since the last save (a download ended)."""
        with self._lock:
            if self._dirty:
                self._save()

    def reload(self) -> None:
        """Read the count from the file again (another budget object saved it)."""
        with self._lock:
            self._month, self._used = self._load()
            self._dirty = False

    def resets_at(self) -> float:
        """When the next month starts, local time (epoch seconds)."""
        local = time.localtime(self._clock())
        year, month = (local.tm_year + 1, 1) if local.tm_mon == 12 else (local.tm_year, local.tm_mon + 1)
        return time.mktime((year, month, 1, 0, 0, 0, 0, 0, -1))

    def until_words(self) -> str:
        """ "until 1 January": when a download held by the budget may go on."""
        return f"until 1 {MONTHS[time.localtime(self.resets_at()).tm_mon - 1]}"

    def _current(self) -> int:
        """This month's count (a new month starts at 0); call with the lock held."""
        month = _month_of(self._clock())
        if month != self._month:
            self._month, self._used, self._dirty = month, 0, True
        return self._used

    def _load(self) -> tuple[str, int]:
        month = _month_of(self._clock())
        try:
            data = json.loads(read_private_text(self.path))
        except FileNotFoundError:
            return month, 0
        except (OSError, ValueError) as exc:
            log.warning("the monthly download count in %s could not be read (%s); counting from 0", self.path, exc)
            return month, 0
        used = data.get("bytes") if isinstance(data, dict) else None
        if not isinstance(used, int) or isinstance(used, bool) or used < 0 or data.get("month") != month:
            return month, 0  # another month's count, or not ours
        return month, used

    def _save(self) -> None:
        try:
            write_private_text(self.path, json.dumps({"month": self._month, "bytes": self._used}))
        except OSError as exc:
            log.warning("the monthly download count could not be saved to %s: %s", self.path, exc)
        self._saved_at = time.monotonic()
        self._dirty = False


@dataclass
class _Chunk:
    """One `take`: its bytes are counted (budget) and paid for (pacing) once, however many times it waits."""

    nbytes: int
    counted: bool = False
    paced: bool = False
    held: bool = False


class TransferControl:
    """The holds, the limit, the budget and the cancel every download obeys; safe from any thread."""

    def __init__(self, *, limit_mib_s: float | None = None, budget: MonthlyBudget | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._changed = threading.Condition()
        self._clock = clock
        self._rate = None if limit_mib_s is None else limit_mib_s * MIB
        self._budget = budget
        self._holds: dict[DownloadHold, str | None] = {}
        self._paid_until = 0.0  # when the bytes taken so far are paid for at the limit
        self._active = 0
        self._cancelled = False
        self.waits = 0  # times a download waited on a hold: an attempt cut while held is no failure

    def set_limit(self, mib_s: float | None) -> None:
        with self._changed:
            self._rate = None if mib_s is None else mib_s * MIB
            self._paid_until = self._clock()
            self._changed.notify_all()

    def set_budget(self, budget: MonthlyBudget | None) -> None:
        """A new budget (the limit changed in Settings); the old one's count is saved first and the
        new one reads it again, so it goes on from it."""
        with self._changed:
            if self._budget is not None and budget is not self._budget:
                self._budget.flush()
                if budget is not None:
                    budget.reload()
            self._budget = budget
            self._holds.pop("budget", None)
            self._changed.notify_all()

    def hold(self, why: DownloadHold, detail: str | None = None) -> None:
        """Downloads wait (reading nothing) until `release(why)`."""
        with self._changed:
            self._holds[why] = detail

    def release(self, why: DownloadHold) -> None:
        with self._changed:
            self._holds.pop(why, None)
            self._changed.notify_all()

    def cancel(self) -> None:
        """The downloads running now raise `DownloadCancelled`; one started later is not affected."""
        with self._changed:
            self._cancelled = self._active > 0
            self._changed.notify_all()

    def held(self) -> tuple[DownloadHold, str | None] | None:
        """Why downloads wait now (the first hold in `HOLD_ORDER`), for the snapshot; None = they move."""
        with self._changed:
            return self._first_hold()

    @contextmanager
    def transfer(self) -> Iterator[None]:
        """One download's lifetime: a cancel reaches it; at its end the budget is saved."""
        with self._changed:
            self._active += 1
        try:
            yield
        finally:
            with self._changed:
                self._active -= 1
                if self._active == 0:
                    self._cancelled = False
                    self._holds.pop("budget", None)  # the budget holds a download, not the node
                budget = self._budget
            if budget is not None:
                budget.flush()

    def check_cancelled(self) -> None:
        with self._changed:
            if self._cancelled:
                raise DownloadCancelled()

    def take(self, nbytes: int, *, stop: threading.Event | None = None) -> None:
        """`nbytes` arrived: count them, wait out holds (and a budget used up), pace to the limit (blocking).
        `stop` set (the caller gave up) ends a wait with `DownloadCancelled`."""
        chunk = _Chunk(nbytes)
        while (wait_s := self._step(chunk)) > 0:
            self._block(wait_s, stop)

    async def take_async(self, nbytes: int, on_wait: Callable[[], None] | None = None) -> None:
        """`take` on the event loop; `on_wait` is called while a hold keeps it waiting (to publish why)."""
        chunk = _Chunk(nbytes)
        while (wait_s := self._step(chunk)) > 0:
            if chunk.held and not chunk.paced and on_wait is not None:
                on_wait()
            await asyncio.sleep(min(wait_s, POLL_S))

    def wait_until_free(self, nbytes: int, *, stop: threading.Event | None = None) -> None:
        """Before a transfer of `nbytes` starts: wait while held or while they would pass the budget
        (blocking). `BudgetExceeded` when they are more than the whole budget."""
        while not self.free_for(nbytes):
            self._block(POLL_S, stop)

    async def wait_until_free_async(self, nbytes: int, on_wait: Callable[[], None] | None = None) -> None:
        """`wait_until_free` on the event loop."""
        while not self.free_for(nbytes):
            if on_wait is not None:
                on_wait()
            await asyncio.sleep(POLL_S)

    def _block(self, wait_s: float, stop: threading.Event | None) -> None:
        if stop is not None and stop.is_set():
            raise DownloadCancelled()
        with self._changed:
            self._changed.wait(min(wait_s, POLL_S))

    def free_for(self, nbytes: int) -> bool:
        """Whether a transfer of `nbytes` may go now: nothing holds it and they fit the budget."""
        with self._changed:
            if self._cancelled:
                raise DownloadCancelled()
            fits = self._budget_allows(nbytes)  # first: it lifts its own hold once the bytes fit
            return fits and self._first_hold() is None

    def _step(self, chunk: _Chunk) -> float:
        """Seconds `chunk` must still wait (0: done): it counts against the budget at once (it arrived),
        then waits out holds (and a budget used up), then is paid for at the limit."""
        with self._changed:
            if self._cancelled:
                raise DownloadCancelled()
            if not chunk.counted:  # the bytes are here: they count, whatever happens next
                chunk.counted = True
                if self._budget is not None:
                    self._budget.add(chunk.nbytes)
            if not chunk.paced:
                fits = self._budget_allows(0)  # first: it lifts its own hold once the month turns
                if not fits or self._first_hold() is not None:
                    if not chunk.held:
                        chunk.held = True
                        self.waits += 1
                    return POLL_S
                chunk.paced = True
                if self._rate is not None:
                    behind = self._clock() - self._paid_until  # a late wake-up is made up; a pause earns nothing
                    self._paid_until = (self._paid_until if behind < CATCH_UP_S else self._clock()) + (
                        chunk.nbytes / self._rate)
            owed = self._paid_until - self._clock() if self._rate is not None else 0.0
            return owed if owed >= MIN_SLEEP_S else 0.0  # shorter debts add up until one is worth a sleep

    def _budget_allows(self, nbytes: int) -> bool:
        """Whether `nbytes` fit this month; if not, the "budget" hold says until when. Lock held."""
        budget = self._budget
        if budget is None or budget.limit_bytes is None:
            return True
        if nbytes > budget.limit_bytes:
            raise BudgetExceeded(nbytes, budget.limit_bytes)
        if budget.fits(nbytes):
            self._holds.pop("budget", None)
            return True
        self._holds["budget"] = budget.until_words()
        return False

    def _first_hold(self) -> tuple[DownloadHold, str | None] | None:
        for why in HOLD_ORDER:
            if why in self._holds:
                return why, self._holds[why]
        return None
