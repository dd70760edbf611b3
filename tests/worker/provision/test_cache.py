from __future__ import annotations

from pathlib import Path

from worker.provision.cache import ModelCache


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 1
        return self.now


def cached(cache: ModelCache, key: str, n_bytes: int) -> Path:
    path = cache.root / key
    path.write_bytes(b"x" * n_bytes)
    cache.put(key, path)
    return path


def test_evicts_least_recently_used_until_under_the_limit(tmp_path: Path) -> None:
    cache = ModelCache(tmp_path, clock=Clock())
    old, middle, new = (cached(cache, key, 100) for key in ("old", "middle", "new"))
    cache.touch("old")

    removed = cache.evict(200)

    assert removed == [middle]
    assert old.exists() and new.exists() and not middle.exists()
    assert cache.get("middle") is None
    assert cache.total_bytes() == 200


def test_never_evicts_a_model_in_use_even_over_the_limit(tmp_path: Path) -> None:
    cache = ModelCache(tmp_path, clock=Clock())
    folder = tmp_path / "repo"
    (folder / "snapshots" / "abc").mkdir(parents=True)
    (folder / "snapshots" / "abc" / "w.safetensors").write_bytes(b"x" * 300)
    cache.put("repo", folder)
    later = cached(cache, "later", 100)

    removed = cache.evict(50, in_use=[folder / "snapshots" / "abc"])

    assert removed == [later]
    assert folder.exists()


def test_index_survives_a_new_instance_and_drops_vanished_files(tmp_path: Path) -> None:
    cached(ModelCache(tmp_path), "kept", 10).unlink()
    cached(ModelCache(tmp_path), "there", 10)

    reopened = ModelCache(tmp_path)

    assert reopened.get("kept") is None
    entry = reopened.get("there")
    assert entry is not None and entry.size_bytes == 10


def test_unreadable_index_starts_over_without_failing(tmp_path: Path) -> None:
    (tmp_path / "index.json").write_text("{not json")

    assert ModelCache(tmp_path).get("anything") is None
