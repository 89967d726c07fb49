"""Turn a model built on the meta device into this rank's parallel, initialized model.

The order is fixed (see DESIGN.md): TP -> activation checkpointing -> compile -> FSDP/DDP, then the
weights are materialized and initialized. Initialization is per parameter from (seed, name), so
every strategy and world size starts from the same weights.
"""

from __future__ import annotations

from torch import nn

from loom.config import FSDP_STRATEGIES, Config
from loom.parallel.checkpointing import apply_activation_checkpointing
from loom.parallel.data_parallel import apply_ddp, apply_fsdp
from loom.parallel.mesh import Dist
from loom.parallel.tensor_parallel import apply_tensor_parallel


def blocks_of(model: nn.Module) -> nn.ModuleList:
    """The repeated blocks: the units of FSDP sharding, checkpointing and compilation."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no `layers` ModuleList of repeated blocks")
    return layers


def parallelize(model: nn.Module, cfg: Config, d: Dist) -> nn.Module:
    """`model` is on the meta device; returns the wrapped model with weights on `d.device`."""
    p = cfg.parallel
    blocks = blocks_of(model)
    if p.tp > 1:
        apply_tensor_parallel(model, d.mesh["tp"], p.sequence_parallel)
    apply_activation_checkpointing(blocks, p.activation_checkpointing, p.ac_every)
    if cfg.train.compile:
        for block in blocks:
            block.compile()  # in place: parameter names stay the same
    if p.strategy in FSDP_STRATEGIES:
        apply_fsdp(model, blocks, p, cfg.train.precision, d)
        init_device = "cpu" if p.offload == "cpu" else d.device
        model.to_empty(device=init_device)
        model.init_weights(cfg.train.seed)
        return model
    model.to_empty(device=d.device)
    model.init_weights(cfg.train.seed)
    return apply_ddp(model, p, d)  # zero1 shards the optimizer, not the model
