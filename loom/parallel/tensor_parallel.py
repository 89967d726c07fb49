"""Tensor parallelism, the model-independent part: which shapes a TP degree can split, and the
vocab-parallel loss. The plans themselves (which linear splits how) live beside each model:
loom/models/gpt/tensor_parallel.py and loom/models/hf/tensor_parallel.py (Megatron-style: column-
split q/k/v and MLP gate/up, row-split attention output and MLP down; the embedding and the head
over the vocabulary, so full logits never exist on one rank).
"""

from __future__ import annotations

import contextlib

from torch import nn
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor import parallel as tp
from torch.distributed.tensor.parallel import loss_parallel


def _distribute(module: nn.Module, mesh, placements: dict[str, Placement], src_data_rank: int | None) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        dist = distribute_tensor(param, mesh, [placements[name]], src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))


class ColwiseParallel(tp.ColwiseParallel):
    """torch's column split of a linear, and of its LoRA adapters (loom/models/lora.py) with it: B's
    rows (the output features) split like the weight's, A whole on every rank. (torch's would split
    every parameter on dim 0, A's rank included.)"""

    def _partition_linear_fn(self, name, module, device_mesh):
        _distribute(module, device_mesh, {"weight": Shard(0), "bias": Shard(0), "lora_A": Replicate(),
                                          "lora_B": Shard(0)}, self.src_data_rank)


class RowwiseParallel(tp.RowwiseParallel):
    """torch's row split of a linear, and of its LoRA adapters with it: A's columns (the input
    features) split like the weight's, B whole; A's output is then partial, summed in the same
    reduction as the weight's. (torch's would leave the adapters unsplit plain tensors.)"""

    def _partition_linear_fn(self, name, module, device_mesh):
        _distribute(module, device_mesh, {"weight": Shard(1), "bias": Replicate(), "lora_A": Shard(1),
                                          "lora_B": Replicate()}, self.src_data_rank)


def parallelize_root(model: nn.Module, mesh, plan: dict, embedding: nn.Module | None,
                     head: nn.Module | None) -> None:
    """`parallelize_module(model, mesh, plan)` for the root's embedding and head, which stay tied when
    they were: each style distributes its module's weight into a parameter of its own (both Shard(0)
    over the vocabulary), so a tied pair would train apart (Hugging Face) or FSDP2 would gather and
    reduce the weight twice, once per unit (loom's GPT, which ties again at init)."""
    tied = embedding is not None and head is not None and head.weight is embedding.weight
    if plan:
        tp.parallelize_module(model, mesh, plan)
    if tied:
        head.weight = embedding.weight


def loss_context(tp: int):
    """Cross entropy over vocab-sharded logits (forward and backward must both run inside)."""
    return loss_parallel() if tp > 1 else contextlib.nullcontext()
