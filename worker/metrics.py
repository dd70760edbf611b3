"""Engine `/metrics` pages → one `EngineMetrics`, whatever the engine and its version.

Pages are parsed with prometheus-client's own parser: the exposition format has escaping, label
quoting and `_total`/`_created` rules that a hand-written parser gets wrong. Engines rename series
across versions, so every quantity is looked up through one name map, newest name first; a server
that exports both the old and the new name (vLLM 0.10/0.11 with hidden metrics shown) is read once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

import httpx
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

MetricsEngine = Literal["vllm", "llamacpp"]

# Quantity → series names, newest first. Counters are given by their declared name; the scraped
# series may carry prometheus-client's `_total` suffix or not (see `_counter_value`).
VLLM_NAMES: Mapping[str, tuple[str, ...]] = {
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

LLAMACPP_NAMES: Mapping[str, tuple[str, ...]] = {
    # kv_cache_usage_ratio was removed in May 2025 (llama.cpp PR #13660); old builds only.
    "kv_usage": ("llamacpp:kv_cache_usage_ratio",),
    "requests_running": ("llamacpp:requests_processing",),
    "requests_waiting": ("llamacpp:requests_deferred",),
    # Newest builds count cached prompt tokens apart from prompt_tokens (see `_llamacpp_prefix`).
    "prompt_tokens": ("llamacpp:prompt_tokens",),
    "prompt_tokens_cached": ("llamacpp:prompt_tokens_cached",),
    "generation_tokens": ("llamacpp:tokens_predicted",),
    "spec_drafts": ("llamacpp:spec_decode_num_drafts",),
    "spec_draft_tokens": ("llamacpp:spec_decode_num_draft_tokens",),
    "spec_accepted_tokens": ("llamacpp:spec_decode_num_accepted_tokens",),
}

# Fractions of one engine's own KV pool: averaged over engines (label sets), never summed.
_FRACTIONS = frozenset({"kv_usage"})
_VLLM_CACHE_INFO = "vllm:cache_config_info"
_COUNTER_SUFFIX = "_total"


class MetricsUnavailable(Exception):
    """The engine's /metrics could not be read; the message says why and what to do."""


@dataclass(frozen=True)
class EngineMetrics:
    """One scrape. Counters are cumulative since the engine started; `None` = not exported."""

    engine: MetricsEngine | None = None
    kv_usage: float | None = None  # 0..1
    requests_running: int | None = None
    requests_waiting: int | None = None
    preemptions: int | None = None
    prefix_cache_queries: int | None = None
    prefix_cache_hits: int | None = None
    prompt_tokens: int | None = None
    generation_tokens: int | None = None
    spec_drafts: int | None = None
    spec_draft_tokens: int | None = None
    spec_accepted_tokens: int | None = None
    kv_cache_tokens: int | None = None  # vLLM's cache_config_info, when it carries it
    max_concurrency: float | None = None

    @property
    def speculative(self) -> bool:
        """Drafts were proposed. llama-server exports the spec series at 0 even when it is off."""
        return bool(self.spec_drafts) or bool(self.spec_draft_tokens)

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        return _ratio(self.prefix_cache_hits, self.prefix_cache_queries)

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted draft tokens ÷ proposed draft tokens."""
        return _ratio(self.spec_accepted_tokens, self.spec_draft_tokens)

    @property
    def tokens_per_forward(self) -> float | None:
        """Tokens one verification pass yields: the bonus token plus the accepted drafts."""
        if self.spec_accepted_tokens is None or not self.spec_drafts:
            return None
        return 1.0 + self.spec_accepted_tokens / self.spec_drafts

    def since(self, earlier: EngineMetrics) -> EngineMetrics:
        """Counters as deltas from an earlier scrape (gauges as now), so rates cover one run.

        A counter that went down means the engine restarted between the scrapes: that delta is
        unknown (`None`), never negative.
        """
        deltas: dict[str, Any] = {
            name: _delta(getattr(self, name), getattr(earlier, name)) for name in _COUNTERS
        }
        return replace(self, **deltas)


_COUNTERS = (
    "preemptions",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "prompt_tokens",
    "generation_tokens",
    "spec_drafts",
    "spec_draft_tokens",
    "spec_accepted_tokens",
)
_INT_FIELDS = frozenset(f.name for f in fields(EngineMetrics)) - {"engine", "kv_usage", "max_concurrency"}


def _ratio(part: int | None, whole: int | None) -> float | None:
    if part is None or not whole:
        return None
    return part / whole


def _delta(now: int | None, before: int | None) -> int | None:
    if now is None or before is None or now < before:
        return None
    return now - before


def parse_metrics(text: str, engine: MetricsEngine | None = None) -> EngineMetrics:
    """A /metrics page → `EngineMetrics`; the engine is told by the series' prefix if not given.

    Raises `MetricsUnavailable` when the text is not Prometheus exposition.
    """
    try:
        families = {family.name: family for family in text_string_to_metric_families(text)}
    except ValueError as exc:
        raise MetricsUnavailable(f"the engine's /metrics page is not Prometheus text ({exc})") from None
    engine = engine or _detect_engine(families)
    if engine is None:
        return EngineMetrics()
    names = VLLM_NAMES if engine == "vllm" else LLAMACPP_NAMES
    values = {
        quantity: _first_present(families, candidates, average=quantity in _FRACTIONS)
        for quantity, candidates in names.items()
    }
    if engine == "llamacpp":
        values = _llamacpp_prefix(values)
    figures: dict[str, Any] = {k: _typed(k, v) for k, v in values.items()}
    return EngineMetrics(engine=engine, **figures, **_vllm_cache_info(families))


def _typed(quantity: str, value: float | None) -> int | float | None:
    """Counts as ints (the parser gives floats, and llama-server prints `1.23457e+06`)."""
    if value is None or quantity not in _INT_FIELDS:
        return value
    return round(value)


def _detect_engine(families: Mapping[str, Metric]) -> MetricsEngine | None:
    for name in families:
        if name.startswith("vllm:"):
            return "vllm"
        if name.startswith("llamacpp:"):
            return "llamacpp"
    return None


def _first_present(
    families: Mapping[str, Metric], candidates: Iterable[str], *, average: bool
) -> float | None:
    for name in candidates:
        value = _series_value(families, name, average=average)
        if value is not None:
            return value
    return None


def _series_value(families: Mapping[str, Metric], name: str, *, average: bool) -> float | None:
    """Sum (or mean, for fractions) over every label set (vLLM labels by model and engine index).

    The parser names a typed counter's family without `_total` and its samples with it; an
    untyped page keeps `_total` in the family name. Both spellings are accepted; `_created`,
    `_bucket` and other companion samples are not summed.
    """
    family = families.get(name) or families.get(name + _COUNTER_SUFFIX)
    if family is None:
        return None
    wanted = {name, name + _COUNTER_SUFFIX}
    samples = [s.value for s in family.samples if s.name in wanted]
    if not samples:
        return None
    return sum(samples) / len(samples) if average else sum(samples)


def _llamacpp_prefix(values: dict[str, float | None]) -> dict[str, float | None]:
    """Newest llama.cpp counts cached prompt tokens apart: hits = cached, queries = cached + computed."""
    cached = values.pop("prompt_tokens_cached")
    computed = values.get("prompt_tokens")
    if cached is not None and computed is not None:
        values["prefix_cache_hits"] = cached
        values["prefix_cache_queries"] = cached + computed
    return values


def _vllm_cache_info(families: Mapping[str, Metric]) -> dict[str, Any]:
    """KV capacity from the labels of vLLM's `cache_config_info` gauge (one sample per engine)."""
    family = families.get(_VLLM_CACHE_INFO)
    labels = [s.labels for s in family.samples] if family else []
    tokens = [_number(lab.get("kv_cache_size_tokens")) for lab in labels]
    concurrency = [_number(lab.get("kv_cache_max_concurrency")) for lab in labels]
    known_tokens = [t for t in tokens if t is not None]
    known_concurrency = [c for c in concurrency if c is not None]
    return {
        "kv_cache_tokens": int(sum(known_tokens)) if known_tokens else None,
        "max_concurrency": sum(known_concurrency) if known_concurrency else None,
    }


def _number(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        return None


async def scrape(
    http: httpx.AsyncClient, url: str, api_key: str | None = None, engine: MetricsEngine | None = None
) -> EngineMetrics:
    """GET an engine's /metrics URL and parse it; llama.cpp's /metrics needs the API key."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = await http.get(url, headers=headers)
    except httpx.HTTPError as exc:
        raise MetricsUnavailable(f"could not read {url}: {exc!r}; is the engine running?") from None
    if response.status_code == 501:
        raise MetricsUnavailable(f"{url} is switched off (501); llama-server must be started with --metrics")
    if response.status_code in (401, 403):
        raise MetricsUnavailable(f"{url} refused the API key ({response.status_code}); pass the engine's key")
    if response.status_code != 200:
        raise MetricsUnavailable(f"{url} answered {response.status_code}; the engine may still be loading")
    return parse_metrics(response.text, engine)
