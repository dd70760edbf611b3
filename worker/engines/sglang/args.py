"""The SGLang arguments an assignment may set: tuning only, each checked against SGLang 0.5.23's parser.

Pure data. Spellings and value types follow the 0.5.23 wheel's `sglang/srt/server_args.py`
(`ServerArgs.add_cli_args`), which builds its parser from the fields in
`sglang/srt/arg_groups/fields/*.py` (`arg_utils.add_cli_args_from_dataclass`): a `bool` field is a
`store_true` switch with no `--no-` form, every other field takes one value, and argparse reads
`--flag=value` for all of them. SGLang's integers take its own suffixes (`1M` is 10^6, `1Mi` is
2^20), unlike vLLM's, so only plain digits are allowed here. Everything the app owns (host, port,
API key, served name, `--tp-size`/`--dp-size`, `--mem-fraction-static`, `--enable-metrics`) and
everything that names a file, address, draft model, import path or template is left off on purpose.
The real-parser test (tests/worker/engines/sglang/test_real_parser.py) holds this to 0.5.23's truth.
"""

from __future__ import annotations

from worker.engines.allowlist import AllowedFlag, Allowlist, Choice, FloatValue, IntValue, Switch

MAX_CONTEXT = 16_777_216  # 16 Mi tokens: above any model's trained context
MAX_REQUESTS = 16_384
MAX_BATCH_TOKENS = 4_194_304
MAX_DRAFT_TOKENS = 64

# `fields/model.py` kv_cache_dtype choices (0.5.23).
KV_CACHE_DTYPES = ("auto", "fp8_e5m2", "fp8_e4m3", "mxfp8", "bf16", "bfloat16", "nvfp4", "fp4_mx_block16")
MODEL_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")  # `fields/model.py` dtype
# `arg_groups/choices.py` QUANTIZATION_CHOICES, less those for other hardware (NPU, Apple, AMD) and
# `gguf` (a file format this engine is never handed).
QUANTIZATION_METHODS = (
    "awq", "fp8", "mxfp8", "gptq", "gptq_marlin", "awq_marlin", "bitsandbytes", "modelopt", "modelopt_fp8",
    "modelopt_fp4", "modelopt_mixed", "w8a8_int8", "w8a8_fp8", "moe_wna16", "w4afp8", "mxfp4",
    "compressed-tensors",
)
# `arg_groups/choices.py` ATTENTION_BACKEND_CHOICES that run on NVIDIA cards (no deprecated aliases).
ATTENTION_BACKENDS = (
    "triton", "torch_native", "flex_attention", "fa3", "fa4", "flashinfer", "flashmla", "trtllm_mla",
    "cutedsl_mla", "trtllm_mha",
)
# `fields/schedule.py` schedule_policy choices.
SCHEDULE_POLICIES = (
    "lpm", "random", "fcfs", "dfs-weight", "lof", "priority", "routing-key", "hrrn", "shortest-prefill-first",
)
# `model_executor/cuda_graph_config.py` Backend.ALL.
CUDA_GRAPH_BACKENDS = ("full", "breakable", "disabled")
# Speculative algorithms that need no draft model path: the model's own MTP layers (NEXTN), n-grams.
SPECULATIVE_ALGORITHMS = ("NEXTN", "NGRAM")


def _value(spelling: str, value: IntValue | FloatValue | Choice, purpose: str) -> AllowedFlag:
    """A flag that takes one value, as `--flag V` or `--flag=V`."""
    return AllowedFlag((spelling,), value, purpose, equals=True)


def _switch(spelling: str, purpose: str) -> AllowedFlag:
    return AllowedFlag((spelling,), Switch(), purpose)


ALLOWLIST = Allowlist(
    "SGLang",
    (
        _value("--context-length", IntValue(1, MAX_CONTEXT), "Context length (at most the model's own)."),
        _value("--max-running-requests", IntValue(1, MAX_REQUESTS), "Requests served at once."),
        _value("--max-prefill-tokens", IntValue(1, MAX_BATCH_TOKENS), "Token budget of one prefill batch."),
        _value("--chunked-prefill-size", IntValue(1, MAX_BATCH_TOKENS, words=("-1",)),
               "Tokens per prefill chunk; -1 turns chunking off."),
        _value("--schedule-policy", Choice(SCHEDULE_POLICIES), "Order in which waiting requests are taken."),
        _value("--schedule-conservativeness", FloatValue(0, 100),
               "How cautiously requests are admitted (larger: fewer retractions)."),
        _value("--num-continuous-decode-steps", IntValue(1, 64), "Decode steps run between scheduling passes."),
        _value("--page-size", IntValue(1, 256), "Tokens per KV cache page."),
        _value("--kv-cache-dtype", Choice(KV_CACHE_DTYPES), "KV cache data type."),
        _value("--dtype", Choice(MODEL_DTYPES), "Weights and activations data type."),
        _value("--quantization", Choice(QUANTIZATION_METHODS), "Weight quantization method."),
        _value("--attention-backend", Choice(ATTENTION_BACKENDS), "Attention kernels."),
        _value("--prefill-attention-backend", Choice(ATTENTION_BACKENDS), "Attention kernels for prefill."),
        _value("--decode-attention-backend", Choice(ATTENTION_BACKENDS), "Attention kernels for decode."),
        _value("--cuda-graph-max-bs-decode", IntValue(1, MAX_REQUESTS), "Largest decode batch captured as a CUDA graph."),
        _value("--cuda-graph-max-bs-prefill", IntValue(1, MAX_REQUESTS),
               "Largest prefill batch captured as a CUDA graph."),
        _value("--cuda-graph-backend-decode", Choice(CUDA_GRAPH_BACKENDS), "CUDA graph kind for decode."),
        _value("--cuda-graph-backend-prefill", Choice(CUDA_GRAPH_BACKENDS), "CUDA graph kind for prefill."),
        _switch("--disable-cuda-graph", "No CUDA graphs (starts faster, decodes slower); deprecated in 0.5.23."),
        _switch("--disable-decode-cuda-graph", "No CUDA graph for decode."),
        _switch("--disable-prefill-cuda-graph", "No CUDA graph for prefill."),
        _switch("--disable-cuda-graph-padding", "No CUDA graph for a batch that would need padding."),
        _switch("--enable-torch-compile", "torch.compile the model (slower start)."),
        _value("--torch-compile-max-bs", IntValue(1, MAX_REQUESTS), "Largest batch torch.compile covers."),
        _switch("--disable-radix-cache", "No prefix caching."),
        _switch("--disable-overlap-schedule", "No overlap of scheduling with the GPU's work."),
        _switch("--enable-mixed-chunk", "Prefill and decode in one batch with chunked prefill."),
        _value("--speculative-algorithm", Choice(SPECULATIVE_ALGORITHMS),
               "Speculative decoding without a draft model: the model's MTP layers or n-grams."),
        _value("--speculative-num-steps", IntValue(1, MAX_DRAFT_TOKENS), "Draft steps per verify."),
        _value("--speculative-eagle-topk", IntValue(1, MAX_DRAFT_TOKENS), "Draft candidates per step."),
        _value("--speculative-num-draft-tokens", IntValue(1, MAX_DRAFT_TOKENS), "Draft tokens verified at once."),
        AllowedFlag(("--trust-remote-code",), Switch(), "Runs Python code shipped in the model's repository.",
                    remote_code=True),
    ),
)
