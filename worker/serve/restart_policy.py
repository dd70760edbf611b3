"""The supervisor's decisions, pure: which arguments to start with, what to do after an
attempt ended, how long to wait, and what the engine's log said during an attempt.

An attempt's end is classified from its log first (vLLM's free-memory refusal, a context the KV
cache cannot hold, out of memory), its exit status second; `next_step` turns that into retry,
fall back a tier, wait for memory another program holds, or give up. `worker.serve.supervisor` runs the
process and acts on these.

A ready engine that dies by itself while serving requests was crashed by a request (`by_request`):
the caller's doing, not the engine's, so it restarts at once and never counts toward giving up
(that rule is for engines that cannot start). `RequestCrashes` keeps the node's count of them:
three within ten minutes and constrained decoding, the way such requests get in, is refused for
the rest of the run (contract, Relay, "Bounded requests").

On Windows a start that does not fit may not fail: since driver 536.40 CUDA moves what the card
cannot hold into shared system memory (the "sysmem fallback") and the engine runs many times
slower instead. `spill` tells it from what the engine logged it allocated on each card
(`DeviceBufferLog`, llama.cpp) against what NVML saw the card's memory grow by; `AttemptFacts.spilled`
makes that an `oom` ending, so the lower tier is tried as after a failed allocation.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from worker.serve import process as procs
from worker.engines.base import (
    ContextSize,
    ContextTooLong,
    FreeMemoryShort,
    KvCacheMemory,
    KvCachePart,
    KvCacheSize,
    LogFact,
    MaxConcurrency,
    MaxModelLen,
    OutOfMemory,
    PhaseReached,
    Slots,
)
from worker.contract.events import EngineSnapshot
from worker.plan.planner import EnginePlan
from worker.system.backoff import DoublingBackoff

log = logging.getLogger(__name__)

ERROR_LINES_SHOWN = 8
DETAIL_LINES_KEPT = 40
# Where the engine runs: on a graphics card, or in RAM (vLLM's CPU build).
MEMORY_WAIT_REASON = "Another program is using the GPU's memory; waiting for it to free up"
RAM_WAIT_REASON = "Other programs are using the computer's memory (RAM) the model needs; waiting for it to free up"
# A request the relay saw break this long before the supervisor saw the exit was still in flight
# when the engine died: the engine's sockets close just before its exit is reported, so the
# relay can end a request first (milliseconds apart; a core dump comes before both).
REQUEST_CRASH_GRACE_S = 1.0
REQUEST_CRASH_LIMIT = 3
REQUEST_CRASH_WINDOW_S = 600.0
# What a card's memory must have grown by, at least, less what the engine logged it allocated
# there: the engine's CUDA context (not logged) adds a few hundred MiB; other programs' own use
# moves NVML's figure by less than this while an engine starts.
SPILL_MARGIN_MIB = 512
SPILL_FULL_SHARE = 0.9  # the driver spills only once a card's memory is (nearly) all used


RestartBackoff = DoublingBackoff  # delay before the n-th restart in a row


@dataclass(frozen=True)
class SupervisorTiming:
    ready_timeout_s: float = 1800.0  # a large vLLM model compiles and captures graphs for many minutes
    poll_s: float = 0.5
    request_timeout_s: float = 10.0
    probe_timeout_s: float = 60.0
    probe_max_tokens: int = 4
    health_interval_s: float = 5.0
    health_timeout_s: float = 10.0  # a /health slower than this counts as failed
    health_failures: int = 3  # consecutive failed /health checks before a restart
    memory_wait: RestartBackoff = RestartBackoff(initial_s=2.0, maximum_s=60.0)  # while another program holds the card
    stable_after_s: float = 60.0  # an engine that ran this long did not crash "fast"
    max_fast_failures: int = 5
    output_settle_s: float = 2.0  # after an exit, for the last lines to be read
    stop: procs.StopTiming = procs.StopTiming()


EndKind = Literal["oom", "context", "free_memory", "crashed", "unhealthy", "timeout", "unstartable"]


@dataclass(frozen=True)
class Ended:
    """How one attempt (one engine process) ended."""

    kind: EndKind
    message: str
    uptime_s: float
    was_ready: bool
    lines: tuple[str, ...] = ()  # the engine's last lines of output (what a person finds under Details)
    by_request: bool = False  # a ready engine died by itself while serving requests
    in_ram: bool = False  # a free-memory refusal of RAM (the engine runs on the CPU), not of a card


@dataclass(frozen=True)
class Step:
    """What to do next: `retry` (same args), `fallback` (the next option), `wait` (for memory
    another program holds, then the same args), or `fail`."""

    action: Literal["retry", "fallback", "wait", "fail"]
    reason: str
    delay_s: float = 0.0


def start_options(plan: EnginePlan) -> tuple[tuple[str | None, tuple[str, ...]], ...]:
    """The planned args, then once the next lower tier, then base args alone (duplicates dropped)."""
    options = [(plan.tier, tuple(plan.args))]
    if plan.fallbacks:
        options += [plan.fallbacks[0], plan.fallbacks[-1]]
    unique: list[tuple[str | None, tuple[str, ...]]] = []
    for tier, args in options:
        if (tier, tuple(args)) not in unique:
            unique.append((tier, tuple(args)))
    return tuple(unique)


def tier_name(tier: str | None) -> str:
    return f"tier {tier}" if tier is not None else "base args"


_TOO_BIG = {"oom": "out of memory while starting", "context": "the KV cache cannot hold the context"}


def next_step(ended: Ended, *, option: int, options: int, fast_failures: int, tier: str | None,
              next_tier: str | None, timing: SupervisorTiming, backoff: RestartBackoff, memory_waits: int = 1) -> Step:
    """Pure: the step after an attempt ended. `fast_failures` counts this one if it was fast;
    `memory_waits` the free-memory refusals in a row, this one included."""
    if ended.kind == "free_memory":
        reason = RAM_WAIT_REASON if ended.in_ram else MEMORY_WAIT_REASON
        return Step("wait", reason, timing.memory_wait.delay(memory_waits))
    if ended.by_request:
        return Step("retry", f"restarting at once: {ended.message}")
    if ended.kind == "unstartable":
        return Step("fail", ended.message)
    if ended.kind in _TOO_BIG and not ended.was_ready:
        if option + 1 < options:
            return Step("fallback", f"{_TOO_BIG[ended.kind]} on {tier_name(tier)}; retrying on {tier_name(next_tier)}")
        if ended.kind == "context":
            return Step("fail", ended.message)
        return Step("fail", f"The engine ran out of GPU memory while starting, even with {tier_name(tier)}. "
                            f"Free GPU memory (close other programs using the GPU) and try again. {ended.message}")
    if fast_failures >= timing.max_fast_failures:
        return Step("fail", f"The engine failed {fast_failures} times in a row within "
                            f"{timing.stable_after_s:.0f} s of starting; gave up. The last one: {ended.message}")
    return Step("retry", f"restarting: {ended.message}", backoff.delay(max(1, fast_failures)))


def crashed_by_request(ended: Ended, *, in_flight: int, since_last_request_s: float | None) -> Ended:
    """`ended`, marked `by_request` when a ready engine died by itself (it crashed or ran out of
    memory; the supervisor did not stop it) with requests in flight: `in_flight` at the exit, or
    one that ended no more than `REQUEST_CRASH_GRACE_S` before it (`since_last_request_s`, None
    when none has)."""
    busy = in_flight > 0 or (since_last_request_s is not None and since_last_request_s <= REQUEST_CRASH_GRACE_S)
    if not (ended.was_ready and ended.kind in ("crashed", "oom") and busy):
        return ended
    message = ("a request crashed the engine while it was serving (this is no failure to start and is not "
               f"counted as one); {ended.message}")
    return dataclasses.replace(ended, by_request=True, message=message)


class RequestCrashes:
    """The node's crashes caused by requests, over its whole run: from the `limit`-th within
    `window_s` on, constrained decoding is refused (`refusal`) until the node stops."""

    def __init__(self, *, limit: int = REQUEST_CRASH_LIMIT, window_s: float = REQUEST_CRASH_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._limit = limit
        self._window_s = window_s
        self._clock = clock
        self._recent: collections.deque[float] = collections.deque(maxlen=limit)
        self.refusal: str | None = None  # why constrained decoding is refused; None while it is not

    def record(self) -> bool:
        """One more crash a request caused; True when this one turns constrained decoding off."""
        now = self._clock()
        self._recent.append(now)
        if self.refusal is not None or len(self._recent) < self._limit or now - self._recent[0] > self._window_s:
            return False
        self.refusal = (f"this node no longer takes grammars, JSON schemas, regexes or tools: requests crashed its "
                        f"engine {self._limit} times within {self._window_s / 60:.0f} minutes, so it refuses "
                        "constrained decoding until it restarts; send the request without them, or to another node")
        log.warning("requests crashed the engine %d times within %.0f s: constrained decoding is refused until "
                    "the node restarts", self._limit, self._window_s)
        return True


@runtime_checkable
class DeviceBufferLog(Protocol):
    """An engine whose log says what it allocated on each card (llama.cpp), for `spill`."""

    def device_buffer(self, line: str) -> tuple[int, float] | None:
        """(CUDA device number among the engine's cards, MiB) where `line` names a buffer on a card."""


@dataclass(frozen=True)
class CardMemory:
    """NVML's reading of one card's memory, MiB: used by every process together, and its total
    (None where not read)."""

    used_mib: int
    total_mib: int | None = None


def spill(device_mib: Mapping[int, float], gpu_indices: Sequence[int], before: Mapping[int, CardMemory],
          after: Mapping[int, CardMemory]) -> str | None:
    """Pure: why the engine's start spilled into shared system memory, or None. `device_mib`: what
    it logged it allocated on its CUDA device k (`gpu_indices[k]`, the order CUDA_VISIBLE_DEVICES
    gives); `before`/`after`: NVML's readings by GPU index before it started and once ready (a
    card missing from `before` counts as empty, which only misses a spill smaller than what others
    held). A spill is a card, (nearly) full, whose memory grew by less than was allocated on it."""
    for device, allocated in sorted(device_mib.items()):
        if device >= len(gpu_indices) or (now := after.get(gpu_indices[device])) is None:
            continue
        index = gpu_indices[device]
        grew = now.used_mib - (before[index].used_mib if index in before else 0)
        full = now.total_mib is None or now.used_mib >= SPILL_FULL_SHARE * now.total_mib
        if allocated - grew > SPILL_MARGIN_MIB and full:
            return (f"the model does not fit in GPU {index}'s memory: the engine put {allocated:,.0f} MiB on it, "
                    f"but the card's memory grew by only {grew:,} MiB. Windows moved the rest into the "
                    "computer's shared memory, which makes it many times slower")
    return None


def context_refusal(fact: ContextTooLong) -> str:
    if fact.model_max:
        return (f"The engine refused context length {fact.max_seq_len}: the model itself takes at most "
                f"{fact.estimated_max_len} tokens. Lower {fact.flag} to {fact.estimated_max_len} or less.")
    estimate = (f"; with the memory there is, it estimates at most {fact.estimated_max_len} tokens"
                if fact.estimated_max_len is not None else "")
    lower = f" to {fact.estimated_max_len} or less" if fact.estimated_max_len is not None else ""
    return (f"The engine refused max model len {fact.max_seq_len}: its KV cache does not fit in GPU memory"
            f"{estimate}. Lower {fact.flag}{lower}, or free GPU memory.")


@dataclass
class AttemptFacts:
    """What the log said during one attempt: figures for the snapshot as they come, failures kept
    to explain how the attempt ended. Made anew for each attempt."""

    oom: str | None = None
    too_long: ContextTooLong | None = None
    free_memory: FreeMemoryShort | None = None
    slots: Slots | None = None
    kv_mib: float = 0.0  # llama.cpp: every KV cache of this start together
    kv_cells: int | None = None  # llama.cpp: the full-attention cache's cells (the largest)
    device_mib: dict[int, float] = field(default_factory=dict)  # llama.cpp: MiB it allocated per CUDA device

    def note_device_buffer(self, buffer: tuple[int, float] | None) -> None:
        """One buffer the engine allocated on a card (`DeviceBufferLog.device_buffer`; None: the
        line named none)."""
        if buffer is not None:
            device, mib = buffer
            self.device_mib[device] = self.device_mib.get(device, 0.0) + mib

    def spilled(self, gpu_indices: Sequence[int], before: Mapping[int, CardMemory],
                after: Mapping[int, CardMemory], uptime_s: float) -> Ended | None:
        """An `oom` ending for a ready engine whose start spilled into shared system memory
        (`spill`), else None. It never served, so it counts as a start that did not fit
        (`was_ready` False): the next tier is tried."""
        message = spill(self.device_mib, gpu_indices, before, after)
        return None if message is None else Ended("oom", message, uptime_s, False)

    def absorb(self, fact: LogFact, snap: EngineSnapshot) -> EngineSnapshot:
        """`snap` with what `fact` says; a new start-up phase shows as a changed `phase` (the
        supervisor reports that as an event)."""
        if isinstance(fact, PhaseReached):
            return dataclasses.replace(snap, phase=fact.phase) if snap.state == "starting" else snap
        if isinstance(fact, KvCacheSize):
            concurrency = fact.concurrency.times if fact.concurrency else snap.max_concurrency
            return dataclasses.replace(snap, kv_cache_tokens=fact.tokens, max_concurrency=concurrency,
                                       context=dataclasses.replace(snap.context, physical=fact.tokens))
        if isinstance(fact, KvCachePart):
            return self._add_kv_part(fact, snap)
        if isinstance(fact, MaxConcurrency):
            return dataclasses.replace(snap, max_concurrency=fact.times)
        if isinstance(fact, KvCacheMemory):
            return dataclasses.replace(snap, kv_cache_gib=fact.gib)
        if isinstance(fact, (MaxModelLen, ContextSize)):
            tokens = fact.tokens if isinstance(fact, MaxModelLen) else fact.n_ctx
            return dataclasses.replace(snap, context=dataclasses.replace(snap.context, requested=tokens))
        if isinstance(fact, Slots):
            self.slots = fact
            return dataclasses.replace(snap, max_concurrency=float(fact.n_slots))
        self._note_failure(fact)
        return snap

    def _add_kv_part(self, part: KvCachePart, snap: EngineSnapshot) -> EngineSnapshot:
        """llama.cpp's budget over this start's caches: their memory together, and the cells of the
        full-attention one (the largest) as tokens, never a sum (engines.md B2)."""
        self.kv_mib += part.mib
        if part.cells is not None:
            self.kv_cells = max(part.cells, self.kv_cells or 0)
        snap = dataclasses.replace(snap, kv_cache_gib=round(self.kv_mib / 1024, 3))
        if self.kv_cells is None:
            return snap
        return dataclasses.replace(snap, kv_cache_tokens=self.kv_cells,
                                   context=dataclasses.replace(snap.context, physical=self.kv_cells))

    def _note_failure(self, fact: LogFact) -> None:
        if isinstance(fact, ContextTooLong):
            self.too_long = fact
        elif isinstance(fact, FreeMemoryShort):
            self.free_memory = self.free_memory or fact
        elif isinstance(fact, OutOfMemory):
            self.oom = self.oom or fact.message

    def ending(self, status: int, tail: Sequence[str], uptime_s: float, was_ready: bool) -> Ended:
        """How an attempt whose process exited with `status` ended: what the log said explains it
        better than the status; else the last lines of output (`tail`) say what there is."""
        lines = tuple(line for line in tail if line.strip())[-DETAIL_LINES_KEPT:]
        if self.free_memory is not None:
            return Ended("free_memory", self.free_memory.message, uptime_s, was_ready, lines,
                         in_ram=self.free_memory.in_ram)
        if self.too_long is not None:
            return Ended("context", context_refusal(self.too_long), uptime_s, was_ready, lines)
        if self.oom is not None:
            return Ended("oom", self.oom, uptime_s, was_ready, lines)
        detail = "\n".join(lines[-ERROR_LINES_SHOWN:]) if lines else "(no output)"
        return Ended("crashed", f"the engine exited with status {status}; last lines:\n{detail}", uptime_s, was_ready,
                     lines)
