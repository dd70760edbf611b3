"""Atomic writes on a machine where another program briefly holds the file open (Windows: an
antivirus scan, the indexer, `gpu-provider status` reading it): the replace is tried again."""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from worker.system import config
from worker.system.config import Paths, State, load_state, save_state, write_private_text


class WindowsHold(OSError):
    """What Python raises on Windows for a file held open: an OSError with a `winerror`."""

    def __init__(self, winerror: int) -> None:
        super().__init__(errno.EINVAL, "The process cannot access the file because it is being used by another process")
        self.winerror = winerror


def held_for(monkeypatch: pytest.MonkeyPatch, refusals: int,
             refusal: Callable[[], OSError] = lambda: PermissionError(errno.EACCES, "Access is denied")) -> list[float]:
    """`os.replace` refused `refusals` times (as a held file is refused), then the real one;
    returns when each try came."""
    real = os.replace
    tries: list[float] = []

    def replace(source: str, target: str) -> None:
        tries.append(time.monotonic())
        if len(tries) <= refusals:
            raise refusal()
        real(source, target)

    monkeypatch.setattr(os, "replace", replace)
    return tries


@pytest.mark.parametrize("refusal", [lambda: PermissionError(errno.EACCES, "Access is denied"),
                                     lambda: WindowsHold(32), lambda: WindowsHold(33), lambda: WindowsHold(5)])
def test_a_file_held_for_a_moment_is_still_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    refusal: Callable[[], OSError]) -> None:
    target = tmp_path / "status.json"
    target.write_text("old", encoding="utf-8")
    tries = held_for(monkeypatch, 4, refusal)
    write_private_text(target, "new")
    assert target.read_text(encoding="utf-8") == "new"
    assert len(tries) == 5 and tries[-1] - tries[0] < 1.0
    assert not list(tmp_path.glob("*.tmp"))


def test_state_and_settings_writes_go_through_the_retry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = Paths.under(tmp_path).ensure()
    tries = held_for(monkeypatch, 2)
    save_state(paths, State(node_id="n-1", paused=True))
    assert load_state(paths).paused and len(tries) == 3
    tries.clear()
    config.save_settings(paths, config.Settings(currency="EUR"))
    assert config.load_settings(paths).currency == "EUR" and len(tries) == 3


def test_a_file_held_for_good_gives_a_clear_error_within_about_a_second(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "status.json"
    target.write_text("old", encoding="utf-8")
    tries = held_for(monkeypatch, 1_000)
    with pytest.raises(OSError, match="another program keeps .*status.json open") as raised:
        write_private_text(target, "new")
    assert isinstance(raised.value.__cause__, PermissionError)
    assert len(tries) == len(config.REPLACE_WAITS_S) + 1 and tries[-1] - tries[0] < 1.5
    assert target.read_text(encoding="utf-8") == "old" and not list(tmp_path.glob("*.tmp"))


def test_any_other_failure_is_not_tried_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tries = held_for(monkeypatch, 1_000, lambda: OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(OSError, match="No space left"):
        write_private_text(tmp_path / "state.json", "{}")
    assert len(tries) == 1
