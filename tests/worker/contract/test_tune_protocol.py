"""The contract's "Tuning (optional)": a `tune` block that never fails an assignment, the `tune`
message, `status.tuning`, an engine's `tuned`, and `tune.report` within 64 KiB."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from worker.contract import protocol

ENGINES = ("vllm", "llamacpp")
CONTRACT_TUNE: dict[str, Any] = {  # the contract's own example
    "enabled": True, "when": ["on_assign", "idle", "on_request"],
    "budget": {"max_minutes": 15, "max_trials": 12},
    "min_gain_pct": 3,
    "objective": {"ladder_max": 16, "per_request_floor_tok_s": 20, "ttft_p90_ceiling_ms": 2000},
    "space": {"--max-num-seqs": {"min": 16, "max": 128},
              "--max-num-batched-tokens": {"values": [2048, 4096, 8192]},
              "--enforce-eager": {"values": ["off"]}},
    "seeds": [["--no-enforce-eager", "--max-num-seqs", "64"]],
}


def assign(tune: Any) -> protocol.Assign:
    frame = {"type": "assign", "assignment_id": "a-17",
             "model": {"name": "m", "vllm": {"source": "org/m", "weights_mib": 1000, "tune": tune}}}
    message = protocol.parse_from_coordinator(json.dumps(frame), engine_names=ENGINES)
    assert isinstance(message, protocol.Assign)
    return message


def block_tune(tune: Any) -> Any:
    block = assign(tune).model.for_engine("vllm")
    assert block is not None
    return block.tune


def test_the_contracts_example_parses() -> None:
    spec = protocol.parse_tune(block_tune(CONTRACT_TUNE))
    assert isinstance(spec, protocol.TuneSpec)
    assert spec.when == ("on_assign", "idle", "on_request") and spec.budget.max_trials == 12
    assert spec.objective is not None and spec.objective.ttft_p90_ceiling_ms == 2000
    assert spec.space["--max-num-batched-tokens"].values == (2048, 4096, 8192)
    assert spec.space["--max-num-seqs"].min == 16 and spec.seeds == (("--no-enforce-eager", "--max-num-seqs", "64"),)


def test_no_tune_block_is_no_tuning() -> None:
    assert protocol.parse_tune(block_tune(None)) is None


@pytest.mark.parametrize(("tune", "why"), [
    ("yes", "not a JSON object"),
    ([1, 2], "not a JSON object"),
    ({"when": ["sometimes"]}, "when.0"),
    ({"budget": {"max_trials": 0}}, "budget.max_trials"),
    ({"min_gain_pct": -1}, "min_gain_pct"),
    ({"space": {f"--flag-{i}": {"min": 1} for i in range(33)}}, "more than 32 keys"),
    ({"space": {"--max-num-seqs": {"values": list(range(65))}}}, "values"),
    ({"space": {"--max-num-seqs": {"min": 9, "max": 8}}}, "min is above max"),
    ({"space": {"--max-num-seqs": {"min": 1, "values": [2]}}}, "either min/max or values"),
    ({"space": {"--max-num-seqs": {}}}, "either min/max or values"),
    ({"space": {"--max-num-seqs": {"values": [True]}}}, "values.0"),
    ({"space": {"--max-num-seqs": {"min": 1.5}}}, "min"),
    ({"space": {"--max-num-seqs": {"step": 2}}}, "step"),
    ({"space": {"x" * 257: {"min": 1}}}, "space"),
    ({"seeds": [["--max-num-seqs", "8"]] * 17}, "more than 16 lists"),
    ({"seeds": [["--enforce-eager"] * 65]}, "more than 64 arguments"),
    ({"seeds": [[1, 2]]}, "seeds.0.0"),
])
def test_a_bad_tune_block_refuses_the_tuning_and_the_assignment_stands(tune: Any, why: str) -> None:
    message = assign(tune)  # parsed: the assignment serves untuned
    assert message.assignment_id == "a-17"
    refused = protocol.parse_tune(block_tune(tune))
    assert isinstance(refused, protocol.TuneRefused)
    assert why in refused.reason and len(refused.reason) < 400


def test_a_huge_space_is_refused_by_its_count_before_anything_walks_it() -> None:
    values = {"values": list(range(64))}
    tune = {"space": {f"--f{i}": values for i in range(200_000)}}
    started = time.perf_counter()
    refused = protocol.parse_tune(tune)
    assert isinstance(refused, protocol.TuneRefused) and "more than 32 keys" in refused.reason
    assert time.perf_counter() - started < 0.5


def test_autotune_is_a_welcome_feature() -> None:
    frame = json.dumps({"type": "welcome", "node_id": "n1", "features": ["batch", protocol.AUTOTUNE_FEATURE]})
    welcome = protocol.parse_from_coordinator(frame, engine_names=ENGINES)
    assert isinstance(welcome, protocol.Welcome) and "autotune" in welcome.features


@pytest.mark.parametrize("action", ["start", "cancel", "forget"])
def test_the_tune_message(action: str) -> None:
    frame = json.dumps({"type": "tune", "assignment_id": "a-17", "action": action})
    message = protocol.parse_from_coordinator(frame, engine_names=ENGINES)
    assert message == protocol.Tune(assignment_id="a-17", action=action)  # type: ignore[arg-type]


def test_a_tune_message_with_an_unknown_action_is_a_bad_message() -> None:
    with pytest.raises(protocol.BadMessage, match="action") as caught:
        protocol.parse_from_coordinator('{"type":"tune","assignment_id":"a-17","action":"restart"}',
                                        engine_names=ENGINES)
    assert caught.value.ref == "a-17"


def test_status_carries_tuning_and_each_engines_tuned_arguments() -> None:
    status = protocol.Status(
        state="ready", assignment_id="a-17",
        engines=[protocol.EngineStatus(
            engine_id="e0", gpu_indices=[0], layout="single", argv=["vllm"], state="ready",
            tuned=protocol.Tuned(args=["--max-num-seqs", "64"], gain_pct=7.4, noise_pct=1.1))],
        tuning=protocol.TuningStatus(state="running", trial=4, trials_max=12, elapsed_s=402, best_gain_pct=6.1))
    data = json.loads(protocol.encode(status))
    assert data["tuning"] == {"state": "running", "trial": 4, "trials_max": 12, "elapsed_s": 402.0,
                              "best_gain_pct": 6.1, "refused": None}
    assert data["engines"][0]["tuned"] == {"args": ["--max-num-seqs", "64"], "gain_pct": 7.4, "noise_pct": 1.1}
    assert protocol.parse_from_node(protocol.encode(status)) == status


def test_a_refused_tuning_says_why_in_status() -> None:
    tuning = protocol.TuningStatus(state="refused", refused=protocol.TuneRefusal(reason="'-c' is never tuned"))
    assert json.loads(protocol.encode(tuning))["refused"] == {"reason": "'-c' is never tuned"}


def level(concurrency: int) -> protocol.TuneLevel:
    return protocol.TuneLevel(concurrency=concurrency, aggregate_tok_s=812.5, per_request_tok_s=50.8,
                              ttft_p90_ms=412.0, failed=0)


def report(trials: int, levels: int = 5) -> protocol.TuneReport:
    ladder = [level(2**i) for i in range(levels)]
    return protocol.TuneReport(
        assignment_id="a-17", engine_id="e0", outcome="adopted", elapsed_s=290.0,
        baseline=protocol.TuneFigures(args=["-np", "1"], levels=ladder),
        chosen=protocol.TuneFigures(args=["-np", "4", "-c", "16384"], levels=ladder, gain_pct=41.0, noise_pct=2.2),
        trials=[protocol.TuneTrial(args=["-np", str(i), "-c", str(4096 * i)], levels=ladder, lost="gate")
                for i in range(trials)])


def test_a_report_round_trips_from_the_node() -> None:
    sent = report(3)
    assert protocol.parse_from_node(protocol.encode(sent)) == sent


def test_a_report_that_fits_is_sent_whole() -> None:
    small = report(3)
    assert small.fitted() == small


def test_a_long_report_is_cut_to_64_kib_keeping_every_trials_arguments_and_reason_first() -> None:
    long = report(200, levels=10)
    assert len(protocol.encode(long).encode()) > protocol.MAX_TUNE_REPORT_BYTES
    fitted = long.fitted()
    assert len(protocol.encode(fitted).encode()) <= protocol.MAX_TUNE_REPORT_BYTES
    assert [t.args for t in fitted.trials] == [t.args for t in long.trials]
    assert all(t.lost == "gate" for t in fitted.trials)
    assert fitted.trials[0].levels == long.trials[0].levels and fitted.trials[-1].levels == []
    assert fitted.baseline == long.baseline and fitted.chosen == long.chosen


def test_a_report_too_long_even_without_figures_drops_its_last_trials() -> None:
    huge = report(3000, levels=1)
    fitted = huge.fitted()
    assert len(protocol.encode(fitted).encode()) <= protocol.MAX_TUNE_REPORT_BYTES
    assert 0 < len(fitted.trials) < 3000 and fitted.trials[0] == huge.trials[0].model_copy(update={"levels": []})
