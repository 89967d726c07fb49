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
    """Shard the model in units of parallel.fsdp_unit_mb: consecutive modules in forward order (the
    embedding, the blocks, norm + head) share a unit, then the root takes what no unit holds (tied
    embeddings: a weight cannot live in two units). When one unit would hold every module, the
    root is that unit."""
    # hsdp, and ddp/zero1 under TP: replicate over dp_replicate, shard over dp_shard (1 for ddp)
    two_d = strategies.lookup(p.strategy).dp_mesh in ("hybrid", "replicate")
    mesh = d.mesh[("dp_replicate", "dp_shard")] if two_d else d.mesh["dp_shard"]
    kwargs: dict = {"mesh": mesh, "reshard_after_forward": reshard_after_forward(p)}
    if precision != "fp32":
        # Compute in low precision, reduce gradients in fp32, keep fp32 master params.
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=DTYPES[precision], reduce_dtype=torch.float32)
    if p.offload == "cpu":
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    entries, head = _in_forward_order(model, blocks)
    sizes = [sum(q.numel() for m in entry for q in m.parameters()) for entry in entries]
    counts = strategies.fsdp_units(sizes, p.fsdp_unit_mb)
    units = []
    for count in counts if len(counts) > 1 else ():
        group, entries = [m for entry in entries[:count] for m in entry], entries[count:]
        # The head is needed first in backward: its unit stays unsharded after forward.
        keep = {"reshard_after_forward": False} if head is not None and head in group else {}
        fully_shard(group if len(group) > 1 else group[0], **{**kwargs, **keep})
        units.append(group[0])
    # The last unit in forward order is the first backward needs: the root, when it is the only
    # unit or holds tied embeddings, stays gathered too.
    tied = head is None and getattr(model, "output", None) is not None
    last = {"reshard_after_forward": False} if len(counts) <= 1 or tied else {}
    fully_shard(model, **{**kwargs, **last})
    _set_prefetch(units, p.fsdp_prefetch)
    return model


def _in_forward_order(model: nn.Module,
                      blocks: list[nn.Module]) -> tuple[list[list[nn.Module]], nn.Module | None]:
    """The modules FSDP units are made of, in forward order: the embedding, each block, norm + head
    (a pipeline stage may hold either or neither; tied embeddings stay with the root), and the head."""
    emb, norm, head = (getattr(model, n, None) for n in ("tok_embeddings", "norm", "output"))
    if emb is not None and head is not None and head.weight is emb.weight:
        return [[b] for b in blocks], None
    first = [[emb]] if emb is not None else []
    last = [[norm, head]] if norm is not None and head is not None else []
    return first + [[b] for b in blocks] + last, head if last else None


def _set_prefetch(units: list[nn.Module], depth: int) -> None:
    """All-gather the next `depth` units ahead of time in forward and backward (overlap); a unit is
    named by its first module."""
    if depth <= 1:
        return  # FSDP2's implicit prefetch already overlaps one unit
    for i, unit in enumerate(units):
        unit.set_modules_to_forward_prefetch(units[i + 1:i + 1 + depth])
        unit.set_modules_to_backward_prefetch(units[max(i - depth, 0):i][::-1])
