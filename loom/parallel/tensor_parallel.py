"""Tensor parallelism, the model-independent part: which shapes a TP degree can split, and the
vocab-parallel loss. The plans themselves (which linear splits how) live beside each model:
loom/models/gpt/tensor_parallel.py and loom/models/hf/tensor_parallel.py (Megatron-style: column-
split q/k/v and MLP gate/up, row-split attention output and MLP down; the embedding and the head
over the vocabulary, so full logits never exist on one rank).
"""

from __future__ import annotations

import contextlib

from torch.distributed.tensor.parallel import loss_parallel

from loom.errors import ConfigError


def check_tp_shapes(n_heads: int, n_kv_heads: int, ffn_hidden: int, vocab_size: int, tp: int) -> None:
    """Every split dimension must divide by tp; one line naming the one that does not."""
    for name, value in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads), ("ffn_hidden", ffn_hidden),
                        ("vocab_size", vocab_size)):
        if value % tp:
            divisors = [k for k in range(1, value + 1) if value % k == 0 and k <= 64]
            raise ConfigError(f"parallel.tp = {tp} does not divide model.{name} = {value}; "
                              f"use tp in {divisors[-6:]} or change the model")


def loss_context(tp: int):
    """Cross entropy over vocab-sharded logits (forward and backward must both run inside)."""
    return loss_parallel() if tp > 1 else contextlib.nullcontext()
