"""FSDP2 (`fully_shard`): zero2 (SHARD_GRAD_OP: parameters stay gathered from forward to backward),
zero3 (FULL_SHARD: re-gathered in backward), hsdp (sharded inside a group, replicated across
groups on the 2-D mesh), and, under tensor parallelism, the replication of ddp and zero1 (DDP
takes no DTensor parameters; FSDP2 on a (dp, 1) mesh holds the same 16Ψ).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from loom import strategies
from loom.config import ParallelConfig
from loom.parallel.mesh import Dist
from loom.parallel.precision import DTYPES


def reshard_after_forward(p: ParallelConfig) -> bool:
    """`parallel.reshard_after_forward` when set, else the strategy's (zero2 False, zero3 True);
    replication (ddp, zero1 under TP) has nothing to reshard."""
    if p.reshard_after_forward is not None:
        return p.reshard_after_forward
    return bool(strategies.lookup(p.strategy).reshard_after_forward)


def apply_fsdp(model: nn.Module, blocks: list[nn.Module], p: ParallelConfig, precision: str,
               d: Dist) -> nn.Module:
    """Shard each block as one FSDP unit, the embedding and the head as their own, then the root."""
    # hsdp, and ddp/zero1 under TP: replicate over dp_replicate, shard over dp_shard (1 for ddp)
    two_d = strategies.lookup(p.strategy).dp_mesh in ("hybrid", "replicate")
    mesh = d.mesh[("dp_replicate", "dp_shard")] if two_d else d.mesh["dp_shard"]
    kwargs: dict = {"mesh": mesh, "reshard_after_forward": reshard_after_forward(p)}
    if precision != "fp32":
        # Compute in low precision, reduce gradients in fp32, keep fp32 master params.
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=DTYPES[precision], reduce_dtype=torch.float32)
    if p.offload == "cpu":
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    for block in blocks:
        fully_shard(block, **kwargs)
    _shard_embeddings_and_head(model, kwargs)
    fully_shard(model, **kwargs)
    _set_prefetch(blocks, p.fsdp_prefetch)
    return model


def _shard_embeddings_and_head(model: nn.Module, kwargs: dict) -> None:
    """Own units for the embedding and for norm + head, so a big vocabulary is not held whole
    through the step. The head's unit is needed first in backward: keep it unsharded after forward.
    Tied weights cannot live in two units; then the root keeps both. A pipeline stage may hold
    either or neither."""
    emb, norm, head = (getattr(model, n, None) for n in ("tok_embeddings", "norm", "output"))
    if emb is not None and head is not None and head.weight is emb.weight:
        return
    if emb is not None:
        fully_shard(emb, **kwargs)
    if norm is not None and head is not None:
        fully_shard([norm, head], **{**kwargs, "reshard_after_forward": False})


def _set_prefetch(blocks: list[nn.Module], depth: int) -> None:
    """All-gather the next `depth` blocks ahead of time in forward and backward (overlap)."""
    if depth <= 1:
        return  # FSDP2's implicit prefetch already overlaps one block
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + depth])
        block.set_modules_to_backward_prefetch(blocks[max(i - depth, 0):i][::-1])
