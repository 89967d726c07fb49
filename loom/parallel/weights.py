"""Writing a rank's share of the weights: every parameter's local block (a DTensor's shard under
FSDP2 or TP, the whole tensor otherwise, a flat slice under DeepSpeed's ZeRO-3) is read from a
source that can read any block of the full tensor. Random initialization and pretrained
checkpoints are both sources, so every layout starts from the same values, and a pretrained
model is read slice by slice: no rank ever holds the full model.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

# Wrappers that insert a segment into parameter names (torch.compile, activation checkpointing):
# the weights are named as in the unwrapped model.
WRAPPER_SEGMENTS = ("_orig_mod.", "_checkpoint_wrapped_module.")


class WeightSource(Protocol):
    def read(self, name: str, shape: tuple[int, ...], offset: tuple[int, ...],
             size: tuple[int, ...]) -> torch.Tensor:
        """The block [offset, offset + size) of the full tensor `name`, whose shape is `shape`."""
        ...


def plain_name(name: str) -> str:
    for segment in WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


def local_block(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offset, size) of the part of the full parameter this rank holds."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        size, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        return tuple(offset), tuple(size)
    return (0,) * param.dim(), tuple(param.shape)


@torch.no_grad()
def write_weights(model: nn.Module, source: WeightSource) -> None:
    """Every parameter's local block from `source` (tied weights once), by its unwrapped name."""
    from torch._subclasses.fake_tensor import is_fake
    from torch.distributed.tensor import DTensor

    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        if is_fake(local):
            continue  # `loom plan --trace`: shapes only, no values to write
        offset, size = local_block(param)
        if local.numel():
            local.copy_(source.read(plain_name(name), tuple(param.shape), offset, size))


def read_flat(source: WeightSource, name: str, shape: tuple[int, ...], start: int, stop: int) -> torch.Tensor:
    """Elements [start, stop) of the flattened tensor: the rows that hold them, read whole, then cut
    (DeepSpeed's ZeRO-3 partitions are flat slices)."""
    if not shape:
        return source.read(name, shape, (), ()).reshape(1)[start:stop]
    row = 1
    for n in shape[1:]:
        row *= n
    first, last = start // row, -(-stop // row)
    rows = source.read(name, shape, (first,) + (0,) * (len(shape) - 1), (last - first,) + shape[1:])
    return rows.flatten()[start - first * row:stop - first * row]


def block(full: torch.Tensor, offset: tuple[int, ...], size: tuple[int, ...]) -> torch.Tensor:
    """The block of a whole tensor (a source that computes values whole, like random init)."""
    return full[tuple(slice(o, o + s) for o, s in zip(offset, size))]


class TensorsSource:
    """Whole tensors in memory, by name, as a source."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def read(self, name: str, shape: tuple[int, ...], offset: tuple[int, ...],
             size: tuple[int, ...]) -> torch.Tensor:
        return block(self.tensors[name], offset, size)
