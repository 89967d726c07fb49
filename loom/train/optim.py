"""AdamW (foreach or fused), ZeRO-1's sharded wrapper, the LR schedule and gradient clipping."""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from loom.config import TrainConfig
from loom.parallel.mesh import Dist


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (linears, embeddings); leave norms' gains undecayed."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, t: TrainConfig, strategy: str, d: Dist) -> torch.optim.Optimizer:
    impl = t.optimizer_impl
    if impl == "auto":
        impl = "fused" if d.device.type == "cuda" else "foreach"
    kwargs = dict(lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, **{impl: True})
    groups = param_groups(model, t.weight_decay)
    if strategy == "zero1":
        # Each rank keeps Adam state for its partition only and broadcasts its updated params.
        sharded = any(isinstance(p, DTensor) for g in groups for p in g["params"])
        zero = _ZeroOverLocalShards if sharded else _zero_class()
        return zero(groups, optimizer_class=torch.optim.AdamW, process_group=d.dp_mesh.get_group(), **kwargs)
    return torch.optim.AdamW(groups, **kwargs)


def _zero_class():
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer


class _ZeroOverLocalShards(_zero_class()):  # type: ignore[misc]
    """ZeRO-1 for tensor-parallel (DTensor) parameters.

    ZeroRedundancyOptimizer broadcasts plain tensors only, so it runs over plain aliases of this
    rank's local TP shards (same storage). The dp ranks it partitions over hold the same TP shard,
    so its partitions and broadcasts are exactly ZeRO-1 within each TP slice. Gradients are linked
    to the aliases for the step only, so no extra reference keeps them alive afterwards.
    """

    def __init__(self, groups: list[dict], **kwargs):
        self._links: list[tuple[torch.Tensor, torch.Tensor]] = []  # (DTensor param, plain alias)
        local_groups = []
        for group in groups:
            aliases = []
            for p in group["params"]:
                alias = nn.Parameter(p.to_local().detach()) if isinstance(p, DTensor) else p
                self._links.append((p, alias))
                aliases.append(alias)
            local_groups.append({**group, "params": aliases})
        super().__init__(local_groups, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        # The gradients live on the DTensor params, which this optimizer's groups do not list.
        for p, _ in self._links:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    def step(self, closure=None, **kwargs):
        linked = [(p, a) for p, a in self._links if a is not p]
        for p, alias in linked:
            alias.grad = None if p.grad is None else p.grad.to_local()
        try:
            return super().step(closure, **kwargs)
        finally:
            for _, alias in linked:
                alias.grad = None


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


def clip_grad_norm(params: list[torch.Tensor], max_norm: float, pp_group=None, foreach: bool = True) -> torch.Tensor:
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
