"""Expert parallelism: each MoE block's routed experts split over `ep` data-parallel ranks, tokens
sent to the ranks that own their experts and back with all_to_all_single.

The ep ranks are the innermost part of the data-parallel ranks (loom/parallel/mesh.py): ep rank j
holds experts [j·E/ep, (j+1)·E/ep) as a DTensor sharded on dim 0 over the mesh's "ep" dim, so
checkpoints reshard across ep degrees like any other DTensor. Every rank routes its own tokens;
the split counts go first (one small all-to-all), then the token rows, ordered by expert.

Gradients: an expert's gradient sums the contributions of every ep rank's tokens, each already
averaged over that rank's tokens, and the data-parallel engine then averages it over the edp =
dp/ep ranks that hold the same experts. Over all dp ranks that is ep times the mean, so expert
weights pass through `scale_grad(w, 1/ep)` (identity forward): dense and expert gradients are both
the mean over the global batch, as the single process computes it.

Under DualPipeV's overlap (loom/parallel/fb_overlap.py) a backward exchanges on a helper thread beside
a forward: every exchange marks its segment (`exchange_segment`) and goes over the group its thread
uses (`exchange_group`: the backward side's own), and the tally takes a lock.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from loom.parallel.context_parallel import EP_ALLTOALL, ExchangeTally, exchanging
from loom.parallel.fb_overlap import exchange_group, exchange_segment


@dataclass(frozen=True)
class ExpertGroup:
    """This rank's place among the ranks that split the experts."""

    group: dist.ProcessGroup | None
    size: int
    rank: int


_tally = ExchangeTally()
_tally_lock = threading.Lock()


def take_tally() -> dict:
    """{"ep_bytes", "ep_wait_s"} since the last call (per step: metrics.jsonl), and start again."""
    with _tally_lock:
        return _tally.take("ep")


def _exchange(x: torch.Tensor, out_rows: list[int], in_rows: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(out_rows), *x.shape[1:]))
    start = time.perf_counter()
    with exchange_segment(), exchanging(EP_ALLTOALL):
        dist.all_to_all_single(out, x.contiguous(), out_rows, in_rows, group=exchange_group(group))
    _count(time.perf_counter() - start, x)
    return out


def _count(wait_s: float, sent: torch.Tensor) -> None:
    with _tally_lock:  # DualPipeV's overlapped forward and backward exchange from two threads
        _tally.wait_s += wait_s
        _tally.bytes_sent += sent.numel() * sent.element_size()


class _AllToAll(torch.autograd.Function):
    """Rows of x sent in_rows[j] to rank j, out_rows[j] received from it; backward the reverse."""

    @staticmethod
    def forward(ctx, x, out_rows, in_rows, group):
        ctx.rows, ctx.group = (out_rows, in_rows), group
        return _exchange(x, out_rows, in_rows, group)

    @staticmethod
    def backward(ctx, grad):
        out_rows, in_rows = ctx.rows
        return _exchange(grad, in_rows, out_rows, ctx.group), None, None, None


def exchange_counts(counts: torch.Tensor, ep: ExpertGroup) -> torch.Tensor:
    """counts [E] (this rank's tokens per expert) -> [ep, E/ep]: row j, what rank j sends to each of
    this rank's experts."""
    out = torch.empty_like(counts)
    start = time.perf_counter()
    with exchange_segment(), exchanging(EP_ALLTOALL):
        dist.all_to_all_single(out, counts, group=exchange_group(ep.group))
    _count(time.perf_counter() - start, counts)
    return out.view(ep.size, -1)


def send_to_experts(rows: torch.Tensor, counts: torch.Tensor, ep: ExpertGroup):
    """rows [M, d] sorted by expert with `counts` [E] per expert -> (this rank's experts' rows,
    sorted by local expert; rows per local expert, a list; how to send the results back)."""
    with exchange_segment():  # the counts and the rows: one segment under DualPipeV's overlap
        received = exchange_counts(counts, ep)  # [ep, E_local]
        local_experts = received.shape[1]
        # One host sync for every size (all_to_all_single takes lists): rows sent to each rank, rows got
        # from each, rows per local expert.
        sizes = torch.cat([counts.view(ep.size, -1).sum(1), received.sum(1), received.sum(0)]).tolist()
        sent_rows, got_rows, per_expert = sizes[:ep.size], sizes[ep.size:2 * ep.size], sizes[2 * ep.size:]
        arrived = _AllToAll.apply(rows, got_rows, sent_rows, ep.group)  # by source rank, then expert
        expert_of_row = torch.arange(local_experts, device=rows.device).repeat(ep.size) \
            .repeat_interleave(received.flatten())
        order = torch.argsort(expert_of_row, stable=True)
        return arrived[order], per_expert, (order, got_rows, sent_rows)


def return_from_experts(out: torch.Tensor, route, ep: ExpertGroup) -> torch.Tensor:
    """The inverse of send_to_experts on the experts' outputs: rows back in the sender's order."""
    order, got_rows, sent_rows = route
    by_source = torch.empty_like(out).index_copy(0, order, out)
    return _AllToAll.apply(by_source, sent_rows, got_rows, ep.group)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x itself, its gradient times `scale`."""
    return x if scale == 1 else _ScaleGrad.apply(x, scale)


def shard_experts(module: torch.nn.Module, ep_mesh) -> None:
    """The module's parameters (stacked experts on dim 0) split over the ep mesh dim: DTensors,
    each rank's local block its own experts."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for name, param in list(module.named_parameters(recurse=False)):
        sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
        module.register_parameter(name, torch.nn.Parameter(sharded, requires_grad=param.requires_grad))
