"""The model cache's index: what is cached, how big, when last used; least-recently-used eviction.

A small JSON file in the cache folder, guarded by a file lock so two app processes never
interleave their updates. Every method blocks (disk walks, the lock): call them through
`asyncio.to_thread`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from filelock import FileLock

log = logging.getLogger(__name__)

INDEX_NAME = "index.json"


@dataclass(frozen=True)
class CacheEntry:
    key: str
    path: str  # relative to the cache folder
    size_bytes: int
    last_used: float
    sha256: str | None = None


def tree_size(path: Path) -> int:
    """Bytes of the regular files under `path` (symlinks not followed, so nothing counts twice)."""
    if path.is_file():
        return path.stat().st_size
    total = 0
    for folder, _, names in os.walk(path):
        for name in names:
            child = Path(folder) / name
            if not child.is_symlink():
                total += child.stat().st_size
    return total


class ModelCache:
    def __init__(self, root: Path, *, clock: Callable[[], float] = time.time) -> None:
        self.root = root
        self._clock = clock
        self._index = root / INDEX_NAME
        self._lock = FileLock(str(root / (INDEX_NAME + ".lock")))

    def get(self, key: str) -> CacheEntry | None:
        """The entry for `key`, or None (an entry whose files vanished is dropped)."""
        with self._locked() as entries:
            entry = entries.get(key)
            if entry is not None and not (self.root / entry.path).exists():
                del entries[key]
                return None
            return entry

    def put(self, key: str, path: Path, *, sha256: str | None = None) -> CacheEntry:
        """Record (or refresh) a finished download at `path`, used now."""
        entry = CacheEntry(
            key, path.relative_to(self.root).as_posix(), tree_size(path), self._clock(), sha256
        )
        with self._locked() as entries:
            entries[key] = entry
        return entry

    def touch(self, key: str) -> None:
        with self._locked() as entries:
            if key in entries:
                entries[key] = _replace_used(entries[key], self._clock())

    def total_bytes(self) -> int:
        with self._locked() as entries:
            return sum(e.size_bytes for e in entries.values())

    def evict(self, limit_bytes: int, *, in_use: Collection[Path] = ()) -> list[Path]:
        """Delete least-recently-used models until the cache holds at most `limit_bytes`.

        Models in `in_use` (or holding a path in it) are never removed, even when that leaves
        the cache over its limit.
        """
        removed: list[Path] = []
        with self._locked() as entries:
            total = sum(e.size_bytes for e in entries.values())
            for entry in sorted(entries.values(), key=lambda e: e.last_used):
                if total <= limit_bytes:
                    break
                path = self.root / entry.path
                if _holds_any(path, in_use):
                    continue
                _remove(path)
                del entries[entry.key]
                total -= entry.size_bytes
                removed.append(path)
                log.info("evicted %s (%d bytes) from the model cache", path, entry.size_bytes)
        return removed

    @contextmanager
    def _locked(self) -> Iterator[dict[str, CacheEntry]]:
        """The entries under the file lock; written back only if the block changed them and succeeded."""
        self.root.mkdir(parents=True, exist_ok=True)
        with self._lock:
            entries = _read_index(self._index)
            before = dict(entries)
            yield entries
            if entries != before:
                _write_index(self._index, entries)


def _read_index(path: Path) -> dict[str, CacheEntry]:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        return {key: CacheEntry(**value) for key, value in raw["entries"].items()}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("model cache index %s is unreadable (%s); starting a new one", path, exc)
        return {}


def _write_index(path: Path, entries: dict[str, CacheEntry]) -> None:
    data = {"version": 1, "entries": {key: asdict(entry) for key, entry in entries.items()}}
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(data, out, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _replace_used(entry: CacheEntry, when: float) -> CacheEntry:
    return CacheEntry(entry.key, entry.path, entry.size_bytes, when, entry.sha256)


def _holds_any(path: Path, in_use: Collection[Path]) -> bool:
    return any(p == path or p.is_relative_to(path) for p in in_use)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
