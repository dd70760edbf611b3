"""Auto-tune in the node, pure: which engine a plan tunes (or why not), what blocks it now, and the
tuned arguments laid after the tier, checked again."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import pytest

from tests.worker.engines.test_vllm_cpu import cpu_machine
from worker.contract import protocol
from worker.contract.events import TuningSnapshot
from worker.node import tuning
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
    (None, False), (Battery(80, 3600, True), False), (Battery(80, 3600, None), False), (Battery(80, 3600, False), True)])
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
