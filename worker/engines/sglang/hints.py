"""SGLang's failure lines (0.5.23's sources) and what each means, for `serve.diagnosis` to word;
most telling first: an out-of-memory traceback also names the card and its driver."""

from __future__ import annotations

import re

from worker.engines.base import FailureHint

FAILURE_HINTS: tuple[FailureHint, ...] = (
    # pool_configurator.py, PyTorch's allocator, and a CUDA graph capture that ran out.
    FailureHint(re.compile(r"out of memory|Not enough memory\. Please try to increase --mem-fraction-static|"
                           r"leaves no room for the full KV pool", re.I), "out_of_memory"),
    # utils/network.py (`wait_port_available`, the reuse-port bind) and uvicorn's own bind.
    FailureHint(re.compile(r"Address already in use|at \d+ is not available|Could not bind port"), "port_taken"),
    FailureHint(re.compile(r"Bfloat16 is only supported|compute capability", re.I), "gpu_too_old"),
    FailureHint(re.compile(r"CUDA driver version is insufficient|no CUDA-capable device|NVIDIA driver", re.I),
                "driver_too_old"),
)
