"""SGLang's /metrics (served with `--enable-metrics`, which the app sets): the series each quantity
is read from, KV capacity included.

Pure. Names are those SGLang 0.5.23 declares in `sglang/srt/observability/metrics_collector.py`;
counters are given by their declared name less `_total`, as prometheus-client exports them.
"""

from __future__ import annotations

from collections.abc import Mapping

from worker.engines.base import SeriesLabels

PREFIX = "sglang:"
NAMES: Mapping[str, tuple[str, ...]] = {
    "kv_usage": ("sglang:token_usage",),
    "requests_running": ("sglang:num_running_reqs",),
    "requests_waiting": ("sglang:num_queue_reqs",),
    "preemptions": ("sglang:num_retracted_requests",),  # a retraction is SGLang's preemption
    "prompt_tokens": ("sglang:prompt_tokens",),
    "generation_tokens": ("sglang:generation_tokens",),
    "kv_cache_tokens": ("sglang:max_total_num_tokens",),  # a gauge per scheduler, summed
}


def derive_metrics(values: dict[str, float | None], labels: SeriesLabels) -> dict[str, float | None]:
    """Nothing to add: even the KV capacity is a plain gauge (`max_total_num_tokens`) in `NAMES`."""
    return values


__all__ = ["NAMES", "PREFIX", "derive_metrics"]
