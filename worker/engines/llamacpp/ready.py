"""What llama-server tells once ready: context per request and slot count, from /props and /slots.

Pure: the documents are read by the supervisor (`READY_READS`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from worker.engines.base import Slots
from worker.contract.events import EngineSnapshot

PROPS = "/props"
SLOTS = "/slots"
READS: tuple[str, ...] = (PROPS, SLOTS)


def ready_snapshot(reads: Mapping[str, Any], snapshot: EngineSnapshot, slots: Slots | None) -> EngineSnapshot:
    """Current builds do not print the KV size at default verbosity. Without it, the KV tokens
    come from the slots: under a unified KV (the default; the log says `kv_unified = 'true'`)
    all slots share one buffer of the largest slot's context; with a split KV each slot owns
    its share, so the budget is their sum. Raises AttributeError or TypeError for documents of
    another shape."""
    props, slot_list = reads[PROPS], reads[SLOTS]
    per_slot = props.get("default_generation_settings", {}).get("n_ctx")
    total_slots = props.get("total_slots")
    largest = max((slot.get("n_ctx", 0) for slot in slot_list), default=0)
    per_request = largest if isinstance(largest, int) and largest > 0 else per_slot
    split = slots is not None and slots.kv_unified is False
    budget = sum(slot.get("n_ctx", 0) for slot in slot_list) if split else per_request
    kv_tokens = snapshot.kv_cache_tokens or (budget if isinstance(budget, int) and budget > 0 else None)
    return dataclasses.replace(
        snapshot,
        kv_cache_tokens=kv_tokens,
        max_concurrency=float(total_slots) if isinstance(total_slots, int) else snapshot.max_concurrency,
        context=dataclasses.replace(snapshot.context, declared=per_slot if isinstance(per_slot, int) else None,
                                    physical=per_request if isinstance(per_request, int) else None))
