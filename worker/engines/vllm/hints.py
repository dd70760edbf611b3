"""vLLM's failure lines (engines.md A3, A8) and what each means, for `serve.diagnosis` to word;
most telling first: an out-of-memory traceback also names the card and its driver."""

from __future__ import annotations

import re

from worker.engines.base import FailureHint

FAILURE_HINTS: tuple[FailureHint, ...] = (
    FailureHint(re.compile(r"out of memory|not enough GPU memory|No available memory for the cache blocks", re.I),
                "out_of_memory"),
    FailureHint(re.compile(r"Address already in use"), "port_taken"),  # uvicorn's bind, before the engine is built
    FailureHint(re.compile(r"Bfloat16 is only supported|compute capability", re.I), "gpu_too_old"),
    FailureHint(re.compile(r"CUDA driver version is insufficient|no CUDA-capable device|NVIDIA driver", re.I),
                "driver_too_old"),
    # No pinned memory under WSL2 though the app asks for it (`runtime_environment`): a WSL kernel
    # older than 4.19.121 (engines.md A8), which the V2 runner before 0.30 could not do without.
    FailureHint(re.compile(r"UVA is not available"), "wsl_too_old"),
)
