"""How figures read on screen: one place for labels, units and colours, shared by every view."""

from __future__ import annotations

import time
from typing import Literal

from worker.node.autopause import GAMES_NOT_SEEN
from worker.contract.events import EngineSnapshot, GpuSnapshot, HeadlineKind, NodeSnapshot, Tuned, TuningSnapshot

TrayState = Literal["idle", "starting", "serving", "paused", "degraded", "failed"]

STATE_COLOURS: dict[TrayState, str] = {  # white text on each reads at 4.5:1 or better, in both schemes
    "idle": "#6B7280",
    "starting": "#2563EB",
    "serving": "#15803D",
    "paused": "#B45309",
    "degraded": "#C2410C",
    "failed": "#DC2626",
}

HEADLINE_STATES: dict[HeadlineKind, TrayState] = {  # the icon's colour and glyph for the core's one state
    "setup": "paused",  # waiting for the person, as a pause does
    "detecting": "starting",
    "stopping": "idle",
    "signed_out": "failed",  # earns nothing until the person acts
    "failed": "failed",
    "offline": "degraded",  # it tries again by itself
    "paused": "paused",
    "downloading": "starting",
    "tuning": "starting",
    "starting": "starting",
    "degraded": "degraded",
    "serving": "serving",
    "idle": "idle",
}

PAUSE_KINDS: frozenset[HeadlineKind] = frozenset({"serving", "starting", "downloading", "tuning", "degraded"})

PHASE_STEPS = ("provisioning", "launching", "loading", "compiling", "capturing", "warming", "ready")


def tray_state(snapshot: NodeSnapshot) -> TrayState:
    """The six looks a person tells apart at a glance, from the core's one headline."""
    return HEADLINE_STATES[snapshot.headline.kind]


def offers_pause(snapshot: NodeSnapshot) -> bool:
    """Pausing means something only while the node works (never for a failure, setup or offline)."""
    return snapshot.headline.kind in PAUSE_KINDS


def games_seen(snapshot: NodeSnapshot) -> bool:
    """The game pause can work here: some games can be seen (it is offered only then)."""
    return snapshot.game_detection != GAMES_NOT_SEEN


def clock_time(epoch: float, now: float | None = None) -> str:
    """ "14:30" today, "Mon 14:30" on another day."""
    moment = time.localtime(epoch)
    today = time.localtime(now if now is not None else time.time())
    if moment.tm_yday == today.tm_yday and moment.tm_year == today.tm_year:
        return time.strftime("%H:%M", moment)
    return time.strftime("%a %H:%M", moment)


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


FINDING_GPUS = "Finding your GPUs…"
CPU_ONLY = "No graphics card found: this computer will serve small models on its CPU."


def gpu_line(gpu: GpuSnapshot) -> str:
    return f"GPU {gpu.index}: {gpu.name}, {gib(gpu.memory_total_mib)}"


def machine_summary(snapshot: NodeSnapshot) -> str:
    """What the core found, in a gamer's words: the GPUs and the memory they give to serving."""
    if snapshot.detecting:
        return FINDING_GPUS
    if not snapshot.gpus:
        return CPU_ONLY
    lines = [gpu_line(g) for g in snapshot.gpus]
    lines.append(f"{gib(snapshot.effective_vram_mib)} of graphics memory usable for serving")
    return "\n".join(lines)


def tokens_short(tokens: int) -> str:
    """ "32k" for 32,768, "128k" for 131,072, "900" below a thousand."""
    if tokens < 1000:
        return str(tokens)
    thousands = tokens // 1024 if tokens % 1024 == 0 else round(tokens / 1000)
    return f"{thousands}k"


def context_words(engine: EngineSnapshot) -> str:
    """ "32k tokens per chat, 8 chats at once": what a person can do with the engine's memory."""
    servable = engine.context.servable or engine.context.requested
    if servable is None:
        return "Known once the model has loaded"
    words = f"{tokens_short(servable)} tokens per chat"
    if engine.max_concurrency is None:
        return words
    chats = max(1, int(engine.max_concurrency))
    return f"{words}, {chats} chat{'s' if chats != 1 else ''} at once"


def kv_tooltip(engine: EngineSnapshot) -> str:
    """The numbers behind `context_words`, for the curious (a tooltip, not the screen)."""
    if engine.kv_cache_tokens is None:
        return "The memory for conversations is measured once the model has loaded."
    size = "" if engine.kv_cache_gib is None else f" ({engine.kv_cache_gib:.1f} GiB)"
    return f"Memory for conversations (KV cache): {engine.kv_cache_tokens:,} tokens{size}."


def gpus_words(gpu_indices: tuple[int, ...], layout: str) -> str:
    """How an engine uses its GPUs: "2 GPUs working as one", "GPU 0", "the CPU"."""
    if not gpu_indices:
        return "the CPU"
    if len(gpu_indices) == 1:
        return f"GPU {gpu_indices[0]}"
    n = len(gpu_indices)
    return {
        "tensor": f"{n} GPUs working as one",
        "layers": f"{n} GPUs sharing the model",
        "replica": f"{n} GPUs, a copy on each",
    }.get(layout, f"{n} GPUs")


def groups_words(groups: tuple[tuple[int, ...], ...]) -> str:
    """The plan for the GPUs: "2 GPUs working as one", "2 GPUs, each on its own"."""
    if not groups:
        return ""
    if len(groups) == 1:
        return gpus_words(groups[0], "tensor")
    if all(len(g) == 1 for g in groups):
        return f"{len(groups)} GPUs, each on its own"
    return " and ".join(gpus_words(g, "tensor") for g in groups)


def engine_state_words(engine: EngineSnapshot) -> str:
    """ "Serving", "Starting", "Restarting (3 of 5)", "Failed"."""
    if engine.state == "starting" and engine.failures_in_a_row > 0:
        return f"Restarting ({engine.failures_in_a_row} of {engine.restart_limit})"
    return {"ready": "Serving"}.get(engine.state, engine.state.capitalize())


def retry_words(retry_at: float | None, now: float | None = None) -> str:
    """ "Trying again at 14:32", or "" when nothing will be retried by itself."""
    if retry_at is None:
        return ""
    return f"Trying again at {clock_time(retry_at, now)}"


def tuned_words(tuned: Tuned | None) -> str:
    """ "Serves 8 requests at once instead of 1 · 42% faster, measured on this computer"."""
    if tuned is None:
        return ""
    said = "; ".join(tuned.words) or "Other engine settings"
    return f"{said[:1].upper()}{said[1:]} · {tuned.gain_pct:.0f}% faster, measured on this computer"


def tuning_line(tuning: TuningSnapshot | None) -> str:
    """Where the search for this computer's own settings stands, in a sentence ("" when there is none)."""
    if tuning is None:
        return ""
    if tuning.progress:
        gain = f"; best so far {tuning.best_gain_pct:.0f}% faster" if tuning.best_gain_pct else ""
        return (f"{tuning.progress}: trying other settings to serve faster on this computer{gain}. "
                "Requests go to other computers meanwhile.")
    if tuning.state == "refused":
        return f"Not tuning ({tuning.refused or 'the network asked for something this app does not try'}); " \
               "serving with the network's settings."
    if tuning.state == "done" and tuning.chosen is not None:
        return "Tuned for this computer: " + tuned_words(tuning.chosen)
    return {
        "done": "Tried other settings; none was reliably faster here, so the network's settings stay.",
        "cancelled": "Tuning stopped before it finished; it carries on later.",
        "failed": "Tuning could not finish; serving with the network's settings.",
    }.get(tuning.state, "")
