"""What tuning keeps: the adopted arguments per machine, model, engine version and baseline, and
the journal an interrupted tuning resumes from; this user's file only."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from worker.hardware.model import Machine
from worker.measure.load import LevelFigures
from worker.measure.tuned import Kept, TrialRecord, TunedStore, TuneKey, machine_key
from worker.system.config import DataFolderUnsafe

KEY = TuneKey("m1", "repo/model", "llamacpp", "b6000", ("-np", "1"))
LEVELS = (LevelFigures(1, 50.0, 50.0, 100.0, 0), LevelFigures(4, 150.5, 40.25, 300.0, 1))


def test_a_kept_result_is_per_key_and_forgotten(tmp_path: Path) -> None:
    store = TunedStore(tmp_path)
    store.keep(KEY, Kept(("-np", "4", "-c", "16384"), 41.0, 3.5, 151.0))
    assert TunedStore(tmp_path).kept(KEY) == Kept(("-np", "4", "-c", "16384"), 41.0, 3.5, 151.0)
    for other in (TuneKey("m2", "repo/model", "llamacpp", "b6000", ("-np", "1")),
                  TuneKey("m1", "repo/model", "llamacpp", "b6001", ("-np", "1")),
                  TuneKey("m1", "repo/model", "llamacpp", "b6000", ("-np", "2"))):
        assert store.kept(other) is None
    store.forget(KEY)
    assert store.kept(KEY) is None


def test_the_journal_keeps_trials_in_order_until_the_tuning_finishes(tmp_path: Path) -> None:
    store = TunedStore(tmp_path)
    trials = [TrialRecord(("-np", "2"), "passed", LEVELS), TrialRecord(("-np", "8"), "oom_start", ()),
              TrialRecord(("-t", "2"), "lost:gate", LEVELS[:1])]
    for trial in trials:
        store.note(KEY, trial)
    assert TunedStore(tmp_path).journal(KEY) == trials
    assert store.journal(TuneKey("m1", "repo/model", "llamacpp", "b6000", ())) == []
    store.finish(KEY)
    assert store.journal(KEY) == []


def test_the_file_is_this_users_alone_and_never_a_link(tmp_path: Path) -> None:
    TunedStore(tmp_path)
    assert stat.S_IMODE((tmp_path / "tuned.sqlite").stat().st_mode) == 0o600
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "target").write_text("")
    (elsewhere / "tuned.sqlite").symlink_to(elsewhere / "target")
    with pytest.raises(DataFolderUnsafe):
        TunedStore(elsewhere)


def test_machines_differ_by_what_changes_speed() -> None:
    a = Machine(os="linux", runtime="cpu", arch="x86_64", cpu_model="EPYC", cpu_cores=2, ram_mib=8192)
    assert machine_key(a) == machine_key(Machine(os="linux", runtime="cpu", arch="x86_64", cpu_model="EPYC",
                                                 cpu_cores=2, ram_mib=8192))
    assert machine_key(a) != machine_key(Machine(os="linux", runtime="cpu", arch="x86_64", cpu_model="EPYC",
                                                 cpu_cores=4, ram_mib=8192))
