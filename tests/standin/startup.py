"""vLLM's startup and failure lines, in the exact texts of the recorded fixtures.

The texts follow tests/fixtures/vllm/ (0.33 and 0.11) and engines.md A2/A3 with this run's
numbers put in. vLLM's loggers write to stdout; tqdm bars and uvicorn write to stderr, so each
line names its stream. The memory checks and their numbers are memory.py's.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Literal

from tests.standin.args import ServeArgs
from tests.standin.behaviour import Behaviour
from tests.standin.memory import GIB, KvBudget, format_gib, free_memory_short, kv_budget, weights_bytes_per_worker
from tests.standin.performance import capture_of

Stream = Literal["stdout", "stderr"]
Line = tuple[Stream, str]

WEIGHTS_GIB = 0.52


@dataclass(frozen=True)
class Outcome:
    """What the start leads to: serving, or an exit status after the failure lines."""

    lines: tuple[Line, ...]
    exit_status: int | None  # None: the server starts


_core_pid: int | None = None  # the engine-core child's, whose lines carry it (as vLLM's do); else ours


def _prefix(process: str, level: str, where: str, pid: int | None = None) -> str:
    stamp = time.strftime("%m-%d %H:%M:%S")
    return f"({process} pid={pid or os.getpid()}) {level} {stamp} [{where}] "


def _api(where: str, message: str, level: str = "INFO") -> Line:
    return "stdout", _prefix("APIServer", level, where) + message


def _core(where: str, message: str, level: str = "INFO", *, old: bool = False) -> Line:
    return "stdout", _prefix("EngineCore_DP0" if old else "EngineCore", level, where, _core_pid) + message


def print_core(level: str, where: str, message: str) -> None:
    """A line the engine core logs while serving (stdout)."""
    print(_core(where, message, level)[1], flush=True)


def effective_max_model_len(args: ServeArgs, behaviour: Behaviour) -> int:
    return args.max_model_len or behaviour.model_max_len


def _opening(args: ServeArgs, behaviour: Behaviour, max_len: int) -> list[Line]:
    old = behaviour.version == "0.11"
    version = "0.11.0" if old else "0.33.0"
    banner = (f"vLLM API server version {version}" if old
              else f"vLLM server version {version}, serving model {args.model}")
    return [
        _api("startup.py:18", banner),
        _api("startup.py:96", f"non-default args: {args.non_default}"),
        _api("model.py:744", "Resolved architecture: LlamaForCausalLM"),
        _api("model.py:2170", f"Using max model len {max_len}"),
        _core("core.py:140", f"Initializing a V1 LLM engine (v{version}) with config: model='{args.model}', "
              f"dtype=torch.bfloat16, max_seq_len={max_len}, tensor_parallel_size={args.tensor_parallel}, "
              f"served_model_name={args.served_name}", old=old),
        _api("utils.py:1444", "Waiting for 1 local, 0 remote core engine proc(s) to start."),
    ]


def _loading(old: bool) -> list[Line]:
    return [
        _core("model_runner.py:399", "Loading model from scratch...", old=old),
        ("stderr", "Loading safetensors checkpoint shards: 100% Completed | 1/1 [00:00<00:00, 98.10it/s]"),
    ]


def _traceback(error: str, *, old: bool) -> list[Line]:
    return [
        _core("core.py:1584", "EngineCore failed to start.", "ERROR", old=old),
        _core("core.py:1584", "Traceback (most recent call last):", "ERROR", old=old),
        _core("core.py:1584", '  File "/opt/vllm/lib/python3.12/site-packages/vllm/v1/engine/core.py", line 1575, '
              "in run_engine_core", "ERROR", old=old),
        _core("core.py:1584", error, "ERROR", old=old),
        ("stdout", f"(APIServer pid={os.getpid()}) Traceback (most recent call last):"),
        ("stdout", f"(APIServer pid={os.getpid()}) RuntimeError: Engine core initialization failed. "
                   "See root cause above. Failed core proc(s): {'EngineCore': 1}"),
    ]


def _oom(old: bool) -> list[Line]:
    torch_oom = ("CUDA out of memory. Tried to allocate 270.00 MiB. GPU 0 has a total capacity of 23.52 GiB "
                 "of which 181.94 MiB is free.")
    return [
        _core("gpu_model_runner.py:5077", "Failed to load model - not enough GPU memory. Try lowering "
              "--gpu-memory-utilization to free memory for weights, increasing --tensor-parallel-size, or using "
              "--quantization. See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more tips. "
              f"(original error: {torch_oom})", "ERROR", old=old),
        *_traceback(f"torch.OutOfMemoryError: {torch_oom}", old=old),
    ]


def _too_long(max_len: int, budget: KvBudget, old: bool) -> list[Line]:
    """`_check_enough_kv_cache_memory`'s refusal; the estimate is the longest request that fits."""
    needed = budget.needed_bytes(max_len)
    if old:
        estimate = (f"Based on the available memory, the estimated maximum model length is {budget.tokens}."
                    if budget.tokens > 0 else "")
        error = (f"ValueError: To serve at least one request with the models's max seq len ({max_len}), "
                 f"({needed / GIB:.2f} GiB KV cache is needed, which is larger than the available KV cache memory "
                 f"({budget.available_bytes / GIB:.2f} GiB). {estimate} Try increasing `gpu_memory_utilization` "
                 "or decreasing `max_model_len` when initializing the engine.")
        return _traceback(error, old=True)
    estimate = (f" Based on the available memory, the estimated maximum model length is {budget.tokens}."
                if budget.tokens > 0 else "")
    error = (f"ValueError: To serve at least one request with the model's max seq len ({max_len}), "
             f"({format_gib(needed)} GiB KV cache is needed, which is larger than the available KV cache memory "
             f"({format_gib(budget.available_bytes)} GiB).{estimate} Try increasing `gpu_memory_utilization` "
             "(which also controls CPU memory on the CPU backend) or decreasing `max_model_len` when initializing "
             "the engine. See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.")
    return _traceback(error, old=False)


def _no_cache_memory(old: bool) -> list[Line]:
    if old:
        error = ("ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` "
                 "when initializing the engine.")
    else:
        error = ("ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` "
                 "when initializing the engine (this flag also controls CPU memory reservation on the CPU backend, "
                 "despite its name). See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more "
                 "details.")
    return _traceback(error, old=old)


def _compile(args: ServeArgs, old: bool) -> list[Line]:
    if args.enforce_eager:
        return []
    if old:
        return [_core("backends.py:559", "Dynamo bytecode transform time: 0.01 s", old=True),
                _core("monitor.py:34", "torch.compile takes 0.02 s in total", old=True)]
    return [_core("monitor.py:40", "Starting torch.compile"),
            _core("backends.py:1188", "Dynamo bytecode transform time: 0.01 s"),
            _core("monitor.py:20", "torch.compile took 0.02 s in total")]


def _kv(budget: KvBudget, max_len: int, old: bool) -> list[Line]:
    concurrency = budget.tokens / max_len
    if old:
        return [_core("gpu_worker.py:298", f"Available KV cache memory: {budget.gib:.2f} GiB", old=True),
                _core("kv_cache_utils.py:1087", f"GPU KV cache size: {budget.tokens:,} tokens", old=True),
                _core("kv_cache_utils.py:1091",
                      f"Maximum concurrency for {max_len:,} tokens per request: {concurrency:.2f}x", old=True)]
    return [_core("gpu_worker.py:773", f"Available KV cache memory: {budget.gib} GiB"),
            _core("kv_cache_utils.py:1146", f"GPU KV cache size: {budget.tokens:,} tokens, "
                  f"Maximum concurrency for {max_len:,} tokens per request: {concurrency:.2f}x")]


def _loaded(args: ServeArgs, behaviour: Behaviour, old: bool) -> Line:
    """The weights each worker loaded: what memory.py counts when the test gave a GPU."""
    gib = round(weights_bytes_per_worker(args, behaviour) / GIB, 2) if behaviour.gpu_given else WEIGHTS_GIB
    if old:
        return _core("gpu_model_runner.py:2653", f"Model loading took {gib:.4f} GiB and 0.012000 seconds", old=True)
    return _core("model_runner.py:429", f"Model loading took {gib} GiB memory and 0.012000 seconds")


def _finish(args: ServeArgs, old: bool) -> list[Line]:
    graphs: list[Line] = [] if args.enforce_eager else [
        ("stderr", "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%|##########| 4/4 [00:00<00:00]"),
        _core("model_runner.py:1164", "Graph capturing finished in 0 secs, took 0.01 GiB", old=old),
    ]
    address = f"unix:{args.uds}" if args.uds is not None else f"http://{args.host}:{args.port}"
    started = f"Starting vLLM API server 0 on {address}" if old else f"Starting vLLM server on {address}"
    return [
        *graphs,
        _core("core.py:396", "init engine (profile, create kv cache, warmup model) took 0.05 s", old=old),
        _api("entry.py:135", "Supported tasks: ['generate']"),
        _api("entry.py:139", started),
        _api("launcher.py:188", "Available routes are:"),
        *(_api("launcher.py:207", f"Route: {route}, Methods: {method}") for route, method in (
            ("/health", "GET"), ("/metrics", "GET"), ("/v1/models", "GET"),
            ("/v1/chat/completions", "POST"), ("/v1/completions", "POST"))),
    ]


def startup(args: ServeArgs, behaviour: Behaviour, core_pid: int | None = None) -> Outcome:
    """The lines up to the point where the server listens, or up to the failure that ends the start:
    vLLM checks each card's free memory before loading, and the KV cache after. The engine core's
    lines carry `core_pid` (its process) where there is one."""
    global _core_pid
    _core_pid = core_pid
    old = behaviour.version == "0.11"
    max_len = effective_max_model_len(args, behaviour)
    lines = _opening(args, behaviour, max_len)
    graphs = capture_of(args, behaviour)
    if graphs is not None and graphs.truncated_from is not None:  # `config/vllm.py:2521`, while the config is made
        lines.insert(2, _api("vllm.py:2521", f"Truncating max_cudagraph_capture_size to {graphs.largest}", "WARNING"))
    if behaviour.exit_at_start is not None:
        error = "RuntimeError: stand-in asked to fail at start (STANDIN_EXIT_AT_START)"
        return Outcome(tuple(lines + _traceback(error, old=old)), behaviour.exit_at_start)
    if not behaviour.cards:
        return Outcome(tuple(lines + _traceback("RuntimeError: No CUDA GPUs are available", old=old)), 1)
    if short := free_memory_short(args, behaviour):
        return Outcome(tuple(lines + _traceback(short.message(old=old), old=old)), 1)
    lines += _loading(old)
    limit = behaviour.oom_above_max_model_len
    if limit is not None and max_len > limit:
        return Outcome(tuple(lines + _oom(old)), 1)
    lines += [_loaded(args, behaviour, old), *_compile(args, old)]
    budget = kv_budget(args, behaviour)
    if budget.available_bytes <= 0:
        return Outcome(tuple(lines + _no_cache_memory(old)), 1)
    if max_len > budget.tokens:
        return Outcome(tuple(lines + _kv(budget, max_len, old)[:1] + _too_long(max_len, budget, old)), 1)
    return Outcome(tuple(lines + _kv(budget, max_len, old) + _finish(args, old)), None)


def uvicorn_ready() -> tuple[Line, ...]:
    """uvicorn's own lines (stderr) once the socket accepts connections."""
    return (
        ("stderr", f"INFO:     Started server process [{os.getpid()}]"),
        ("stderr", "INFO:     Waiting for application startup."),
        ("stderr", "INFO:     Application startup complete."),
    )
