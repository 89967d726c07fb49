"""DistributedDataParallel: ddp (ZeRO-0, a full replica per rank, one all-reduce per gradient
bucket) and the model side of zero1, whose optimizer states loom/parallel/zero1.py shards."""

from __future__ import annotations

import inspect

from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from loom.config import ParallelConfig
from loom.parallel.mesh import Dist

# loom's buffers (RoPE tables) are computed, never trained: no broadcast of them before each forward.
# torch 2.13 names the switch forward_sync_buffers (broadcast_buffers deprecated) and torch 2.11 knows
# only broadcast_buffers: no form is common to both, so the name is read off DDP's signature.
NO_BUFFER_SYNC = ({"forward_sync_buffers": False}
                  if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
                  else {"broadcast_buffers": False})


def apply_ddp(model: nn.Module, p: ParallelConfig, d: Dist) -> nn.Module:
    """The model under DDP over the dp × cp ranks; with one such rank, the model itself: there is
    nothing to all-reduce, and DDP's buckets would keep the gradients' 4Ψ allocated through the next
    forward (the step's activation peak), where a plain loop has freed them (set_to_none)."""
    if d.grad_mesh.size() == 1:
        return model
    ddp = DDP(
        model,
        device_ids=[d.device.index] if d.device.type == "cuda" else None,
        process_group=d.grad_mesh.get_group(),  # dp × cp
        bucket_cap_mb=p.ddp_bucket_mb,
        gradient_as_bucket_view=True,  # grads live in the buckets: no second 4Ψ copy
        **NO_BUFFER_SYNC,
        static_graph=p.ddp_static_graph,
    )
    if p.pp > 1:
        # A pipeline stage runs one backward per micro-batch (no_sync on all but the last), and
        # DDP's bucket rebuild after step 1 would record the gradients of every one of them and fail
        # (twice the parameters). Rebuilding now, in parameter order, settles the buckets before any
        # step: nothing is recorded, and no find_unused_parameters graph walk (or its warning) per step.
        ddp.reducer._push_all_rebuilt_params()
        ddp.reducer._rebuild_buckets()
    return ddp
