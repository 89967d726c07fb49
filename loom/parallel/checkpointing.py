"""Activation checkpointing: keep a block's input, recompute its activations in backward.

`full` wraps every block, `selective` every k-th block (parallel.ac_every), trading roughly one
extra forward of those blocks for their activation memory. Non-reentrant checkpointing composes
with FSDP2, DDP and torch.compile.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper


def apply_activation_checkpointing(layers: nn.ModuleList, mode: str, every: int = 1) -> int:
    """Wrap the chosen blocks of `layers` in place; returns how many were wrapped."""
    if mode == "none":
        return 0
    step = 1 if mode == "full" else every
    wrapped = 0
    for i, block in enumerate(layers):
        # selective: blocks 0, k, 2k, ...: the earliest blocks' activations live longest
        if i % step == 0:
            layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)
            wrapped += 1
    return wrapped
