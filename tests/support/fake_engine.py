"""A fast, local OpenAI-compatible engine for relay tests and the relay benchmark.

stdlib asyncio only: HTTP/1.1 with keep-alive, `/v1/models`, `/v1/chat/completions` and
`/v1/completions`, streamed (one SSE event per HTTP chunk, as vLLM and llama-server send them)
or whole. What it does is set by `Behaviour`: tokens, delays, usage, a crash mid-stream, bytes
written one at a time (to split multi-byte characters across reads). It records every request
and whether the client went away before the answer was complete, so tests can see that a cancel
really reached the engine. It listens on 127.0.0.1, or on a Unix socket (`socket_path`). Run it alone for benchmarks:
`python -m tests.support.fake_engine --port 0 --tokens 256` prints its base URL.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import dataclass, field, replace
from typing import Any, Self

CREATED = 1_700_000_000
PIECES = ("Hé", "llo", " wörld", " €", " 😀", " ok", " ✓", " 字")  # multi-byte on purpose
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 500: "Internal Server Error"}


@dataclass(frozen=True)
class Behaviour:
    tokens: int = 16  # a body's max_tokens, when smaller, wins
    token_delay_s: float = 0.0
    head_delay_s: float = 0.0  # before the response head (deadline tests)
    crash_after: int | None = None  # reset the connection after this many tokens
    prompt_tokens: int = 9
    byte_writes: bool = False  # each byte in its own HTTP chunk
    batch: int = 64  # tokens written before waiting for the socket, with no token delay


@dataclass
class StreamRecord:
    """One answer as the engine saw it."""

    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    tokens_sent: int = 0
    completed: bool = False
    disconnected: bool = False
    crashed: bool = False
    finished: asyncio.Event = field(default_factory=asyncio.Event)


class FakeEngine:
    def __init__(self, *, api_key: str = "engine-key", served_name: str = "fake-model",
                 behaviour: Behaviour = Behaviour(), host: str = "127.0.0.1", port: int = 0,
                 socket_path: str | None = None) -> None:
        self.api_key = api_key
        self.served_name = served_name
        self.behaviour = behaviour
        self._host, self._port = host, port
        self.socket_path = socket_path
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self.records: list[StreamRecord] = []

    @property
    def port(self) -> int:
        assert self._server is not None, "start() the engine first"
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    @property
    def base_url(self) -> str:
        """Where to send requests; on a Unix socket only the Host (the socket is `socket_path`)."""
        return "http://localhost" if self.socket_path is not None else f"http://127.0.0.1:{self.port}"

    async def start(self) -> Self:
        if self.socket_path is not None:
            self._server = await asyncio.start_unix_server(self._serve_connection, self.socket_path)
        else:
            self._server = await asyncio.start_server(self._serve_connection, self._host, self._port)
        return self

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for writer in list(self._connections):
            writer.transport.abort()
        if self._handlers:
            await asyncio.wait(self._handlers, timeout=5)
        await self._server.wait_closed()
        self._server = None

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(writer)
        handler = asyncio.current_task()
        assert handler is not None
        self._handlers.add(handler)
        try:
            while await self._serve_one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            self._connections.discard(writer)
            self._handlers.discard(handler)
            writer.transport.abort()

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        head = await reader.readuntil(b"\r\n\r\n")
        request_line, *header_lines = head.decode("latin-1").split("\r\n")
        method, target, _ = request_line.split(" ", 2)
        headers = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in header_lines if ":" in h)}
        raw_body = await reader.readexactly(int(headers.get("content-length", "0")))
        body = json.loads(raw_body) if raw_body else {}
        if headers.get("authorization") != f"Bearer {self.api_key}":
            await _write_json(writer, 401, {"error": "Unauthorized"})
        elif method == "GET" and target == "/v1/models":
            await _write_json(writer, 200, {"object": "list", "data": [
                {"id": self.served_name, "object": "model", "owned_by": "fake", "max_model_len": 4096}]})
        elif method == "POST" and target in ("/v1/chat/completions", "/v1/completions"):
            await self._complete(reader, writer, target, body, headers)
        else:
            await _write_json(writer, 404, {"error": {"message": f"no route {method} {target}"}})
        return headers.get("connection", "").lower() != "close"

    async def _complete(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str,
                        body: dict[str, Any], headers: dict[str, str]) -> None:
        record = StreamRecord(path=path, body=body, headers=headers)
        self.records.append(record)
        behaviour = self.behaviour
        tokens = min(behaviour.tokens, int(body.get("max_tokens") or behaviour.tokens))
        gone = asyncio.ensure_future(reader.read(1))  # b"" when the client goes away
        try:
            if behaviour.head_delay_s:
                await _sleep_or_gone(behaviour.head_delay_s, gone)
            if gone.done():
                record.disconnected = True
            elif body.get("stream") is True:
                await self._stream(writer, record, tokens, gone)
            else:
                await self._whole(writer, record, tokens, gone)
        finally:
            gone.cancel()
            await asyncio.wait([gone])  # the reader is free again before the next request
            record.finished.set()

    async def _whole(self, writer: asyncio.StreamWriter, record: StreamRecord, tokens: int,
                     gone: asyncio.Future[bytes]) -> None:
        behaviour = self.behaviour
        if behaviour.token_delay_s:
            await _sleep_or_gone(behaviour.token_delay_s * tokens, gone)
        if gone.done():
            record.disconnected = True
            return
        text = "".join(PIECES[i % len(PIECES)] for i in range(tokens))
        chat = record.path.endswith("/chat/completions")
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                  if chat else {"index": 0, "text": text, "finish_reason": "length"})
        await _write_json(writer, 200, {
            "id": "fake-0", "object": "chat.completion" if chat else "text_completion", "created": CREATED,
            "model": self.served_name, "choices": [choice], "usage": _usage(behaviour.prompt_tokens, tokens)})
        record.tokens_sent = tokens
        record.completed = True

    async def _stream(self, writer: asyncio.StreamWriter, record: StreamRecord, tokens: int,
                      gone: asyncio.Future[bytes]) -> None:
        behaviour = self.behaviour
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
                     b"Transfer-Encoding: chunked\r\nCache-Control: no-cache\r\n\r\n")
        events = _Events(self.served_name, record.path.endswith("/chat/completions"))
        try:
            for i in range(tokens):
                if gone.done():
                    record.disconnected = True
                    return
                if behaviour.crash_after is not None and i >= behaviour.crash_after:
                    record.crashed = True
                    writer.transport.abort()
                    return
                if behaviour.byte_writes:
                    await self._send_event(writer, events.token(i), behaviour)
                else:
                    writer.write(events.framed_token(i))
                record.tokens_sent = i + 1
                if behaviour.token_delay_s:
                    await _sleep_or_gone(behaviour.token_delay_s, gone)
                elif (i + 1) % behaviour.batch == 0:
                    await writer.drain()
            tail = [events.final()]
            if (record.body.get("stream_options") or {}).get("include_usage") is True:
                tail.append(events.usage(behaviour.prompt_tokens, tokens))
            tail.append(b"data: [DONE]\n\n")
            for event in tail:
                await self._send_event(writer, event, behaviour)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            record.completed = True
        except ConnectionError:
            record.disconnected = True

    @staticmethod
    async def _send_event(writer: asyncio.StreamWriter, event: bytes, behaviour: Behaviour) -> None:
        if not behaviour.byte_writes:
            writer.write(b"%x\r\n%b\r\n" % (len(event), event))
            return
        for byte in event:
            writer.write(b"1\r\n%c\r\n" % byte)
            await writer.drain()
            await asyncio.sleep(0)


class _Events:
    """SSE events, encoded once per distinct piece so that the engine is never the bottleneck."""

    def __init__(self, model: str, chat: bool) -> None:
        self._model = model
        self._chat = chat
        self._pieces = [self._event({"content": p} if chat else p, None) for p in PIECES]
        self._framed = [b"%x\r\n%b\r\n" % (len(p), p) for p in self._pieces]

    def token(self, i: int) -> bytes:
        return self._pieces[i % len(self._pieces)]

    def framed_token(self, i: int) -> bytes:
        """The token's event as one HTTP chunk."""
        return self._framed[i % len(self._framed)]

    def final(self) -> bytes:
        return self._event({} if self._chat else "", "length")

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        return self._frame({"choices": [], "usage": _usage(prompt_tokens, completion_tokens)})

    def _event(self, content: Any, finish: str | None) -> bytes:
        choice = ({"index": 0, "delta": content, "finish_reason": finish} if self._chat
                  else {"index": 0, "text": content, "finish_reason": finish})
        return self._frame({"choices": [choice]})

    def _frame(self, fields: dict[str, Any]) -> bytes:
        document = {"id": "fake-0", "object": "chat.completion.chunk" if self._chat else "text_completion",
                    "created": CREATED, "model": self._model, **fields}
        return b"data: " + json.dumps(document, ensure_ascii=False).encode("utf-8") + b"\n\n"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def _sleep_or_gone(delay: float, gone: asyncio.Future[bytes]) -> None:
    await asyncio.wait([gone], timeout=delay)


async def _write_json(writer: asyncio.StreamWriter, status: int, document: Any) -> None:
    payload = json.dumps(document, ensure_ascii=False).encode("utf-8")
    writer.write(b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
                 % (status, _REASONS.get(status, "Status").encode(), len(payload), payload))
    await writer.drain()


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--api-key", default="engine-key")
    parser.add_argument("--tokens", type=int, default=Behaviour.tokens)
    parser.add_argument("--token-delay", type=float, default=0.0)
    args = parser.parse_args()

    async def serve() -> None:
        behaviour = replace(Behaviour(), tokens=args.tokens, token_delay_s=args.token_delay)
        engine = await FakeEngine(api_key=args.api_key, behaviour=behaviour, port=args.port).start()
        print(engine.base_url, flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    _main()
