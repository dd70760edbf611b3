"""One module per engine behind one small interface (`base.EngineAdapter`); look one up by name."""

from __future__ import annotations

from typing import cast

from worker.engines import llamacpp, vllm
from worker.engines.base import Endpoint, EngineAdapter, LogFact

ENGINE_NAMES = ("vllm", "llamacpp")
_ADAPTERS = {"vllm": vllm, "llamacpp": llamacpp}


def get_adapter(name: str) -> EngineAdapter:
    """The adapter module for `vllm` or `llamacpp`; ValueError names the known engines otherwise."""
    try:
        return cast(EngineAdapter, _ADAPTERS[name])
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; known engines: {', '.join(ENGINE_NAMES)}") from None


__all__ = ["ENGINE_NAMES", "EngineAdapter", "Endpoint", "LogFact", "get_adapter"]
