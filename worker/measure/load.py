"""Closed-loop load on one engine, measured as `status` measures: aggregate output tok/s over a
ladder of concurrencies, per-request decode speed and time to first token, and the greedy text of
a fixed probe set (the tuner's gate compares it across configurations).

Closed loop: each of N workers sends its next request when its last one ends, so the engine sees
exactly N requests at once, as a provider's queue would keep it. Warm-up requests are sent and
not counted; each figure is the median of `repeats` runs. At levels 1 and 2 a long prefill runs
beside the load (the decode trap of field note 004 shows only then). The prompts are the app's
own (`prompts/prompts.json`), never callers' traffic.
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import httpx

RUN_S = 3.0  # a run of a level lasts at least this long (each worker's request then ends it)
MIN_REQUESTS_PER_WORKER = 2
log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 120.0
LONG_PREFILL_LEVELS = frozenset({1, 2})
CHARS_PER_TOKEN = 2  # a conservative count of a prompt's tokens by its characters
# A request's decode is timed from its chunks' arrivals; chunks an engine or the socket delivered
# together (in one read) arrive microseconds apart and time the read, not the decode.
TOGETHER_S = 0.001  # chunks closer than this came in one read
MIN_DECODE_SPAN_S = 0.02  # a first-to-last span shorter than this is no decode time


@dataclass(frozen=True)
class Endpoint:
    base_url: str
    api_key: str | None
    model: str
    unix_socket: str | None = None


@dataclass(frozen=True)
class Prompt:
    cls: str  # chat, long, shared_prefix, tool_call
    messages: tuple[tuple[str, str], ...]  # (role, content)
    max_tokens: int

    def body(self, *, stream: bool) -> dict[str, Any]:
        return {"messages": [{"role": r, "content": c} for r, c in self.messages], "max_tokens": self.max_tokens,
                "temperature": 0.0, "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}


@dataclass(frozen=True)
class PromptSet:
    load: tuple[Prompt, ...]
    probes: tuple[Prompt, ...]
    long_prefill: Prompt


@dataclass(frozen=True)
class LevelFigures:
    concurrency: int
    aggregate_tok_s: float
    per_request_tok_s: float  # decode: tokens after the first ÷ the time after the first (median); 0: not measured
    ttft_p90_ms: float
    failed: int
    answer_tok_s: float = 0.0  # as a request sees it: its tokens ÷ the time since it was sent (median)


@dataclass(frozen=True)
class Greedy:
    """One probe's greedy answer as tokens, with how far each token led the runner-up (nats;
    None where the engine gave no alternatives)."""

    tokens: tuple[str, ...]
    margins: tuple[float | None, ...]


@dataclass(frozen=True)
class Measurement:
    levels: tuple[LevelFigures, ...]
    greedy: tuple[str, ...]
    kv_tokens: int | None
    greedy_detail: tuple[Greedy, ...] = ()

    def level(self, concurrency: int) -> LevelFigures | None:
        return next((lv for lv in self.levels if lv.concurrency == concurrency), None)

    @property
    def peak_tok_s(self) -> float:
        """The best aggregate over the ladder: what the machine serves at its best concurrency."""
        return max((lv.aggregate_tok_s for lv in self.levels), default=0.0)


@dataclass(frozen=True)
class _Done:
    tokens: int
    ttft_s: float | None
    decode_tok_s: float | None
    ok: bool
    answer_tok_s: float | None = None


def shipped_prompts() -> PromptSet:
    """The prompt set the app ships."""
    text = resources.files("worker.measure").joinpath("prompts", "prompts.json").read_text(encoding="utf-8")
    return prompt_set(json.loads(text))


def read_prompts(path: Path) -> PromptSet:
    """A prompt set in the shipped file's shape (tests cut it to their model's context)."""
    return prompt_set(json.loads(path.read_text(encoding="utf-8")))


def prompt_set(data: dict[str, Any]) -> PromptSet:
    def prompt(item: dict[str, Any]) -> Prompt:
        return Prompt(str(item["class"]), tuple((str(m["role"]), str(m["content"])) for m in item["messages"]),
                      int(item["max_tokens"]))
    return PromptSet(tuple(prompt(p) for p in data["load"]), tuple(prompt(p) for p in data["probes"]),
                     prompt(data["long_prefill"]))


TEMPLATE_TOKENS = 64  # what a chat template adds around the messages, at most, for the models served


def fitting(prompts: PromptSet, context: int | None) -> PromptSet:
    """The prompt set cut to what one request may hold (`context`, tokens; None: unknown, all kept).

    A prompt's bytes bound its tokens (a byte-level tokenizer's worst case; real ones give fewer),
    so one that could overflow is left out rather than failing every measurement; the long prefill
    is shortened to fit instead, so it still runs beside the decode it is there to disturb."""
    if context is None:
        return prompts

    def fits(prompt: Prompt) -> bool:
        return _bytes(prompt) + prompt.max_tokens + TEMPLATE_TOKENS <= context

    load = tuple(p for p in prompts.load if fits(p)) or (min(prompts.load, key=_bytes),)
    return PromptSet(load, tuple(p for p in prompts.probes if fits(p)), _shortened(prompts.long_prefill, context))


def _bytes(prompt: Prompt) -> int:
    return sum(len(content.encode()) for _, content in prompt.messages)


def _shortened(prompt: Prompt, context: int) -> Prompt:
    over = _bytes(prompt) + prompt.max_tokens + TEMPLATE_TOKENS - context
    if over <= 0 or not prompt.messages:
        return prompt
    role, content = prompt.messages[-1]
    kept = content.encode()[: max(0, len(content.encode()) - over)].decode("utf-8", "ignore")
    return Prompt(prompt.cls, (*prompt.messages[:-1], (role, kept)), prompt.max_tokens)


def ladder(ladder_max: int, kv_slots: int | None = None) -> tuple[int, ...]:
    """1, 2, 4, … up to `ladder_max` and to the concurrency the engine's KV holds (`kv_slots`)."""
    top = min(ladder_max, kv_slots) if kv_slots else ladder_max
    levels, n = [], 1
    while n <= max(top, 1):
        levels.append(n)
        n *= 2
    return tuple(levels)


def kv_slots(kv_tokens: int | None, prompts: PromptSet) -> int | None:
    """How many of the set's largest requests the engine's KV holds at once (None: not told),
    counting two characters a token (real tokenizers average about four)."""
    if not kv_tokens:
        return None
    largest = max(sum(len(c) for _, c in p.messages) // CHARS_PER_TOKEN + p.max_tokens for p in prompts.load)
    return max(1, kv_tokens // max(1, largest))


def client(endpoint: Endpoint) -> httpx.AsyncClient:
    """A fresh connection per request: an engine closes kept-alive connections on its own terms
    (llama-server's HTTP library after a few requests or seconds), and a request written onto one
    it is closing fails for nothing the configuration did."""
    limits = httpx.Limits(max_keepalive_connections=0)
    transport = httpx.AsyncHTTPTransport(uds=endpoint.unix_socket, limits=limits)
    headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
    return httpx.AsyncClient(base_url=endpoint.base_url, headers=headers, transport=transport, trust_env=False,
                             timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=5.0))


async def measure(endpoint: Endpoint, ladder: Sequence[int], *, repeats: int, warmup: int, prompts: PromptSet,
                  long_prefill_beside: bool = True, run_s: float = RUN_S) -> Measurement:
    """The engine's figures at each level of `ladder` (medians of `repeats` runs after `warmup`
    requests), and its greedy answers to the probes."""
    async with client(endpoint) as http:
        for i in range(warmup):
            await _one(http, endpoint, prompts.load[i % len(prompts.load)])
        greedy = [await _greedy(http, endpoint, probe) for probe in prompts.probes]
        levels = [await _level(http, endpoint, n, repeats, prompts, long_prefill_beside and n in LONG_PREFILL_LEVELS,
                              run_s) for n in ladder]
    return Measurement(tuple(levels), tuple("".join(g.tokens) for g in greedy), None, tuple(greedy))


async def _level(http: httpx.AsyncClient, endpoint: Endpoint, n: int, repeats: int, prompts: PromptSet,
                 beside: bool, run_s: float) -> LevelFigures:
    runs = [await _run(http, endpoint, n, prompts, beside, run_s) for _ in range(max(repeats, 1))]
    decode = [r.per_request_tok_s for r in runs if r.per_request_tok_s > 0]  # runs that measured it
    return LevelFigures(n, statistics.median(r.aggregate_tok_s for r in runs),
                        statistics.median(decode) if decode else 0.0,
                        statistics.median(r.ttft_p90_ms for r in runs), max(r.failed for r in runs),
                        statistics.median(r.answer_tok_s for r in runs))


async def _run(http: httpx.AsyncClient, endpoint: Endpoint, n: int, prompts: PromptSet, beside: bool,
               run_s: float) -> LevelFigures:
    """One run of a level: n closed-loop workers, a long prefill beside them if asked."""
    done: list[_Done] = []

    started = time.monotonic()

    async def worker(w: int) -> None:
        k = 0
        while k < MIN_REQUESTS_PER_WORKER or time.monotonic() - started < run_s:
            done.append(await _one(http, endpoint, prompts.load[(w + k * n) % len(prompts.load)]))
            k += 1

    prefill = asyncio.create_task(_one(http, endpoint, prompts.long_prefill)) if beside else None
    await asyncio.gather(*(worker(w) for w in range(n)))
    elapsed = time.monotonic() - started
    if prefill is not None:
        await prefill
    return figures(n, done, elapsed)


def figures(n: int, done: Sequence[_Done], elapsed_s: float) -> LevelFigures:
    ok = [d for d in done if d.ok]
    ttfts = sorted(d.ttft_s for d in ok if d.ttft_s is not None)
    decode = [d.decode_tok_s for d in ok if d.decode_tok_s is not None]
    answer = [d.answer_tok_s for d in ok if d.answer_tok_s is not None]
    p90 = ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))] * 1000 if ttfts else 0.0
    return LevelFigures(n, sum(d.tokens for d in ok) / elapsed_s if elapsed_s > 0 else 0.0,
                        statistics.median(decode) if decode else 0.0, p90, len(done) - len(ok),
                        statistics.median(answer) if answer else 0.0)


async def _one(http: httpx.AsyncClient, endpoint: Endpoint, prompt: Prompt) -> _Done:
    """One streamed request: its output tokens, time to first token and decode speed."""
    started = time.monotonic()
    arrivals: list[float] = []
    usage = None
    try:
        async with http.stream("POST", "/v1/chat/completions",
                               json={"model": endpoint.model, **prompt.body(stream=True)}) as response:
            if response.status_code != 200:
                log.info("load: a request got HTTP %d: %s", response.status_code, (await response.aread())[:200])
                return _Done(0, None, None, False)
            async for line in response.aiter_lines():
                event = _event(line)
                if event is None:
                    continue
                usage = event.get("usage") or usage
                if any((c.get("delta") or {}).get("content") for c in event.get("choices") or ()):
                    arrivals.append(time.monotonic())
    except (httpx.HTTPError, ValueError) as exc:
        log.info("load: a request failed: %r", exc)
        return _Done(0, None, None, False)
    tokens = int(usage["completion_tokens"]) if isinstance(usage, dict) and "completion_tokens" in usage else len(arrivals)
    if not arrivals:
        return _Done(tokens, None, None, True, None)
    last = arrivals[-1]
    answer = tokens / (last - started) if last > started else None
    return _Done(tokens, arrivals[0] - started, decode_tok_s(tokens, arrivals), True, answer)


def decode_tok_s(tokens: int, arrivals: Sequence[float]) -> float | None:
    """A request's decode speed: its tokens after the first over the time from its first chunk to
    its last, or None (not measured) where that span times reads rather than decoding: shorter
    than `MIN_DECODE_SPAN_S`, or most chunks after the first came together with the one before."""
    if tokens < 2 or len(arrivals) < 2:
        return None
    span = arrivals[-1] - arrivals[0]
    apart = sum(1 for earlier, later in zip(arrivals, arrivals[1:]) if later - earlier >= TOGETHER_S)
    if span < MIN_DECODE_SPAN_S or 2 * apart < len(arrivals) - 1:
        return None
    return (tokens - 1) / span


def _event(line: str) -> dict[str, Any] | None:
    if not line.startswith("data:") or line.strip() == "data: [DONE]":
        return None
    event = json.loads(line[5:])
    return event if isinstance(event, dict) else None


async def _greedy(http: httpx.AsyncClient, endpoint: Endpoint, probe: Prompt) -> Greedy:
    """A probe's answer at temperature 0, token by token with each token's lead when given."""
    body = {"model": endpoint.model, **probe.body(stream=False), "logprobs": True, "top_logprobs": 2}
    try:
        response = await http.post("/v1/chat/completions", json=body)
        choice = response.json()["choices"][0]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return Greedy((), ())
    content = ((choice.get("logprobs") or {}).get("content")) or []
    if not content:
        return Greedy((str((choice.get("message") or {}).get("content") or ""),), (None,))
    return Greedy(tuple(str(t.get("token", "")) for t in content), tuple(_margin(t) for t in content))


def _margin(token: dict[str, Any]) -> float | None:
    others = [float(t["logprob"]) for t in token.get("top_logprobs") or () if t.get("token") != token.get("token")]
    return float(token["logprob"]) - max(others) if others and "logprob" in token else None
