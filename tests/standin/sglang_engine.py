"""The SGLang stand-in: what `sglang.launch_server.run_server` does on a card, as a test double.

The app starts SGLang through its own launcher (`worker/engines/sglang/launcher.py`), which imports
`sglang` in-process. Tests put `tests/standin/sglang_site` first on `PYTHONPATH`, so the launcher
imports the modules there, which hand over to this one: the real launcher runs, against a fake
`sglang`. It parses SGLang 0.5.23's command line (its flag spellings, `prog="sglang serve"`,
argparse's errors), enforces SGLang's own start-up checks with its messages (file in the 0.5.23
wheel named beside each), prints its start-up lines, and serves the OpenAI endpoints and /metrics
with SGLang's names, guarding everything but `/health*`, `/ready*` and `/metrics*` with the key.

| variable | effect |
| --- | --- |
| `STANDIN_GPU_TOTAL_MIB` | the card's memory (24564) |
| `STANDIN_WEIGHTS_MIB` | the weights' size (15872) |
| `STANDIN_KV_BYTES_PER_TOKEN` | KV bytes per token over all layers (147456: Qwen3-8B in bf16) |
| `STANDIN_MODEL_MAX_LEN` | the model's own context length, `derived_context_len` (40960) |
| `STANDIN_GRAPH_BS_LIMIT` | a decode CUDA graph batch above this runs out of memory while capturing |
| `STANDIN_CRASH_AFTER_REQUESTS`, `STANDIN_TOKEN_DELAY_S`, … | as for the vLLM stand-in (behaviour.py) |
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from tests.standin.args import ServeArgs
from tests.standin.behaviour import Behaviour
from tests.standin.server import HttpError, Request, StandinServer, _json, respond

GIB = 1 << 30
MIB = 1 << 20
# `arg_groups/fields/*.py` choices the stand-in checks (0.5.23).
SCHEDULE_POLICIES = ("lpm", "random", "fcfs", "dfs-weight", "lof", "priority", "routing-key", "hrrn",
                     "shortest-prefill-first")
KV_CACHE_DTYPES = ("auto", "fp8_e5m2", "fp8_e4m3", "mxfp8", "bf16", "bfloat16", "nvfp4", "fp4_mx_block16")
DEFAULT_DECODE_GRAPH_BS = 256
CHUNKED_PREFILL_DEFAULT = 2048


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        """argparse's own exit: usage and the error on stderr, status 2."""
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> _Parser:
    """The flags of `ServerArgs.add_cli_args` the app and its tests use, spelled and typed as there."""
    parser = _Parser(prog="sglang serve")
    add = parser.add_argument
    add("--model-path", "--model", dest="model_path", required=True)
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=30000)
    add("--api-key")
    add("--served-model-name")
    add("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1)
    add("--dp-size", "--data-parallel-size", dest="dp_size", type=int, default=1)
    add("--mem-fraction-static", type=float)
    add("--enable-metrics", action="store_true")
    add("--context-length", type=int)
    add("--max-running-requests", type=int)
    add("--max-prefill-tokens", type=int, default=16384)
    add("--chunked-prefill-size", type=int)
    add("--schedule-policy", choices=SCHEDULE_POLICIES, default="fcfs")
    add("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    add("--cuda-graph-max-bs-decode", type=int)
    add("--disable-cuda-graph", action="store_true")
    add("--disable-radix-cache", action="store_true")
    add("--trust-remote-code", action="store_true")
    return parser


class ServerArgs:
    """Parsed arguments, open to writes until `resolve_once` seals them (as 0.5.23's record is)."""

    def __init__(self, namespace: argparse.Namespace) -> None:
        self.__dict__.update(vars(namespace))
        self._input_frozen = False

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_input_frozen", False):
            raise AttributeError(f"ServerArgs input is sealed after resolution; cannot set {name!r}")
        object.__setattr__(self, name, value)

    def resolve_once(self) -> None:
        self._input_frozen = True


def prepare_server_args(argv: list[str]) -> ServerArgs:
    return ServerArgs(_parser().parse_args(argv))


@dataclass(frozen=True)
class Card:
    total_bytes: int
    weights_bytes: int
    kv_bytes_per_token: int
    model_max_len: int
    graph_bs_limit: int | None

    @classmethod
    def from_env(cls, env: dict[str, str] | os._Environ[str] = os.environ) -> Card:
        limit = env.get("STANDIN_GRAPH_BS_LIMIT")
        return cls(int(env.get("STANDIN_GPU_TOTAL_MIB", "24564")) * MIB, int(env.get("STANDIN_WEIGHTS_MIB", "15872")) * MIB,
                   int(env.get("STANDIN_KV_BYTES_PER_TOKEN", "147456")), int(env.get("STANDIN_MODEL_MAX_LEN", "40960")),
                   int(limit) if limit else None)


def default_mem_fraction(card: Card, chunked_prefill: int) -> float:
    """`arg_groups/memory_hook.py`: reserve 512 MiB + 1.5 MiB per activation token (at least 2048),
    at least 10 GiB on cards over 60 GiB; the rest of the card is the static share."""
    total_mib = card.total_bytes / MIB
    reserved = 512 + max(chunked_prefill, 2048) * 1.5
    if total_mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return round((total_mib - reserved) / total_mib, 3)


def _stamp(rank: bool = True) -> str:
    return f"[{time.strftime('%Y-%m-%d %H:%M:%S')}{' TP0' if rank else ''}] "


def _say(text: str, rank: bool = True) -> None:
    print(_stamp(rank) + text, file=sys.stderr, flush=True)


def _fail(exception: str) -> None:
    """A scheduler's death as SGLang logs it, then the launcher's exit (status 1)."""
    _say("Scheduler hit an exception: Traceback (most recent call last):")
    print(exception, file=sys.stderr, flush=True)
    _say("Received sigquit from a child process. It usually means the child failed.", rank=False)
    sys.exit(1)


@dataclass
class Started:
    kv_tokens: int
    context_len: int
    max_running: int
    served: list[str] = field(default_factory=list)


def start(args: ServerArgs, card: Card) -> Started:
    """Load, size the KV pool, capture graphs: each step's line, or its refusal and exit."""
    context = card.model_max_len
    if args.context_length is not None:
        if args.context_length > card.model_max_len and os.environ.get("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN") != "1":
            _fail(  # configs/model_config.py `_derive_context_length`
                f"ValueError: Warning: User-specified context_length ({args.context_length}) is greater than the "
                f"derived context_length ({card.model_max_len}). This may lead to incorrect model outputs or CUDA "
                "errors. Note that the derived context_length may differ from max_position_embeddings in the "
                "model's config. To allow overriding this maximum, set the env var "
                "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1")
        context = args.context_length
    chunked = args.chunked_prefill_size or CHUNKED_PREFILL_DEFAULT
    fraction = args.mem_fraction_static or default_mem_fraction(card, chunked)
    total_gb = card.total_bytes / GIB
    _say(f"Load weight begin. avail mem={total_gb:.2f} GB")
    _say(f"Load weight end. elapsed=2.41 s, type=Qwen3ForCausalLM, avail mem={(card.total_bytes - card.weights_bytes) / GIB:.2f} GB, "
         f"mem usage={card.weights_bytes / GIB:.2f} GB.")
    tokens = math.floor((card.total_bytes * fraction - card.weights_bytes) / card.kv_bytes_per_token)
    if tokens <= 0:  # model_executor/pool_configurator.py MemoryPoolConfig.__post_init__
        _fail("RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. "
              f"Current value: mem_fraction_static={fraction}")
    half_gb = tokens * card.kv_bytes_per_token / 2 / GIB
    _say(f"KV Cache is allocated. dtype: torch.bfloat16, #tokens: {tokens}, K size: {half_gb:.2f} GB, "
         f"V size: {half_gb:.2f} GB")
    _say(f"Memory pool end. avail mem={(card.total_bytes * (1 - fraction)) / GIB:.2f} GB")
    max_running = args.max_running_requests or min(4096, max(1, tokens // 512))
    if not args.disable_cuda_graph:
        _capture(args, card)
    _say(f"max_total_num_tokens={tokens}, chunked_prefill_size={chunked}, max_prefill_tokens={args.max_prefill_tokens}, "
         f"max_running_requests={max_running}, context_len={context}, available_gpu_mem={total_gb * (1 - fraction):.2f} GB")
    return Started(tokens, context, max_running)


def _capture(args: ServerArgs, card: Card) -> None:
    bs = args.cuda_graph_max_bs_decode or DEFAULT_DECODE_GRAPH_BS
    _say(f"Capture target decode CUDA graph begin. backend=full, num_tokens_per_req=1, avail mem=3.10 GB")
    if card.graph_bs_limit is not None and bs > card.graph_bs_limit:
        _fail("Exception: Capture cuda graph failed: CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a "
              "total capacity of 23.99 GiB of which 312.00 MiB is free.")
    sizes = [s for s in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if s <= bs]
    _say(f"Capture target decode CUDA graph end. bs={sizes}, elapsed=4.87 s, mem usage=0.61 GB, avail mem=2.49 GB.")


class SglangServer(StandinServer):
    """The vLLM stand-in's HTTP serving with SGLang's key rule, model card and /metrics."""

    def __init__(self, args: ServeArgs, behaviour: Behaviour, started: Started) -> None:
        super().__init__(args, behaviour, started.context_len)
        self.started = started

    async def _dispatch(self, request: Request, writer: asyncio.StreamWriter) -> None:
        if request.path.startswith(("/health", "/ready", "/metrics")):  # utils/auth.py: never guarded
            await super()._dispatch(request, writer)
            return
        try:
            self._authorise(request)
        except HttpError as exc:
            respond(writer, exc.status, _json(exc.body))
            return
        await super()._dispatch(request, writer)

    def _models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.args.served_name, "object": "model", "created": self.created,
                                            "owned_by": "sglang", "root": self.args.served_name, "parent": None,
                                            "max_model_len": self.started.context_len}]}

    def _metrics(self) -> str:
        """Made by prometheus-client as SGLang's is, with `metrics_collector.py`'s declarations
        (one scheduler: tp_rank 0)."""
        registry = CollectorRegistry()
        labels = {"model_name": self.args.served_name, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0"}
        c = self.counters
        gauges = (("sglang:num_running_reqs", "The number of running requests.", float(c.running)),
                  ("sglang:num_queue_reqs", "The number of requests in the waiting queue.", 0.0),
                  ("sglang:token_usage", "The token usage.", min(1.0, c.running * 64 / max(self.started.kv_tokens, 1))),
                  ("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.",
                   float(self.started.kv_tokens)))
        for name, documentation, value in gauges:
            Gauge(name, documentation, list(labels), registry=registry).labels(**labels).set(value)
        counters = (("sglang:prompt_tokens_total", "Number of prefill tokens processed.", c.prompt_tokens),
                    ("sglang:generation_tokens_total", "Number of generation tokens processed.", c.generation_tokens),
                    ("sglang:num_retracted_requests_total", "Total number of retracted requests.", 0))
        for name, documentation, count in counters:
            Counter(name, documentation, list(labels), registry=registry).labels(**labels).inc(count)
        return generate_latest(registry).decode()


def _serve_args(args: ServerArgs) -> ServeArgs:
    return ServeArgs(model=args.model_path, host=args.host, port=args.port, uds=None,
                     api_keys=(args.api_key,) if args.api_key else (), served_names=(args.served_model_name,)
                     if args.served_model_name else (), tensor_parallel=args.tp_size, max_model_len=args.context_length,
                     max_num_seqs=args.max_running_requests or 0, gpu_memory_utilization=args.mem_fraction_static or 0.0,
                     enforce_eager=args.disable_cuda_graph, non_default={})


def run_server(args: ServerArgs) -> None:
    args.resolve_once()
    started = start(args, Card.from_env())
    server = SglangServer(_serve_args(args), Behaviour.from_env(), started)
    asyncio.run(_serve(server))


async def _serve(server: SglangServer) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    listener = await asyncio.start_server(server.handle, server.args.host, server.args.port, backlog=1024)
    for line in (f"INFO:     Started server process [{os.getpid()}]", "INFO:     Waiting for application startup.",
                 "INFO:     Application startup complete.",
                 f"INFO:     Uvicorn running on http://{server.args.host}:{server.args.port} (Press CTRL+C to quit)"):
        print(line, file=sys.stderr, flush=True)
    _say("The server is fired up and ready to roll!", rank=False)
    async with listener:
        await stop.wait()


def kill_process_tree(pid: int, include_parent: bool = True) -> None:
    """No children to stop: the stand-in runs in one process."""


def main(argv: Sequence[str]) -> int:  # `python -m sglang.launch_server` without the app's launcher
    run_server(prepare_server_args(list(argv)))
    return 0
