"""What the node shows and reports, from its inputs: the node state, `hello`, `status`, the
snapshot and the chart points."""

from __future__ import annotations

import dataclasses

import pytest

from worker.contract import protocol
from worker.contract.events import (
    ConnectionSnapshot,
    DownloadProgress,
    EarningsSnapshot,
    EngineSnapshot,
    LimitsSnapshot,
    MeasuredCapacity,
    NodeSnapshot,
    Problem,
    RoutingNotice,
    ThroughputSnapshot,
    Tuned,
    TuningSnapshot,
)
from worker.hardware import Gpu, GpuSample, Machine
from worker.hardware.model import GpuGroup
from worker.measure.metrics import EngineMetrics
from worker.node.view import (
    Pause,
    build_hello,
    build_snapshot,
    build_status,
    chart_points,
    download_status,
    engine_views,
    gpu_view,
    limits_status,
    node_state,
    status_key,
    summarise,
    tuned_words,
    tuning_status,
)

MODEL = protocol.ModelSpec(name="qwen3-8b", vllm=protocol.EngineModel(source="hf:Qwen/Qwen3-8B", weights_mib=16000))
ASSIGN = protocol.Assign(assignment_id="a-1", model=MODEL)
CARD = Gpu(index=0, uuid="GPU-0", name="NVIDIA GeForce RTX 4090", memory_total_mib=24564, memory_free_mib=23000,
           usable_mib=20188, memory_used_mib=400, util_pct=0.0, power_w=20.0, power_limit_w=450.0)
GROUP = GpuGroup(gpu_indices=(0,), name="NVIDIA GeForce RTX 4090", usable_mib_per_gpu=20188)
MACHINE = Machine(os="linux", runtime="native", arch="x86_64", cpu_model="cpu", cpu_cores=8, ram_mib=65536,
                  gpus=(CARD,), groups=(GROUP,), effective_vram_mib=20188)
SAMPLE = GpuSample(index=0, util_pct=97.0, memory_used_mib=21000, power_w=430.0, temperature_c=71.0, energy_mj=5)


def engine(state: str = "ready", **changes) -> EngineSnapshot:
    return EngineSnapshot(engine_id="e0", engine="vllm", gpu_indices=(0,), layout="single", state=state,
                          **changes)


@pytest.mark.parametrize(
    ("states", "expected"),
    [
        ([], "configured"),
        (["ready"], "ready"),
        (["ready", "ready"], "ready"),
        (["ready", "degraded"], "degraded"),
        (["degraded"], "degraded"),
        (["ready", "starting"], "degraded"),  # some serve, others do not
        (["ready", "failed"], "degraded"),
        (["starting", "failed"], "starting"),  # none serves, one is (re)starting
        (["starting", "configured"], "starting"),
        (["failed", "failed"], "failed"),
        (["stopped", "stopped"], "stopped"),
        (["configured"], "configured"),
    ],
)
def test_summarise_follows_the_protocol(states: list[str], expected: str) -> None:
    assert summarise(states) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("paused", "assigned", "planned", "problem", "engines", "expected"),
    [
        (True, True, True, False, ["ready"], "paused"),  # a pause outranks everything
        (False, False, False, False, [], "idle"),
        (False, False, False, True, [], "failed"),  # nothing to serve and a problem: a refusal, a bad local model
        (False, True, False, False, [], "failed"),  # assigned but no plan
        (False, True, True, True, [], "failed"),  # provisioning failed, nothing runs
        (False, True, True, True, ["starting"], "starting"),  # a problem with engines running: theirs decide
        (False, True, True, False, [], "configured"),  # planned, not started (paused before, or provisioning)
        (False, True, True, False, ["ready", "starting"], "degraded"),
    ],
)
def test_node_state(paused: bool, assigned: bool, planned: bool, problem: bool, engines: list[str],
                    expected: str) -> None:
    assert node_state(paused=paused, assigned=assigned, planned=planned, problem=problem,
                      engines=engines) == expected  # type: ignore[arg-type]


def test_hello_carries_the_machine_the_version_and_whether_paused() -> None:
    hello = build_hello("n-1", MACHINE, paused=True, allow_remote_code=False)
    assert (hello.node_id, hello.paused) == ("n-1", True)
    machine_part = {"platform", "hardware", "engines"}
    expected = protocol.Hello(node_id="n-1", app_version="x", **MACHINE.to_detect_json())
    assert hello.model_dump(include=machine_part) == expected.model_dump(include=machine_part)
    assert hello.engine_args  # the published allowlist, never empty


def test_status_carries_engines_figures_and_gpu_samples() -> None:
    figures = ThroughputSnapshot(tokens_per_s=80.0, per_request_tokens_per_s=40.0, run_tokens=1200,
                                 run_seconds=15.12345, requests=9)
    refused = protocol.Refused(assignment_id="a-2", reason="too big")
    status = build_status(state="ready", assignment=ASSIGN, problem=Problem("t", "it broke"), refused=refused,
                          engines=[engine(argv=("vllm", "serve"), restarts=2, kv_cache_tokens=44880)],
                          figures=figures, gpus=[SAMPLE], in_flight=3)
    assert (status.assignment_id, status.model, status.last_error, status.refused) == ("a-1", "qwen3-8b", "it broke",
                                                                                        refused)
    assert status.engines[0].argv == ["vllm", "serve"] and status.engines[0].kv_cache_tokens == 44880
    assert status.throughput.run_seconds == 15.123 and status.throughput.requests == 9
    assert status.gpus[0].power_w == 430.0 and status.in_flight == 3


def test_an_idle_status_has_no_assignment() -> None:
    status = build_status(state="idle", assignment=None, problem=None, refused=None, engines=[],
                          figures=ThroughputSnapshot(), gpus=[], in_flight=0)
    assert (status.assignment_id, status.model, status.last_error, status.engines, status.gpus) == (
        None, None, None, [], [])


def test_the_status_key_ignores_figures_but_not_restarts() -> None:
    def status(restarts: int, tokens_per_s: float) -> protocol.Status:
        return build_status(state="ready", assignment=ASSIGN, problem=None, refused=None,
                            engines=[engine(restarts=restarts)], figures=ThroughputSnapshot(tokens_per_s=tokens_per_s),
                            gpus=[SAMPLE], in_flight=0)

    assert status_key(status(0, 10.0)) == status_key(status(0, 99.0))
    assert status_key(status(0, 10.0)) != status_key(status(1, 10.0))


def test_engine_views_lay_metrics_over_serving_engines_only() -> None:
    metrics = {"e0": EngineMetrics(kv_usage=0.25, requests_running=2, requests_waiting=1)}
    serving, = engine_views([engine("degraded")], metrics)
    assert (serving.kv_usage_pct, serving.requests_running, serving.requests_waiting) == (25.0, 2, 1)
    starting, = engine_views([engine("starting")], metrics)
    assert starting == engine("starting")
    unknown, = engine_views([engine("ready")], {"e0": EngineMetrics()})
    assert unknown.kv_usage_pct is None


def test_gpu_view_lays_the_latest_sample_over_detection() -> None:
    live = gpu_view(CARD, SAMPLE, None)
    assert (live.memory_used_mib, live.util_pct, live.power_w, live.temperature_c) == (21000, 97.0, 430.0, 71.0)
    assert (live.memory_total_mib, live.memory_usable_mib, live.power_limit_w, live.lent) == (24564, 20188, 450.0, True)
    detected = gpu_view(CARD, None, {1})
    assert (detected.memory_used_mib, detected.power_w, detected.lent) == (400, 20.0, False)


def snapshot(**changes) -> NodeSnapshot:
    inputs = dict(at=5.0, state="ready", node_id="n-1", machine=MACHINE, lent=None, gpu_samples={0: SAMPLE},
                  pause=None, assignment=ASSIGN, problem=None, engines=[engine()], metrics={},
                  throughput=ThroughputSnapshot(tokens_per_s=1.0), connection=ConnectionSnapshot("ws://c", "connected"),
                  downloads=[], in_flight=2, notices=["Serving qwen3-8b on e0"], earnings=None)
    return build_snapshot(**{**inputs, **changes})


def test_the_snapshot_gathers_its_inputs() -> None:
    snap = snapshot()
    assert (snap.at, snap.state, snap.node_id, snap.runtime, snap.model, snap.assignment_id) == (
        5.0, "ready", "n-1", "native", "qwen3-8b", "a-1")
    assert (snap.paused, snap.pause_reason, snap.in_flight) == (False, None, 2)
    assert snap.notices == ("Serving qwen3-8b on e0",)
    assert snap.gpus[0].util_pct == 97.0 and snap.groups == ((0,),) and snap.effective_vram_mib == 20188
    assert snap.earnings == EarningsSnapshot()  # not read yet: the empty figures
    assert snap.last_capacity is None


def test_the_snapshot_keeps_the_last_measured_capacity_while_paused() -> None:
    kept = MeasuredCapacity(tokens_per_s=61.5, model="qwen3-8b", measured_at=1_800_000_000.0)
    snap = snapshot(pause=Pause("game", None), engines=[], throughput=ThroughputSnapshot(), last_capacity=kept)
    assert snap.last_capacity == kept and snap.throughput.capacity_tokens_per_s is None


def test_the_snapshot_shows_a_pause_earnings_downloads_and_a_node_without_a_machine() -> None:
    earnings = EarningsSnapshot(currency="EUR", today=1.5)
    download = DownloadProgress("model qwen3-8b", done_bytes=1, total_bytes=2)
    snap = snapshot(pause=Pause("game", None, "Cyberpunk2077.exe"), earnings=earnings, downloads=[download],
                    machine=None, lent=[1])
    assert (snap.paused, snap.pause_reason, snap.pause_detail) == (True, "game", "Cyberpunk2077.exe")
    assert snap.earnings == earnings and snap.downloads == (download,)
    assert (snap.runtime, snap.gpus, snap.groups, snap.effective_vram_mib) == ("cpu", (), (), 0)


def test_chart_points_plot_the_live_rate_and_each_card_apart() -> None:
    second = GpuSample(index=1, util_pct=None, memory_used_mib=None, power_w=100.0, temperature_c=None, energy_mj=None)
    figures = ThroughputSnapshot(tokens_per_s=42.0, live_tokens_per_s=0.0)  # the load stopped: the average lags
    rows = chart_points(figures, 30.0, [second, SAMPLE])
    assert rows == [("tokens_per_s", 0.0), ("kv_usage", 30.0),
                    ("gpu0.util_pct", 97.0), ("gpu0.power_w", 430.0), ("gpu0.temperature_c", 71.0),
                    ("gpu1.util_pct", None), ("gpu1.power_w", 100.0), ("gpu1.temperature_c", None)]
    assert chart_points(ThroughputSnapshot(), None, []) == [("tokens_per_s", None), ("kv_usage", None)]  # a CPU node


def test_chart_points_of_eight_cards() -> None:
    samples = [GpuSample(index=i, util_pct=50.0, memory_used_mib=1, power_w=300.0, temperature_c=60.0, energy_mj=None)
               for i in range(8)]
    names = [name for name, _ in chart_points(ThroughputSnapshot(live_tokens_per_s=1.0), 10.0, samples)]
    assert len(names) == len(set(names)) == 2 + 8 * 3
    assert "gpu7.temperature_c" in names and "gpu_util" not in names and "power_w" not in names


# --- tuning -------------------------------------------------------------------------------------

TUNED = Tuned(args=("-np", "8", "-c", "32768"), gain_pct=41.5, noise_pct=1.2,
              words=("serves 8 requests at once instead of 1",))


def test_status_says_where_tuning_stands_and_what_each_engine_runs_with() -> None:
    running = TuningSnapshot(state="running", trial=4, trials_max=12, elapsed_s=402.04, best_gain_pct=6.1)
    status = build_status(state="ready", assignment=ASSIGN, problem=None, refused=None,
                          engines=engine_views([engine()], {}, {"e0": TUNED}), figures=ThroughputSnapshot(),
                          gpus=[], in_flight=0, tuning=running)
    assert status.tuning == protocol.TuningStatus(state="running", trial=4, trials_max=12, elapsed_s=402.0,
                                                  best_gain_pct=6.1)
    assert status.engines[0].tuned == protocol.Tuned(args=["-np", "8", "-c", "32768"], gain_pct=41.5, noise_pct=1.2)
    refused = tuning_status(TuningSnapshot(state="refused", refused="--max-model-len is never tuned"))
    assert refused is not None and refused.refused == protocol.TuneRefusal(reason="--max-model-len is never tuned")
    assert build_status(state="idle", assignment=None, problem=None, refused=None, engines=[],
                        figures=ThroughputSnapshot(), gpus=[], in_flight=0).tuning is None


def test_the_status_key_changes_with_each_trial_but_not_with_the_time_it_took() -> None:
    def status(trial: int, elapsed_s: float) -> protocol.Status:
        return build_status(state="ready", assignment=ASSIGN, problem=None, refused=None, engines=[engine()],
                            figures=ThroughputSnapshot(), gpus=[], in_flight=0,
                            tuning=TuningSnapshot(state="running", trial=trial, trials_max=12, elapsed_s=elapsed_s))

    assert status_key(status(4, 10.0)) == status_key(status(4, 11.0))
    assert status_key(status(4, 10.0)) != status_key(status(5, 10.0))


def test_the_snapshot_carries_tuning_and_each_engines_tuned_arguments() -> None:
    tuning = TuningSnapshot(state="done", chosen=TUNED)
    snap = build_snapshot(at=1.0, state="ready", node_id="n", machine=MACHINE, lent=None, gpu_samples={}, pause=None,
                          assignment=ASSIGN, problem=None, engines=[engine()], metrics={},
                          throughput=ThroughputSnapshot(), connection=ConnectionSnapshot("local", "connected"),
                          downloads=(), in_flight=0, notices=(), earnings=None, tuning=tuning, tuned={"e0": TUNED})
    assert snap.tuning == tuning and snap.engines[0].tuned == TUNED
    assert snap.without_clock() == dataclasses.replace(snap, at=5.0).without_clock()


@pytest.mark.parametrize(("chosen", "baseline", "words"), [
    (("-np", "8", "-c", "32768"), ("-c", "4096", "-np", "1"), ("serves 8 requests at once instead of 1",)),
    (("--max-num-seqs=64", "--no-enforce-eager"), ("--enforce-eager",),
     ("serves up to 64 requests at once", "prepares the GPU's work ahead")),
    (("-t", "4", "--max-num-batched-tokens", "2048"), ("-t", "4"), ("reads prompts 2048 tokens at a time",)),
    (("--some-new-flag", "3"), (), ("sets --some-new-flag to 3",)),
])
def test_tuned_arguments_read_in_a_persons_words(chosen: tuple[str, ...], baseline: tuple[str, ...],
                                                 words: tuple[str, ...]) -> None:
    assert tuned_words(chosen, baseline) == words


# --- the headline, limits and downloads ------------------------------------------------------------


def test_the_snapshot_carries_its_headline_routing_and_limits() -> None:
    routing = RoutingNotice(share=0.0, reason="low_demand", message="No demand for this model right now", at=5.0)
    limits = LimitsSnapshot(max_requests=2, memory_share_pct=((0, 80),), reason="too_hot", words="GPU 0 at 84 °C")
    snap = snapshot(routing=routing, limits=limits)
    assert (snap.routing, snap.limits) == (routing, limits)
    assert (snap.headline.title, snap.headline.not_earning) == (
        "Serving · qwen3-8b", "The network says: No demand for this model right now")
    assert snapshot(setup_needed=True).headline.title == "Finish setting up"
    assert snapshot(pause=Pause("game", None, "Cyberpunk2077.exe")).headline.title == "Paused for Cyberpunk2077.exe"


def test_limits_on_the_wire_only_where_the_lender_set_some() -> None:
    assert limits_status(LimitsSnapshot()) is None
    assert limits_status(LimitsSnapshot(memory_share_pct=((0, 100),))) is None  # all of it: no limit
    assert limits_status(LimitsSnapshot(max_requests=2, memory_share_pct=((0, 80), (1, 100)), reason="too_hot")) == (
        protocol.Limits(max_requests=2, memory_share_pct={"0": 80}, reason="too_hot"))
    hello = build_hello("n-1", MACHINE, paused=False, allow_remote_code=False, limits=LimitsSnapshot(max_requests=4))
    assert hello.limits == protocol.Limits(max_requests=4)
    assert build_hello("n-1", MACHINE, paused=False, allow_remote_code=False).limits is None


def test_the_status_carries_the_download_in_progress_and_the_limits() -> None:
    mib = 2**20
    going = DownloadProgress("model qwen3-8b", done_bytes=1200 * mib + 5, total_bytes=4300 * mib, rate_bps=8.1 * mib)
    assert download_status([going]) == protocol.DownloadStatus(what="model", done_mib=1200, total_mib=4300,
                                                               mib_per_s=8.1, paused=False)
    held = dataclasses.replace(going, held="game", held_detail="Cyberpunk2077.exe", kind="engine", total_bytes=None)
    assert download_status([dataclasses.replace(going, finished=True), held]) == protocol.DownloadStatus(
        what="engine", done_mib=1200, total_mib=None, mib_per_s=None, paused=True)
    assert download_status([dataclasses.replace(going, error="x")]) is None

    def status(downloads: list[DownloadProgress], limits: LimitsSnapshot = LimitsSnapshot()) -> protocol.Status:
        return build_status(state="configured", assignment=ASSIGN, problem=None, refused=None, engines=[],
                            figures=ThroughputSnapshot(), gpus=[], in_flight=0, downloads=downloads, limits=limits)

    sent = status([going], LimitsSnapshot(max_requests=3))
    assert sent.download is not None and sent.download.done_mib == 1200
    assert sent.limits == protocol.Limits(max_requests=3)
    further = dataclasses.replace(going, done_bytes=2000 * mib)
    assert status_key(status([going])) == status_key(status([further]))  # bytes move every second
    assert status_key(status([going])) != status_key(status([held]))  # held: said at once
    assert status_key(status([going])) != status_key(status([]))  # ended
    assert status_key(status([])) != status_key(status([], LimitsSnapshot(max_requests=2, reason="too_hot")))
    first = build_status(state="idle", assignment=None, problem=None, refused=None, engines=[],
                         figures=ThroughputSnapshot(), gpus=[], in_flight=0, downloads=[going])
    assert first.state == "configured"  # fetching for an assignment not adopted yet
