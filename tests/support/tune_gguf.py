"""Llama GGUFs for the auto-tuner's tests on a real llama-server: big enough that decode is
memory-bound on a CPU (so more slots batch real work), and confident (output weights scaled up,
the end token's row zero) so that greedy answers are the same under any batch shape and run to
their `max_tokens`: the gate then sees only what a configuration really changes.

Same tokenizer and chat template as `tiny_gguf` (byte-level: one character is one token).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from tests.support.tiny_gguf import CHAT_TEMPLATE, MERGES, vocabulary

LAYERS = 6
EMBD = 768  # 6 layers of 768 wide: ~35 M F32 weights, ~142 MB read per decoded token (beyond any CPU cache)
HEAD_DIM = 64
FF = 1536
CONTEXT = 8192


def write_tune_gguf(path: Path, *, seed: int = 0, output_scale: float = 1.0, layers: int = LAYERS,
                    embd: int = EMBD, ff: int = FF) -> Path:
    """Write the model to `path` and return it. `output_scale` is the output weights' standard
    deviation: 1.0 puts the top logit tens of nats above the rest (confident); 0.02 is noise."""
    rng = np.random.default_rng(seed)
    tokens, types = vocabulary()
    n_vocab = len(tokens)

    def weights(*shape: int, std: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    output = weights(n_vocab, embd, std=output_scale)
    output[n_vocab - 2] = 0.0  # the end token never leads: answers run to max_tokens
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tune-llama")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(embd)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(embd // HEAD_DIM)
    writer.add_head_count_kv(embd // HEAD_DIM)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(list(MERGES))
    writer.add_bos_token_id(n_vocab - 3)
    writer.add_eos_token_id(n_vocab - 2)
    writer.add_pad_token_id(n_vocab - 1)
    writer.add_chat_template(CHAT_TEMPLATE)
    writer.add_tensor("token_embd.weight", weights(n_vocab, embd, std=1.0))
    writer.add_tensor("output_norm.weight", np.ones(embd, dtype=np.float32))
    writer.add_tensor("output.weight", output)
    for layer in range(layers):
        block = f"blk.{layer}"
        writer.add_tensor(f"{block}.attn_norm.weight", np.ones(embd, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"{block}.{name}.weight", weights(embd, embd))
        writer.add_tensor(f"{block}.ffn_norm.weight", np.ones(embd, dtype=np.float32))
        writer.add_tensor(f"{block}.ffn_gate.weight", weights(ff, embd))
        writer.add_tensor(f"{block}.ffn_up.weight", weights(ff, embd))
        writer.add_tensor(f"{block}.ffn_down.weight", weights(embd, ff))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
