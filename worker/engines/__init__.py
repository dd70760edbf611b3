"""One module per engine behind one small interface (`base.EngineAdapter`); look one up by name."""

from __future__ import annotations

from typing import cast

from worker.engines import llamacpp, vllm
from worker.engines.base import Endpoint, EngineAdapter, LogFact

ENGINE_NAMES = ("vllm", "llamacpp")
_ADAPTERS = {"vllm": vllm, "llamacpp": llamacpp}


ARGS_DOC_COMMAND = "python -c 'import worker.engines as e; print(e.args_markdown(), end=\"\")' > docs/engine-args.md"
_ENGINE_TITLES = {"vllm": "vLLM 0.33 (`vllm serve`)", "llamacpp": "llama.cpp (`llama-server`)"}


def get_adapter(name: str) -> EngineAdapter:
    """The adapter module for `vllm` or `llamacpp`; ValueError names the known engines otherwise."""
    try:
        return cast(EngineAdapter, _ADAPTERS[name])
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; known engines: {', '.join(ENGINE_NAMES)}") from None


def published_args(*, allow_remote_code: bool = False) -> dict[str, list[str]]:
    """Per engine, every flag spelling this node accepts in an assignment (`hello.engine_args`)."""
    return {name: get_adapter(name).ALLOWED_ARGS.published(allow_remote_code=allow_remote_code)
            for name in ENGINE_NAMES}


def args_markdown() -> str:
    """`docs/engine-args.md`: the allowlists as tables, so the document cannot drift from the code."""
    parts = [
        "# Engine arguments an assignment may set\n",
        "Generated from `worker/engines/vllm_args.py` and `worker/engines/llamacpp_args.py`; do not edit.",
        f"Regenerate with `{ARGS_DOC_COMMAND}`.\n",
        "Closed world (contract, Assignment rule 4): every argument in `base_args` and `tiers` must be one of",
        "these spellings, followed by a value of the listed type. Anything else refuses the whole assignment",
        "with `argument not allowed: FLAG` (or `value not allowed for FLAG: why`): unknown flags, prefix",
        "abbreviations, `_` for `-`, dotted JSON keys (`--x.key`), JSON keys not listed, and any value that",
        "is a path, URL, host, module or template. The app owns the host, port, socket, API key, served name,",
        "parallel layout and memory flags (`--kv-cache-memory-bytes`, llama.cpp's `--fit`) and sets them",
        "itself; an assignment's `--gpu-memory-utilization` is only a cap on what the app measured.\n",
    ]
    for name in ENGINE_NAMES:
        parts += [f"## {_ENGINE_TITLES[name]}\n", get_adapter(name).ALLOWED_ARGS.markdown()]
    return "\n".join(parts)


__all__ = ["ENGINE_NAMES", "EngineAdapter", "Endpoint", "LogFact", "args_markdown", "get_adapter", "published_args"]
