"""Activation checkpointing: keep a block's input, recompute its activations in backward.

`full` wraps every block, `selective` every k-th block (parallel.ac_every), trading roughly one
extra forward of those blocks for their activation memory. Non-reentrant checkpointing composes
with FSDP2, DDP and torch.compile.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper,
)


def apply_activation_checkpointing(layers: nn.ModuleList | nn.ModuleDict, mode: str, every: int = 1) -> int:
    """Wrap the chosen blocks of `layers` in place; returns how many were wrapped.

    `layers` is the whole model's ModuleList or a pipeline stage's ModuleDict keyed by layer index.
    """
    if mode == "none":
        return 0
    step = 1 if mode == "full" else every
    keys = list(layers.keys()) if isinstance(layers, nn.ModuleDict) else list(range(len(layers)))
    wrapped = 0
    for key in keys:
        # selective: layers 0, k, 2k, ...: the earliest blocks' activations live longest
        if int(key) % step == 0:
            layers[key] = checkpoint_wrapper(layers[key], preserve_rng_state=False)
            wrapped += 1
    return wrapped
