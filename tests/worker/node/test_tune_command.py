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
from worker.node.tune_command import TuneInputError, assignment, shown, tune_spec
from worker.node.tuner import TuneReport, TunerSettings

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


@pytest.mark.parametrize(("space", "reason"), [
    ("{\"-np\": ", "--space is not JSON"),
    ("[1, 2]", "--space must be a JSON object"),
    ("[" * 100_000, "--space is over"),
    ('{"-np": {"min": 1, "max": 8, "step": 2}}', "invalid tune block: space.-np"),
    ('{"-np": {"min": "1"}}', "invalid tune block: space.-np.min"),
    (json.dumps({f"--flag-{i}": {"values": [1]} for i in range(200)}), "the tune block's space has more than"),
])
def test_a_bad_space_exits_2_with_the_reason_before_anything_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                   space: str, reason: str) -> None:
    code = main(["tune", "--data-dir", str(tmp_path / "data"), "--model", model(tmp_path), "--space", space])
    assert code == 2 and reason in json.loads(capsys.readouterr().out)["error"]
    assert not (tmp_path / "data").exists()


def test_a_budget_out_of_the_contracts_bounds_is_refused_as_a_coordinators_would_be(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["tune", "--data-dir", str(tmp_path / "data"), "--model", model(tmp_path), "--minutes", "0"])
    assert code == 2 and "budget.max_minutes" in json.loads(capsys.readouterr().out)["error"]
    assert not (tmp_path / "data").exists()


def test_the_space_is_the_contracts_tune_space() -> None:
    spec = tune_spec(5, 3, '{"-np": {"min": 1, "max": 8}, "-b": {"values": [1024, 4096]}}')
    assert spec.budget == protocol.TuneBudget(max_minutes=5, max_trials=3)
    assert spec.space == {"-np": protocol.SpaceEntry(min=1, max=8), "-b": protocol.SpaceEntry(values=(1024, 4096))}
    assert tune_spec(5, 3, None).space == {}


def test_a_longer_budget_measures_more_and_a_shorter_one_less() -> None:
    """The defaults at 15 minutes; 5 buys cheaper trials (still three starts of each config in the
    re-measure), 60 more pairs and blocks and longer runs."""
    short, usual, long = (TunerSettings.for_budget(m) for m in (5, 15, 60))
    assert usual == TunerSettings()
    assert short.repeats < usual.repeats and short.pairs < usual.pairs and short.run_s < usual.run_s
    assert long.pairs > usual.pairs and long.blocks > usual.blocks and long.run_s > usual.run_s
    assert all(s.blocks >= 3 and s.pairs >= s.blocks for s in (TunerSettings.for_budget(m) for m in (0.1, 1, 5, 24 * 60)))
    assert TunerSettings.for_budget(24 * 60).pairs <= 24 and TunerSettings.for_budget(24 * 60).run_s <= 6
