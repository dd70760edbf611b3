"""The node's decisions, pure: what an assign, unassign, refusal, pause, resume or retry does to
what the node holds, and what must happen for it, as `restart_policy` is to the supervisor.

`decide(state, event)` returns a `Decision`: actions to run first under the old state (draining
and stopping the engines still serve the old assignment's terms), the new state, then actions to
run under it. `worker.node.node` executes the actions; those that end in a fact the policy must
weigh (a plan, a refusal, provisioning done or failed, a problem) hand it back as the next event.
The engines' states are observed by the node and passed in with the state, never kept here.

The rules: an assignment is planned (which validates it) before anything stops, and provisioned
while the old engines keep serving; only then are they drained. A refused assignment leaves the
one serving serving, with `status.refused` saying why; a node with nothing else to serve adopts
the refusal as its failure. The person's pause is theirs: the coordinator's pause does not
replace it and its resume does not lift it; the lender's guard (too hot, on battery, costs more
than it earns) pauses only a node nobody else paused, lifts only its own pause, and leaves alone a
reason the person resumed over until that reason clears. A paused node adopts new assignments but
starts no engines until it resumes; a download the person cancels pauses the node (not a failure)
with the assignment kept, for Resume to fetch again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from worker.contract import protocol
from worker.contract.events import NodeState, Problem
from worker.node.view import Pause, node_state
from worker.plan.planner import EnginePlan, Plan
from worker.provision.errors import ProvisionError

PauseReason = Literal["user", "timed", "coordinator", "game", "schedule", "too_hot", "battery", "costs"]
Gate = Literal["paused", "draining", "tuning", "not_ready"]
GUARD_REASONS = frozenset({"too_hot", "battery", "costs"})  # the lender's own limits pause for these


@dataclass(frozen=True)
class State:
    """What the node holds, and its engines' states as last observed."""

    assignment: protocol.Assign | None = None
    plan: Plan | None = None
    problem: Problem | None = None
    refused: protocol.Refused | None = None  # the latest assignment this node would not run
    pause: Pause | None = None
    stopping: bool = False  # from `shutdown` to the end
    engines: tuple[NodeState, ...] = ()  # observed: one state per engine the node runs

    @property
    def running(self) -> bool:
        return bool(self.engines)

    @property
    def serving(self) -> bool:
        """Some engine serves, or is on its way to (a failed or stopped one is not)."""
        return any(s not in ("failed", "stopped") for s in self.engines)

    def node_state(self) -> NodeState:
        """A problem the node retries by itself (the network is down) is no failure yet."""
        gave_up = self.problem is not None and self.problem.retry_at is None
        return node_state(paused=self.pause is not None, assigned=self.assignment is not None,
                          planned=self.plan is not None, problem=gave_up, engines=self.engines)


# --- events -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Assigned:
    """The coordinator's `assign`."""

    assign: protocol.Assign


@dataclass(frozen=True)
class Planned:
    assign: protocol.Assign
    plan: Plan


@dataclass(frozen=True)
class Refuse:
    """An assignment this node will not run: the planner's refusal, or one that fit no schema."""

    assignment_id: str
    reason: str
    assign: protocol.Assign | None = None  # None where it did not even parse


@dataclass(frozen=True)
class Provisioned:
    assign: protocol.Assign
    plan: Plan
    engine_plans: tuple[EnginePlan, ...]


@dataclass(frozen=True)
class ProvisionFailed:
    assign: protocol.Assign
    plan: Plan
    error: ProvisionError


@dataclass(frozen=True)
class ProblemFound:
    """What the person is shown: a provisioning failure (`DescribeFailure`), or what opening
    the link found (a local model that cannot be served); None: nothing is wrong."""

    problem: Problem | None


@dataclass(frozen=True)
class Unassigned:
    assignment_id: str | None  # None: whatever is held (a network switch ends it)


@dataclass(frozen=True)
class Paused:
    reason: PauseReason | str
    until: float | None = None
    detail: str | None = None


@dataclass(frozen=True)
class Resumed:
    by: Literal["user", "coordinator", "timer", "guard"] = "user"


@dataclass(frozen=True)
class Cancelled:
    """The person cancelled the download the plan waits for: `assign` and `plan` where a new
    assignment was being provisioned (None: the held plan's own)."""

    assign: protocol.Assign | None = None
    plan: Plan | None = None


@dataclass(frozen=True)
class Retry:
    """What failed, again: the person's Retry (`by_hand`) or the offline retry's timer."""

    by_hand: bool = True


@dataclass(frozen=True)
class HandedBack:
    """An update was rolled back (or refused) after the engines were stopped for it."""


@dataclass(frozen=True)
class Quit:
    """`shutdown`: the node says "stopping" from now to the end."""


Event = (Assigned | Planned | Refuse | Provisioned | ProvisionFailed | ProblemFound | Unassigned | Paused
         | Resumed | Cancelled | Retry | HandedBack | Quit)


# --- actions --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanAssignment:
    """Plan `assign` (off the loop); hands back `Planned` or `Refuse`."""

    assign: protocol.Assign


@dataclass(frozen=True)
class StartProvision:
    """Fetch what the plan needs; hands back `Provisioned` or `ProvisionFailed`."""

    assign: protocol.Assign
    plan: Plan


@dataclass(frozen=True)
class DescribeFailure:
    """Word a provisioning failure (and schedule the offline retry); hands back `ProblemFound`."""

    error: ProvisionError


@dataclass(frozen=True)
class StopEngines:
    """Drain the relay's requests (with `reason` as the 503's code), then stop every engine.
    `lock`: take the engines lock first (a pause, which was announced without it)."""

    reason: Literal["paused", "draining"] = "draining"
    lock: bool = False


@dataclass(frozen=True)
class LaunchEngines:
    engine_plans: tuple[EnginePlan, ...]


@dataclass(frozen=True)
class StartEngines:
    """Provision and start the held plan; a failure hands back `ProblemFound`."""


@dataclass(frozen=True)
class RestartFailed:
    """The engines that gave up start again, their failure counts reset."""


@dataclass(frozen=True)
class ResetOfflineRetry:
    """The person's Retry starts the offline backoff over."""


@dataclass(frozen=True)
class SaveAssignment:
    assign: protocol.Assign


@dataclass(frozen=True)
class SavePause:
    """Persist the person's pause (a game's or the coordinator's is not kept across restarts)."""

    paused: bool
    until: float | None


@dataclass(frozen=True)
class ReportRefusal:
    assignment_id: str
    reason: str


@dataclass(frozen=True)
class SendStatus:
    """`status` to the coordinator now, and a new snapshot for the app."""


@dataclass(frozen=True)
class Publish:
    """A new snapshot for the app only."""


Action = (PlanAssignment | StartProvision | DescribeFailure | StopEngines | LaunchEngines | StartEngines
          | RestartFailed | ResetOfflineRetry | SaveAssignment | SavePause | ReportRefusal | SendStatus | Publish)


@dataclass(frozen=True)
class Decision:
    """`before` runs under the old state, `state` is then the node's, `after` runs under it."""

    state: State
    before: tuple[Action, ...] = ()
    after: tuple[Action, ...] = ()

    @property
    def actions(self) -> tuple[Action, ...]:
        return self.before + self.after


# --- the rules --------------------------------------------------------------------------------


def decide(state: State, event: Event) -> Decision:
    """The node's next state and what to do for it; pure."""
    if isinstance(event, Assigned):
        return _assigned(state, event.assign)
    if isinstance(event, Planned):
        return _planned(state, event)
    if isinstance(event, Refuse):
        return _refuse(state, event)
    if isinstance(event, Provisioned):
        return _adopt(state, event.assign, event.plan, launch=event.engine_plans)
    if isinstance(event, ProvisionFailed):
        return _provision_failed(state, event)
    if isinstance(event, ProblemFound):
        return Decision(dataclasses.replace(state, problem=event.problem))
    if isinstance(event, Unassigned):
        return _unassigned(state, event.assignment_id)
    if isinstance(event, Paused):
        return _paused(state, event)
    if isinstance(event, Resumed):
        return _resumed(state, event.by)
    if isinstance(event, Cancelled):
        return _cancelled(state, event)
    if isinstance(event, Retry):
        return _retry(state, event.by_hand)
    if isinstance(event, HandedBack):
        return _start_if_due(state)
    return Decision(dataclasses.replace(state, stopping=True), after=(Publish(),))


def commit(held: State, start: State, decided: State) -> State:
    """`held` with the fields a decision changed from `start`, the state it was made on: what
    another decision committed while this one's `before` actions ran (a pause announced during a
    drain) stays, and only what this one decided is laid over it."""
    changed = {f.name: getattr(decided, f.name) for f in dataclasses.fields(State)
               if f.name != "engines" and getattr(decided, f.name) is not getattr(start, f.name)}
    return dataclasses.replace(held, **changed)


def resume_due(state: State, now: float) -> bool:
    """A timed pause whose time has come."""
    return state.pause is not None and state.pause.until is not None and now >= state.pause.until


def guard_event(pause: Pause | None, wanted: str | None, detail: str | None,
                overridden: str | None) -> Event | None:
    """What the lender's guard asks of the pause now (`wanted`: its reason, None when all is
    well): its own pause taken where nobody else's holds, lifted once its reason clears; a reason
    the person resumed over (`overridden`) is left alone until it clears. None: nothing to do."""
    own = pause is not None and pause.reason in GUARD_REASONS
    if wanted is None or wanted == overridden:
        return Resumed("guard") if own and wanted is None else None
    if pause is None or (own and pause.reason != wanted):
        return Paused(wanted, None, detail)
    return None


def gate(state: State, *, draining: bool, ready: bool, tuning: bool = False) -> Gate | None:
    """Why the relay refuses a request now (the contract's 503 codes); None: it may forward it.
    `tuning`: trial engines hold the card, measured on the app's own prompts, never callers'."""
    if state.pause is not None:
        return "paused"
    if tuning:  # its own drain says why too
        return "tuning"
    if draining:
        return "draining"
    if not ready:
        return "not_ready"
    return None


def _assigned(state: State, assign: protocol.Assign) -> Decision:
    if assign == state.assignment and state.running and state.node_state() != "failed":
        return Decision(state, after=(SendStatus(),))  # re-sent after a reconnect: keep serving, no reload
    return Decision(state, after=(PlanAssignment(assign),))


def _planned(state: State, event: Planned) -> Decision:
    if state.pause is not None:  # adopted now, provisioned when the node resumes
        return _adopt(state, event.assign, event.plan, launch=None)
    return Decision(state, after=(StartProvision(event.assign, event.plan),))


def _provision_failed(state: State, event: ProvisionFailed) -> Decision:
    if state.serving:  # the old assignment keeps serving; the new one is refused
        return _refuse(state, Refuse(event.assign.assignment_id, event.error.problem.message))
    adopted = _adopt(state, event.assign, event.plan, launch=None)  # shown as failed, tried again on Retry
    return dataclasses.replace(adopted, after=(DescribeFailure(event.error),) + adopted.after)


def _adopt(state: State, assign: protocol.Assign, accepted: Plan, launch: Sequence[EnginePlan] | None) -> Decision:
    """`assign` becomes the node's, after the old engines are drained; a paused node starts none."""
    adopted = dataclasses.replace(state, assignment=assign, plan=accepted, problem=None, refused=None)
    after: tuple[Action, ...] = (SaveAssignment(assign), SendStatus())
    if launch is not None and state.pause is None:
        after += (LaunchEngines(tuple(launch)),)
    return Decision(adopted, before=_stop(state), after=after)


def _refuse(state: State, event: Refuse) -> Decision:
    """The one serving keeps serving, and `status` says what was refused and why; a node with
    nothing else to serve reports `failed`."""
    refused = protocol.Refused(assignment_id=event.assignment_id, reason=event.reason)
    report = (ReportRefusal(event.assignment_id, event.reason),)
    if state.serving:
        return Decision(dataclasses.replace(state, refused=refused), before=report, after=(SendStatus(),))
    held = event.assign if event.assign is not None else state.assignment
    if held is not None and held.assignment_id != event.assignment_id:
        held = None  # the old one no longer runs; the refused one is in `refused`
    failed = dataclasses.replace(state, assignment=held, plan=None, refused=refused,
                                 problem=Problem("Assignment refused", event.reason, "none"))
    return Decision(failed, before=report + _stop(state), after=(SendStatus(),))


def _unassigned(state: State, assignment_id: str | None) -> Decision:
    if assignment_id is not None and (state.assignment is None or state.assignment.assignment_id != assignment_id):
        return Decision(state)  # not (or no longer) the one held
    cleared = dataclasses.replace(state, assignment=None, plan=None, problem=None, refused=None)
    return Decision(cleared, before=_stop(state), after=(SendStatus(),))


def _paused(state: State, event: Paused) -> Decision:
    """Announced at once; the card is freed before the pause is saved: a save that fails (a file
    Windows keeps locked) must never leave an engine on the card while the game starts."""
    if event.reason == "coordinator" and state.pause is not None and state.pause.reason != "coordinator":
        return Decision(state)  # the person's own pause stays theirs
    if event.reason in GUARD_REASONS and state.pause is not None and state.pause.reason not in GUARD_REASONS:
        return Decision(state)  # the guard never replaces a pause it did not take
    paused = dataclasses.replace(state, pause=Pause(event.reason, event.until, event.detail))
    keep = event.reason in ("user", "timed")
    return Decision(paused, after=(SendStatus(), StopEngines("paused", lock=True),
                                   SavePause(keep, event.until), SendStatus()))


def _resumed(state: State, by: Literal["user", "coordinator", "timer", "guard"]) -> Decision:
    if state.pause is None or (by == "coordinator" and state.pause.reason != "coordinator"):
        return Decision(state)  # the coordinator lifts only its own pause
    if by == "guard" and state.pause.reason not in GUARD_REASONS:
        return Decision(state)  # and the guard only its own
    resumed = _start_if_due(dataclasses.replace(state, pause=None))
    return dataclasses.replace(resumed, after=(SavePause(False, None), SendStatus()) + resumed.after)


def _cancelled(state: State, event: Cancelled) -> Decision:
    """Paused by the person, the assignment kept (a new one adopted, its old engines stopped):
    Resume fetches it again. Decided under the engines lock, so the stop takes none."""
    paused = dataclasses.replace(state, pause=Pause("user", None))
    if event.assign is None or event.plan is None:
        return Decision(paused, after=(SavePause(True, None), SendStatus()))
    adopted = dataclasses.replace(paused, assignment=event.assign, plan=event.plan, problem=None, refused=None)
    return Decision(adopted, before=_stop(paused), after=(SaveAssignment(event.assign), SavePause(True, None),
                                                        SendStatus()))


def _retry(state: State, by_hand: bool) -> Decision:
    reset: tuple[Action, ...] = (ResetOfflineRetry(),) if by_hand else ()
    if state.plan is None or state.pause is not None:
        return Decision(state, before=reset)
    if state.running:
        return Decision(state, before=reset, after=(RestartFailed(), SendStatus()))
    started = _start_if_due(state)
    return dataclasses.replace(started, before=reset, after=started.after + (SendStatus(),))


def _start_if_due(state: State) -> Decision:
    """The held plan's engines start where none run and the node is not paused."""
    if state.plan is None or state.pause is not None or state.running:
        return Decision(state)
    return Decision(dataclasses.replace(state, problem=None), after=(StartEngines(),))


def _stop(state: State) -> tuple[Action, ...]:
    return (StopEngines("paused" if state.pause else "draining"),) if state.running else ()
