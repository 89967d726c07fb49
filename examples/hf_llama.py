"""Bring your own model: a Hugging Face Llama built from a LlamaConfig (no weights downloaded),
trained by loom with ZeRO-3 (FSDP2) over 2 ranks × tensor parallel over 2 ranks.

    pip install transformers
    python -m torch.distributed.run --standalone --nproc-per-node 4 examples/hf_llama.py

loom only needs a model factory, a loss and a dataset (`loom.train.task.Task`); the config
chooses the strategy. FSDP units are the decoder layers; the tensor-parallel plan for Llama,
Mistral and Qwen2 decoders is in loom/parallel/tensor_parallel.py.
"""

from __future__ import annotations

from pathlib import Path

import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from loom.config import Config, load_config
from loom.data.loader import split_train_eval
from loom.train.driver import train
from loom.train.task import Task, load_data

SETTINGS = ["parallel.strategy=zero3", "parallel.tp=2", "train.steps=20", "train.batch_size=8",
            "data.seq_len=64", "train.lr=3e-3"]


def llama_config(vocab_size: int = 256) -> LlamaConfig:
    """A tiny Llama: 2 layers, d 64, GQA 4 heads / 2 KV heads, SwiGLU 128."""
    return LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       tie_word_embeddings=False)


def next_token_loss(model, batch):
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())


def make_task(cfg: Config) -> Task:
    tokens, vocab = load_data(cfg)  # the config's corpus (default: the standard library's sources)
    train_set, eval_set = split_train_eval(tokens, cfg.data.seq_len, cfg.data.eval_fraction)
    llama = llama_config(vocab)
    return Task(model_fn=lambda: LlamaForCausalLM(llama), loss_fn=next_token_loss, train_data=train_set,
                eval_data=eval_set, tokens_per_sample=cfg.data.seq_len, description="HF Llama 2L d64")


if __name__ == "__main__":
    cfg = load_config(None, SETTINGS)
    train(cfg, Path("runs/hf-llama"), task=make_task(cfg))
