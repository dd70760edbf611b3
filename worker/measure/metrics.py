"""Engine `/metrics` pages → one `EngineMetrics`, whatever the engine and its version.

Pages are parsed with prometheus-client's own parser: the exposition format has escaping, label
quoting and `_total`/`_created` rules that a hand-written parser gets wrong. Engines rename series
across versions, so every quantity is looked up through the engine adapter's name map
(`METRIC_NAMES`), newest name first; a server that exports both the old and the new name (vLLM
0.10/0.11 with hidden metrics shown) is read once. What only one engine exports (vLLM's KV
capacity labels, llama.cpp's cached prompt tokens) its adapter derives (`derive_metrics`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

import httpx
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from worker.engines import registry

# Fractions of one engine's own KV pool: averaged over engines (label sets), never summed.
_FRACTIONS = frozenset({"kv_usage"})
_COUNTER_SUFFIX = "_total"


class MetricsUnavailable(Exception):
    """The engine's /metrics could not be read; the message says why and what to do."""


@dataclass(frozen=True)
class EngineMetrics:
    """One scrape. Counters are cumulative since the engine started; `None` = not exported."""

    engine: str | None = None  # the registered engine's name
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


def parse_metrics(text: str, engine: str | None = None) -> EngineMetrics:
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
    adapter = registry.get(engine)
    values = {
        quantity: _first_present(families, candidates, average=quantity in _FRACTIONS)
        for quantity, candidates in adapter.METRIC_NAMES.items()
    }
    values = adapter.derive_metrics(values, lambda name: _labels(families, name))
    figures: dict[str, Any] = {k: _typed(k, v) for k, v in values.items()}
    return EngineMetrics(engine=engine, **figures)


def _typed(quantity: str, value: float | None) -> int | float | None:
    """Counts as ints (the parser gives floats, and llama-server prints `1.23457e+06`)."""
    if value is None or quantity not in _INT_FIELDS:
        return value
    return round(value)


def _detect_engine(families: Mapping[str, Metric]) -> str | None:
    """The registered engine whose prefix the page's first series of any engine carries."""
    adapters = registry.adapters()
    for name in families:
        for adapter in adapters:
            if name.startswith(adapter.METRICS_PREFIX):
                return adapter.NAME
    return None


def _labels(families: Mapping[str, Metric], name: str) -> list[Mapping[str, str]]:
    """The label sets of a family's samples (none where the page has no such family)."""
    family = families.get(name)
    return [sample.labels for sample in family.samples] if family else []


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


async def scrape(
    http: httpx.AsyncClient, url: str, api_key: str | None = None, engine: str | None = None
) -> EngineMetrics:
    """GET an engine's /metrics URL and parse it; llama.cpp's /metrics needs the API key."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = await http.get(url, headers=headers)
    except httpx.HTTPError as exc:
        raise MetricsUnavailable(f"could not read {url}: {exc!r}; is the engine running?") from None
    if response.status_code == 501:
        raise MetricsUnavailable(f"{url} is switched off (501); the engine was started without its metrics switch")
    if response.status_code in (401, 403):
        raise MetricsUnavailable(f"{url} refused the API key ({response.status_code}); pass the engine's key")
    if response.status_code != 200:
        raise MetricsUnavailable(f"{url} answered {response.status_code}; the engine may still be loading")
    return parse_metrics(response.text, engine)
