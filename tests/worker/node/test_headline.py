"""The node's one headline: each kind's words and main action, which kind wins when several hold,
and the one reason it earns nothing (the node's own before the network's)."""

from __future__ import annotations

import dataclasses
import time

import pytest

from worker.contract.events import (
    ConnectionSnapshot,
    DownloadProgress,
    EngineSnapshot,
    LimitsSnapshot,
    NodeSnapshot,
    Problem,
    RoutingNotice,
    TuningSnapshot,
)
from worker.node.headline import ACTION_LABELS, clock_time, headline

NOW = time.mktime((2026, 12, 2, 12, 0, 0, 0, 0, -1))  # local noon
CONNECTED = ConnectionSnapshot("wss://c", "connected")
SERVING = NodeSnapshot(at=NOW, state="ready", node_id="n", runtime="native", assignment_id="a-1", model="qwen3-8b",
                       connection=CONNECTED,
                       engines=(EngineSnapshot("e0", "vllm", (0,), "single", "ready"),))
IDLE = NodeSnapshot(at=NOW, state="idle", node_id="n", runtime="native", connection=CONNECTED)
DOWNLOAD = DownloadProgress("model qwen3-8b", done_bytes=42 * 2**20, total_bytes=100 * 2**20, rate_bps=8.1 * 2**20,
                            eta_s=360.0)
NO_DEMAND = RoutingNotice(share=0.0, reason="low_demand", message="No demand for this model right now", at=NOW)


def of(snap: NodeSnapshot, **changes: object) -> NodeSnapshot:
    return dataclasses.replace(snap, **changes)  # type: ignore[arg-type]


def test_serving_names_the_model_offers_pause_and_earns() -> None:
    head = headline(SERVING, NOW)
    assert (head.kind, head.title, head.action, head.action_label, head.not_earning) == (
        "serving", "Serving · qwen3-8b", "pause", "Pause serving", None)


def test_serving_with_no_traffic_says_the_networks_words() -> None:
    assert headline(of(SERVING, routing=NO_DEMAND), NOW).not_earning == (
        "The network says: No demand for this model right now")
    wordless = RoutingNotice(share=0.0, reason="probation", message="", at=NOW)
    assert headline(of(SERVING, routing=wordless), NOW).not_earning == "New computers get a little traffic at first"
    some = dataclasses.replace(NO_DEMAND, share=0.25)
    assert headline(of(SERVING, routing=some), NOW).not_earning is None


def test_setup_comes_before_everything() -> None:
    head = headline(of(SERVING, setup_needed=True, detecting=True, paused=True), NOW)
    assert (head.kind, head.title, head.action, head.action_label) == (
        "setup", "Finish setting up", "finish_setup", "Finish setting up")
    assert head.not_earning == "Setup isn't finished"


def test_detecting_then_stopping() -> None:
    assert headline(of(IDLE, detecting=True, stopping=True), NOW).kind == "detecting"
    head = headline(of(SERVING, stopping=True, in_flight=2, paused=True), NOW)
    assert (head.kind, head.title, head.detail, head.action) == ("stopping", "Stopping…", "2 requests finishing", "none")


def test_signed_out_reads_signed_out_never_idle_and_offers_sign_in() -> None:
    snap = of(IDLE, connection=ConnectionSnapshot("wss://c", "signed_out"), state="failed",
              problem=Problem("Engine failed", "x", "retry"))
    head = headline(snap, NOW)
    assert (head.kind, head.title, head.action, head.action_label, head.not_earning) == (
        "signed_out", "Signed out", "sign_in", "Sign in", "You're signed out")


@pytest.mark.parametrize(("action", "label"), [("retry", "Try again"), ("free_disk", "Try again"),
                                               ("settings", "Open Settings"), ("update", "Update")])
def test_a_failed_node_offers_its_remedy_never_pause(action: str, label: str) -> None:
    problem = Problem("Not enough disk space", "Free 12 GiB on /home", action)  # type: ignore[arg-type]
    head = headline(of(SERVING, state="failed", problem=problem), NOW)
    assert (head.kind, head.title, head.detail, head.action, head.action_label) == (
        "failed", "Failed: Not enough disk space", "Free 12 GiB on /home", action, label)
    assert head.not_earning == "Not enough disk space"


def test_a_failed_engine_without_a_problem_says_its_last_error() -> None:
    engine = EngineSnapshot("e0", "vllm", (0,), "single", "failed", last_error="CUDA out of memory")
    head = headline(of(SERVING, state="failed", engines=(engine,)), NOW)
    assert (head.title, head.detail, head.action) == ("Failed: The engine stopped", "CUDA out of memory", "retry")


def test_a_connection_the_network_ended_is_a_failure_with_its_remedy() -> None:
    problem = Problem("Update required", "This version is too old for the network.", "update")
    head = headline(of(SERVING, connection=ConnectionSnapshot("wss://c", "update_required", problem)), NOW)
    assert (head.kind, head.title, head.action) == ("failed", "Failed: Update required", "update")


def test_failed_comes_before_offline_and_offline_before_paused() -> None:
    offline = ConnectionSnapshot("wss://c", "offline", Problem("Can't reach the coordinator", "down", "check_network"),
                                 retry_in_s=12.4)
    failed = of(SERVING, state="failed", problem=Problem("Engine failed", "x", "retry"), connection=offline)
    assert headline(failed, NOW).kind == "failed"
    head = headline(of(SERVING, connection=offline, paused=True, pause_reason="user"), NOW)
    assert (head.kind, head.title, head.detail, head.action) == (
        "offline", "Offline", "down · trying again in 12 s", "retry")
    assert head.not_earning == "Offline: the network can't reach this computer"


def test_a_try_to_reconnect_still_reads_offline_until_it_connects() -> None:
    """The link retries every few seconds: each try must not flash "Serving" while nothing can earn."""
    down = Problem("Can't reach the coordinator", "down", "check_network")
    head = headline(of(SERVING, connection=ConnectionSnapshot("wss://c", "connecting", down)), NOW)
    assert (head.kind, head.title, head.detail) == ("offline", "Offline", "down · trying again now")
    first = headline(of(IDLE, connection=ConnectionSnapshot("wss://c", "connecting")), NOW)  # never connected yet
    assert (first.kind, first.detail) == ("idle", "Connecting to the network")


def test_a_download_waiting_for_the_network_reads_offline() -> None:
    waiting = Problem("Waiting for the network", "Cannot reach the releases.", "retry", retry_at=NOW + 30)
    head = headline(of(IDLE, state="configured", assignment_id="a-1", problem=waiting, downloads=(DOWNLOAD,)), NOW)
    assert (head.kind, head.title, head.detail) == ("offline", "Offline", "Cannot reach the releases.")


@pytest.mark.parametrize(("reason", "detail", "until", "title"), [
    ("user", None, None, "Paused"),
    ("timed", None, NOW + 2.5 * 3600, "Paused until 14:30"),
    ("game", "Cyberpunk2077.exe", None, "Paused for Cyberpunk2077.exe"),
    ("game", None, None, "Paused for a game"),
    ("schedule", None, None, "Paused outside your serve hours"),
    ("coordinator", None, None, "Paused by the network"),
    ("battery", None, None, "Paused on battery"),
    ("too_hot", "GPU 0 at 86 °C", None, "Paused: GPU 0 at 86 °C"),
    ("costs", None, None, "Paused: electricity costs more than it earns"),
])
def test_paused_says_why_and_until_when_and_offers_resume(reason: str, detail: str | None, until: float | None,
                                                        title: str) -> None:
    snap = of(SERVING, paused=True, pause_reason=reason, pause_detail=detail, pause_until=until, state="paused",
              downloads=(DOWNLOAD,))
    head = headline(snap, NOW)
    assert (head.kind, head.title, head.action, head.action_label, head.not_earning) == (
        "paused", title, "resume", "Resume", title)


def test_a_pause_for_the_lenders_limits_says_the_step_taken() -> None:
    words = "GPU 0 at 86 °C: paused until every GPU is at 75 °C or cooler (your limit is 80 °C)"
    snap = of(SERVING, paused=True, pause_reason="too_hot", pause_detail="GPU 0 at 86 °C", state="paused",
              limits=LimitsSnapshot(max_requests=1, reason="too_hot", words=words))
    head = headline(snap, NOW)
    assert (head.title, head.detail) == ("Paused: GPU 0 at 86 °C", words)
    assert headline(of(snap, pause_reason="user", pause_detail=None), NOW).detail == "Your GPU is all yours"


def test_a_pause_on_another_day_names_the_day() -> None:
    assert clock_time(NOW + 86400, NOW) == time.strftime("%a 12:00", time.localtime(NOW + 86400))


def test_downloading_shows_percent_speed_and_time_left_and_offers_pause() -> None:
    snap = of(IDLE, state="configured", assignment_id="a-1", model="qwen3-8b", downloads=(DOWNLOAD,),
              tuning=TuningSnapshot(state="running", trial=1, trials_max=4))
    head = headline(snap, NOW)
    assert (head.kind, head.title, head.action, head.not_earning) == (
        "downloading", "Downloading the model · 42 %", "pause", "Downloading the model")
    assert head.detail == "42 MiB of 100 MiB · 8.1 MiB/s · 6 min left"
    engine = dataclasses.replace(DOWNLOAD, what="engine vllm", kind="engine", total_bytes=None, done_bytes=0,
                                 rate_bps=None, eta_s=None, step="Unpacking")
    head = headline(of(snap, downloads=(engine,)), NOW)
    assert (head.title, head.detail) == ("Downloading the engine", "Unpacking")
    big = dataclasses.replace(DOWNLOAD, done_bytes=1229 * 2**20, total_bytes=4300 * 2**20, rate_bps=None, eta_s=5400)
    assert headline(of(snap, downloads=(big,)), NOW).detail == "1.2 GiB of 4.2 GiB · 1 h 30 min left"


@pytest.mark.parametrize(("held", "detail", "words"), [
    ("paused_by_you", None, "Paused by you"),
    ("game", "Cyberpunk2077.exe", "Paused while you play Cyberpunk2077.exe"),
    ("budget", "until 1 January", "Monthly download limit reached: waits until 1 January"),
])
def test_a_held_download_says_why_it_waits(held: str, detail: str | None, words: str) -> None:
    download = dataclasses.replace(DOWNLOAD, held=held, held_detail=detail)  # type: ignore[arg-type]
    head = headline(of(IDLE, state="configured", assignment_id="a-1", downloads=(download,)), NOW)
    assert (head.kind, head.title, head.detail, head.action) == ("downloading", "Download waiting · 42 %", words, "none")


def test_finished_or_failed_downloads_are_not_a_download() -> None:
    done = dataclasses.replace(DOWNLOAD, finished=True)
    failed = dataclasses.replace(DOWNLOAD, error="boom")
    assert headline(of(SERVING, downloads=(done, failed)), NOW).kind == "serving"


def test_tuning_shows_its_trial_before_starting() -> None:
    snap = of(SERVING, state="starting", tuning=TuningSnapshot(state="running", trial=4, trials_max=12))
    head = headline(snap, NOW)
    assert (head.kind, head.title, head.action) == ("tuning", "Tuning… (trial 4 of 12)", "pause")
    assert head.not_earning == "Tuning: requests wait until the trials end"


def test_starting_and_restarting() -> None:
    head = headline(of(SERVING, state="starting", engines=()), NOW)
    assert (head.kind, head.title, head.detail, head.action, head.not_earning) == (
        "starting", "Starting", "qwen3-8b", "pause", "Starting the engine")
    again = EngineSnapshot("e0", "vllm", (0,), "single", "starting", failures_in_a_row=3)
    assert headline(of(SERVING, state="starting", engines=(again,)), NOW).detail == "Restarting (3 of 5)"


def test_degraded_still_serves_and_says_what_is_wrong() -> None:
    engines = (EngineSnapshot("e0", "vllm", (0,), "single", "ready"),
               EngineSnapshot("e1", "vllm", (1,), "single", "failed", last_error="Xid 79"))
    head = headline(of(SERVING, state="degraded", engines=engines), NOW)
    assert (head.kind, head.title, head.detail, head.action, head.not_earning) == (
        "degraded", "Serving with problems · qwen3-8b", "Xid 79", "pause", None)


def test_idle_waits_for_the_network_and_gives_its_words_first() -> None:
    head = headline(IDLE, NOW)
    assert (head.kind, head.title, head.action, head.action_label) == ("idle", "Idle", "none", "")
    assert head.not_earning == "Waiting for the network to assign a model"
    assert headline(of(IDLE, routing=NO_DEMAND), NOW).not_earning == "The network says: No demand for this model right now"
    assert headline(of(IDLE, connection=ConnectionSnapshot("wss://c", "connecting")), NOW).not_earning == (
        "Connecting to the network")


def test_every_action_has_a_label_but_none() -> None:
    assert all(label for action, label in ACTION_LABELS.items() if action != "none")
