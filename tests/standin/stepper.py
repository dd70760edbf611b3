"""The stand-in's scheduler when performance.py paces it: vLLM's step loop in miniature.

Each step admits waiting requests up to `--max-num-seqs`, gives every decoding request 1 + drafts
tokens of the `--max-num-batched-tokens` budget and the rest to prefill chunks (first come, first
served), sleeps what performance.py says the step costs, then hands out tokens: a request whose
prompt finished gets its first token, a decoding one what its drafts earned (fractions carry over).
It logs what vLLM logs meanwhile: the SpecDecoding metrics line every VLLM_LOG_STATS_INTERVAL
(scaled), and the DSpark drafter's graph failure when note 004's trap trips.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from tests.standin.performance import Performance, PromptClass, accepted_per_position, whole_tokens

# vLLM 0.33 `vllm/v1/spec_decode/metrics.py:120-136` (engines.md 23b)
SPEC_LINE = ("SpecDecoding metrics: Mean acceptance length: {mean:.2f}, Accepted throughput: {acc_tps:.2f} tokens/s, "
             "Drafted throughput: {drafted_tps:.2f} tokens/s, Accepted: {accepted} tokens, Drafted: {drafted} tokens, "
             "Per-position acceptance rate: {positions}, Avg Draft acceptance rate: {rate:.1f}%")
# `vllm/v1/spec_decode/dspark.py` `_DSparkForwardCUDAGraph.__call__` (logger.warning with exc_info), in
# vLLM's main branch (commit 26a86f5); the 0.32 CPU build has no DSpark wrapper
DSPARK_GRAPH_OFF = "Disabling DSpark draft forward CUDA graph after capture failure"
DSPARK_TRACE = (
    "Traceback (most recent call last):",
    '  File "/opt/vllm/lib/python3.12/site-packages/vllm/v1/spec_decode/dspark.py", line 177, in __call__',
    "    with torch.cuda.graph(graph):",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 512.00 MiB. GPU 0 has a total capacity of "
    "31.36 GiB of which 301.94 MiB is free.",
)


@dataclass
class _Sequence:
    prompt_left: int
    tokens_left: int
    klass: PromptClass
    out: asyncio.Queue[int] = field(default_factory=asyncio.Queue)
    credit: float = 0.0


@dataclass
class _Tally:
    """Drafts made and kept since the last SpecDecoding line, per position."""

    drafts: int = 0
    kept_by_position: list[float] = field(default_factory=list)
    since: float = field(default_factory=time.monotonic)


class Stepper:
    """One engine: requests go in through `generate`, steps run while any is left."""

    def __init__(self, perf: Performance, log: Callable[[str, str, str], None]):
        self.perf = perf
        self.log = log  # (level, where, message) as the engine core's line
        self.waiting: list[_Sequence] = []
        self.running: list[_Sequence] = []
        self.drafter_graph = True
        self.tally = _Tally(kept_by_position=[0.0] * perf.drafts)
        self._loop: asyncio.Task[None] | None = None
        self._deadline = 0.0

    async def generate(self, prompt_tokens: int, max_tokens: int, klass: PromptClass) -> AsyncIterator[int]:
        """How many tokens each step gives this request, until it has max_tokens."""
        seq = _Sequence(prompt_tokens, max_tokens, klass)
        self.waiting.append(seq)
        if self._loop is None or self._loop.done():
            self._loop = asyncio.create_task(self._run())
        try:
            while seq.tokens_left > 0 or not seq.out.empty():
                yield await seq.out.get()
        finally:
            for queue in (self.waiting, self.running):
                if seq in queue:
                    queue.remove(seq)

    async def _run(self) -> None:
        while self.waiting or self.running:
            while self.waiting and len(self.running) < self.perf.max_num_seqs:
                self.running.append(self.waiting.pop(0))
            decoding = [s for s in self.running if s.prompt_left == 0]
            budget = self.perf.chunk - self.perf.decode_tokens(len(decoding))
            chunks: list[tuple[_Sequence, int]] = []
            for seq in self.running:
                if seq.prompt_left and budget > 0:
                    chunks.append((seq, min(seq.prompt_left, budget)))
                    budget -= chunks[-1][1]
            if self.drafter_graph and self.perf.drafter_graph_breaks(len(decoding)):
                self._drafter_graph_fails()
            await self._pace(self.perf.step_seconds(len(decoding), sum(n for _, n in chunks), self.drafter_graph))
            for seq in decoding:
                self._decode(seq)
            for seq, n in chunks:
                seq.prompt_left -= n
                if seq.prompt_left == 0:
                    self._give(seq, 1)
            self.running = [s for s in self.running if s.tokens_left > 0]
            self._maybe_log_spec()

    async def _pace(self, seconds: float) -> None:
        """Sleep to the step's deadline, not for its length, so the loop's own overhead does not slow
        the engine down (steps are a millisecond or so once scaled)."""
        now = time.monotonic()
        self._deadline = max(self._deadline, now - seconds) + seconds
        await asyncio.sleep(max(0.0, self._deadline - now))

    def _decode(self, seq: _Sequence) -> None:
        kept = self.perf.kept_drafts(seq.klass)
        seq.credit += 1 + kept
        if self.perf.drafts:
            self.tally.drafts += self.perf.drafts
            for i, p in enumerate(accepted_per_position(self.perf.drafts, seq.klass)):
                self.tally.kept_by_position[i] += p
        given = whole_tokens(seq.credit)
        seq.credit -= given
        self._give(seq, given)

    def _give(self, seq: _Sequence, count: int) -> None:
        count = min(count, seq.tokens_left)
        if count:
            seq.tokens_left -= count
            seq.out.put_nowait(count)

    def _drafter_graph_fails(self) -> None:
        """Note 004's trap: the capture fails and the drafter runs eager from now on; vLLM says so
        only for DSpark (its own wrapper), while the dispatcher that MTP goes through is silent."""
        self.drafter_graph = False
        if self.perf.method == "dspark":
            self.log("WARNING", "dspark.py:186", DSPARK_GRAPH_OFF)
            for line in DSPARK_TRACE:
                print(line, flush=True)

    def _maybe_log_spec(self) -> None:
        tally = self.tally
        elapsed = time.monotonic() - tally.since
        if not tally.drafts or elapsed < self.perf.log_interval_s:
            return
        kept = sum(tally.kept_by_position)
        per_step = tally.drafts / self.perf.drafts
        positions = ", ".join(f"{k / per_step:.3f}" for k in tally.kept_by_position)
        self.log("INFO", "metrics.py:120", SPEC_LINE.format(
            mean=1 + kept / per_step, acc_tps=kept / elapsed, drafted_tps=tally.drafts / elapsed,
            accepted=round(kept), drafted=tally.drafts, positions=positions, rate=100 * kept / tally.drafts))
        self.tally = _Tally(kept_by_position=[0.0] * self.perf.drafts)
