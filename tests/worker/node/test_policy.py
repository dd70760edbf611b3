"""The node's decisions, without processes: each event against the state it meets."""

from __future__ import annotations

import dataclasses
from typing import Any

from worker.contract import protocol
from worker.contract.events import Problem
from worker.node import policy
from worker.node.policy import (
    Assigned,
    Cancelled,
    DescribeFailure,
    HandedBack,
    LaunchEngines,
    Paused,
    PlanAssignment,
    Planned,
    ProblemFound,
    Provisioned,
    ProvisionFailed,
    Publish,
    Quit,
    Refuse,
    ReportRefusal,
    ResetOfflineRetry,
    RestartFailed,
    Resumed,
    Retry,
    SaveAssignment,
    SavePause,
    SendStatus,
    StartEngines,
    StartProvision,
    State,
    StopEngines,
    Unassigned,
    decide,
    guard_event,
)
from worker.node.view import Pause
from worker.plan.planner import Plan
from worker.provision.errors import ProvisionError


def assign(assignment_id: str, name: str = "qwen3.8-27b") -> protocol.Assign:
    model: dict[str, Any] = {"name": name, "llamacpp": {
        "source": "https://example.org/m.gguf", "sha256": "ab" * 32, "weights_mib": 1000,
        "base_args": ["--ctx-size", "4096"], "tiers": {}}}
    return protocol.Assign(assignment_id=assignment_id, model=model)


def plan_for(a: protocol.Assign) -> Plan:
    assert a.model.llamacpp is not None
    return Plan(engine="llamacpp", model_name=a.model.name, engine_model=a.model.llamacpp, engines=(),
                assignment_id=a.assignment_id)


OLD = assign("a-1", "old-model")
NEW = assign("a-2", "new-model")
SERVING = State(assignment=OLD, plan=plan_for(OLD), engines=("ready",))
IDLE = State()


def step(state: State, event: policy.Event) -> tuple[State, tuple[policy.Action, ...]]:
    decision = decide(state, event)
    return decision.state, decision.actions


def kinds(actions: tuple[policy.Action, ...]) -> list[type]:
    return [type(a) for a in actions]


# --- assign and replace -------------------------------------------------------------------


def test_an_assign_is_planned_before_anything_stops():
    state, actions = step(SERVING, Assigned(NEW))
    assert state == SERVING
    assert actions == (PlanAssignment(NEW),)


def test_the_same_assign_again_while_serving_only_reports_status():
    assert step(SERVING, Assigned(OLD)) == (SERVING, (SendStatus(),))


def test_the_same_assign_again_while_failed_is_planned_anew():
    failed = dataclasses.replace(SERVING, engines=("failed",))
    assert step(failed, Assigned(OLD))[1] == (PlanAssignment(OLD),)


def test_a_replace_provisions_while_the_old_serves_then_drains_and_launches():
    state, actions = step(SERVING, Planned(NEW, plan_for(NEW)))
    assert state == SERVING  # the old one serves while the new model is fetched
    assert actions == (StartProvision(NEW, plan_for(NEW)),)

    decision = decide(SERVING, Provisioned(NEW, plan_for(NEW), ()))
    assert decision.before == (StopEngines("draining"),)  # drained under the old assignment's terms
    assert decision.state.assignment == NEW and decision.state.plan == plan_for(NEW)
    assert decision.state.refused is None and decision.state.problem is None
    assert decision.after == (SaveAssignment(NEW), SendStatus(), LaunchEngines(()))


def test_a_first_assign_on_an_idle_node_stops_nothing():
    decision = decide(IDLE, Provisioned(NEW, plan_for(NEW), ()))
    assert decision.before == ()
    assert decision.state.assignment == NEW


# --- refuse --------------------------------------------------------------------------------


def test_a_refused_assign_keeps_the_old_assignment_serving():
    decision = decide(SERVING, Refuse("a-2", "needs 40 GiB", NEW))
    assert decision.state.assignment == OLD and decision.state.plan == SERVING.plan
    assert decision.state.refused == protocol.Refused(assignment_id="a-2", reason="needs 40 GiB")
    assert decision.state.problem is None
    assert StopEngines("draining") not in decision.actions
    assert decision.actions == (ReportRefusal("a-2", "needs 40 GiB"), SendStatus())


def test_a_refused_assign_on_an_idle_node_is_held_as_failed():
    state, actions = step(IDLE, Refuse("a-2", "needs 40 GiB", NEW))
    assert state.assignment == NEW and state.plan is None
    assert state.problem == Problem("Assignment refused", "needs 40 GiB", "none")
    assert state.node_state() == "failed"
    assert kinds(actions) == [ReportRefusal, SendStatus]


def test_a_refusal_over_failed_engines_stops_them_and_drops_the_old_assignment():
    failed = dataclasses.replace(SERVING, engines=("failed",))
    decision = decide(failed, Refuse("a-2", "bad schema"))  # did not even parse: no Assign
    assert decision.before == (ReportRefusal("a-2", "bad schema"), StopEngines("draining"))
    assert decision.state.assignment is None and decision.state.plan is None
    assert decision.state.refused is not None and decision.state.refused.assignment_id == "a-2"


def test_a_provisioning_failure_while_the_old_serves_is_a_refusal():
    error = ProvisionError(Problem("Download failed", "The model's host said no.", "retry"))
    decision = decide(SERVING, ProvisionFailed(NEW, plan_for(NEW), error))
    assert decision.state.assignment == OLD
    assert decision.state.refused == protocol.Refused(assignment_id="a-2", reason="The model's host said no.")
    assert kinds(decision.actions) == [ReportRefusal, SendStatus]


def test_a_provisioning_failure_with_nothing_serving_adopts_it_as_failed():
    error = ProvisionError(Problem("Download failed", "The model's host said no.", "retry"))
    decision = decide(IDLE, ProvisionFailed(NEW, plan_for(NEW), error))
    assert decision.state.assignment == NEW and decision.state.plan == plan_for(NEW)
    assert decision.after == (DescribeFailure(error), SaveAssignment(NEW), SendStatus())
    problem = Problem("Download failed", "The model's host said no.", "retry")
    assert decide(decision.state, ProblemFound(problem)).state.problem == problem


# --- unassign --------------------------------------------------------------------------------


def test_unassign_drains_and_clears_everything():
    refused = dataclasses.replace(SERVING, refused=protocol.Refused(assignment_id="a-0", reason="x"))
    decision = decide(refused, Unassigned("a-1"))
    assert decision.before == (StopEngines("draining"),)
    assert decision.state == dataclasses.replace(IDLE, engines=("ready",))
    assert decision.after == (SendStatus(),)


def test_unassign_of_another_assignment_changes_nothing():
    assert step(SERVING, Unassigned("a-9")) == (SERVING, ())


def test_unassign_while_paused_keeps_the_pause_and_stops_nothing_more():
    paused = dataclasses.replace(SERVING, pause=Pause("user", None), engines=())
    state, actions = step(paused, Unassigned("a-1"))
    assert state.assignment is None and state.plan is None
    assert state.pause == Pause("user", None)
    assert state.node_state() == "paused"
    assert actions == (SendStatus(),)


def test_a_network_switch_ends_whatever_is_held():
    state, actions = step(SERVING, Unassigned(None))
    assert state.assignment is None and actions == (StopEngines("draining"), SendStatus())


# --- pause and resume --------------------------------------------------------------------------


def test_pause_is_announced_then_the_engines_stop_under_the_lock_and_only_then_it_is_saved():
    state, actions = step(SERVING, Paused("user"))
    assert state.pause == Pause("user", None)
    assert actions == (SendStatus(), StopEngines("paused", lock=True), SavePause(True, None), SendStatus())


def test_a_games_pause_is_not_kept_across_restarts():
    assert SavePause(False, None) in step(SERVING, Paused("game", None, "game.exe"))[1]


def test_the_coordinators_pause_does_not_replace_the_persons():
    mine = dataclasses.replace(SERVING, pause=Pause("user", None))
    assert step(mine, Paused("coordinator")) == (mine, ())


def test_the_coordinators_resume_lifts_only_its_own_pause():
    mine = dataclasses.replace(SERVING, pause=Pause("user", None), engines=())
    assert step(mine, Resumed("coordinator")) == (mine, ())
    theirs = dataclasses.replace(mine, pause=Pause("coordinator", None))
    state, actions = step(theirs, Resumed("coordinator"))
    assert state.pause is None and actions == (SavePause(False, None), SendStatus(), StartEngines())


def test_pause_during_provisioning_adopts_the_new_assignment_but_starts_nothing():
    state, _ = step(IDLE, Assigned(NEW))
    state, _ = step(state, Paused("user"))  # while provisioning runs
    decision = decide(state, Provisioned(NEW, plan_for(NEW), ()))
    assert decision.state.assignment == NEW and decision.state.pause == Pause("user", None)
    assert not any(isinstance(a, LaunchEngines) for a in decision.actions)
    state, actions = step(decision.state, Resumed("user"))
    assert StartEngines() in actions  # the engines start on resume


def test_a_plan_made_while_paused_is_adopted_without_provisioning():
    paused = dataclasses.replace(IDLE, pause=Pause("user", None))
    state, actions = step(paused, Planned(NEW, plan_for(NEW)))
    assert state.assignment == NEW
    assert kinds(actions) == [SaveAssignment, SendStatus]


def test_resume_after_an_until_time():
    timed = dataclasses.replace(SERVING, pause=Pause("timed", 1000.0), engines=())
    assert not policy.resume_due(timed, 999.9)
    assert policy.resume_due(timed, 1000.0)
    assert not policy.resume_due(dataclasses.replace(timed, pause=Pause("user", None)), 10**9)
    state, actions = step(timed, Resumed("timer"))
    assert state.pause is None and state.problem is None
    assert actions == (SavePause(False, None), SendStatus(), StartEngines())


def test_resume_with_engines_running_or_nothing_planned_starts_nothing():
    running = dataclasses.replace(SERVING, pause=Pause("user", None))
    assert step(running, Resumed())[1] == (SavePause(False, None), SendStatus())
    bare = dataclasses.replace(IDLE, pause=Pause("user", None))
    assert step(bare, Resumed())[1] == (SavePause(False, None), SendStatus())


def test_resume_when_not_paused_does_nothing():
    assert step(SERVING, Resumed()) == (SERVING, ())


# --- the lender's guard, and a cancelled download ------------------------------------------------


def test_the_guard_pauses_only_a_node_nobody_else_paused_and_lifts_only_its_own():
    hot = Pause("too_hot", None, "GPU 0 at 86 °C")
    assert guard_event(None, "too_hot", "GPU 0 at 86 °C", None) == Paused("too_hot", None, "GPU 0 at 86 °C")
    assert guard_event(hot, "too_hot", "GPU 0 at 87 °C", None) is None  # already its pause: no re-pause each degree
    assert guard_event(hot, "battery", "on battery", None) == Paused("battery", None, "on battery")
    for theirs in (Pause("user", None), Pause("game", None, "game.exe"), Pause("coordinator", None)):
        assert guard_event(theirs, "battery", "on battery", None) is None
        assert guard_event(theirs, None, None, None) is None  # never lifts a pause it did not take
    assert guard_event(hot, None, None, None) == Resumed("guard")
    assert guard_event(None, None, None, None) is None


def test_a_reason_the_person_resumed_over_is_left_alone_until_it_clears():
    assert guard_event(None, "battery", "on battery", "battery") is None
    assert guard_event(None, "too_hot", "GPU 0 at 86 °C", "battery") == Paused("too_hot", None, "GPU 0 at 86 °C")


def test_the_guards_pause_and_resume_go_through_the_rules():
    person = dataclasses.replace(SERVING, pause=Pause("user", None))
    assert step(person, Paused("costs", None, "x")) == (person, ())  # a race: the person's pause stays
    guarded, actions = step(SERVING, Paused("battery", None, "on battery"))
    assert guarded.pause == Pause("battery", None, "on battery") and SavePause(False, None) in actions
    assert step(person, Resumed("guard")) == (person, ())
    state, actions = step(dataclasses.replace(guarded, engines=()), Resumed("guard"))
    assert state.pause is None and actions == (SavePause(False, None), SendStatus(), StartEngines())


def test_a_cancelled_download_pauses_and_keeps_the_assignment_for_resume():
    state, _ = step(SERVING, Assigned(NEW))
    state, actions = step(state, Cancelled(NEW, plan_for(NEW)))
    assert (state.assignment, state.plan, state.pause, state.problem) == (NEW, plan_for(NEW), Pause("user", None), None)
    assert actions == (StopEngines("paused"), SaveAssignment(NEW), SavePause(True, None), SendStatus())
    held = dataclasses.replace(SERVING, engines=())
    state, actions = step(held, Cancelled())
    assert (state.assignment, state.pause) == (OLD, Pause("user", None))
    assert actions == (SavePause(True, None), SendStatus())
    state, actions = step(state, Resumed("user"))
    assert StartEngines() in actions  # Resume fetches it again


# --- retry, hand-back, quit ----------------------------------------------------------------------


def test_retry_restarts_failed_engines_or_provisions_again():
    failed = dataclasses.replace(SERVING, engines=("failed",))
    assert step(failed, Retry())[1] == (ResetOfflineRetry(), RestartFailed(), SendStatus())
    nothing_runs = dataclasses.replace(SERVING, engines=(), problem=Problem("Download failed", "x", "retry"))
    state, actions = step(nothing_runs, Retry(by_hand=False))
    assert state.problem is None  # a retry must not keep showing the last failure
    assert actions == (StartEngines(), SendStatus())


def test_retry_while_paused_or_unplanned_only_resets_the_backoff():
    paused = dataclasses.replace(SERVING, pause=Pause("user", None))
    assert step(paused, Retry())[1] == (ResetOfflineRetry(),)
    assert step(IDLE, Retry(by_hand=False))[1] == ()


def test_handed_back_after_an_update_starts_the_plan_unless_paused():
    stopped = dataclasses.replace(SERVING, engines=())
    assert step(stopped, HandedBack())[1] == (StartEngines(),)
    assert step(dataclasses.replace(stopped, pause=Pause("user", None)), HandedBack())[1] == ()


def test_quit_says_stopping():
    state, actions = step(SERVING, Quit())
    assert state.stopping and actions == (Publish(),)


# --- the gate and the commit --------------------------------------------------------------------


def test_the_gate_gives_the_contracts_503_codes():
    assert policy.gate(SERVING, draining=False, ready=True) is None
    assert policy.gate(dataclasses.replace(SERVING, pause=Pause("game", None)), draining=True, ready=True) == "paused"
    assert policy.gate(SERVING, draining=True, ready=True) == "draining"
    assert policy.gate(SERVING, draining=False, ready=False) == "not_ready"


def test_a_tuning_node_refuses_requests_with_tuning_unless_paused_and_while_it_drains_for_it():
    assert policy.gate(SERVING, draining=False, ready=False, tuning=True) == "tuning"
    assert policy.gate(SERVING, draining=True, ready=True, tuning=True) == "tuning"
    paused = dataclasses.replace(SERVING, pause=Pause("game", None))
    assert policy.gate(paused, draining=False, ready=True, tuning=True) == "paused"


def test_a_commit_keeps_a_pause_made_while_the_decision_drained():
    decision = decide(SERVING, Provisioned(NEW, plan_for(NEW), ()))
    meanwhile = dataclasses.replace(SERVING, pause=Pause("user", None))
    held = policy.commit(meanwhile, SERVING, decision.state)
    assert held.assignment == NEW and held.pause == Pause("user", None)
