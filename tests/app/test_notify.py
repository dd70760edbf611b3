from __future__ import annotations

import time
from dataclasses import replace

from app.notify import MESSAGE_LIMIT, Notification, Notifier, new_notices, short_sentence
from tests.app import snapshots
from tests.app.scripted_node import headed
from worker.contract.events import NodeSnapshot, Problem, TuningSnapshot

TRACEBACK = (
    "Traceback (most recent call last):\n  File \"/opt/vllm/engine.py\", line 812, in load\n"
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n" + "  frame\n" * 12
)


def feed(*snaps: NodeSnapshot) -> list[Notification | None]:
    notifier = Notifier()
    return [notifier.update(headed(s)) for s in snaps]  # the headline as the core fills it


def told(*snaps: NodeSnapshot) -> list[Notification]:
    return [n for n in feed(*snaps) if n is not None]


def restarting(failures: int) -> NodeSnapshot:
    """A crash loop between its restarts: the engine starting again after quick failures."""
    snap = snapshots.starting()
    engine = replace(snap.engines[0], failures_in_a_row=failures, restarts=failures, last_error=TRACEBACK)
    return replace(snap, engines=(engine,))


SERVING = "Serving · Qwen/Qwen3-8B"  # the headline's title, as tray and dashboard show it
OOM_ADVICE = ("vLLM could not fit Qwen/Qwen3-8B even at the lowest memory tier. "
              "Close other GPU apps or lend another GPU.")


def crashed(message: str = OOM_ADVICE) -> NodeSnapshot:
    """The crash loop's end: failed for good, with the traceback in details and in the core's notice."""
    failed = snapshots.failed()
    engine = replace(failed.engines[0], last_error=TRACEBACK, failures_in_a_row=5)
    problem = Problem("The engine keeps crashing", message, "retry", details=tuple(TRACEBACK.splitlines()))
    return replace(failed, engines=(engine,), problem=problem,
                   notices=(f"Engine engine-0 failed: {TRACEBACK}",))


def test_ready_after_starting_is_told_once():
    notes = feed(snapshots.idle(), snapshots.starting(), snapshots.serving(), snapshots.serving())
    assert notes[:2] == [None, None]
    assert notes[2] == Notification("Serving · Qwen/Qwen3-8B", "Qwen/Qwen3-8B is ready and serving.")
    assert notes[3] is None


def test_a_crash_loop_and_its_final_failure_are_one_short_notification():
    notes = told(snapshots.serving(), restarting(1), restarting(2), restarting(3), restarting(4), crashed(),
                 crashed(), replace(crashed(), at=snapshots.NOW + 5))
    assert notes[0].title == SERVING  # the first snapshot: the model was serving when the app opened
    failures = notes[1:]
    assert len(failures) == 1
    assert failures[0].title == "Failed: The engine keeps crashing" and failures[0].level == "critical"
    assert failures[0].message.startswith("vLLM could not fit Qwen/Qwen3-8B")
    assert len(failures[0].message) <= MESSAGE_LIMIT
    assert "Traceback" not in failures[0].message and "\n" not in failures[0].message


def test_failing_again_after_retry_is_the_same_incident_but_a_new_one_after_serving():
    assert [n.title for n in told(crashed(), restarting(1), crashed())] == ["Failed: The engine keeps crashing"]
    titles = [n.title for n in told(crashed(), snapshots.serving(), crashed())]
    assert titles == ["Failed: The engine keeps crashing", SERVING, "Failed: The engine keeps crashing"]


def test_a_restart_that_recovers_is_not_news():
    assert [n.title for n in told(snapshots.serving(), restarting(1), restarting(2), snapshots.serving())] == [
        SERVING
    ]


def test_serving_again_after_a_tuning_is_not_news():
    tuning = replace(snapshots.idle(), state="configured", model=snapshots.MODEL,
                     tuning=TuningSnapshot(state="running", trial=2, trials_max=12))
    assert [n.title for n in told(snapshots.serving(), tuning, snapshots.serving())] == [SERVING]


def test_a_long_message_becomes_one_short_sentence():
    long = ("The engine could not start because " + "the model needs more memory than is free " * 6 + ". "
            "Close other apps. Then Retry.")
    note = told(crashed(long))[0]
    assert len(note.message) <= MESSAGE_LIMIT and note.message.endswith("…")
    assert "Close other apps" not in note.message


def test_a_failure_that_retries_by_itself_says_when():
    at = time.mktime((2027, 1, 15, 14, 32, 0, 0, 0, -1))
    problem = Problem("No connection", "Cannot download the engine: this computer seems to be offline.", "retry",
                      retry_at=at)
    snap = replace(snapshots.failed(), at=at - 30, problem=problem)
    note = told(snap)[0]
    assert note.message == "Cannot download the engine: this computer seems to be offline. Trying again at 14:32."
    assert note.level == "warning"


def test_failure_without_problem_never_shows_the_log_line():
    snap = replace(snapshots.failed(), problem=None)
    note = told(snapshots.starting(), snap)[0]
    assert note.title == "Failed: The engine stopped"  # the headline's words
    assert "OutOfMemoryError" not in note.message and len(note.message) <= MESSAGE_LIMIT


def test_resuming_from_a_pause_is_not_announced():
    assert told(snapshots.serving(), snapshots.paused_for_game(), snapshots.serving())[1:] == [
        Notification("Paused for a game", "The GPU is yours; serving resumes when the game ends.")
    ]


def test_a_game_pause_names_the_game_and_hides_the_cores_own_notice():
    game = replace(snapshots.paused_for_game(), pause_detail="Cyberpunk2077.exe",
                   notices=("Paused for Cyberpunk2077.exe",))
    assert feed(snapshots.idle(), game) == [
        None, Notification("Paused for Cyberpunk2077.exe", "The GPU is yours; serving resumes when the game ends.")
    ]


def test_one_notification_per_change_and_the_update_offer_waits_for_the_next():
    ready = replace(snapshots.serving(), update_ready="0.3.0", notices=("Serving Qwen/Qwen3-8B on engine-0",))
    notes = feed(snapshots.starting(), ready, replace(ready, at=snapshots.NOW + 1),
                 replace(ready, at=snapshots.NOW + 2))
    assert notes[1] is not None and notes[1].title == SERVING
    assert notes[2] is not None and notes[2].title == "Update 0.3.0 ready"
    assert notes[3] is None


def test_core_notices_are_shown_once_each_newest_only():
    one = replace(snapshots.serving(), notices=("Update 0.2.0 installed",))
    two = replace(snapshots.serving(), notices=("Update 0.2.0 installed", "Model cache trimmed"))
    notes = feed(snapshots.serving(), one, one, two)
    assert [n.message if n else None for n in notes[1:]] == ["Update 0.2.0 installed", None, "Model cache trimmed"]
    burst = replace(snapshots.serving(), notices=("Model cache trimmed", "Update 0.3.0 installed"))
    assert [n.message if n else None for n in feed(snapshots.serving(), burst)] == [
        "Qwen/Qwen3-8B is ready and serving.", "Update 0.3.0 installed"
    ]


def test_the_back_online_reminder_is_told_as_the_node_comes_back():
    """The core's reminder comes with the snapshot that leaves Offline: a change of state, yet news."""
    back = replace(snapshots.idle(), notices=("Back online after 2 h offline",))
    notes = feed(snapshots.idle(), snapshots.offline(), back)
    assert notes[2] == Notification("GPU Provider", "Back online after 2 h offline")


def test_new_notices_follow_a_rolling_list():
    one = replace(snapshots.serving(), notices=("Update 0.2.0 installed",))
    two = replace(snapshots.serving(), notices=("Update 0.2.0 installed", "Model cache trimmed"))
    assert new_notices(one, two) == ("Model cache trimmed",)
    assert new_notices(two, two) == ()
    rolled = replace(snapshots.serving(), notices=("Model cache trimmed", "Update 0.3.0 installed"))
    assert new_notices(two, rolled) == ("Update 0.3.0 installed",)


def test_nothing_is_news_while_quitting():
    draining = replace(snapshots.failed(), stopping=True, notices=("Engine engine-0 failed: stopped",))
    assert feed(snapshots.serving(), replace(snapshots.serving(), stopping=True), draining)[1:] == [None, None]


def test_short_sentence():
    assert short_sentence("Out of memory. Try a smaller model.") == "Out of memory."
    assert short_sentence("  first line\nsecond line") == "first line"
    assert short_sentence("") == ""
    cut = short_sentence("word " * 40, limit=30)
    assert cut.endswith("…") and len(cut) <= 30 and not cut[:-1].endswith(" ")
