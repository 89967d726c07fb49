"""Turn a model into this rank's parallel, initialized model parts, and what the loop needs of them.

The order is fixed: pipeline split -> TP -> EP (experts split) -> activation checkpointing -> compile
-> FSDP/DDP, then
the weights are materialized and initialized. Initialization is per parameter from (seed, name),
so every strategy and world size starts from the same weights. The model is known only through
its adapter (loom/parallel/adapter.py); the engines are loom/parallel/ddp.py and fsdp.py (zero1's
optimizer side: zero1.py), chosen by the strategy table (loom/strategies.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel as DDP

from loom import strategies
from loom.config import Config, pipeline_microbatches, rank_stages, splits_backward, stages_per_rank
from loom.layout import validate_pipeline
from loom.parallel.activation_checkpointing import apply_activation_checkpointing
from loom.parallel.adapter import ModelAdapter
from loom.parallel.context_parallel import SequenceSplit
from loom.parallel.ddp import apply_ddp
from loom.parallel.expert_parallel import shard_experts
from loom.parallel.fsdp import apply_fsdp
from loom.parallel.known_warnings import silence_dtensor_sequential_redistribute
from loom.parallel.mesh import Dist
from loom.parallel.pipeline import stage_layers
from loom.parallel.weights import WeightSource


def parallelize(model: nn.Module, cfg: Config, d: Dist, adapter: ModelAdapter,
                weights: WeightSource | None = None, split: SequenceSplit | None = None) -> list[nn.Module]:
    """Returns this rank's parallelized parts with weights on `d.device`: the whole model, or with
    pipeline parallelism this rank's stage(s). A meta-init model (loom's GPT, a pretrained Hugging
    Face decoder) arrives on the meta device and its weights are written after sharding, from
    `weights` (pretrained) or its own initialization; any other model arrives built (same seed on
    every rank) and is moved and sharded. `split`: context parallelism and packed documents, which
    the model lays out itself (see sequence_split)."""
    p = cfg.parallel
    if p.pp == 1:
        return [_parallelize_part(model, cfg, d, adapter, weights, split)]
    n_layers = adapter.num_layers(model)
    validate_pipeline(n_layers, p.pp, p.pp_virtual_stages, p.pp_schedule, pipeline_microbatches(p),
                      split=p.pp_stage_layers)
    local = stages_per_rank(p.pp_schedule, p.pp_virtual_stages)
    num_stages = p.pp * local
    layers = stage_layers(n_layers, p.pp, local, p.pp_stage_layers)
    stages = rank_stages(d.mesh["pp"].get_local_rank(), p.pp, p.pp_virtual_stages, p.pp_schedule)
    return [_parallelize_part(adapter.pipeline_stage(model, s, num_stages, layers[s]), cfg, d, adapter,
                              weights, split) for s in stages]


def sequence_split(d: Dist, document_eos: int | None) -> SequenceSplit | None:
    """How the model splits its sequences: over the cp ranks, into documents at `document_eos`
    (data.packing = documents); None when neither."""
    if d.cp is None and document_eos is None:
        return None
    return SequenceSplit(d.cp, document_eos)


def _parallelize_part(model: nn.Module, cfg: Config, d: Dist, adapter: ModelAdapter,
                      weights: WeightSource | None, split: SequenceSplit | None) -> nn.Module:
    p = cfg.parallel
    if split is not None:
        adapter.split_sequences(model, split)
    if not adapter.meta_init:
        model.to(d.device)  # built whole on every rank; sharding below frees what is not ours
    if p.tp > 1:
        silence_dtensor_sequential_redistribute()
        frozen = {name for name, q in model.named_parameters() if not q.requires_grad}
        adapter.apply_tensor_parallel(model, d.mesh["tp"], p.sequence_parallel)
        for name, q in model.named_parameters():  # (torch's SequenceParallel makes every norm trainable)
            q.requires_grad_(name not in frozen)
    experts = adapter.expert_modules(model)
    if d.ep is not None:
        for module in experts:
            shard_experts(module, d.mesh["ep"])
            module.ep = d.ep
    layers = adapter.layers(model)
    apply_activation_checkpointing(layers, p.activation_checkpointing, p.ac_every)
    blocks = list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)
    if cfg.train.compile:
        compile_blocks(blocks)
    if uses_fsdp(p):
        apply_fsdp(model, blocks, p, cfg.train.precision, d, experts if d.ep is not None else [])
        if adapter.meta_init:
            materialize(model, d.device, offload=p.offload == "cpu")
            adapter.init_weights(model, cfg.train.seed, weights)
        return model
    if adapter.meta_init:
        materialize(model, d.device)
        adapter.init_weights(model, cfg.train.seed, weights)
    return apply_ddp(model, p, d)  # zero1 shards the optimizer, not the model


def compile_blocks(blocks: list[nn.Module], backend: str = "inductor") -> None:
    """torch.compile each block in place (parameter names stay the same), as one graph each: an MoE
    block's routing tally is a forward side effect that checkpointing must not replay in backward
    (eager skips it there itself: loom/models/gpt/moe.py), so dynamo is told to skip it too rather
    than break the checkpointed block's graph. `backend`: the tests count graph breaks without
    inductor ("aot_eager")."""
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    for block in blocks:
        block.compile(backend=backend)


def materialize(model: nn.Module, device: torch.device, offload: bool = False) -> None:
    """Give a model built on the meta device its storage (uninitialized: init_weights writes it).
    Under CPU offload the parameters live in host memory (FSDP2 copies each unit in for its
    compute), but the buffers (RoPE tables, routing biases) are read by forward as they are: they
    go to the compute device, else the first step mixes cuda and cpu tensors."""
    model.to_empty(device="cpu" if offload else device)
    if offload:
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                module._buffers[name] = torch.empty_like(buffer, device=device)


def uses_fsdp(p) -> bool:
    """Whether FSDP2 wraps the model: zero2/zero3/hsdp, and ddp/zero1 under TP, EP or a schedule that
    splits the backward (see fsdp.py, pipeline.py)."""
    return strategies.lookup(p.strategy).uses_fsdp(p.tp, p.ep, splits_backward(p))


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

