"""Bring your own model: a Hugging Face Llama built from a LlamaConfig (no weights downloaded),
trained by loom with ZeRO-3 (FSDP2) over 2 ranks × tensor parallel over 2 ranks.

    pip install transformers
    python -m torch.distributed.run --standalone --nproc-per-node 4 examples/hf_llama.py

The run lands in runs/hf-llama (or --out DIR); like `loom train`, it never writes over an earlier run
without --overwrite, which replaces only a run directory loom made.

loom only needs a model factory, a loss and a dataset (`loom.train.task.Task`); the config
chooses the strategy. FSDP units are the decoder layers; the tensor-parallel plan for Llama,
Mistral and Qwen2 decoders is in loom/parallel/tensor_parallel.py.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from loom.config import Config, load_config
from loom.data.loader import split_train_eval
from loom.files import RUN_MARKER, claim_run_dir, is_loom_run
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


def take_run_dir(run_dir: Path, overwrite: bool) -> None:
    """loom's run-directory rules, before anything is loaded: a used directory is replaced only
    under --overwrite and only if loom made it (its marker); rank 0 replaces it before the ranks meet."""
    rank = int(os.environ.get("RANK", "0"))
    used = run_dir.exists() and (not run_dir.is_dir() or any(p.name != RUN_MARKER for p in run_dir.iterdir()))
    if used and not overwrite:
        sys.exit(f"run directory {run_dir} already exists; replace it with --overwrite, or pick a new --out"
                 if rank == 0 else 1)
    if used and not is_loom_run(run_dir):
        sys.exit(f"--overwrite replaces only a run directory loom made, and {run_dir} is not one; pick "
                 f"another --out" if rank == 0 else 1)
    if rank == 0:
        if used:
            shutil.rmtree(run_dir)
        claim_run_dir(run_dir)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="train a tiny Hugging Face Llama with loom")
    parser.add_argument("--out", type=Path, default=Path("runs/hf-llama"), help="the run directory")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier run in --out")
    args = parser.parse_args()
    take_run_dir(args.out, args.overwrite)
    cfg = load_config(None, SETTINGS)
    train(cfg, args.out, task=make_task(cfg))
