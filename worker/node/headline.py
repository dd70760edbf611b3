"""The node's one state in a person's words, pure: the same title in the tray, the dashboard, the
notifications and `gpu-provider status`, so that no two places can disagree about what the machine
does. One kind wins, by priority (what the person must do or know first):

setup > detecting > stopping > signed_out > failed > offline > paused > downloading > tuning >
starting > degraded > serving > idle.

The main action is what helps in that state: a failure's own remedy (never Pause), Resume while
paused, Pause while working. `not_earning` is the one live reason the node earns nothing, the
node's own before the network's (`routing`): the person can act on the node's.
"""

from __future__ import annotations

import time

from worker.contract.events import (
    DownloadProgress, Headline, HeadlineKind, MainAction, NodeSnapshot, Problem, RoutingNotice,
)

MIB = 1024 * 1024

ACTION_LABELS: dict[MainAction, str] = {
    "finish_setup": "Finish setting up",
    "sign_in": "Sign in",
    "retry": "Try again",
    "check_network": "Try again",
    "free_disk": "Try again",
    "settings": "Open Settings",
    "update": "Update",
    "resume": "Resume",
    "pause": "Pause serving",
    "none": "",
}

_ROUTING_WORDS = {
    "low_demand": "No demand for this model right now",
    "warming_up": "The network is still trying this computer out",
    "probation": "New computers get a little traffic at first",
    "too_slow": "The network finds this computer too slow for this model",
    "context_too_small": "The model's context here is too small for most requests",
    "capacity_full": "Other computers cover this model's traffic now",
}

_PAUSE_WORDS = {
    "user": "Paused",
    "timed": "Paused",
    "schedule": "Paused outside your serve hours",
    "coordinator": "Paused by the network",
    "battery": "Paused on battery",
    "too_hot": "Paused: too hot",
    "costs": "Paused: electricity costs more than it earns",
}

_CONNECTION_FAILURES = ("banned", "taken_over", "update_required")
_GUARD_REASONS = ("too_hot", "battery", "costs")  # the lender's limits paused it


def headline(snapshot: NodeSnapshot, now: float) -> Headline:
    """The headline for `snapshot` at wall-clock `now` (for "until 14:30")."""
    for pick in (_setup, _detecting, _stopping, _signed_out, _failed, _offline, _paused, _downloading,
                 _tuning, _starting, _serving):
        found = pick(snapshot, now)
        if found is not None:
            return found
    return _idle(snapshot)


def _make(kind: HeadlineKind, title: str, detail: str, action: MainAction, not_earning: str | None) -> Headline:
    return Headline(kind, title, detail, action, ACTION_LABELS[action], not_earning)


def _setup(snap: NodeSnapshot, now: float) -> Headline | None:
    if not snap.setup_needed:
        return None
    return _make("setup", "Finish setting up", "Nothing is downloaded, started or connected until you do",
                 "finish_setup", "Setup isn't finished")


def _detecting(snap: NodeSnapshot, now: float) -> Headline | None:
    if not snap.detecting:
        return None
    return _make("detecting", "Finding your GPUs…", "", "none", "Still finding your GPUs")


def _stopping(snap: NodeSnapshot, now: float) -> Headline | None:
    if not snap.stopping:
        return None
    n = snap.in_flight
    detail = f"{n} request{'s' if n != 1 else ''} finishing" if n > 0 else ""
    return _make("stopping", "Stopping…", detail, "none", "Stopping")


def _signed_out(snap: NodeSnapshot, now: float) -> Headline | None:
    if snap.connection.state != "signed_out":
        return None
    return _make("signed_out", "Signed out", "Sign in to lend this computer to the network", "sign_in",
                 "You're signed out")


def _failed(snap: NodeSnapshot, now: float) -> Headline | None:
    connection = snap.connection
    problem: Problem | None
    if connection.state in _CONNECTION_FAILURES:
        problem = connection.problem or Problem("The network closed the connection", "", "none")
    elif snap.state == "failed" and not snap.paused:
        problem = snap.problem or _engine_failure(snap)
    else:
        return None
    action: MainAction = problem.action
    return _make("failed", f"Failed: {problem.title}", problem.message, action, problem.title)


def _engine_failure(snap: NodeSnapshot) -> Problem:
    cause = next((e.last_error for e in snap.engines if e.last_error), None)
    return Problem("The engine stopped", cause or "It gave up starting", "retry")


def _offline(snap: NodeSnapshot, now: float) -> Headline | None:
    """The link is down, or a download or install waits for the network (the node retries by itself)."""
    waiting = snap.problem if snap.problem is not None and snap.problem.retry_at is not None else None
    retrying = snap.connection.state == "connecting" and snap.connection.problem is not None  # still down
    if snap.connection.state != "offline" and not retrying and waiting is None:
        return None
    problem = waiting or snap.connection.problem
    detail = problem.message if problem is not None else "Check the internet connection"
    retry_in = snap.connection.retry_in_s
    if retrying and waiting is None:
        detail = f"{detail} · trying again now"
    elif retry_in is not None and waiting is None:
        detail = f"{detail} · trying again in {max(1, round(retry_in))} s"
    return _make("offline", "Offline", detail, "retry", "Offline: the network can't reach this computer")


def _paused(snap: NodeSnapshot, now: float) -> Headline | None:
    if not snap.paused:
        return None
    title = pause_title(snap, now)
    if snap.pause_reason in _GUARD_REASONS:
        detail = snap.limits.words or ""  # the limit's own step: "paused until every GPU is at 75 °C …"
    else:
        detail = "Your GPU is all yours" if snap.pause_reason in ("user", "timed", "game") else ""
    return _make("paused", title, detail, "resume", title)


def pause_title(snap: NodeSnapshot, now: float) -> str:
    """ "Paused for Cyberpunk2077.exe", "Paused until 14:30", "Paused: GPU 0 at 86 °C"."""
    reason = snap.pause_reason or "user"
    if reason == "game":
        title = f"Paused for {snap.pause_detail}" if snap.pause_detail else "Paused for a game"
    elif reason == "too_hot" and snap.pause_detail:
        title = f"Paused: {snap.pause_detail}"
    else:
        title = _PAUSE_WORDS.get(reason, "Paused")
    if snap.pause_until is not None and snap.pause_until > now:
        title += " until " + clock_time(snap.pause_until, now)
    return title


def clock_time(epoch: float, now: float) -> str:
    """ "14:30" today, "Mon 14:30" on another day (local time)."""
    moment, today = time.localtime(epoch), time.localtime(now)
    if (moment.tm_year, moment.tm_yday) == (today.tm_year, today.tm_yday):
        return time.strftime("%H:%M", moment)
    return time.strftime("%a %H:%M", moment)


def _downloading(snap: NodeSnapshot, now: float) -> Headline | None:
    active = next((d for d in snap.downloads if not d.finished and not d.error), None)
    if active is None:
        return None
    what = f"the {active.kind}"
    share = f" · {active.fraction * 100:.0f} %" if active.fraction is not None else ""
    if active.held is not None:
        title = f"Download waiting{share}"
        return _make("downloading", title, held_words(active), "none", f"Waiting to download {what}")
    title = f"Downloading {what}{share}"
    return _make("downloading", title, download_detail(active), "pause", f"Downloading {what}")


def held_words(download: DownloadProgress) -> str:
    """Why a download waits, in a person's words."""
    detail = download.held_detail
    return {
        "paused_by_you": "Paused by you",
        "paused": "Paused while serving is paused",
        "game": f"Paused while you play {detail}" if detail else "Paused while you play",
        "budget": f"Monthly download limit reached: waits {detail}" if detail else "Monthly download limit reached",
        "setup": "Waits until you finish setting up",
    }.get(download.held or "", "Waiting")


def download_detail(download: DownloadProgress) -> str:
    """ "1.2 of 4.2 GiB · 8.1 MiB/s · 6 min left"."""
    if download.total_bytes is None and download.done_bytes == 0:
        return download.step or ""
    done = _size(download.done_bytes)
    parts = [f"{done} of {_size(download.total_bytes)}" if download.total_bytes else done]
    if download.rate_bps:
        parts.append(f"{download.rate_bps / MIB:.1f} MiB/s")
    if download.eta_s is not None:
        parts.append(_time_left(download.eta_s))
    return " · ".join(parts)


def _size(nbytes: int) -> str:
    mib = nbytes / MIB
    return f"{mib:,.0f} MiB" if mib < 1024 else f"{mib / 1024:,.1f} GiB"


def _time_left(seconds: float) -> str:
    if seconds < 60:
        return "less than a minute left"
    minutes = round(seconds / 60)
    if minutes < 60:
        return f"{minutes} min left"
    return f"{minutes // 60} h {minutes % 60} min left"


def _tuning(snap: NodeSnapshot, now: float) -> Headline | None:
    progress = snap.tuning.progress if snap.tuning is not None else None
    if progress is None:
        return None
    return _make("tuning", progress, "Measuring faster settings for this computer; requests wait meanwhile",
                 "pause", "Tuning: requests wait until the trials end")


def _starting(snap: NodeSnapshot, now: float) -> Headline | None:
    if snap.state not in ("starting", "configured") or snap.assignment_id is None:
        return None
    restarting = next((e for e in snap.engines if e.state == "starting" and e.failures_in_a_row > 0), None)
    if restarting is not None:
        detail = f"Restarting ({restarting.failures_in_a_row} of {restarting.restart_limit})"
    else:
        detail = snap.model or ""
    return _make("starting", "Starting", detail, "pause", "Starting the engine")


def _serving(snap: NodeSnapshot, now: float) -> Headline | None:
    if snap.state not in ("ready", "degraded"):
        return None
    reason = _network_reason(snap.routing)
    if snap.state == "ready":
        return _make("serving", f"Serving · {snap.model}", "", "pause", reason)
    detail = next((e.last_error for e in snap.engines if e.state not in ("ready", "degraded") and e.last_error),
                  "Some engines are not serving")
    return _make("degraded", f"Serving with problems · {snap.model}", detail, "pause", reason)


def _idle(snap: NodeSnapshot) -> Headline:
    connecting = snap.connection.state == "connecting"
    waiting = "Connecting to the network" if connecting else "Waiting for the network to assign a model"
    return _make("idle", "Idle", waiting, "none", _network_reason(snap.routing) or waiting)


def _network_reason(routing: RoutingNotice | None) -> str | None:
    """The network's words when it sends this node nothing; None while it sends some."""
    if routing is None or routing.share > 0:
        return None
    if routing.message:
        return f"The network says: {routing.message}"
    return _ROUTING_WORDS.get(routing.reason or "", "The network sends this computer no requests right now")
