"""Auto-tune on the real llama-server (CPU), through the app's supervisor, with a test-made model
big enough that decode is memory-bound (tests/support/tune_gguf.py, 142 MB): from one slot at
four concurrent requests the tuner adopts more slots, `-c` scaled so each request keeps its
context and never more threads than cores; in a space with nothing to gain it keeps the
baseline; a candidate that changes the greedy text is rejected by the gate."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from tests.support.engines import LlamaServer, free_port
from tests.support.tune_gguf import write_tune_gguf
from worker.contract import protocol
from worker.hardware.model import Machine
from worker.measure import gates
from worker.measure.load import Prompt, read_prompts
from worker.measure.tuned import TunedStore, TuneKey
from worker.node.cli import main
from worker.node.tuner import TuneReport, Tuner, TunerSettings
from worker.plan.planner import EnginePlan
from worker.serve.process import StopTiming
from worker.serve.restart_policy import SupervisorTiming
from worker.system.config import Paths

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "tune"
BASELINE = ("-np", "1", "-c", "4096", "-t", "1")  # one thread: two spin-wait for each other on a shared 2-core machine
TIMING = SupervisorTiming(ready_timeout_s=60, poll_s=0.05, request_timeout_s=5.0, probe_timeout_s=20.0,
                          health_interval_s=1.0, output_settle_s=0.5, stop=StopTiming(grace_s=3.0, gone_s=3.0, poll_s=0.02))
# three starts of each config at least: two cannot tell a start that landed well from a gain
SETTINGS = TunerSettings(repeats=2, pairs=6, blocks=3, run_s=1.5)


@pytest.fixture(scope="module")
def tune_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tune_gguf(tmp_path_factory.mktemp("models") / "tune.gguf")


def machine() -> Machine:
    return Machine(os="linux", runtime="cpu", arch="x86_64", cpu_model="test CPU", cpu_cores=os.cpu_count() or 1,
                   ram_mib=8192)


def plan(server: LlamaServer, model: Path, args: tuple[str, ...] = BASELINE) -> EnginePlan:
    return EnginePlan(engine_id="cpu0", engine="llamacpp", gpu_indices=(), layout="single", memory_mib=1024,
                      tier=None, args=args, fallbacks=(), port=free_port(), env={},
                      executable=(str(server.executable),), model=str(model), served_name="tune-llama")


def spec(space: dict[str, object], trials: int) -> protocol.TuneSpec:
    tune = protocol.parse_tune({"budget": {"max_minutes": 5, "max_trials": trials}, "min_gain_pct": 5,
                                "objective": {"ladder_max": 4}, "space": space})
    assert isinstance(tune, protocol.TuneSpec)
    return tune


async def tune(server: LlamaServer, model: Path, tmp_path: Path, space: dict[str, object], trials: int,
               args: tuple[str, ...] = BASELINE) -> tuple[TuneReport, list[tuple[int, int]], TunedStore, TuneKey]:
    paths = Paths.under(tmp_path).ensure()
    store, key = TunedStore(paths.data_dir), TuneKey("this-pc", "tune-llama", "llamacpp", "test", args)
    progress: list[tuple[int, int]] = []
    tuner = Tuner(plan(server, model, args), spec(space, trials), machine(), paths=paths, store=store, key=key,
                  progress=lambda trial, most: progress.append((trial, most)),
                  prompts=read_prompts(FIXTURES / "prompts-bytes.json"), settings=SETTINGS, timing=TIMING,
                  base_env=server.environment())
    return await tuner.run(), progress, store, key


def value(args: tuple[str, ...], flag: str) -> str | None:
    return args[len(args) - 1 - args[::-1].index(flag) + 1] if flag in args else None


async def test_more_slots_adopted_with_context_scaled(llama_server_bin: LlamaServer, tune_gguf: Path,
                                                      tmp_path: Path) -> None:
    report, progress, store, key = await tune(llama_server_bin, tune_gguf, tmp_path,
                                              {"-np": {"min": 1, "max": 8}, "-t": {"min": 1, "max": 64}}, trials=3)
    print(report)
    assert report.outcome == "adopted", report
    chosen = report.chosen
    assert chosen is not None and int(value(chosen, "-np") or 1) > 1
    assert int(value(chosen, "-c") or 0) == 4096 * int(value(chosen, "-np") or 1)  # each request keeps 4,096
    assert report.gain_pct is not None and report.gain_pct >= 5
    for trial in report.trials:
        assert int(value(trial.args, "-t") or 1) <= (os.cpu_count() or 1)
    assert report.trials[0].result == "baseline" and len(report.trials) <= 1 + 3
    assert [r for r in report.trials if r.result == "adopted"][0].args == chosen
    assert progress and progress[0] == (1, 3) and all(most == 3 for _, most in progress)
    kept = store.kept(key)
    assert kept is not None and kept.args == chosen and store.journal(key) == []


async def test_nothing_to_gain_keeps_the_baseline(llama_server_bin: LlamaServer, tune_gguf: Path,
                                                  tmp_path: Path) -> None:
    # prompts are shorter than 512 tokens: a logical batch of 1,024 or 4,096 changes nothing
    report, _, store, key = await tune(llama_server_bin, tune_gguf, tmp_path, {"-b": {"values": [1024, 4096]}},
                                       trials=2)
    print(report)
    assert report.outcome == "kept_baseline", report
    assert report.chosen is None and store.kept(key) is None
    assert [t.result for t in report.trials][0] == "baseline" and len(report.trials) == 3
    assert all(t.result.startswith("lost:") for t in report.trials[1:])


async def test_the_gate_rejects_a_candidate_that_changes_the_text(llama_server_bin: LlamaServer, tmp_path: Path) -> None:
    """A small confident model (output weights scaled up): more slots keep every greedy answer; a
    server-wide repeat penalty (a flag that changes sampling) changes them, and loses with `gate`."""
    model = write_tune_gguf(tmp_path / "confident.gguf", layers=2, embd=128, ff=256, output_scale=1.0)
    baseline_args = ("-np", "1", "-c", "2048", "-t", "1")
    tuner = Tuner(plan(llama_server_bin, model, baseline_args), spec({}, 1), machine(),
                  paths=Paths.under(tmp_path).ensure(), prompts=read_prompts(FIXTURES / "prompts-bytes.json"),
                  settings=SETTINGS, timing=TIMING, base_env=llama_server_bin.environment())
    baseline, _, _ = await tuner.measured((), levels=(1, 2), repeats=1)
    slots, traps, _ = await tuner.measured(("-np", "4", "-c", "8192"), levels=(1, 2), repeats=1)
    penalised, _, _ = await tuner.measured(("--repeat-penalty", "1.5"), levels=(1, 2), repeats=1)
    assert all(len(text) > 10 for text in baseline.greedy)
    assert slots.greedy == baseline.greedy and traps == () and gates.same_answers(baseline, slots)
    assert penalised.greedy != baseline.greedy
    assert gates.check(baseline, penalised, None, ()) == "gate"


async def test_cancel_ends_the_trial_at_once_and_the_next_tuning_resumes(llama_server_bin: LlamaServer, tiny_gguf: Path,
                                                                         tmp_path: Path) -> None:
    """A game or a pause cancels: the running trial's engine stops at once, what finished is in
    the journal, and the next tuning takes those trials from it instead of measuring them again."""
    paths = Paths.under(tmp_path).ensure()
    args = ("-np", "1", "-c", "2048", "-t", "1")
    store, key = TunedStore(paths.data_dir), TuneKey("this-pc", "tiny", "llamacpp", "test", args)
    cancelled_at: list[float] = []

    def make(progress: Callable[[int, int], None]) -> Tuner:
        return Tuner(plan(llama_server_bin, tiny_gguf, args), spec({"-np": {"min": 1, "max": 8}}, 3), machine(),
                     paths=paths, store=store, key=key, progress=progress,
                     prompts=read_prompts(FIXTURES / "prompts-bytes.json"),
                     settings=TunerSettings(repeats=1, pairs=2, blocks=1, run_s=0.5), timing=TIMING,
                     base_env=llama_server_bin.environment())

    def cancel_at_second(trial: int, most: int) -> None:
        if trial == 2 and not cancelled_at:
            cancelled_at.append(time.monotonic())
            first.cancel()

    first = make(cancel_at_second)
    report = await first.run()
    assert report.outcome == "cancelled" and time.monotonic() - cancelled_at[0] < 10
    assert [t.args for t in report.trials] == [(), ("-np", "2", "-c", "4096")]
    assert not [p for p in psutil.Process().children(recursive=True) if p.name() == "llama-server"]
    journal = store.journal(key)
    assert [t.args for t in journal] == [("-np", "2", "-c", "4096")]

    seen: list[int] = []
    report = await make(lambda trial, most: seen.append(trial)).run()
    assert report.outcome in ("adopted", "kept_baseline") and seen[:3] == [1, 2, 3]
    resumed = next(t for t in report.trials if t.args == ("-np", "2", "-c", "4096"))
    assert resumed.levels == journal[0].levels  # taken from the journal, not measured again
    assert store.journal(key) == []


async def test_a_baseline_that_fails_requests_fails_the_tuning(llama_server_bin: LlamaServer, tiny_gguf: Path,
                                                                tmp_path: Path) -> None:
    """A prompt set none of whose prompts fits 1,024 tokens of a byte-level model's context (the
    set is cut to what fits, down to its shortest prompt, which still does not): every candidate
    would lose with `failed` against a baseline that fails too, so none is tried."""
    args = ("-np", "1", "-c", "1024", "-t", "1")
    shipped = read_prompts(FIXTURES / "prompts-bytes.json")
    too_long = Prompt("long", (("user", "word " * 600),), 32)
    prompts = dataclasses.replace(shipped, load=(too_long,), probes=())
    tuner = Tuner(plan(llama_server_bin, tiny_gguf, args), spec({"-np": {"min": 1, "max": 8}}, 3), machine(),
                  paths=Paths.under(tmp_path).ensure(), settings=TunerSettings(repeats=1, run_s=0.3),
                  timing=TIMING, base_env=llama_server_bin.environment(), prompts=prompts)
    report = await tuner.run()
    assert report.outcome == "failed" and [t.result for t in report.trials] == ["baseline"]
    assert any(level.failed for level in report.baseline.levels)


def test_the_tune_command_tries_only_its_space_and_measures_as_its_budget_allows(
        llama_server_bin: LlamaServer, tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`gpu-provider tune --space … --minutes 3` on the real llama-server: every candidate is from
    the space given, and the report says how hard a three-minute budget measured."""
    code = main(["tune", "--data-dir", str(tmp_path / "data"), "--model", str(tiny_gguf),
                 "--engine-bin", f"llamacpp={llama_server_bin.executable}", "--base-args", "-np 1 -c 2048 -t 1",
                 "--space", '{"-np": {"values": [2]}}', "--minutes", "3", "--trials", "2", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["outcome"] in ("adopted", "kept_baseline"), report
    settings = TunerSettings.for_budget(3)
    assert report["measuring"] == {"repeats": settings.repeats, "pairs": settings.pairs, "blocks": settings.blocks,
                                   "run_s": settings.run_s}
    assert report["baseline"]["args"] == ["-np", "1", "-c", "2048", "-t", "1"]
    tried = [trial["args"] for trial in report["trials"][1:]]
    assert tried == [["-np", "2", "-c", "4096"]], report["trials"]
    assert report["trials"][1]["levels"] and report["elapsed_s"] < 3 * 60 + 60
