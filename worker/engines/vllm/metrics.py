"""vLLM's /metrics: the series each quantity is read from, newest name first, and the KV capacity
its `cache_config_info` gauge carries in labels.

Pure. Counters are given by their declared name; `worker.measure.metrics` accepts the scraped series with
or without prometheus-client's `_total` suffix.
"""

from __future__ import annotations

from collections.abc import Mapping

from worker.engines.base import SeriesLabels

PREFIX = "vllm:"
NAMES: Mapping[str, tuple[str, ...]] = {
    # gpu_cache_usage_perc: deprecated 0.9.2, hidden in 0.10/0.11, gone by 0.20.
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "requests_running": ("vllm:num_requests_running",),
    "requests_waiting": ("vllm:num_requests_waiting",),
    "preemptions": ("vllm:num_preemptions",),
    # gpu_prefix_cache_*: same history as gpu_cache_usage_perc.
    "prefix_cache_queries": ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
    "prefix_cache_hits": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
    "prompt_tokens": ("vllm:prompt_tokens",),
    "generation_tokens": ("vllm:generation_tokens",),
    "spec_drafts": ("vllm:spec_decode_num_drafts",),
    "spec_draft_tokens": ("vllm:spec_decode_num_draft_tokens",),
    "spec_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",),
}
CACHE_INFO = "vllm:cache_config_info"


def derive_metrics(values: dict[str, float | None], labels: SeriesLabels) -> dict[str, float | None]:
    """KV capacity from the labels of `cache_config_info` (one sample per engine), summed."""
    samples = labels(CACHE_INFO)
    tokens = [t for lab in samples if (t := _number(lab.get("kv_cache_size_tokens"))) is not None]
    concurrency = [c for lab in samples if (c := _number(lab.get("kv_cache_max_concurrency"))) is not None]
    return {
        **values,
        "kv_cache_tokens": int(sum(tokens)) if tokens else None,
        "max_concurrency": sum(concurrency) if concurrency else None,
    }


def _number(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        return None
