"""Expert parallelism for the planner: which ep splits loom runs and what the dispatch exchanges
(loom/parallel/expert_parallel.py runs it; plan/memory.py, comm.py and step.py price it from here).

ep borrows from the data-parallel ranks (dp = edp × ep, ep innermost: an ep group spans ep·tp
consecutive ranks). Each MoE block's E routed experts are split over the ep ranks, E/ep each; the
strategy then shards a rank's experts over the edp ranks holding the same ones (FSDP2 over
N_e = N/ep; ddp replicates them) and reduces their gradients over those edp ranks only. Everything
else (attention, norms, embeddings, head, router, shared experts, dense blocks) is laid out as at
ep = 1. TP splits the dense parts only: each TP rank runs the MoE on the whole gathered sequence,
its experts replicated over tp.

Per MoE block and micro-batch a rank holding T = b·s tokens (each routed to k experts, h wide, e
bytes per element) issues, as the observer records them (kind `ep_alltoall`, payload = its input):
  forward   the split counts, E int64 (8·E bytes), then the dispatch (T·k rows of h) and the
            combine (the same number of rows back): 8·E + 2·T·k·h·e in 3 all_to_all_single
  backward  the dispatch's and the combine's gradients: 2·T·k·h·e in 2
A block whose forward is recomputed (activation checkpointing: full, selective's blocks, op) runs
its forward exchange again. On the wire a share (ep−1)/ep of each leaves the rank; the link is
intra-node when ep·tp ≤ GPUs per node.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

KIND = "ep_alltoall"  # the CommAccount kind of the dispatch (loom/parallel/context_parallel.py EP_ALLTOALL)
OBSERVED = "all_to_all"  # what the device profile measures it as (or all_reduce's fit)
COUNT_BYTES = 8  # the split counts: int64
SPLITS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # the ep degrees the search tries


def valid(shape, c) -> bool:
    """Whether loom runs candidate `c`'s ep: 1 always; above 1 only for an MoE model whose E divides
    over ep, on the torch engine (not zero1, nor the deepspeed engine), without context parallelism,
    ep dividing the ranks that shard the model (dp_shard: zero2, zero3, hsdp's shard group) or, for
    ddp, dp."""
    if c.ep == 1:
        return True
    if not shape.moe or shape.moe_layers == 0 or shape.moe_experts % c.ep or c.cp > 1:
        return False
    s = c.strategy_info
    if c.engine == "deepspeed" or s.shards_optimizer_only:
        return False
    return (c.shard_size if s.sharded else c.dp) % c.ep == 0


def splits(shape, ranks: int) -> list[int]:
    """The ep degrees above 1 worth pricing over `ranks` data-parallel ranks: powers of two dividing
    both the ranks and E (none for a dense model)."""
    if not shape.moe or shape.moe_layers == 0:
        return []
    return [ep for ep in SPLITS if ep <= ranks and ranks % ep == 0 and shape.moe_experts % ep == 0]


@functools.lru_cache(maxsize=4096)
def checkpointed_moe_layers(shape, start: int, layers: int, mode: str, every: int) -> int:
    """How many of the MoE blocks among blocks start .. start + layers − 1 are checkpointed (recomputed
    in backward): all under full and op, selective's every `every`-th block of the stage."""
    if mode == "none" or not shape.moe:
        return 0
    step = every if mode == "selective" else 1
    return sum(shape.is_moe(start + j) for j in range(0, layers, step))


@dataclass(frozen=True)
class Dispatch:
    """One MoE block's exchange for one micro-batch, as a rank sends it: payload bytes and the
    all_to_all_single calls carrying them, forward and backward."""

    rows: float  # T·k·h·e: the dispatch's (or the combine's) payload
    counts: float  # 8·E
    forward: float
    backward: float
    forward_ops: int = 3
    backward_ops: int = 2


def dispatch(shape, tokens: int, elem: int) -> Dispatch:
    """The exchange of one MoE block for `tokens` tokens on the rank (the module's docstring)."""
    rows = tokens * shape.moe_top_k * shape.d_model * elem
    counts = COUNT_BYTES * shape.moe_experts
    return Dispatch(rows, counts, counts + 2 * rows, 2 * rows)


def inter_node(c, gpus_per_node: int) -> bool:
    """Whether the ep group (ep·tp consecutive ranks) spans nodes."""
    return c.ep * c.tp > gpus_per_node


def imbalance(w, c) -> float:
    """The load factor the busiest rank's experts take: the workload's moe_imbalance under expert
    parallelism; 1 at ep = 1, where every rank holds all the experts and runs exactly T·k rows."""
    return w.moe_imbalance if c.ep > 1 else 1.0
