"""Activation checkpointing: keep a block's input, recompute its activations in backward.

`full` wraps every block, `selective` every k-th block (parallel.ac_every), trading roughly one
extra forward of those blocks for their activation memory. `op` wraps every block but keeps the
outputs of its matmuls and of attention (and attention's log-sum-exp) through torch's selective
checkpoint API: backward recomputes only the cheap elementwise work (norms, RoPE, SwiGLU's
activation) and, under TP, the collectives between them. Every matmul is kept, not every other one
(torchtitan's choice): one policy whose saved bytes the planner counts exactly
(plan/shapes.py::op_saved_bytes_per_layer). Non-reentrant checkpointing composes with FSDP2, DDP,
TP, pipelining and torch.compile.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper,
)
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, create_selective_checkpoint_contexts

_aten = torch.ops.aten
# What "op" keeps: the matmuls and every fused attention kernel (the CPU one included), whose second
# output is the log-sum-exp its backward reads.
OP_SAVED = frozenset({
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_fused_attention_overrideable.default,
})


# Profiler ranges are no computation, and an FSDP2 unit inside a block (an MoE block's experts under
# expert parallelism) opens a different number of them in the recompute than in forward when it holds
# its parameters whole; counted, they would make the selective checkpoint refuse its own replay.
SAC_IGNORED_OPS.update({torch.ops.profiler._record_function_enter_new.default,
                        torch.ops.profiler._record_function_exit._RecordFunction})


def _op_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in OP_SAVED else CheckpointPolicy.PREFER_RECOMPUTE


def op_context_fn():
    """The (forward, recompute) contexts of torch's selective checkpoint under the "op" policy."""
    return create_selective_checkpoint_contexts(_op_policy)


def apply_activation_checkpointing(layers: nn.ModuleList | nn.ModuleDict, mode: str, every: int = 1) -> int:
    """Wrap the chosen blocks of `layers` in place; returns how many were wrapped.

    `layers` is the whole model's ModuleList or a pipeline stage's ModuleDict keyed by layer index.
    """
    if mode == "none":
        return 0
    step = every if mode == "selective" else 1
    extra = {"context_fn": op_context_fn} if mode == "op" else {}
    keys = list(layers.keys()) if isinstance(layers, nn.ModuleDict) else list(range(len(layers)))
    wrapped = 0
    for key in keys:
        # selective: layers 0, k, 2k, ...: the earliest blocks' activations live longest
        if int(key) % step == 0:
            layers[key] = checkpoint_wrapper(layers[key], preserve_rng_state=False, **extra)
            wrapped += 1
    return wrapped
