"""`gpu-provider tune`'s edges: the assignment it tunes (local mode's, with `--base-args` alone as
the baseline), what it refuses before anything starts, and the report it prints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from worker.contract import protocol
from worker.hardware.model import Machine
from worker.measure.load import LevelFigures, Measurement
from worker.measure.tuned import TrialRecord
from worker.node.cli import main
from worker.node.tune_command import TuneInputError, assignment, shown
from worker.node.tuner import TuneReport

CPU = Machine(os="linux", runtime="cpu", arch="x86_64", cpu_model="EPYC", cpu_cores=2, ram_mib=8192)
SPEC = protocol.TuneSpec(budget=protocol.TuneBudget(max_minutes=5, max_trials=3))
LEVEL = LevelFigures(4, 95.2, 40.1, 300.0, 0, 30.0)


def model(tmp_path: Path) -> str:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(1024))
    return str(path)


def test_base_args_are_the_whole_baseline(tmp_path: Path) -> None:
    assign = assignment(CPU, model(tmp_path), None, "-np 1 -c '4096'", SPEC)
    (name, block), = (assign.model.__pydantic_extra__ or {}).items()
    assert name == "llamacpp" and block.base_args == ["-np", "1", "-c", "4096"] and block.tiers == {}
    assert protocol.parse_tune(block.tune) == SPEC


def test_without_base_args_local_defaults_and_tiers_stay(tmp_path: Path) -> None:
    (_, block), = (assignment(CPU, model(tmp_path), None, None, SPEC).model.__pydantic_extra__ or {}).items()
    assert block.base_args == ["--ctx-size", "4096"] and block.tiers


def test_an_engine_this_machine_does_not_run_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TuneInputError, match="this machine runs"):
        assignment(CPU, model(tmp_path), "sglang", None, SPEC)
    with pytest.raises(TuneInputError, match="this machine runs"):
        assignment(CPU, model(tmp_path), "nonsense", None, SPEC)


def test_a_bad_engine_bin_is_an_error_before_anything_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["tune", "--data-dir", str(tmp_path), "--model", model(tmp_path), "--engine-bin", "llamacpp"])
    assert code == 2 and "expected NAME=PATH" in json.loads(capsys.readouterr().out)["error"]
    assert not (tmp_path / "data").exists() or not any((tmp_path / "data").iterdir())


def test_the_report_has_the_wire_shape_with_gain_time_and_every_trial() -> None:
    report = TuneReport("adopted", Measurement((LEVEL,), ("Mercury, Venus",), 4096), ("-np", "4", "-c", "16384"), 41.27, 3.1,
                        95.04, (TrialRecord((), "baseline", (LEVEL,)), TrialRecord(("-np", "2"), "lost:gate", (LEVEL,)),
                                TrialRecord(("-np", "4", "-c", "16384"), "adopted", (LEVEL,)),
                                TrialRecord(("-np", "8"), "oom_start", ())))
    out = shown("local-1", "cpu0", ("-np", "1"), report)
    assert out["type"] == "tune.report" and out["outcome"] == "adopted" and out["engine_id"] == "cpu0"
    assert out["gain_pct"] == 41.27 and out["noise_pct"] == 3.1 and out["elapsed_s"] == 95.0
    assert out["chosen"]["args"] == ["-np", "4", "-c", "16384"] and out["baseline"]["args"] == ["-np", "1"]
    assert [(t["args"], t["result"]) for t in out["trials"]] == [
        ([], "baseline"), (["-np", "2"], "lost:gate"), (["-np", "4", "-c", "16384"], "adopted"), (["-np", "8"], "oom_start")]
    assert out["trials"][1]["levels"][0]["aggregate_tok_s"] == 95.2
    assert "Mercury" not in json.dumps(out)  # no answers in a report
