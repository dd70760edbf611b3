"""Write a tiny random-weight Llama in Hugging Face format (~1.5 MB) that the real vLLM loads.

Run by the Python of the cached vLLM environment (it has torch, transformers and tokenizers):
`python tiny_hf_model.py FOLDER`. Seeded, so every run writes the same weights. Its answers are
noise; what matters is that every step of vLLM's path is real. The head size is 64: vLLM's CPU
attention refuses 16 at the first request (`Unsupported CPU attention configuration`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIALS = ["<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
TEXT = [
    "Hello, how are you today?", "The quick brown fox jumps over the lazy dog.",
    "A provider lends a graphics card to a network that serves language models.",
    "Tokens stream back one by one until the answer is complete.", "Count: one two three four five six.",
]


def write(folder: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(TEXT * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer.get_vocab()), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
        bos_token_id=tokenizer.token_to_id("<s>"), eos_token_id=tokenizer.token_to_id("</s>"),
        tie_word_embeddings=True, torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    config_path = folder / "tokenizer_config.json"
    settings = json.loads(config_path.read_text(encoding="utf-8"))
    settings["chat_template"] = CHAT_TEMPLATE  # older transformers keep it only in a separate file
    config_path.write_text(json.dumps(settings, indent=1), encoding="utf-8")


if __name__ == "__main__":
    write(Path(sys.argv[1]))
