"""The data-parallel family on the real engines.

ddp   -> DistributedDataParallel (ZeRO-0: full replica, one all-reduce per bucket)
zero1 -> DDP + ZeroRedundancyOptimizer (optimizer states sharded over the dp group)
zero2 -> FSDP2 fully_shard(reshard_after_forward=False)  (= FSDP SHARD_GRAD_OP)
zero3 -> FSDP2 fully_shard(reshard_after_forward=True)   (= FSDP FULL_SHARD)
hsdp  -> FSDP2 on the 2-D mesh (dp_replicate, dp_shard): shard inside, replicate across
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
)
from torch.nn.parallel import DistributedDataParallel as DDP

from loom.config import FSDP_STRATEGIES, ParallelConfig
from loom.parallel.mesh import Dist

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def uses_fsdp(p: ParallelConfig) -> bool:
    """FSDP2 runs zero2/zero3/hsdp, and DDP's replication under TP (ddp, zero1): DDP takes no
    DTensor parameters; FSDP2 on a (dp, 1) mesh replicates exactly like DDP (16Ψ per rank)."""
    return p.strategy in FSDP_STRATEGIES or (p.strategy in ("ddp", "zero1") and p.tp > 1)


def reshard_after_forward(p: ParallelConfig) -> bool:
    if p.reshard_after_forward is not None:
        return p.reshard_after_forward
    return p.strategy not in ("zero2", "ddp", "zero1")


def apply_fsdp(model: nn.Module, blocks: list[nn.Module], p: ParallelConfig, precision: str,
               d: Dist) -> nn.Module:
    """Shard each block as one FSDP unit, the embedding and the head as their own, then the root."""
    # hsdp, and ddp/zero1 under TP: replicate over dp_replicate, shard over dp_shard (1 for ddp)
    two_d = p.strategy in ("hsdp", "ddp", "zero1")
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


def apply_ddp(model: nn.Module, p: ParallelConfig, d: Dist) -> nn.Module:
    return DDP(
        model,
        device_ids=[d.device.index] if d.device.type == "cuda" else None,
        process_group=d.dp_mesh.get_group(),
        bucket_cap_mb=p.ddp_bucket_mb,
        gradient_as_bucket_view=True,  # grads live in the buckets: no second 4Ψ copy
        forward_sync_buffers=False,  # loom's buffers (RoPE tables) are computed, never trained
        static_graph=p.ddp_static_graph,
        # A pipeline stage runs one backward per micro-batch (no_sync on all but the last). DDP's
        # bucket rebuild after step 1 would record every one of them and fail; with
        # find_unused_parameters it keeps its first buckets and reduces correctly.
        find_unused_parameters=p.pp > 1,
    )


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the gradient collective on non-final micro-steps of gradient accumulation."""
    if isinstance(model, DDP):
        with (contextlib.nullcontext() if enabled else model.no_sync()):
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
        yield
    else:
        yield

