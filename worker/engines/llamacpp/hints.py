"""llama-server's failure lines (engines.md B3) and what each means, for `serve.diagnosis` to
word; most telling first: a CUDA allocation failure is followed by "error loading model".

Its device lines name each card's compute capability at every start, so that is no failure here."""

from __future__ import annotations

import re

from worker.engines.base import FailureHint

FAILURE_HINTS: tuple[FailureHint, ...] = (
    FailureHint(re.compile(r"out of memory|cudaMalloc failed|failed to allocate .*buffer", re.I), "out_of_memory"),
    FailureHint(re.compile(r"couldn't bind HTTP server socket"), "port_taken"),
    FailureHint(re.compile(r"CUDA driver version is insufficient|no CUDA-capable device|NVIDIA driver", re.I),
                "driver_too_old"),
    FailureHint(re.compile(r"error loading model|failed to load model|exiting due to model loading error", re.I),
                "model_unreadable"),
)
