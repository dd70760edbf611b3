"""The stand-in's GPU memory, and vLLM's two start-up memory checks done on it with vLLM's arithmetic.

1. Before loading, each worker checks its card: `ceil(total × gpu_memory_utilization)` bytes must
   be free (`vllm/v1/worker/utils.py` `request_memory`), else the "Free memory on device" refusal.
2. After loading, the KV cache gets what the share leaves: `share × total − weights − activations`;
   it is cut into blocks of 16 tokens, and a `--max-model-len` that needs more blocks than there
   are is refused ("To serve at least one request…", `v1/core/kv_cache_planning.py`).

Without `STANDIN_GPU_*` the stand-in runs on an idle card whose KV budget is fixed by
`STANDIN_KV_TOKENS`/`STANDIN_KV_GIB` (older tests set those); with them, the budget follows from
the memory, so a share that is too large or too small fails as it would on the real card.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tests.standin.args import ServeArgs
from tests.standin.behaviour import Behaviour, Card

GIB = 1 << 30
MIB = 1 << 20
BLOCK_TOKENS = 16  # vLLM's default KV block size on CUDA


def format_gib(size_bytes: float) -> str:
    """vLLM's `format_gib` (`vllm/utils/mem_utils.py`): GiB rounded to 2 places, as Python prints it."""
    return str(round(size_bytes / GIB, 2))


@dataclass(frozen=True)
class FreeMemoryShort:
    """A worker's card has less free memory than the share asks for."""

    device: int  # the worker's CUDA ordinal (`cuda:N`, numbered within CUDA_VISIBLE_DEVICES)
    card: Card
    share: float
    requested_bytes: int

    def message(self, *, old: bool) -> str:
        free, total = self.card.free_mib * MIB, self.card.total_mib * MIB
        if old:  # 0.11 named no device and printed %.2f
            head = f"Free memory on device ({free / GIB:.2f}/{total / GIB:.2f} GiB)"
            asked = f"{self.requested_bytes / GIB:.2f}"
        else:
            head = f"Free memory on device cuda:{self.device} ({format_gib(free)}/{format_gib(total)} GiB)"
            asked = format_gib(self.requested_bytes)
        return (f"ValueError: {head} on startup is less than desired GPU memory utilization ({self.share}, "
                f"{asked} GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.")


@dataclass(frozen=True)
class KvBudget:
    """One worker's KV cache: its bytes, the tokens they hold, and what a token costs there (a
    tensor-parallel worker holds 1/TP of every token)."""

    available_bytes: int
    tokens: int
    bytes_per_token: float

    @classmethod
    def from_memory(cls, available_bytes: int, bytes_per_token: float) -> KvBudget:
        """Whole blocks of 16 tokens, as vLLM allocates them."""
        blocks = max(0, int(available_bytes // (BLOCK_TOKENS * bytes_per_token)))
        return cls(available_bytes, blocks * BLOCK_TOKENS, bytes_per_token)

    @property
    def gib(self) -> float:
        return round(self.available_bytes / GIB, 2)

    def needed_bytes(self, max_len: int) -> float:
        """One request of `max_len` tokens, in whole blocks."""
        return math.ceil(max_len / BLOCK_TOKENS) * BLOCK_TOKENS * self.bytes_per_token


def worker_cards(args: ServeArgs, behaviour: Behaviour) -> list[Card]:
    """The card of each tensor-parallel worker: the first TP visible ones."""
    return list(behaviour.cards[: max(1, args.tensor_parallel)])


def free_memory_short(args: ServeArgs, behaviour: Behaviour) -> FreeMemoryShort | None:
    """vLLM's first check, on every worker's card; the first card that fails it, or None."""
    share = args.gpu_memory_utilization
    for device, card in enumerate(worker_cards(args, behaviour)):
        requested = math.ceil(card.total_mib * MIB * share)
        if card.free_mib * MIB < requested:
            return FreeMemoryShort(device, card, share, requested)
    return None


def weights_bytes_per_worker(args: ServeArgs, behaviour: Behaviour) -> int:
    return behaviour.weights_bytes(args.model) // max(1, args.tensor_parallel)


def kv_budget(args: ServeArgs, behaviour: Behaviour) -> KvBudget:
    """The KV cache of the smallest worker: as fixed on the default card, else from the memory."""
    if not behaviour.gpu_given:
        available = int(behaviour.kv_gib * GIB)
        return KvBudget(available, behaviour.kv_tokens, available / max(behaviour.kv_tokens, 1))
    tp = max(1, args.tensor_parallel)
    reserve = behaviour.activation_mib * MIB + weights_bytes_per_worker(args, behaviour)
    available = min(math.ceil(card.total_mib * MIB * args.gpu_memory_utilization) - reserve
                    for card in worker_cards(args, behaviour))
    return KvBudget.from_memory(available, behaviour.kv_bytes_per_token / tp)
