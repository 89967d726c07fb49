"""AdamW (foreach or fused; ZeRO-1's sharded one comes from loom/parallel/zero1.py) or Muon with
AdamW (loom/train/muon.py), the LR schedule and gradient clipping."""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from loom import strategies
from loom.config import MuonConfig, TrainConfig, choose_deepspeed_accelerator
from loom.parallel.mesh import Dist
from loom.parallel.zero1 import build_zero1_optimizer
from loom.train.muon import MuonAdamW, muon_groups


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (linears, embeddings); leave norms' gains undecayed."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            # DeepSpeed's ZeRO-3 keeps a partitioned parameter's real shape in ds_shape.
            (decay if len(getattr(p, "ds_shape", p.shape)) >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, t: TrainConfig, strategy: str, d: Dist,
                    engine: str = "torch", offloaded: bool = False,
                    muon: MuonConfig | None = None) -> torch.optim.Optimizer:
    """AdamW, fused on GPUs and foreach on CPU unless `train.optimizer_impl` says; sharded over the
    dp group when the strategy shards only the optimizer (zero1) on the torch engine. The deepspeed
    engine shards it itself, and steps an offloaded optimizer with its CPU Adam (AdamW mode).
    train.optimizer = "muon": Muon for the blocks' matrices, this AdamW for the rest (muon.py)."""
    use_muon = t.optimizer == "muon"
    groups = muon_groups(model, t, muon or MuonConfig()) if use_muon else param_groups(model, t.weight_decay)
    if offloaded:
        choose_deepspeed_accelerator()
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # an optional dependency: deepspeed engine only

        return DeepSpeedCPUAdam(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, adamw_mode=True)
    impl = t.optimizer_impl
    if impl == "auto":
        impl = "fused" if d.device.type == "cuda" else "foreach"
    adamw = dict(lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, **{impl: True})
    kind = MuonAdamW if use_muon else torch.optim.AdamW
    if engine == "torch" and strategies.lookup(strategy).shards_optimizer_only:
        return build_zero1_optimizer(groups, d, kind, **adamw)
    return kind(groups, **adamw)


def lr_lambda(t: TrainConfig):
    """Step k (1-based) of T trains at lr·k/W during the W warmup steps, then at
    lr·(m + (1−m)·½(1 + cos(π(k−W)/(T−W)))): the peak at step W, the floor lr·m at step T."""
    warmup = min(t.warmup_steps, t.steps)

    def factor(step: int) -> float:  # `step` = optimizer steps already taken = k − 1
        if step < warmup:
            return (step + 1) / warmup
        progress = (step + 1 - warmup) / max(t.steps - warmup, 1)
        cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * cosine

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, t: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(t))


def clip_grad_norm(params: list[torch.Tensor], max_norm: float, pp_group=None,
                   foreach: bool = True) -> torch.Tensor:
    """The global gradient norm (across shards), clipping in place when max_norm > 0.

    Stays on the device: no host sync here; the caller reads the value a step later.
    """
    # Grads may live on different meshes (FSDP×TP 2-D, FSDP-only 1-D, plain); foreach kernels
    # cannot mix them, so norm and scale each group separately.
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        if p.grad is not None:
            groups[p.grad.device_mesh if isinstance(p.grad, DTensor) else None].append(p)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=foreach)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)  # reduces over shards
    total = torch.linalg.vector_norm(torch.stack(norms)) if len(norms) > 1 else norms[0]
    if pp_group is not None:  # each pipeline rank holds different layers: add their squares
        squared = total.float() ** 2
        torch.distributed.all_reduce(squared, group=pp_group)
        total = squared.sqrt()
    if max_norm > 0:
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=foreach)
    return total
