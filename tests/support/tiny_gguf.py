"""A tiny random-weight llama GGUF that a real llama-server loads and runs on CPU in milliseconds.

Shape and tokenizer as shared/reference/llama-server-on-cpu.md describes: 2 layers, n_embd 64,
4 heads, n_ff 128, context 2048, F32 weights; a GPT-2 byte-level tokenizer (the 256 byte tokens,
two merges, since llama.cpp refuses a BPE vocabulary without merges, and bos/eos/pad); a plain
Jinja chat template so /v1/chat/completions works. The text it writes is noise, which is all a
test of the engine's plumbing needs.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

N_LAYERS = 2
N_EMBD = 64
N_HEAD = 4
N_FF = 128
CONTEXT = 2048
MERGES = ("h e", "l l")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode table: each of the 256 bytes as one printable character."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    table = dict(zip(printable, codes, strict=False))
    return [chr(table[byte]) for byte in range(256)]


def vocabulary() -> tuple[list[str], list[int]]:
    tokens = byte_tokens() + [merge.replace(" ", "") for merge in MERGES] + ["<s>", "</s>", "<pad>"]
    types = [gguf.TokenType.NORMAL] * (len(tokens) - 3) + [gguf.TokenType.CONTROL] * 3
    return tokens, [int(t) for t in types]


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """Write the model to `path` (about 0.5 MB) and return it."""
    rng = np.random.default_rng(seed)
    tokens, types = vocabulary()
    n_vocab = len(tokens)

    def weights(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYERS)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD)
    writer.add_rope_dimension_count(N_EMBD // N_HEAD)
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
    writer.add_tensor("token_embd.weight", weights(n_vocab, N_EMBD))
    writer.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    writer.add_tensor("output.weight", weights(n_vocab, N_EMBD))
    for layer in range(N_LAYERS):
        block = f"blk.{layer}"
        writer.add_tensor(f"{block}.attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"{block}.{name}.weight", weights(N_EMBD, N_EMBD))
        writer.add_tensor(f"{block}.ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        writer.add_tensor(f"{block}.ffn_gate.weight", weights(N_FF, N_EMBD))
        writer.add_tensor(f"{block}.ffn_up.weight", weights(N_FF, N_EMBD))
        writer.add_tensor(f"{block}.ffn_down.weight", weights(N_EMBD, N_FF))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
