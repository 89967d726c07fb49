"""ZeRO-1 in one place: optimizer states sharded over the data-parallel group, the model replicated.

The model side is DDP (loom/parallel/ddp.py), or FSDP2 replication under tensor parallelism
(DDP takes no DTensor parameters). The optimizer side is torch's ZeroRedundancyOptimizer: each
rank keeps AdamW states for its partition of the parameters and broadcasts the ones it updated.
This module builds it (over plain aliases of the local TP shards when the parameters are
DTensors), names the optimizer that holds this rank's states, and lays those states out for a
checkpoint under the full model's parameter names.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from loom.parallel.mesh import Dist, local_view


def build_zero1_optimizer(groups: list[dict], d: Dist, kind: type = torch.optim.AdamW,
                          **adamw) -> ZeroRedundancyOptimizer:
    """`kind` (AdamW, or Muon with AdamW) over `groups` (param groups), its states partitioned over
    the dp group: each rank steps the whole parameters it holds the states of."""
    sharded = any(isinstance(p, DTensor) for g in groups for p in g["params"])
    zero = _ZeroOverLocalShards if sharded else ZeroRedundancyOptimizer
    return zero(groups, optimizer_class=kind, process_group=d.grad_mesh.get_group(), **adamw)


def is_zero1(optimizer) -> bool:
    return isinstance(optimizer, ZeroRedundancyOptimizer)


def local_optimizer(optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds (and steps) this rank's states: ZeRO-1's local one, or itself."""
    return optimizer.optim if is_zero1(optimizer) else optimizer


class _ZeroOverLocalShards(ZeroRedundancyOptimizer):
    """ZeRO-1 for tensor-parallel (DTensor) parameters.

    ZeroRedundancyOptimizer broadcasts plain tensors only, so it runs over plain aliases of this
    rank's local TP shards (same storage). The dp ranks it partitions over hold the same TP shard,
    so its partitions and broadcasts are exactly ZeRO-1 within each TP slice. Gradients are linked
    to the aliases for the step only, so no extra reference keeps them alive afterwards.
    """

    def __init__(self, groups: list[dict], **kwargs):
        self.links: list[tuple[torch.Tensor, torch.Tensor]] = []  # (DTensor param, plain alias)
        local_groups = []
        for group in groups:
            aliases = []
            for p in group["params"]:
                alias = nn.Parameter(p.to_local().detach()) if isinstance(p, DTensor) else p
                self.links.append((p, alias))
                aliases.append(alias)
            local_groups.append({**group, "params": aliases})
        super().__init__(local_groups, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        # The gradients live on the DTensor params, which this optimizer's groups do not list.
        for p, _ in self.links:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    def step(self, closure=None, **kwargs):
        linked = [(p, a) for p, a in self.links if a is not p]
        for p, alias in linked:
            alias.grad = None if p.grad is None else p.grad.to_local()
        try:
            return super().step(closure, **kwargs)
        finally:
            for _, alias in linked:
                alias.grad = None


def owned_states(optimizer: ZeroRedundancyOptimizer, model_sd: dict[str, torch.Tensor], d: Dist
                 ) -> dict[str, dict[str, torch.Tensor]]:
    """ZeRO-1: the states of the parameters this rank owns (the others are on their owners).

    Under TP the owners of one parameter's shards are one rank per TP slice (the same dp index:
    ZeRO partitions equal shard sizes the same way), so its state is a DTensor on the TP mesh."""
    by_storage = {}
    for name, value in model_sd.items():
        by_storage.setdefault(local_view(value).data_ptr(), (name, value))
    links = {id(alias): p for p, alias in getattr(optimizer, "links", [])}
    local = optimizer.optim
    create_states(local)
    out = {}
    for group in local.param_groups:
        for p in group["params"]:
            name, value = by_storage[p.data_ptr()]
            param = links.get(id(p), value)
            states = {}
            for key, t in local.state[p].items():
                names = param.device_mesh.mesh_dim_names or () if isinstance(param, DTensor) else ()
                if "tp" in names and t.shape == p.shape and t.ndim > 0:
                    tp_dim = param.device_mesh.mesh_dim_names.index("tp")
                    t = DTensor.from_local(t, d.mesh["tp"], [param.placements[tp_dim]], run_check=False,
                                           shape=param.shape, stride=param.stride())
                states[key] = t
            out[name] = states
    return out


def create_states(optimizer: torch.optim.Optimizer) -> None:
    """Create Adam's states (a step at lr 0 changes nothing) so a load has tensors to fill."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p not in optimizer.state]
    if not params:
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    for p in params:
        p.grad = None
