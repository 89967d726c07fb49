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
from loom.config import ParallelConfig, splits_backward
from loom.parallel.mesh import Dist
from loom.parallel.precision import DTYPES


def reshard_after_forward(p: ParallelConfig) -> bool:
    """`parallel.reshard_after_forward` when set, else the strategy's (zero2 False, zero3 True);
    replication (ddp, zero1 under TP) has nothing to reshard. Under a pipeline schedule that defers
    weight gradients (zb, zbv, dualpipev) a unit stays gathered until the step's last backward (the
    schedule reshards the stage then): re-gathered for a deferred W, torch's split backward gives
    wrong gradients (up to 90% off in tests/distributed/test_zero_bubble.py's zero3 case)."""
    if splits_backward(p):
        return False
    if p.reshard_after_forward is not None:
        return p.reshard_after_forward
    return bool(strategies.lookup(p.strategy).reshard_after_forward)


def apply_fsdp(model: nn.Module, blocks: list[nn.Module], p: ParallelConfig, precision: str,
               d: Dist, experts: list[nn.Module] = ()) -> nn.Module:
    """Shard the model in units of parallel.fsdp_unit_mb: consecutive modules in forward order (the
    embedding, the blocks, norm + head) share a unit, then the root takes what no unit holds (tied
    embeddings: a weight cannot live in two units). When one unit would hold every module, the
    root is that unit. `experts` (expert parallelism: already split over the ep ranks) are units of
    their own, sharded over the ranks that hold the same experts."""
    # hsdp, and ddp/zero1 under TP: replicate over dp_replicate, shard over dp_shard (1 for ddp)
    replicated = strategies.lookup(p.strategy).dp_mesh in ("hybrid", "replicate")
    mesh = d.fsdp_mesh(replicated=replicated)
    kwargs: dict = {"mesh": mesh, "reshard_after_forward": reshard_after_forward(p)}
    if precision != "fp32":
        # Compute in low precision, reduce gradients in fp32, keep fp32 master params.
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=DTYPES[precision], reduce_dtype=torch.float32)
    if p.offload == "cpu":
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    # Units in forward order: the embedding, each block, norm + head (a pipeline stage may hold
    # either or neither). Tied embeddings stay with the root: a weight cannot live in two units.
    emb, norm, head = (getattr(model, n, None) for n in ("tok_embeddings", "norm", "output"))
    tied = emb is not None and head is not None and head.weight is emb.weight
    head_unit = not tied and norm is not None and head is not None
    entries = ([[emb]] if emb is not None and not tied else []) + [[b] for b in blocks] \
        + ([[norm, head]] if head_unit else [])
    for module in experts:
        fully_shard(module, **{**kwargs, "mesh": d.expert_fsdp_mesh(replicated)})
    sizes = [sum(q.numel() for m in entry for q in m.parameters()) for entry in entries]
    groups = strategies.fsdp_units(entries, sizes, p.fsdp_unit_mb)
    units = []
    for i, group in enumerate(groups if len(groups) > 1 else []):
        modules = [m for entry in group for m in entry]
        # The last unit in forward order is the first backward needs: the head's stays gathered.
        keep = {"reshard_after_forward": False} if head_unit and i == len(groups) - 1 else {}
        fully_shard(modules if len(modules) > 1 else modules[0], **{**kwargs, **keep})
        units.append(modules[0])
    # The root holds the rest: everything when one unit would, or the tied embedding and head,
    # which backward needs first too.
    keep = {"reshard_after_forward": False} if len(groups) <= 1 or tied else {}
    fully_shard(model, **{**kwargs, **keep})
    _set_prefetch(units, p.fsdp_prefetch)
    return model


def _set_prefetch(units: list[nn.Module], depth: int) -> None:
    """All-gather the next `depth` units ahead of time in forward and backward (overlap); a unit is
    named by its first module."""
    if depth <= 1:
        return  # FSDP2's implicit prefetch already overlaps one unit
    for i, unit in enumerate(units):
        unit.set_modules_to_forward_prefetch(units[i + 1:i + 1 + depth])
        unit.set_modules_to_backward_prefetch(units[max(i - depth, 0):i][::-1])
