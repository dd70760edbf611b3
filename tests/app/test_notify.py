from __future__ import annotations

from dataclasses import replace

from app.notify import new_notices, notifications_between
from tests.app import snapshots


def test_ready_after_starting_and_failure_with_reason():
    ready = notifications_between(snapshots.starting(), snapshots.serving())
    assert [(n.title, n.message) for n in ready] == [("Serving", "Qwen/Qwen3-8B is ready and serving.")]
    failed = notifications_between(snapshots.serving(), snapshots.failed())
    assert failed[0].level == "critical" and failed[0].message.startswith("vLLM could not fit")


def test_failure_without_problem_uses_the_engine_error():
    snap = replace(snapshots.failed(), problem=None)
    assert notifications_between(snapshots.starting(), snap)[0].message == "torch.OutOfMemoryError: CUDA out of memory"


def test_resuming_from_a_pause_is_not_announced():
    assert notifications_between(snapshots.paused_for_game(), snapshots.serving()) == []


def test_core_notices_are_shown_once_each():
    one = replace(snapshots.serving(), notices=("Update 0.2.0 installed",))
    two = replace(snapshots.serving(), notices=("Update 0.2.0 installed", "Model cache trimmed"))
    assert [n.message for n in notifications_between(snapshots.serving(), one)] == ["Update 0.2.0 installed"]
    assert new_notices(one, two) == ("Model cache trimmed",)
    assert new_notices(two, two) == ()
    rolled = replace(snapshots.serving(), notices=("Model cache trimmed", "Update 0.3.0 installed"))
    assert new_notices(two, rolled) == ("Update 0.3.0 installed",)
