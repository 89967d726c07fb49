"""Muon's whole-matrix orthogonalization from shards (loom/train/muon.py) on gloo ranks: every
placement a layout gives a matrix (FSDP2's dim-0 shards, even and uneven; a split of the columns;
stacked experts split along the experts or along their rows; a replica × shard mesh; FSDP2 × TP's
two splits, and FSDP2's strided one over TP's, on whole-divisible shapes as FSDP2 makes them) gives
each rank its piece of the whole matrix's Newton-Schulz result, within 1e-5."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from loom.train.muon import newton_schulz, orthogonalize

SHAPES = [(12, 8), (8, 12), (7, 5), (3, 9, 6), (5, 4, 4), (2, 6, 10)]  # rows < world: uneven


def _placements(world: int):
    """(mesh shape, placements) for each case."""
    flat = [((world,), [p]) for p in (Shard(0), Shard(1), Replicate())]
    flat.append(((world,), [Shard(-1)]))
    if world == 4:
        flat += [((2, 2), [Replicate(), Shard(0)]), ((2, 2), [Shard(0), Shard(1)]),
                 ((2, 2), [Shard(0), Shard(0)]), ((2, 2), [_StridedShard(0, split_factor=2), Shard(0)])]
    return flat


def _rank_orthogonalize(world: int):
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    wholes = [torch.randn(s) for s in SHAPES]
    out = []
    for mesh_shape, placements in _placements(world):
        mesh = init_device_mesh("cpu", mesh_shape)
        mats = wholes
        if any(isinstance(p, _StridedShard) for p in placements):  # (defined where 4 divides the rows)
            mats = [w if w.shape[0] % 4 == 0 else torch.ones(4, 4) for w in wholes]
        shards = [distribute_tensor(w, mesh, placements) for w in mats]
        pieces = orthogonalize(shards, 5, torch.float32)
        want = [distribute_tensor(newton_schulz(w, 5, torch.float32), mesh, placements).to_local()
                for w in mats]
        out.append([(p.shape == q.shape and (p - q).abs().max().item() if p.numel() else 0.0)
                    for p, q in zip(pieces, want)])
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_pieces_of_the_whole_matrix_result(world):
    for rank, cases in enumerate(run_ranks(_rank_orthogonalize, world, world)):
        for (mesh_shape, placements), errors in zip(_placements(world), cases):
            for shape, err in zip(SHAPES, errors):
                assert err is not False, f"rank {rank} {placements} {shape}: wrong piece shape"
                assert err < 1e-5, f"rank {rank} {mesh_shape} {placements} {shape}: error {err:.2e}"
