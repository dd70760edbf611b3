"""One package per engine behind one interface (`base.EngineAdapter`), listed in one registry.

Importing this package registers the built-in engines, vLLM first, then llama.cpp. Adding an
engine is adding its package and registering it here.
"""

from __future__ import annotations

from worker.engines import llamacpp, registry, sglang, vllm
from worker.engines.base import Endpoint, EngineAdapter, LogFact

registry.register(vllm)
registry.register(sglang)
registry.register(llamacpp)

get_adapter = registry.get

ARGS_DOC_COMMAND = "python -c 'import worker.engines as e; print(e.args_markdown(), end=\"\")' > docs/engine-args.md"


def published_args(*, allow_remote_code: bool = False) -> dict[str, list[str]]:
    """Per engine, every flag spelling this node accepts in an assignment (`hello.engine_args`)."""
    return {adapter.NAME: adapter.ALLOWED_ARGS.published(allow_remote_code=allow_remote_code)
            for adapter in registry.adapters()}


def args_markdown() -> str:
    """`docs/engine-args.md`: the allowlists as tables, so the document cannot drift from the code."""
    parts = [
        "# Engine arguments an assignment may set\n",
        "Generated from each engine's `worker/engines/<engine>/args.py`; do not edit.",
        f"Regenerate with `{ARGS_DOC_COMMAND}`.\n",
        "Closed world (contract, Assignment rule 4): every argument in `base_args` and `tiers` must be one of",
        "these spellings, followed by a value of the listed type. Anything else refuses the whole assignment",
        "with `argument not allowed: FLAG` (or `value not allowed for FLAG: why`): unknown flags, prefix",
        "abbreviations, `_` for `-`, dotted JSON keys (`--x.key`), JSON keys not listed, and any value that",
        "is a path, URL, host, module or template. The app owns the host, port, socket, API key, served name,",
        "parallel layout and memory flags (`--kv-cache-memory-bytes`, llama.cpp's `--fit`) and sets them",
        "itself; an assignment's `--gpu-memory-utilization` is only a cap on what the app measured.\n",
    ]
    for adapter in registry.adapters():
        parts += [f"## {adapter.ARGS_TITLE}\n", adapter.ALLOWED_ARGS.markdown()]
    return "\n".join(parts)


__all__ = ["Endpoint", "EngineAdapter", "LogFact", "args_markdown", "get_adapter", "published_args", "registry"]
