"""The stand-in's HTTP surface, shaped like `vllm serve`'s, on stdlib asyncio streams.

HTTP/1.1 with keep-alive and chunked SSE, so a few hundred concurrent streams cost little. Routes
and bodies follow vLLM 0.33: `/health` (200, empty), `/v1/models` (with `max_model_len`),
`/v1/chat/completions` and `/v1/completions` (streaming or not, `usage`,
`stream_options.include_usage`), `/metrics` (vLLM 0.33 names). Only `/v1…` needs the API key,
as vLLM's middleware guards only those paths.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from tests.standin.args import ServeArgs
from tests.standin.behaviour import Behaviour
from tests.standin.performance import Performance, prompt_class
from tests.standin.startup import print_core
from tests.standin.stepper import Stepper

WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "and", "runs", "away")
DEFAULT_MAX_TOKENS = 16
MAX_HEADER_BYTES = 64 * 1024
MAX_BODY_BYTES = 16 * 1024 * 1024
REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
           413: "Payload Too Large"}


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    @property
    def keep_alive(self) -> bool:
        return self.headers.get("connection", "").lower() != "close"


@dataclass
class Counters:
    """What /metrics reports; also drives the crash / stall / freeze switches."""

    completions_started: int = 0
    completions_finished: int = 0
    running: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished_by_reason: dict[str, int] = field(default_factory=dict)


class HttpError(Exception):
    def __init__(self, status: int, body: dict[str, Any]):
        super().__init__(status)
        self.status = status
        self.body = body


def _openai_error(status: int, message: str, kind: str = "BadRequestError") -> HttpError:
    return HttpError(status, {"error": {"message": message, "type": kind, "param": None, "code": status}})


async def read_request(reader: asyncio.StreamReader) -> Request | None:
    """One request off a keep-alive connection; None when the client has closed it."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    except asyncio.LimitOverrunError:
        raise _openai_error(413, "request headers too large") from None
    request_line, *header_lines = head.decode("latin-1").split("\r\n")
    method, path, _version = request_line.split(" ", 2)
    headers = {}
    for line in header_lines:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    if length > MAX_BODY_BYTES:
        raise _openai_error(413, "request body too large")
    body = await reader.readexactly(length) if length else b""
    return Request(method, path.split("?", 1)[0], headers, body)


def _head(status: int, content_type: str, extra: str = "") -> bytes:
    return (f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}\r\ncontent-type: {content_type}\r\n"
            f"server: uvicorn\r\n{extra}").encode()


def respond(writer: asyncio.StreamWriter, status: int, body: bytes, content_type: str = "application/json") -> None:
    writer.write(_head(status, content_type, f"content-length: {len(body)}\r\n\r\n") + body)


def _json(data: Any) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _token_count(text: str) -> int:
    return max(1, len(text.split()))


def _prompt_text(path: str, body: dict[str, Any]) -> str:
    if path == "/v1/chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _openai_error(400, "messages must be a non-empty list")
        return " ".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
    prompt = body.get("prompt")
    if not isinstance(prompt, (str, list)):
        raise _openai_error(400, "prompt must be a string or a list")
    return prompt if isinstance(prompt, str) else " ".join(map(str, prompt))


class StandinServer:
    """Serves one model under its served name until the process is told to stop."""

    def __init__(self, args: ServeArgs, behaviour: Behaviour, max_model_len: int):
        self.args = args
        self.behaviour = behaviour
        self.max_model_len = max_model_len
        self.counters = Counters()
        self.created = int(time.time())
        self.frozen = asyncio.Event()
        self.never = asyncio.Event()
        perf = Performance.of(args, behaviour)
        self.stepper = Stepper(perf, print_core) if perf is not None else None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    request = await read_request(reader)
                except HttpError as exc:
                    respond(writer, exc.status, _json(exc.body))
                    break
                if request is None:
                    break
                if self.frozen.is_set():
                    await self.never.wait()
                await self._dispatch(request, writer)
                await writer.drain()
                if not request.keep_alive:
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _dispatch(self, request: Request, writer: asyncio.StreamWriter) -> None:
        try:
            if request.path.startswith("/v1"):
                self._authorise(request)
            route = (request.method, request.path)
            if route == ("GET", "/health"):
                respond(writer, 200, b"")
            elif route == ("GET", "/metrics"):
                respond(writer, 200, self._metrics().encode(), "text/plain; version=0.0.4; charset=utf-8")
            elif route == ("GET", "/v1/models"):
                respond(writer, 200, _json(self._models()))
            elif request.path in ("/v1/chat/completions", "/v1/completions") and request.method == "POST":
                await self._complete(request, writer)
            elif request.path in ("/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions"):
                raise HttpError(405, {"detail": "Method Not Allowed"})
            else:
                raise HttpError(404, {"detail": "Not Found"})
        except HttpError as exc:
            respond(writer, exc.status, _json(exc.body))

    def _authorise(self, request: Request) -> None:
        if not self.args.api_keys:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        good = scheme.lower() == "bearer" and any(
            hmac.compare_digest(token.encode(), key.encode()) for key in self.args.api_keys)
        if not good:
            raise HttpError(401, {"error": "Unauthorized"})

    def _models(self) -> dict[str, Any]:
        cards = [{"id": name, "object": "model", "created": self.created, "owned_by": "vllm", "root": self.args.model,
                  "parent": None, "max_model_len": self.max_model_len,
                  "permission": [{"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
                                  "created": self.created, "allow_create_engine": False, "allow_sampling": True,
                                  "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                                  "allow_fine_tuning": False, "organization": "*", "group": None,
                                  "is_blocking": False}]}
                 for name in (self.args.served_names or (self.args.model,))]
        return {"object": "list", "data": cards}

    def _parse_completion(self, request: Request) -> tuple[dict[str, Any], str, int, int]:
        try:
            body = json.loads(request.body or b"null")
        except ValueError as exc:
            raise _openai_error(400, f"body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise _openai_error(400, "body must be a JSON object")
        model = body.get("model")
        if model is not None and model not in (self.args.served_names or (self.args.model,)):
            raise _openai_error(404, f"The model `{model}` does not exist.", "NotFoundError")
        prompt = _prompt_text(request.path, body)
        prompt_tokens = _token_count(prompt)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_MAX_TOKENS
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise _openai_error(400, "max_tokens must be a positive integer")
        if prompt_tokens + max_tokens > self.max_model_len:
            raise _openai_error(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                     f"you requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the "
                                     f"messages, {max_tokens} in the completion).")
        return body, prompt, prompt_tokens, max_tokens

    async def _complete(self, request: Request, writer: asyncio.StreamWriter) -> None:
        body, prompt, prompt_tokens, max_tokens = self._parse_completion(request)
        counters = self.counters
        counters.completions_started += 1
        counters.running += 1
        counters.prompt_tokens += prompt_tokens
        try:
            stall = self.behaviour.stall_after_requests
            if stall is not None and counters.completions_started > stall:
                await self._stall(writer, bool(body.get("stream")))
            chat = request.path == "/v1/chat/completions"
            if body.get("stream"):
                await self._stream(writer, body, chat, prompt, prompt_tokens, max_tokens)
            else:
                await self._whole(writer, chat, prompt, prompt_tokens, max_tokens)
        finally:
            counters.running -= 1
        counters.completions_finished += 1
        counters.finished_by_reason["length"] = counters.finished_by_reason.get("length", 0) + 1
        await writer.drain()
        self._after_completion()

    async def _stall(self, writer: asyncio.StreamWriter, stream: bool) -> None:
        if stream:
            writer.write(_head(200, "text/event-stream; charset=utf-8", "transfer-encoding: chunked\r\n\r\n"))
            await writer.drain()
        await self.never.wait()

    def _after_completion(self) -> None:
        finished = self.counters.completions_finished
        if self.behaviour.crash_after_requests is not None and finished >= self.behaviour.crash_after_requests:
            print(f"(APIServer pid={os.getpid()}) ERROR stand-in crashing after {finished} requests "
                  "(STANDIN_CRASH_AFTER_REQUESTS)", flush=True)
            os._exit(1)
        if self.behaviour.freeze_after_requests is not None and finished >= self.behaviour.freeze_after_requests:
            self.frozen.set()

    async def _tokens(self, count: int, prompt: str, prompt_tokens: int) -> AsyncIterator[tuple[int, str]]:
        """The text each step adds and its token count: one token at a time, or several where a
        step of speculative decoding keeps drafts (vLLM streams them in one chunk)."""
        index = 0
        async for burst in self._paced(count, prompt, prompt_tokens):
            self.counters.generation_tokens += burst
            yield burst, "".join(" " + WORDS[i % len(WORDS)] for i in range(index, index + burst))
            index += burst

    async def _paced(self, count: int, prompt: str, prompt_tokens: int) -> AsyncIterator[int]:
        """How many tokens come out at a time: performance.py's steps, else one per token delay."""
        if self.stepper is not None:
            async for burst in self.stepper.generate(prompt_tokens, count, prompt_class(prompt, prompt_tokens)):
                yield burst
            return
        for _ in range(count):
            if self.behaviour.token_delay_s:
                await asyncio.sleep(self.behaviour.token_delay_s)
            yield 1

    def _usage(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
                "completion_tokens": completion_tokens, "prompt_tokens_details": None}

    async def _whole(self, writer: asyncio.StreamWriter, chat: bool, prompt: str, prompt_tokens: int,
                     max_tokens: int) -> None:
        text = "".join([piece async for _, piece in self._tokens(max_tokens, prompt, prompt_tokens)])
        if chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []},
                                      "logprobs": None, "finish_reason": "length", "stop_reason": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None}
        respond(writer, 200, _json({
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": self.args.served_name, "choices": [choice], "usage": self._usage(prompt_tokens, max_tokens)}))

    async def _stream(self, writer: asyncio.StreamWriter, body: dict[str, Any], chat: bool, prompt: str,
                      prompt_tokens: int, max_tokens: int) -> None:
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        base = {"id": ident, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.args.served_name}

        def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            return _chunk(b"data: " + _json({**base, "choices": choices, **extra}) + b"\n\n")

        writer.write(_head(200, "text/event-stream; charset=utf-8", "transfer-encoding: chunked\r\n\r\n"))
        if chat:
            writer.write(event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}]))
        produced = 0
        async for burst, token in self._tokens(max_tokens, prompt, prompt_tokens):
            produced += burst
            finish = "length" if produced == max_tokens else None
            if chat:
                choice = {"index": 0, "delta": {"content": token}, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": token, "logprobs": None, "finish_reason": finish, "stop_reason": None}
            writer.write(event([choice]))
            await writer.drain()
        options = body.get("stream_options") or {}
        if isinstance(options, dict) and options.get("include_usage"):
            writer.write(event([], usage=self._usage(prompt_tokens, produced)))
        writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")

    def _metrics(self) -> str:
        labels = f'engine="0",model_name="{self.args.served_name}"'
        counters = self.counters
        usage = min(1.0, counters.running * self.max_model_len / max(self.behaviour.kv_tokens, 1) / 10)
        concurrency = self.behaviour.kv_tokens / self.max_model_len
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {float(counters.running)}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} 0.0",
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{labels}}} {usage}",
            "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{{{labels}}} {float(counters.prompt_tokens)}",
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{{{labels}}} {float(counters.generation_tokens)}",
            "# HELP vllm:request_success_total Count of successfully processed requests.",
            "# TYPE vllm:request_success_total counter",
            *(f'vllm:request_success_total{{{labels},finished_reason="{reason}"}} {float(n)}'
              for reason, n in sorted(counters.finished_by_reason.items())),
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="16",cache_dtype="auto",engine="0",'
            f'gpu_memory_utilization="{self.args.gpu_memory_utilization}",'
            f'kv_cache_max_concurrency="{concurrency:.2f}",kv_cache_size_tokens="{self.behaviour.kv_tokens}",'
            f'num_gpu_blocks="{self.behaviour.kv_tokens // 16}"}} 1.0',
        ]
        return "\n".join(lines) + "\n"
