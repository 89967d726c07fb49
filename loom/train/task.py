"""What is trained: a model factory, its loss and its data (a Task). `loom train` trains
`gpt_task(cfg)`, loom's GPT on the config's corpus; the Python API takes any Task.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from loom.config import Config, pipeline_microbatches
from loom.data.corpus import load_tokens
from loom.data.loader import split_train_eval
from loom.errors import ConfigError
from loom.models.gpt.config import GPTConfig, preset
from loom.models.gpt.model import build_model
from loom.parallel.pipeline import validate_pipeline
from loom.parallel.tensor_parallel import check_tp_shapes
from loom.plan.shapes import ModelShape, from_gpt_config


@dataclass
class Task:
    """What `train` trains. Any nn.Module works for the data-parallel strategies; TP/PP need a
    plan (an adapter: loom/parallel/adapter.py)."""

    # Called on every rank with the same seed: model_fn(), or model_fn(device="cpu") by the deepspeed
    # engine's ZeRO-3, which partitions the model as it is built (loom's GPT: the meta device by default).
    model_fn: Callable[..., nn.Module]
    loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor]  # (model, batch) -> mean loss
    train_data: Dataset  # items of equal shape; the default collate stacks them
    eval_data: Dataset | None = None
    tokens_per_sample: int = 1  # for tokens/s
    description: str = "model"
    shape: ModelShape | None = None  # known to the planner: plan.json and measured-vs-planned


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of logits [B, T, V] against targets [B, T], in fp32 whatever
    the compute dtype (a bf16 log-softmax over a large vocabulary loses the loss's precision)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def next_token_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """A language model's loss on a batch of token windows [B, T + 1]."""
    return cross_entropy(model(batch[:, :-1]), batch[:, 1:])


def gpt_task(cfg: Config) -> Task:
    tokens, vocab = load_data(cfg)
    train_set, eval_set = split_train_eval(tokens, cfg.data.seq_len, cfg.data.eval_fraction)
    gpt_cfg = model_config(cfg, vocab)
    return Task(model_fn=lambda device="meta": build_model(gpt_cfg, device=device), loss_fn=next_token_loss,
                train_data=train_set, eval_data=eval_set, tokens_per_sample=cfg.data.seq_len,
                description=f"GPT {gpt_cfg.n_layers}L d{gpt_cfg.d_model}",
                shape=from_gpt_config(gpt_cfg, cfg.model.preset))


def model_config(cfg: Config, data_vocab: int) -> GPTConfig:
    """The preset with the config's overrides; the vocabulary must cover the data's token ids, and
    the parallel layout must be able to split the model."""
    m, p = cfg.model, cfg.parallel
    overrides = {k: v for k, v in vars(m).items() if k != "preset" and v is not None}
    if "vocab_size" not in overrides and cfg.data.tokenizer == "bpe":
        overrides["vocab_size"] = data_vocab
    gpt = preset(m.preset, **overrides)
    if gpt.vocab_size < data_vocab:
        raise ConfigError(f"model vocab_size {gpt.vocab_size} is smaller than the tokenizer's {data_vocab}; "
                          f"set model.vocab_size={data_vocab}")
    if p.pp > 1:
        validate_pipeline(gpt.n_layers, p.pp, p.pp_virtual_stages, p.pp_schedule, pipeline_microbatches(p),
                          tie_embeddings=gpt.tie_embeddings)
    if p.tp > 1:
        check_tp_shapes(gpt.n_heads, gpt.n_kv_heads, gpt.ffn_hidden, gpt.vocab_size, p.tp)
    if cfg.data.seq_len > gpt.max_seq_len:
        raise ConfigError(f"data.seq_len = {cfg.data.seq_len} exceeds the model's max_seq_len "
                          f"{gpt.max_seq_len}; lower data.seq_len or set model.max_seq_len")
    return gpt


def load_data(cfg: Config) -> tuple[Any, int]:
    """The run's token stream and its vocabulary size (a .bin file's vocab is the model's)."""
    d = cfg.data
    vocab = d.bpe_vocab_size
    if d.source.endswith(".bin"):
        vocab = cfg.model.vocab_size or preset(cfg.model.preset).vocab_size
    return load_tokens(d.source, d.tokenizer, vocab, d.bin_dtype, Path(d.cache_dir).expanduser())
