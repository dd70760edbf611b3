"""How figures read on screen: one place for labels, units and colours, shared by every view."""

from __future__ import annotations

import time
from typing import Literal

from worker.events import NodeSnapshot, PauseReason

TrayState = Literal["idle", "starting", "serving", "paused", "degraded", "failed"]

STATE_COLOURS: dict[TrayState, str] = {
    "idle": "#8A94A6",
    "starting": "#3B82F6",
    "serving": "#16A34A",
    "paused": "#D97706",
    "degraded": "#EA580C",
    "failed": "#DC2626",
}

_STATE_TITLES: dict[TrayState, str] = {
    "idle": "Idle",
    "starting": "Starting",
    "serving": "Serving",
    "paused": "Paused",
    "degraded": "Degraded",
    "failed": "Failed",
}

_PAUSE_WHY: dict[PauseReason, str] = {
    "user": "by you",
    "timed": "by you",
    "game": "for a game",
    "schedule": "outside serve hours",
    "coordinator": "by the network",
}

PHASE_STEPS = ("provisioning", "launching", "loading", "compiling", "capturing", "warming", "ready")


def tray_state(snapshot: NodeSnapshot) -> TrayState:
    """The six states a person tells apart at a glance (a pause wins over what engines do)."""
    if snapshot.paused:
        return "paused"
    mapping: dict[str, TrayState] = {
        "ready": "serving",
        "starting": "starting",
        "degraded": "degraded",
        "failed": "failed",
        "paused": "paused",
    }
    return mapping.get(snapshot.state, "idle")


def state_title(snapshot: NodeSnapshot) -> str:
    return _STATE_TITLES[tray_state(snapshot)]


def pause_line(snapshot: NodeSnapshot, now: float | None = None) -> str:
    """ "Paused for a game", "Paused by you until 14:30", or "" when serving."""
    if not snapshot.paused:
        return ""
    why = _PAUSE_WHY.get(snapshot.pause_reason or "user", "by you")
    if snapshot.pause_reason == "game" and snapshot.pause_detail:
        why = f"for {snapshot.pause_detail}"
    line = f"Paused {why}"
    if snapshot.pause_until is not None and snapshot.pause_until > (now if now is not None else time.time()):
        line += " until " + clock_time(snapshot.pause_until, now)
    return line


def clock_time(epoch: float, now: float | None = None) -> str:
    """ "14:30" today, "Mon 14:30" on another day."""
    moment = time.localtime(epoch)
    today = time.localtime(now if now is not None else time.time())
    if moment.tm_yday == today.tm_yday and moment.tm_year == today.tm_year:
        return time.strftime("%H:%M", moment)
    return time.strftime("%a %H:%M", moment)


def status_line(snapshot: NodeSnapshot) -> str:
    """The menu's first line: state, then the model or the reason."""
    if snapshot.paused:
        return pause_line(snapshot)
    title = state_title(snapshot)
    if snapshot.model and tray_state(snapshot) in ("serving", "starting", "degraded"):
        return f"{title} · {snapshot.model}"
    if snapshot.problem is not None and tray_state(snapshot) == "failed":
        return f"{title}: {snapshot.problem.title}"
    return title


def gib(mib: float | None) -> str:
    if mib is None:
        return "—"
    return f"{mib / 1024:.1f} GiB"


def rate(tokens_per_s: float | None) -> str:
    if tokens_per_s is None:
        return "—"
    return f"{tokens_per_s:,.1f} tok/s" if tokens_per_s < 100 else f"{tokens_per_s:,.0f} tok/s"


def number(value: float | None, unit: str = "", digits: int = 0) -> str:
    if value is None:
        return "—"
    text = f"{value:,.{digits}f}"
    return f"{text} {unit}".strip()


def money(amount: float, currency: str) -> str:
    symbols = {"USD": "$", "EUR": "€", "GBP": "£", "JPY": "¥"}
    sign = "−" if amount < 0 else ""
    symbol = symbols.get(currency.upper())
    if symbol:
        return f"{sign}{symbol}{abs(amount):,.2f}"
    return f"{sign}{abs(amount):,.2f} {currency.upper()}"


def tooltip(snapshot: NodeSnapshot) -> str:
    """State, model, tok/s and today's earnings, in the few lines a tray tooltip shows."""
    lines = ["GPU Provider — " + status_line(snapshot)]
    if snapshot.model:
        lines.append(f"{snapshot.model} · {rate(snapshot.throughput.tokens_per_s)}")
    lines.append("Today: " + money(snapshot.earnings.net_today, snapshot.earnings.currency) + " net")
    return "\n".join(lines)


def machine_summary(snapshot: NodeSnapshot) -> str:
    """One line per GPU and the totals, as detected by the core."""
    if not snapshot.gpus:
        return f"No GPU detected (runtime {snapshot.runtime}). This computer can serve small models on its CPU."
    lines = [f"GPU {g.index}: {g.name}, {gib(g.memory_total_mib)}" for g in snapshot.gpus]
    lines.append(f"Runtime {snapshot.runtime} · {gib(snapshot.effective_vram_mib)} usable for serving")
    return "\n".join(lines)
