"""Auto-tune in the node, pure: which engine a plan tunes (or why not), what blocks it now, and the
tuned arguments laid after the tier, checked again."""

from __future__ import annotations

import dataclasses
from collections import namedtuple
from typing import Any, Literal

import pytest

from tests.worker.engines.test_vllm_cpu import cpu_machine
from worker.contract import protocol
from worker.contract.events import TuningSnapshot
from worker.measure.load import LevelFigures, Measurement
from worker.measure.tuned import Kept, TrialRecord
from worker.node import tuning
from worker.node.tuner import TuneReport
from worker.plan.planner import Plan, plan
from worker.system.config import Settings

OFFERED = ["batch", protocol.AUTOTUNE_FEATURE]
GOOD = {"when": ["on_assign", "idle"], "budget": {"max_trials": 6}, "space": {"-np": {"min": 1, "max": 8}}}


def planned(tune: Any) -> Plan:
    block = {"source": "/models/tiny.gguf", "weights_mib": 40, "base_args": ["-c", "4096", "-np", "1"], "tune": tune}
    assign = protocol.Assign.model_validate(
        {"type": "assign", "assignment_id": "a-1", "model": {"name": "tiny", "llamacpp": block}})
    result = plan(cpu_machine(), assign, Settings())
    assert isinstance(result, Plan), result
    return result


def test_a_good_block_tunes_the_plans_first_engine_with_its_spec() -> None:
    accepted = planned(GOOD)
    found = tuning.target(accepted, OFFERED, cpu_machine())
    assert isinstance(found, tuning.Target)
    assert found.assignment_id == "a-1" and found.engine_plan == accepted.engines[0]
    assert found.spec.when == ("on_assign", "idle") and found.spec.budget.max_trials == 6


@pytest.mark.parametrize(("tune", "features"), [(GOOD, ["batch"]), (None, OFFERED), ({**GOOD, "enabled": False},
                                                                                     OFFERED)])
def test_nothing_is_tuned_without_the_feature_a_block_or_with_a_disabled_one(tune: Any, features: list[str]) -> None:
    assert tuning.target(planned(tune), features, cpu_machine()) is None


@pytest.mark.parametrize(("tune", "said"), [
    ({"space": {"-c": {"min": 1024, "max": 8192}}}, "-c"),  # context is never tuned
    ({"space": {"--not-a-flag": {"values": ["x"]}}}, "--not-a-flag"),
    ({"when": ["sometimes"]}, "when"),
    (["not", "an", "object"], "not a JSON object"),
])
def test_a_bad_block_refuses_the_tuning_only_and_says_why(tune: Any, said: str) -> None:
    accepted = planned(tune)  # the assignment itself plans
    refused = tuning.target(accepted, OFFERED, cpu_machine())
    assert isinstance(refused, protocol.TuneRefused) and said in refused.reason


def test_blocked_while_paused_outside_serve_hours_or_on_battery() -> None:
    assert tuning.blocked(paused=False, in_serve_hours=True, battery=False) is None
    assert tuning.blocked(paused=True, in_serve_hours=True, battery=False) == "the node is paused"
    assert tuning.blocked(paused=False, in_serve_hours=False, battery=False) == "it is outside serve hours"
    assert tuning.blocked(paused=False, in_serve_hours=True, battery=True) == "the computer runs on battery"


Battery = namedtuple("Battery", "percent secsleft power_plugged")


@pytest.mark.parametrize(("reading", "battery"), [
    (None, False), (Battery(80, 3600, True), False), (Battery(80, 3600, None), False),
    (Battery(80, 3600, False), True)])
def test_on_battery_reads_the_battery_psutil_sees(monkeypatch: pytest.MonkeyPatch, reading: Any, battery: bool) -> None:
    monkeypatch.setattr("psutil.sensors_battery", lambda: reading)
    assert tuning.on_battery() is battery


def test_tuned_arguments_go_after_the_tier_with_the_tier_alone_the_first_fallback() -> None:
    engine_plan = planned(GOOD).engines[0]
    tuned = tuning.with_tuned(engine_plan, ("-np", "4", "-c", "16384"), allow_remote_code=False)
    assert tuned is not None
    assert tuned.args == engine_plan.args + ("-np", "4", "-c", "16384")
    assert tuned.fallbacks[0] == (engine_plan.tier, engine_plan.args)
    assert tuned.fallbacks[1:] == engine_plan.fallbacks


def test_tuned_arguments_the_allowlist_refuses_are_not_used() -> None:
    engine_plan = planned(GOOD).engines[0]
    assert tuning.with_tuned(engine_plan, ("--rpc", "10.0.0.1:50052"), allow_remote_code=False) is None
    assert tuning.with_tuned(engine_plan, ("-np",), allow_remote_code=False) is None


def test_progress_says_the_trial_and_clears_an_earlier_refusal() -> None:
    shown = tuning.progress(TuningSnapshot(state="refused", refused="x"), 4, 12, 402.0)
    assert shown == TuningSnapshot(state="running", trial=4, trials_max=12, elapsed_s=402.0)
    assert shown.progress == "Tuning… (trial 4 of 12)"


def test_tuned_says_the_arguments_in_words_against_the_tier() -> None:
    said = tuning.tuned(("-np", "8", "-c", "32768"), ("-c", "4096", "-np", "1"), 41.56, 1.04)
    assert (said.args, said.gain_pct, said.noise_pct) == (("-np", "8", "-c", "32768"), 41.6, 1.0)
    assert said.words == ("serves 8 requests at once instead of 1",)


def test_an_engine_runs_with_its_tuned_arguments_only_where_its_command_line_has_them_in_order() -> None:
    argv = ("llama-server", "-m", "m.gguf", "-c", "4096", "-np", "1", "-np", "4", "-c", "16384", "--host", "x")
    assert tuning.runs_with(argv, ("-np", "4", "-c", "16384"))
    assert not tuning.runs_with(argv[:7] + argv[11:], ("-np", "4", "-c", "16384"))  # the tier alone: a fallback
    assert not tuning.runs_with(argv, ("-c", "16384", "-np", "4"))
    assert tuning.runs_with(argv, ())


# --- what a search reports ------------------------------------------------------------------------

def level(n: int, tok_s: float, failed: int = 0) -> LevelFigures:
    return LevelFigures(concurrency=n, aggregate_tok_s=tok_s, per_request_tok_s=tok_s / n, ttft_p90_ms=120.04,
                        failed=failed)


BASELINE = Measurement(levels=(level(1, 40.0), level(2, 52.123)), greedy=("the answer",), kv_tokens=4096)
TIER = ("-c", "4096", "-np", "1")


def search(outcome: Literal["adopted", "kept_baseline", "cancelled", "failed"],
           chosen: tuple[str, ...] | None = None) -> TuneReport:
    trials = (TrialRecord((), "baseline", BASELINE.levels),
              TrialRecord(("-np", "2", "-c", "8192"), "adopted" if chosen else "lost:below_threshold",
                          (level(1, 41.0), level(2, 80.0))),
              TrialRecord(("-np", "4", "-c", "16384"), "oom_start", ()),
              TrialRecord(("-t", "2"), "lost:regressed:decode", (level(1, 20.0), level(2, 30.0))))
    gain, noise = (41.7, 1.2) if chosen else (None, None)
    return TuneReport(outcome, BASELINE, chosen, gain, noise, 402.06, trials)


def test_the_report_has_each_trials_arguments_figures_and_why_it_lost() -> None:
    sent = tuning.report_message("a-17", "e0", TIER, search("adopted", ("-np", "2", "-c", "8192")))
    assert (sent.type, sent.assignment_id, sent.engine_id, sent.outcome, sent.elapsed_s) == (
        "tune.report", "a-17", "e0", "adopted", 402.1)
    assert sent.baseline == protocol.TuneFigures(args=list(TIER), levels=[
        protocol.TuneLevel(concurrency=1, aggregate_tok_s=40.0, per_request_tok_s=40.0, ttft_p90_ms=120.0),
        protocol.TuneLevel(concurrency=2, aggregate_tok_s=52.12, per_request_tok_s=26.06, ttft_p90_ms=120.0)])
    assert sent.chosen is not None and sent.chosen.args == ["-np", "2", "-c", "8192"]
    assert (sent.chosen.gain_pct, sent.chosen.noise_pct, len(sent.chosen.levels)) == (41.7, 1.2, 2)
    assert [(t.args, t.lost, len(t.levels)) for t in sent.trials] == [
        (["-np", "2", "-c", "8192"], None, 2), (["-np", "4", "-c", "16384"], "oom_start", 0),
        (["-t", "2"], "regressed:decode", 2)]
    assert "the answer" not in protocol.encode(sent)  # no prompts or answers


def test_a_kept_baseline_reports_no_choice_and_every_trials_reason() -> None:
    sent = tuning.report_message("a-17", "e0", TIER, search("kept_baseline"))
    assert sent.outcome == "kept_baseline" and sent.chosen is None
    assert [t.lost for t in sent.trials] == ["below_threshold", "oom_start", "regressed:decode"]


def test_a_search_that_failed_before_reporting_is_reported_failed() -> None:
    sent = tuning.report_message("a-17", "e0", TIER, None)
    assert (sent.outcome, sent.baseline, sent.trials) == ("failed", None, [])


def test_a_report_of_many_trials_fits_the_contracts_64_kib() -> None:
    many = search("kept_baseline")
    trials = many.trials + tuple(TrialRecord(("--some-long-flag-" + "x" * 200, str(i)), "lost:gate",
                                             tuple(level(2 ** k, 10.0) for k in range(10))) for i in range(256))
    sent = tuning.report_message("a-17", "e0", TIER, dataclasses.replace(many, trials=trials))
    assert len(protocol.encode(sent).encode()) <= protocol.MAX_TUNE_REPORT_BYTES
    assert sent.trials[0].lost == "below_threshold"  # the first trials keep their reasons


def test_the_snapshot_once_a_search_ended() -> None:
    adopted = tuning.ended(search("adopted", ("-np", "2", "-c", "8192")), 12, TIER)
    assert (adopted.state, adopted.trial, adopted.trials_max, adopted.best_gain_pct) == ("done", 3, 12, 41.7)
    assert adopted.chosen is not None and adopted.chosen.words == ("serves 2 requests at once instead of 1",)
    kept = tuning.ended(search("kept_baseline"), 12, TIER)
    assert (kept.state, kept.chosen) == ("done", None)
    assert tuning.ended(search("cancelled"), 12, TIER).state == "cancelled"
    assert tuning.ended(None, 12, TIER) == TuningSnapshot(state="failed", trials_max=12)


def test_a_kept_result_regressed_where_it_no_longer_beats_what_the_tier_served() -> None:
    kept = Kept(("-np", "4"), gain_pct=25.0, noise_pct=2.0, tok_s=125.0)  # the tier served 100
    assert not tuning.regressed(kept, 120.0)
    assert not tuning.regressed(kept, 96.5)  # within twice the spread of the tier's figure
    assert tuning.regressed(kept, 95.0)


def test_tuned_arguments_are_checked_for_the_engine_version_the_plan_runs() -> None:
    assign = protocol.Assign.model_validate({"type": "assign", "assignment_id": "a-1", "model": {
        "name": "tiny", "vllm": {"source": "org/tiny", "weights_mib": 100}}})
    accepted = plan(cpu_machine(), assign, Settings())
    assert isinstance(accepted, Plan), accepted
    engine_plan = accepted.engines[0]
    newer_only = ("--disable-chunked-prefill",)  # vLLM 0.33 and later
    assert tuning.with_tuned(engine_plan, newer_only, allow_remote_code=False, version="0.33.0") is not None
    assert tuning.with_tuned(engine_plan, newer_only, allow_remote_code=False, version="0.32.0") is None


def test_a_plan_made_again_for_the_same_assignment_is_the_same_tuning() -> None:
    assert tuning.same_assignment(planned(GOOD), planned(GOOD))
    assert not tuning.same_assignment(planned({**GOOD, "budget": {"max_trials": 7}}), planned(GOOD))
