"""SGLang's own start-up and failure lines (0.5.23, as its sources format them) → the facts the
supervisor reads."""

from __future__ import annotations

import pytest

from worker.engines.base import (
    ContextTooLong,
    GraphsCaptured,
    KvCacheSize,
    Listening,
    MaxConcurrency,
    ModelLoaded,
    OutOfMemory,
    PhaseReached,
    StartFailed,
    StartupComplete,
)
from worker.engines.sglang.log import parse_line
from worker.serve.restart_policy import context_refusal

TP = "[2026-12-02 10:00:00 TP0] "
MAIN = "[2026-12-02 10:00:00] "


@pytest.mark.parametrize(("line", "fact"), [
    (TP + "Load weight begin. avail mem=23.05 GB", PhaseReached("loading")),
    (TP + "Load weight end. elapsed=3.21 s, type=Qwen3ForCausalLM, avail mem=7.55 GB, mem usage=15.50 GB.",
     ModelLoaded(15.5, 3.21)),
    (TP + "Load weight end. elapsed=9.80 s, type=Qwen3ForCausalLM, quant=fp8, avail mem=60.10 GB, mem usage=8.12 GB.",
     ModelLoaded(8.12, 9.8)),
    (TP + "KV Cache is allocated. dtype: torch.bfloat16, #tokens: 18140, K size: 1.25 GB, V size: 1.25 GB",
     KvCacheSize(18140)),
    (TP + "SWA KV Cache is allocated. dtype: torch.bfloat16, #tokens: 4096, KV size: 0.50 GB", KvCacheSize(4096)),
    (TP + "Post-capture KV sizing: KV cache allocated. dtype: torch.bfloat16, #tokens: 52000, KV size: 3.57 GB, "
          "avail mem=2.10 GB", KvCacheSize(52000)),
    (TP + "max_total_num_tokens=18140, chunked_prefill_size=2048, max_prefill_tokens=16384, max_running_requests=35, "
          "context_len=8192, available_gpu_mem=6.00 GB", KvCacheSize(18140, MaxConcurrency(8192, 2.21))),
    (TP + "Capture target decode CUDA graph begin. backend=full, num_tokens_per_req=1, avail mem=3.10 GB",
     PhaseReached("capturing")),
    (TP + "Capture target decode CUDA graph end. bs=[1, 2, 4, 8], elapsed=4.87 s, mem usage=0.61 GB, avail mem=2.49 GB.",
     GraphsCaptured(4.87, 0.61)),
    (TP + "Capture target prefill CUDA graph end. elapsed=1.20 s, mem usage=0.10 GB, avail mem=2.39 GB.",
     GraphsCaptured(1.2, 0.1)),
    ("INFO:     Application startup complete.", PhaseReached("warming")),
    ("INFO:     Uvicorn running on http://127.0.0.1:30000 (Press CTRL+C to quit)", Listening("http://127.0.0.1:30000")),
    (MAIN + "The server is fired up and ready to roll!", StartupComplete()),
    ("\x1b[32m" + MAIN + "The server is fired up and ready to roll!\x1b[0m\r\n", StartupComplete()),
])
def test_start_up_lines(line: str, fact: object) -> None:
    assert parse_line(line) == fact


def test_a_context_above_the_models_is_a_context_refusal_with_both_numbers() -> None:
    line = ("ValueError: Warning: User-specified context_length (131072) is greater than the derived context_length "
            "(40960). This may lead to incorrect model outputs or CUDA errors. Note that the derived context_length "
            "may differ from max_position_embeddings in the model's config. To allow overriding this maximum, set "
            "the env var SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1")
    assert parse_line(line) == ContextTooLong(131072, 40960, flag="--context-length", model_max=True)


def test_sglangs_context_refusal_speaks_of_the_models_limit_and_its_own_flag() -> None:
    """Not vLLM's KV-cache words: SGLang refused a context above what the model itself takes."""
    refusal = context_refusal(ContextTooLong(131072, 40960, flag="--context-length", model_max=True))
    assert refusal == ("The engine refused context length 131072: the model itself takes at most 40960 tokens. "
                       "Lower --context-length to 40960 or less.")


@pytest.mark.parametrize("line", [
    "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. Current value: "
    "mem_fraction_static=0.62",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity of 23.99 GiB",
    "Exception: Capture cuda graph failed: CUDA out of memory. Tried to allocate 2.00 GiB.",
    "RuntimeError: SWA pool cap (4096 tokens, 0.50 GiB) leaves no room for the full KV pool within the available "
    "0.40 GiB. Reduce --max-running-requests, lower SGLANG_SWA_EVICTION_INTERVAL, or increase --mem-fraction-static.",
])
def test_out_of_memory_lines(line: str) -> None:
    fact = parse_line(line)
    assert isinstance(fact, OutOfMemory) and fact.message == line


@pytest.mark.parametrize("line", [
    TP + "Scheduler hit an exception: Traceback (most recent call last):",
    MAIN + "Received sigquit from a child process. It usually means the child failed.",
    MAIN + "Initialization failed. warmup error: Traceback (most recent call last):",
])
def test_start_failures(line: str) -> None:
    assert isinstance(parse_line(line), StartFailed)


@pytest.mark.parametrize("line", [
    TP + "KV pool holds 18140 tokens, fewer than --context-length 40960. One full-length request cannot fit, so "
         "long requests will be refused or truncated at serving time.",  # a warning: SGLang serves on
    TP + "Memory pool end. avail mem=6.00 GB",
    TP + "Prefill batch, #new-seq: 1, #new-token: 6, #cached-token: 0, token usage: 0.00, #running-req: 0",
    "",
])
def test_other_lines_carry_no_fact(line: str) -> None:
    assert parse_line(line) is None


@pytest.mark.parametrize(("line", "cause"), [
    ("RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. Current value: "
     "mem_fraction_static=0.62", "out_of_memory"),
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB.", "out_of_memory"),
    ("ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 30000): Address already in use",
     "port_taken"),
    ("OSError: Could not bind port 30000 on any configured address family", "port_taken"),
    ("RuntimeError: The NVIDIA driver on your system is too old (found version 11040).", "driver_too_old"),
])
def test_failure_hints_name_the_cause(line: str, cause: str) -> None:
    from worker.engines.sglang.hints import FAILURE_HINTS

    assert next(hint.cause for hint in FAILURE_HINTS if hint.pattern.search(line)) == cause
