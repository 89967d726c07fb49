"""Mixed precision as each engine does it: FSDP2 casts parameters to the compute dtype itself
(MixedPrecisionPolicy, fp32 master weights and fp32 gradient reduction: loom/parallel/fsdp.py);
DDP and ZeRO-1 run under autocast. fp16 also needs loss scaling (a sharded scaler under FSDP2)."""

from __future__ import annotations

import contextlib

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, fsdp: bool, device: torch.device):
    if precision == "fp32" or fsdp:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


def grad_scaler(precision: str, fsdp: bool, device: torch.device):
    """fp16 needs loss scaling; bf16 and fp32 do not (None)."""
    if precision != "fp16":
        return None
    if fsdp:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type)
    return torch.amp.GradScaler(device.type)
