"""The llama-server arguments an assignment may set: tuning only, each checked against `common/arg.cpp`.

Pure data. llama.cpp looks every token up exactly (only `_` becomes `-` in `--long` names, which
this list refuses anyway) and never reads `--flag=value`: a value is always the next argument.
Everything the app owns (`--host`, `--port`, the API key, `--alias`, `-sm/-ts/-mg` across GPUs,
`--fit`) and everything that names a file, address, model or template is left off on purpose.
"""

from __future__ import annotations

from worker.engines.allowlist import AllowedFlag, Allowlist, Choice, IntValue, Switch

MAX_CONTEXT = 16_777_216
MAX_BATCH = 1_048_576
MAX_THREADS = 1024
MAX_SLOTS = 256
MAX_NGRAM = 1024  # `common/arg.cpp` refuses n-gram sizes above 1024

# `common/arg.cpp` kv_cache_types
KV_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
# `common/speculative.cpp` type names that need no draft model or lookup-cache file: none, the
# model's own MTP head, and the n-gram drafters that learn from the running context.
SPEC_TYPES = ("none", "draft-mtp", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod")


def _ngram(spelling: str, purpose: str, low: int = 1) -> AllowedFlag:
    return AllowedFlag((spelling,), IntValue(low, MAX_NGRAM), purpose)


ALLOWLIST = Allowlist(
    "llama.cpp",
    (
        AllowedFlag(("-c", "--ctx-size"), IntValue(0, MAX_CONTEXT), "Context size over all slots (0: the model's)."),
        AllowedFlag(("-np", "--parallel"), IntValue(1, MAX_SLOTS, words=("-1",)), "Server slots (-1: automatic)."),
        AllowedFlag(("-b", "--batch-size"), IntValue(1, MAX_BATCH), "Logical batch size."),
        AllowedFlag(("-ub", "--ubatch-size"), IntValue(1, MAX_BATCH), "Physical batch size."),
        AllowedFlag(("-ngl", "--gpu-layers", "--n-gpu-layers"), IntValue(0, 10_000, words=("auto", "all")),
                    "Layers kept in GPU memory."),
        AllowedFlag(("-fa", "--flash-attn"), Choice(("on", "off", "auto")), "Flash attention."),
        AllowedFlag(("-ctk", "--cache-type-k"), Choice(KV_CACHE_TYPES), "KV cache type of K."),
        AllowedFlag(("-ctv", "--cache-type-v"), Choice(KV_CACHE_TYPES), "KV cache type of V (quantized needs -fa)."),
        AllowedFlag(("-kvu", "--kv-unified"), Switch(), "One KV buffer shared by all slots.",
                    negations=("-no-kvu", "--no-kv-unified")),
        AllowedFlag(("-kvo", "--kv-offload"), Switch(), "KV cache in GPU memory.",
                    negations=("-nkvo", "--no-kv-offload")),
        AllowedFlag(("--swa-full",), Switch(), "Full-size sliding-window cache."),
        AllowedFlag(("-ctxcp", "--ctx-checkpoints", "--swa-checkpoints"), IntValue(0, 1024),
                    "Context checkpoints per slot."),
        AllowedFlag(("-cram", "--cache-ram"), IntValue(0, MAX_BATCH),
                    "Prompt cache in RAM, MiB (0: off); no unlimited -1, and at most the RAM the machine can spare."),
        AllowedFlag(("--cache-reuse",), IntValue(0, MAX_CONTEXT), "Smallest chunk reused from the cache by shifting."),
        AllowedFlag(("--context-shift",), Switch(), "Context shift when a generation fills the context.",
                    negations=("--no-context-shift",)),
        AllowedFlag(("-cb", "--cont-batching"), Switch(), "Continuous batching.",
                    negations=("-nocb", "--no-cont-batching")),
        AllowedFlag(("-t", "--threads"), IntValue(1, MAX_THREADS), "CPU threads for generation (at most the machine's cores)."),
        AllowedFlag(("-tb", "--threads-batch"), IntValue(1, MAX_THREADS), "CPU threads for prompt processing (at most the machine's cores)."),
        AllowedFlag(("-cmoe", "--cpu-moe"), Switch(), "Mixture-of-experts weights kept in RAM."),
        AllowedFlag(("-ncmoe", "--n-cpu-moe"), IntValue(0, 10_000), "MoE weights of the first N layers kept in RAM."),
        AllowedFlag(("--jinja",), Switch(), "The model's own chat template through llama.cpp's Jinja engine.",
                    negations=("--no-jinja",)),
        AllowedFlag(("--spec-type",), Choice(SPEC_TYPES, many=True),
                    "Speculative decoding without a draft model file."),
        AllowedFlag(("--spec-draft-n-max",), IntValue(0, 64), "Most tokens drafted per step."),
        AllowedFlag(("--spec-draft-n-min",), IntValue(0, 64), "Fewest tokens drafted per step."),
        _ngram("--spec-ngram-mod-n-min", "ngram-mod: fewest n-gram tokens.", low=0),
        _ngram("--spec-ngram-mod-n-max", "ngram-mod: most n-gram tokens.", low=0),
        _ngram("--spec-ngram-mod-n-match", "ngram-mod: lookup length."),
        _ngram("--spec-ngram-simple-size-n", "ngram-simple: lookup n-gram length."),
        _ngram("--spec-ngram-simple-size-m", "ngram-simple: draft m-gram length."),
        AllowedFlag(("--spec-ngram-simple-min-hits",), IntValue(1, 1_000_000), "ngram-simple: fewest hits."),
    ),
)
