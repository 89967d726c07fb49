"""Turn a model built on the meta device into this rank's parallel, initialized model.

The order is fixed (see DESIGN.md): TP -> activation checkpointing -> compile -> FSDP/DDP, then the
weights are materialized and initialized. Initialization is per parameter from (seed, name), so
every strategy and world size starts from the same weights.
"""

from __future__ import annotations

from torch import nn

from loom.config import Config
from loom.parallel.checkpointing import apply_activation_checkpointing
from loom.parallel.data_parallel import apply_ddp, apply_fsdp, uses_fsdp
from loom.parallel.mesh import Dist
from loom.parallel.pipeline import build_stage, rank_stages, stage_layers
from loom.parallel.tensor_parallel import apply_tensor_parallel


def layers_of(model: nn.Module) -> nn.ModuleList | nn.ModuleDict:
    """The repeated blocks' container (a stage holds a ModuleDict keyed by layer index)."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (nn.ModuleList, nn.ModuleDict)):
        raise TypeError(f"{type(model).__name__} has no `layers` container of repeated blocks")
    return layers


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks, in order: the units of FSDP sharding, checkpointing and compilation."""
    layers = layers_of(model)
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


def parallelize(model: nn.Module, cfg: Config, d: Dist) -> list[nn.Module]:
    """`model` is on the meta device; returns this rank's parallelized parts with weights on
    `d.device`: the whole model, or with pipeline parallelism this rank's stage(s)."""
    p = cfg.parallel
    if p.pp == 1:
        return [_parallelize_part(model, cfg, d)]
    num_stages = p.pp * p.pp_virtual_stages
    layers = stage_layers(model.cfg.n_layers, p.pp, p.pp_virtual_stages)
    stages = rank_stages(d.mesh["pp"].get_local_rank(), p.pp, p.pp_virtual_stages)
    return [_parallelize_part(build_stage(model, s, num_stages, layers[s]), cfg, d) for s in stages]


def _parallelize_part(model: nn.Module, cfg: Config, d: Dist) -> nn.Module:
    p = cfg.parallel
    if p.tp > 1:
        apply_tensor_parallel(model, d.mesh["tp"], p.sequence_parallel)
    apply_activation_checkpointing(layers_of(model), p.activation_checkpointing, p.ac_every)
    blocks = blocks_of(model)
    if cfg.train.compile:
        for block in blocks:
            block.compile()  # in place: parameter names stay the same
    if uses_fsdp(p):
        apply_fsdp(model, blocks, p, cfg.train.precision, d)
        init_device = "cpu" if p.offload == "cpu" else d.device
        model.to_empty(device=init_device)
        model.init_weights(cfg.train.seed)
        return model
    model.to_empty(device=d.device)
    model.init_weights(cfg.train.seed)
    return apply_ddp(model, p, d)  # zero1 shards the optimizer, not the model
