"""The vLLM stand-in's speed: what one engine step costs and what it yields, from the field notes'
figures, so that a tuner run against it meets the traps the notes met (000, 004). Pure arithmetic.

Off unless `STANDIN_PERF_SCALE` is set (then time runs that many times faster than the figures
below, which are one RTX 5090 serving a 27B model). One step is one forward pass over every
running request, as in vLLM's scheduler:

| figure | value | source |
| --- | --- | --- |
| eager decode, one request | 6.4 tok/s | note 000 ("RTX 5090, eager") |
| CUDA graphs, one request | 61 tok/s | note 000 ("CUDA graphs, one flag") |
| MTP, 3 drafts, on graphs | 35 passes/s × 2.7 tokens = 94.7 tok/s | note 000 |
| draft acceptance: real prompts / "count from 1 to 120" | 56 % / 98.7 % (3 drafts) | note 000 |
| 3 → 4 drafts | +6.8 % decode | note 004 |
| drafter's CUDA graph off | decode 109 → 19 tok/s | note 004 (trap one) |
| prefill | 9,081 tok/s | note 004 |

What the notes do not give is the stand-in's assumption, named here: a second request in a batch
costs 4 % of a pass (decode is memory-bound); code drafts better than chat and a long prompt worse
(per-position acceptance 0.80 and 0.62 against chat's 0.74). Where vLLM decides, it decides as
vLLM 0.32 does: `--max-num-seqs` and `--max-num-batched-tokens` default by the card's memory
(`engine/arg_utils.py`: 1024 and 16384 from 160 GiB, 1024 and 8192 from 70 GiB, else 256 and
2048); the CUDA graph capture sizes are `config/vllm.py`'s (at most min(max_num_seqs × (1 + drafts)
× 2, 512) unless `--max-cudagraph-capture-size` says otherwise, never above
`--max-num-batched-tokens`; a size that is not in the list is cut to the largest one that is, with
vLLM's "Truncating max_cudagraph_capture_size to N"); and a step whose tokens are more than the
largest captured size runs eager (the dispatcher returns NONE).

The drafter trap (note 004): with a drafter (MTP, DSpark) and a prefill chunk
(`--max-num-batched-tokens`) at or above `STANDIN_DRAFTER_GRAPH_CHUNK` (8192), the drafter's CUDA
graph fails to capture the first time two requests decode together and stays off from then on, as
DSpark's wrapper sets `disabled` for good (`vllm/v1/spec_decode/dspark.py`). Acceptance is untouched.
Only DSpark's wrapper says so in the log ("Disabling DSpark draft forward CUDA graph after capture
failure"); MTP's drafter goes through the dispatcher, which falls back to eager without a word, so
only a measurement sees it (stepper.py prints accordingly). Not reproduced: note 000's 70.7 tok/s
on the counting prompt (its acceptance is; that run's lower speed had causes the note leaves open).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

from tests.standin.args import ServeArgs
from tests.standin.behaviour import Behaviour

PromptClass = Literal["count", "code", "long", "chat"]

EAGER_PASS_S = 1 / 6.4
GRAPH_PASS_S = 1 / 61
# A pass with k drafts adds the drafter's part, DRAFTER_FIXED_S + DRAFTER_PER_DRAFT_S × k on
# graphs: the pass is 1/35 s at k = 3 (note 000) and 4.07 % longer at k = 4, which with chat's
# acceptance gives note 004's +6.8 % decode.
MTP_PASS_S = 1 / 35
DRAFTER_PER_DRAFT_S = 0.0407 * MTP_PASS_S
DRAFTER_FIXED_S = MTP_PASS_S - GRAPH_PASS_S - 3 * DRAFTER_PER_DRAFT_S
# The drafter's part without its graph, so that the whole pass is 109/19 times longer (note 004).
DRAFTER_EAGER_FACTOR = (MTP_PASS_S * 109 / 19 - GRAPH_PASS_S) / (MTP_PASS_S - GRAPH_PASS_S)
BATCH_COST = 0.04
PREFILL_TOK_S = 9081.0
# Per-position acceptance: the chance each next draft is kept given the one before was.
ACCEPTANCE: dict[PromptClass, float] = {"count": 0.99, "code": 0.80, "long": 0.62, "chat": 0.74}
LONG_PROMPT_TOKENS = 512
DRAFTER_METHODS = ("mtp", "dspark")
_COUNT = re.compile(r"\bcount (?:from|to)\b", re.IGNORECASE)
_CODE = re.compile(r"```|\bdef |\bfunction\b|\bclass \w+|\bcode\b", re.IGNORECASE)


def batch_defaults(total_mib: int) -> tuple[int, int]:
    """vLLM's `--max-num-seqs` and `--max-num-batched-tokens` for an API server on this card."""
    if total_mib >= 160 * 1024:
        return 1024, 16384
    if total_mib >= 70 * 1024:
        return 1024, 8192
    return 256, 2048


@dataclass(frozen=True)
class Capture:
    """The largest batch (in tokens) a CUDA graph covers, and the size asked for when vLLM cut it."""

    largest: int
    truncated_from: int | None


def capture(asked: int | None, max_num_seqs: int, drafts: int, max_num_tokens: int) -> Capture:
    """`VllmConfig._set_cudagraph_sizes` (0.32): the default ceiling, or the sizes up to the one
    asked for (1, 2, 4, then steps of 8 to 256 and of 16 beyond, and max_num_tokens if it fits)."""
    if asked is None:
        return Capture(min(max_num_seqs * (1 + drafts) * 2, 512, max_num_tokens), None)
    ceiling = min(max_num_tokens, asked)
    sizes = [i for i in (1, 2, 4) if i <= ceiling]
    sizes += list(range(8, min(ceiling + 1, 256), 8)) + list(range(256, ceiling + 1, 16))
    if max_num_tokens <= ceiling:
        sizes.append(max_num_tokens)
    largest = max(sizes)
    return Capture(largest, asked if asked != largest else None)


def drafts_of(args: ServeArgs) -> int:
    """Speculative tokens per step of a drafter that runs on the GPU (MTP, DSpark); 0 otherwise."""
    spec = args.speculative or {}
    return int(str(spec.get("num_speculative_tokens", 1))) if spec.get("method") in DRAFTER_METHODS else 0


def capture_of(args: ServeArgs, behaviour: Behaviour) -> Capture | None:
    """This start's capture sizes; None where there are no CUDA graphs."""
    if args.enforce_eager or (args.cudagraph_mode or "").upper() == "NONE":
        return None
    seqs, tokens = batch_defaults(behaviour.cards[0].total_mib if behaviour.cards else 0)
    return capture(args.max_cudagraph_capture_size, args.max_num_seqs or seqs,
                   drafts_of(args), args.max_num_batched_tokens or tokens)


def prompt_class(text: str, prompt_tokens: int) -> PromptClass:
    """Which acceptance a prompt gets: a counting prompt, code, a long prompt, else chat."""
    if _COUNT.search(text):
        return "count"
    if prompt_tokens >= LONG_PROMPT_TOKENS:
        return "long"
    if _CODE.search(text):
        return "code"
    return "chat"


def tokens_per_pass(drafts: int, klass: PromptClass) -> float:
    """1 + the expected number of drafts kept: Σ p^i for i in 0…k."""
    p = ACCEPTANCE[klass]
    return sum(p**i for i in range(drafts + 1))


@dataclass(frozen=True)
class Performance:
    """The speed-relevant settings of one start, read from its command line and card."""

    scale: float
    graphs: bool  # CUDA graphs at all (no --enforce-eager, no cudagraph_mode NONE)
    max_num_seqs: int
    chunk: int  # --max-num-batched-tokens
    max_capture: int  # largest step (tokens) a CUDA graph covers
    drafts: int  # speculative tokens per step (0: none)
    method: str | None
    drafter_chunk_limit: int
    log_interval_s: float  # between SpecDecoding lines, scaled

    @classmethod
    def of(cls, args: ServeArgs, behaviour: Behaviour) -> Performance | None:
        if behaviour.perf_scale is None:
            return None
        seqs, tokens = batch_defaults(behaviour.cards[0].total_mib if behaviour.cards else 0)
        graphs = capture_of(args, behaviour)
        spec = args.speculative or {}
        return cls(
            scale=behaviour.perf_scale,
            graphs=graphs is not None,
            max_num_seqs=args.max_num_seqs or seqs,
            chunk=args.max_num_batched_tokens or tokens,
            max_capture=graphs.largest if graphs is not None else 0,
            drafts=drafts_of(args),
            method=str(spec["method"]) if "method" in spec else None,
            drafter_chunk_limit=behaviour.drafter_graph_chunk,
            log_interval_s=behaviour.log_stats_interval_s / behaviour.perf_scale,
        )

    def decode_tokens(self, decoding: int) -> int:
        """Tokens one step spends on `decoding` requests: each verifies 1 + drafts."""
        return decoding * (1 + self.drafts)

    def on_graph(self, step_tokens: int) -> bool:
        return self.graphs and step_tokens <= self.max_capture

    def drafter_graph_breaks(self, decoding: int) -> bool:
        """The step that makes the drafter's graph capture fail (note 004's trap)."""
        return self.drafts > 0 and self.graphs and self.chunk >= self.drafter_chunk_limit and decoding >= 2

    def step_seconds(self, decoding: int, prefill_tokens: int, drafter_graph: bool) -> float:
        """Wall seconds of one step (already divided by the scale)."""
        seconds = prefill_tokens / PREFILL_TOK_S
        if decoding:
            step_tokens = self.decode_tokens(decoding) + prefill_tokens
            one = GRAPH_PASS_S if self.on_graph(step_tokens) else EAGER_PASS_S
            if self.drafts:
                drafter = DRAFTER_FIXED_S + DRAFTER_PER_DRAFT_S * self.drafts
                one += drafter if drafter_graph and self.graphs else drafter * DRAFTER_EAGER_FACTOR
            seconds += one * (1 + BATCH_COST * (decoding - 1))
        return seconds / self.scale

    def kept_drafts(self, klass: PromptClass) -> float:
        return tokens_per_pass(self.drafts, klass) - 1 if self.drafts else 0.0


def accepted_per_position(drafts: int, klass: PromptClass) -> list[float]:
    """What vLLM's "Per-position acceptance rate" shows: position i is kept with chance p^(i+1)."""
    p = ACCEPTANCE[klass]
    return [p ** (i + 1) for i in range(drafts)]


def whole_tokens(credit: float) -> int:
    return math.floor(credit + 1e-9)
