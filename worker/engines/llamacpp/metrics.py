"""llama-server's /metrics: the series each quantity is read from, and its prefix-cache figures.

Pure. Counters are given by their declared name; `worker.measure.metrics` accepts the scraped series with
or without prometheus-client's `_total` suffix.
"""

from __future__ import annotations

from collections.abc import Mapping

from worker.engines.base import SeriesLabels

PREFIX = "llamacpp:"
NAMES: Mapping[str, tuple[str, ...]] = {
    # kv_cache_usage_ratio was removed in May 2025 (llama.cpp PR #13660); old builds only.
    "kv_usage": ("llamacpp:kv_cache_usage_ratio",),
    "requests_running": ("llamacpp:requests_processing",),
    "requests_waiting": ("llamacpp:requests_deferred",),
    # Newest builds count cached prompt tokens apart from prompt_tokens (see `derive_metrics`).
    "prompt_tokens": ("llamacpp:prompt_tokens",),
    "prompt_tokens_cached": ("llamacpp:prompt_tokens_cached",),
    "generation_tokens": ("llamacpp:tokens_predicted",),
    "spec_drafts": ("llamacpp:spec_decode_num_drafts",),
    "spec_draft_tokens": ("llamacpp:spec_decode_num_draft_tokens",),
    "spec_accepted_tokens": ("llamacpp:spec_decode_num_accepted_tokens",),
}


def derive_metrics(values: dict[str, float | None], labels: SeriesLabels) -> dict[str, float | None]:
    """Newest llama.cpp counts cached prompt tokens apart: hits = cached, queries = cached + computed."""
    values = dict(values)
    cached = values.pop("prompt_tokens_cached")
    computed = values.get("prompt_tokens")
    if cached is not None and computed is not None:
        values["prefix_cache_hits"] = cached
        values["prefix_cache_queries"] = cached + computed
    return values
