"""Make a small Hugging Face Llama folder and a fine-tuning dataset on this machine, no download:
docs/hugging-face.md's "Fine-tune a Hugging Face model" walk-through starts from them.

    python examples/make_tiny_llama.py models/tiny-llama data/

writes models/tiny-llama/ (config.json, sharded *.safetensors + index, tokenizer.json with a chat
template in tokenizer_config.json: what `save_pretrained` gives for a real checkpoint) and, in data/,
corpus.jsonl (text records for continued pre-training) and sft.jsonl (prompt/completion pairs).
The weights are random: a real run points model.init_from at a downloaded model instead.
"""

from __future__ import annotations

import inspect
import json
import random
import sys
from pathlib import Path

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SPECIAL = ["<|endoftext|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]


def documents() -> list[str]:
    """Some English-and-code text of the standard library: its modules' docstrings and functions."""
    import collections
    import json as json_module
    import textwrap

    out = []
    for module in (collections, json_module, textwrap, inspect):
        for name, obj in inspect.getmembers(module, callable):
            doc = inspect.getdoc(obj)
            if doc and not name.startswith("_"):
                out.append(f"{module.__name__}.{name}: {doc}")
    return out


def tokenizer(texts: list[str], vocab_size: int = 1024):
    import tokenizers as tk

    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def main(model_dir: Path, data_dir: Path) -> None:
    from loom.config import choose_deepspeed_accelerator

    # transformers imports DeepSpeed when it is installed: name its accelerator so it does not probe
    # and warn; and a folder of a few MB needs no progress bar per shard.
    choose_deepspeed_accelerator()
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()

    texts = documents()
    tok = tokenizer(texts)
    model_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE}, indent=2))
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
        eos_token_id=tok.token_to_id("<|endoftext|>"), bos_token_id=None)  # no BOS (LlamaConfig's is 1)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(model_dir, max_shard_size="1MB")

    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / "corpus.jsonl", "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    rng = random.Random(0)
    with open(data_dir / "sft.jsonl", "w") as f:
        for _ in range(4000):
            a, b = rng.randrange(100), rng.randrange(100)
            f.write(json.dumps({"prompt": f"What is {a} plus {b}? ", "completion": f"{a + b}."}) + "\n")
    params = sum(p.numel() for p in transformers.LlamaForCausalLM(config).parameters())
    print(f"wrote {model_dir} ({params:,} parameters, vocabulary {tok.get_vocab_size()}) and "
          f"{data_dir}/corpus.jsonl, {data_dir}/sft.jsonl")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python examples/make_tiny_llama.py MODEL_DIR DATA_DIR")
    main(Path(sys.argv[1]), Path(sys.argv[2]))
