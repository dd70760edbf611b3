"""What auto-tune may change in llama-server's arguments, and what a change must keep.

Pure. Knobs are flags of `args.ALLOWLIST` only. The per-request context is never tuned: without a
unified KV buffer each slot gets `-c` ÷ `-np` (engines.md B, "Server slots"), so a change of `-np`
brings `-c` with it; threads never exceed the machine's cores. No field note has a llama.cpp
recipe or a log line that betrays a fast-looking trap, so there are no seeds and no traps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

from worker.engines.base import EngineTuning, Knob, argument_values, set_arguments
from worker.engines.llamacpp.args import ALLOWLIST, MAX_BATCH, MAX_CONTEXT, MAX_SLOTS, MAX_THREADS

if TYPE_CHECKING:
    from worker.hardware.model import Machine

AUTO_SLOTS = 4  # `-np -1`, the default: four slots sharing one KV buffer (engines.md B, "Auto parallel")

KNOBS = (
    Knob("-np", "int", 1, MAX_SLOTS, grows_memory=True),
    # `common/common.h`: n_batch 2048, n_ubatch 512
    Knob("-b", "int", 1, MAX_BATCH, default="2048", grows_memory=True),
    Knob("-ub", "int", 1, MAX_BATCH, default="512", grows_memory=True),
    Knob("-t", "int", 1, MAX_THREADS),
    Knob("-tb", "int", 1, MAX_THREADS),
    Knob("-fa", "choice", choices=("off", "auto", "on"), default="auto"),
    Knob("--spec-draft-n-max", "int", 0, 64, scale="linear", needs=("--spec-type",)),
    Knob("-cb", "switch", choices=("on", "off"), off="-nocb", default="on"),
)

# Context (per request: `-c` follows `-np`), KV precision, what lives on which device, the cache
# kept in RAM, and the chat template: never tuned.
NEVER = frozenset({
    "-c", "--ctx-size", "-ctk", "--cache-type-k", "-ctv", "--cache-type-v", "-ngl", "--gpu-layers",
    "--n-gpu-layers", "-kvo", "--kv-offload", "-nkvo", "--no-kv-offload", "-cmoe", "--cpu-moe", "-ncmoe",
    "--n-cpu-moe", "-kvu", "--kv-unified", "-no-kvu", "--no-kv-unified", "--swa-full", "-cram", "--cache-ram",
    "--jinja", "--no-jinja",
})


def _slots(values: Mapping[str, str]) -> int | None:
    """Slots, or None for automatic (`-1`, or no `-np`)."""
    slots = values.get("-np", "-1")
    return None if slots == "-1" else int(slots)


def _unified(values: Mapping[str, str]) -> bool:
    """Whether all slots share one KV buffer: `-kvu`, or automatic slots unless `-no-kvu`."""
    if "-kvu" in values:
        return values["-kvu"] == "on"
    return _slots(values) is None


def _context(baseline: Mapping[str, str], tuned: Mapping[str, str]) -> dict[str, str] | None:
    """What `tuned` must add so each request keeps the baseline's context, or None where it cannot
    (the model's own context, `-c 0`, split over another number of slots)."""
    merged = {**baseline, **tuned}
    extra: dict[str, str] = {}
    if _unified(baseline) and "-kvu" not in baseline and "-np" in tuned and "-kvu" not in tuned:
        extra["-kvu"] = "on"  # automatic slots' one shared buffer, kept once the slots are counted
    unified_before, unified_after = _unified(baseline), _unified({**merged, **extra})
    slots_before, slots_after = _slots(baseline) or AUTO_SLOTS, _slots(merged) or AUTO_SLOTS
    total = int(baseline.get("-c", "0"))
    if unified_before == unified_after and (unified_after or slots_before == slots_after):
        return extra
    if total == 0:
        return None
    per_request = total if unified_before else total // slots_before
    wanted = per_request if unified_after else per_request * slots_after
    if wanted > MAX_CONTEXT:
        return None
    extra["-c"] = str(wanted)
    return extra


def fix(baseline: Sequence[str], tuned: Sequence[str], machine: Machine) -> tuple[str, ...] | None:
    """`tuned` with `-c` scaled to its slots and threads held to the machine's cores; None where
    the batch sizes or drafts contradict each other or the context cannot be kept."""
    before, mine = argument_values(baseline, ALLOWLIST), argument_values(tuned, ALLOWLIST)
    extra = _context(before, mine)
    if extra is None:
        return None
    for flag in ("-t", "-tb"):
        if flag in mine and int(mine[flag]) > machine.cpu_cores:
            extra[flag] = str(machine.cpu_cores)
    merged = {**before, **mine, **extra}
    if int(merged.get("-ub", "512")) > int(merged.get("-b", "2048")):
        return None  # llama.cpp would clamp it to -b: the same run as another candidate
    if int(merged.get("--spec-draft-n-min", "0")) > int(merged.get("--spec-draft-n-max", "64")):
        return None
    return set_arguments(tuned, extra, ALLOWLIST) if extra else tuple(tuned)


def defaults(machine: Machine) -> Mapping[str, str]:
    """llama-server computes with one thread per core where no `-t` says otherwise."""
    return {"-t": str(machine.cpu_cores), "-tb": str(machine.cpu_cores)}


TUNING = EngineTuning(knobs=KNOBS, never=NEVER, constrain=fix, defaults=defaults)
