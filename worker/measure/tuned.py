"""What tuning found, kept in the data folder (SQLite, this user's only): the adopted arguments per
machine, model, engine version and baseline arguments (a change of any of them is another
tuning), and a journal of each finished trial, so that a tuning a game or a pause interrupted
resumes where it stopped instead of measuring the same candidates again.

A kept result holds the figure it was adopted at, so a start can measure again and drop it where
it regressed (`forget`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sqlite3
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.hardware.model import Machine
from worker.measure.load import LevelFigures
from worker.system.config import private_dir, private_opener

FILE_NAME = "tuned.sqlite"
SCHEMA = """
CREATE TABLE IF NOT EXISTS kept (key TEXT PRIMARY KEY, args TEXT NOT NULL, gain_pct REAL NOT NULL,
    noise_pct REAL NOT NULL, tok_s REAL NOT NULL, at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS journal (key TEXT NOT NULL, seq INTEGER NOT NULL, args TEXT NOT NULL,
    result TEXT NOT NULL, levels TEXT NOT NULL, PRIMARY KEY (key, seq));
"""


@dataclass(frozen=True)
class TuneKey:
    """What a tuning's result holds for: a change of any part is another tuning."""

    machine: str
    model: str
    engine: str
    version: str
    baseline: tuple[str, ...]

    def text(self) -> str:
        return json.dumps([self.machine, self.model, self.engine, self.version, list(self.baseline)])


@dataclass(frozen=True)
class TrialRecord:
    """One trial: its tuned arguments, how it ended ("baseline", "adopted", "lost:<reason>",
    "oom_start"), and its figures per level (none for a start that failed)."""

    args: tuple[str, ...]
    result: str
    levels: tuple[LevelFigures, ...]


@dataclass(frozen=True)
class Kept:
    args: tuple[str, ...]
    gain_pct: float
    noise_pct: float
    tok_s: float  # the aggregate it was adopted at, for the check at each start


def machine_key(machine: Machine) -> str:
    """This machine as tuning tells machines apart: its processors, memory, cards and driver."""
    parts = [machine.os, machine.runtime, machine.cpu_model, str(machine.cpu_cores), str(machine.ram_mib),
             *(f"{g.name}/{g.memory_total_mib}" for g in machine.gpus), machine.driver_version or ""]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


class TunedStore:
    """The kept results and the journal, in `folder`/tuned.sqlite."""

    def __init__(self, folder: Path) -> None:
        private_dir(folder)
        self._path = folder / FILE_NAME
        with open(self._path, "ab", opener=private_opener):  # made 0600 before SQLite opens it
            pass
        with self._db() as db:
            db.executescript(SCHEMA)

    @contextlib.contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self._path, timeout=5.0)
        try:
            with db:
                yield db
        finally:
            db.close()

    def kept(self, key: TuneKey) -> Kept | None:
        with self._db() as db:
            row = db.execute("SELECT args, gain_pct, noise_pct, tok_s FROM kept WHERE key = ?", (key.text(),)).fetchone()
        return None if row is None else Kept(tuple(json.loads(row[0])), row[1], row[2], row[3])

    def keep(self, key: TuneKey, kept: Kept) -> None:
        with self._db() as db:
            db.execute("INSERT OR REPLACE INTO kept VALUES (?, ?, ?, ?, ?, ?)",
                       (key.text(), json.dumps(list(kept.args)), kept.gain_pct, kept.noise_pct, kept.tok_s, time.time()))

    def forget(self, key: TuneKey) -> None:
        """Drops the kept result and the journal (the coordinator's `forget`, a regression)."""
        with self._db() as db:
            db.execute("DELETE FROM kept WHERE key = ?", (key.text(),))
            db.execute("DELETE FROM journal WHERE key = ?", (key.text(),))

    def journal(self, key: TuneKey) -> list[TrialRecord]:
        """The trials an unfinished tuning of `key` ended, in order."""
        with self._db() as db:
            rows = db.execute("SELECT args, result, levels FROM journal WHERE key = ? ORDER BY seq",
                              (key.text(),)).fetchall()
        return [TrialRecord(tuple(json.loads(a)), r, tuple(_level(lv) for lv in json.loads(ls))) for a, r, ls in rows]

    def note(self, key: TuneKey, record: TrialRecord) -> None:
        with self._db() as db:
            seq = db.execute("SELECT COUNT(*) FROM journal WHERE key = ?", (key.text(),)).fetchone()[0]
            db.execute("INSERT INTO journal VALUES (?, ?, ?, ?, ?)",
                       (key.text(), seq, json.dumps(list(record.args)), record.result,
                        json.dumps([_row(lv) for lv in record.levels])))

    def finish(self, key: TuneKey) -> None:
        """A tuning ran to its end: its journal is done with."""
        with self._db() as db:
            db.execute("DELETE FROM journal WHERE key = ?", (key.text(),))


def _row(level: LevelFigures) -> list[float]:
    return [level.concurrency, level.aggregate_tok_s, level.per_request_tok_s, level.ttft_p90_ms, level.failed]


def _level(row: Sequence[Any]) -> LevelFigures:
    return LevelFigures(int(row[0]), float(row[1]), float(row[2]), float(row[3]), int(row[4]))

