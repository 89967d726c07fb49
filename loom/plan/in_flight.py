"""What each pipeline rank holds of its micro-batches, stage by stage, at the moments its memory can
peak: `live`, the micro-batches whose forward ran and whose backward has not finished, each keeping
its saved tensors; and under the zero-bubble schedules `deferred`, those among them whose input
gradient (B) ran and whose weight gradient (W) did not. torch runs B with the autograd graph
retained for W, so a deferred micro-batch keeps all its saved tensors until W, and beside them the
gradients of its linears' outputs that W reads.

Closed forms of torch.distributed.pipelining's own action orders (the same in torch 2.11 and 2.13):
tests/unit/test_plan_in_flight.py walks those orders rank by rank and checks that the largest of the
moments here is the orders' peak, whatever a deferred W weighs against a live micro-batch. With
R = m // max(1, m // p) micro-batches a round (torch's microbatches_per_round) and a rank's stages
numbered k = 0 .. v−1 in the order it holds them (loom.config.rank_stages):

  gpipe        m on its one stage
  1f1b         min(m, p − r)
  interleaved  the first min(m·v, (v − 1)·R + 2·(p − 1 − r) + 1) forwards of its warm-up, which take
               R micro-batches of stage 0, then R of stage 1, ... round after round
  zb           the first min(m·v, (v − 1)·R + p) forwards the same way, its last stage's r + 1 first
               B's run and their W's not
  zbv          the warm-up's end: 2p − 1 − r of stage r, r + 1 of stage 2p − 1 − r (one B run);
               the cool-down: p of stage r (r + 1 of them deferred), r of the other (all deferred)
  dualpipev    the warm-up's end: 2p − r of stage r, r + 1 of the other, or (but on the last rank) one
               fewer of stage r and the other's first B run; the cool-down: p − ⌈r/2⌉ of stage r
               (⌊r/2⌋ + 1 deferred), ⌈r/2⌉ of the other (all deferred)

So a V holds 2p (zbv) or 2p + 1 (dualpipev) micro-batches of half a rank's layers on every rank, where
1F1B holds p − r of all of them: the V's peak is 1F1B's first rank's on every rank, with the head's
on rank 0 only once; deferring W moves the later ranks' peak into the cool-down.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from loom.config import rank_stages, stages_per_rank


@dataclass(frozen=True)
class Chunk:
    """One stage a rank runs, at one moment of its step."""
    stage: int  # its index among the pp·v stages
    live: int  # micro-batches forwarded whose backward has not finished (their saved tensors)
    deferred: int = 0  # of those, the ones whose B ran and W did not (their linears' output gradients too)


Moment = tuple[Chunk, ...]


@functools.lru_cache(maxsize=4096)  # the planner's search asks for the same ranks often
def rank_moments(schedule: str, pp: int, virtual: int, microbatches: int, rank: int) -> tuple[Moment, ...]:
    """The moments at which pipeline rank `rank` can peak, each its stages' counts (module doc)."""
    p, m, r = pp, microbatches, rank
    if p == 1:
        return ((Chunk(0, 1),),)
    stages = rank_stages(r, p, stages_per_rank(schedule, virtual), schedule)
    if schedule == "gpipe":
        return ((Chunk(r, m),),)
    if schedule == "1f1b":
        return ((Chunk(r, min(m, p - r)),),)
    first, last = stages[0], stages[-1]
    if schedule == "zbv":
        return ((Chunk(first, min(m, 2 * p - 1 - r)), Chunk(last, min(m, r + 1), 1)),
                (Chunk(first, min(m, p), min(m, r + 1)), Chunk(last, min(m, r), min(m, r))))
    if schedule == "dualpipev":
        up, down = (r + 1) // 2, r // 2 + 1
        warm = (Chunk(first, min(m, 2 * p - r)), Chunk(last, min(m, r + 1)))
        first_b = (Chunk(first, min(m, 2 * p - 1 - r)), Chunk(last, min(m, r + 1), 1))  # not on the last rank
        cool = (Chunk(first, min(m, p - up), min(m, down)), Chunk(last, min(m, up), min(m, up)))
        return (warm, first_b, cool) if r < p - 1 else (warm, cool)
    v = len(stages)
    per_round = m // max(1, m // p)
    warmup = (v - 1) * per_round + (2 * (p - 1 - r) if schedule == "interleaved" else p - 1)
    live = [0] * v
    for i in range(min(m * v, warmup + 1)):
        live[(i // per_round) % v] += 1
    deferred = [0] * v
    if schedule == "zb":
        deferred[-1] = min(live[-1], r + 1)
    return (tuple(Chunk(s, n, w) for s, n, w in zip(stages, live, deferred)),)


def cross_rank_sends(stages: list[int], total: int) -> tuple[int, int]:
    """(forward, backward) sends per micro-batch of a rank running `stages` of `total`: forward from each
    stage whose next one is on another rank, backward from each whose previous one is (a V's turn
    between stages p − 1 and p stays on its rank). As many receives."""
    forward = sum(s < total - 1 and s + 1 not in stages for s in stages)
    backward = sum(s > 0 and s - 1 not in stages for s in stages)
    return forward, backward


def overlapped_pairs(pp: int, microbatches: int, rank: int) -> int:
    """How many of DualPipeV rank `rank`'s 2m forwards run paired with a backward (torch's OVERLAP_F_B
    actions; as many of its backwards): 2m − 3p + 1 + min(r, p − 2), the fewest on rank 0."""
    return max(0, 2 * microbatches - 3 * pp + 1 + min(rank, pp - 2))


def rule(schedule: str) -> str:
    """The closed form of `rank_moments` for `schedule`, in words (for `loom plan --explain`)."""
    return {
        "gpipe": "m (GPipe: every forward before any backward)",
        "1f1b": "min(m, p − r) (1F1B, rank r)",
        "interleaved": "the first min(m·v, (v−1)·R + 2(p−1−r) + 1) warm-up forwards, R a stage in turn "
                       "(interleaved 1F1B, R = m // max(1, m // p))",
        "zb": "the first min(m·v, (v−1)·R + p) warm-up forwards, R a stage in turn; the last stage's r + 1 "
              "first B's run, their W's deferred (zero bubble, R = m // max(1, m // p))",
        "zbv": "warm-up's end: 2p − 1 − r of stage r, r + 1 of stage 2p − 1 − r; cool-down: p of stage r "
               "(r + 1 W deferred), r of the other (all deferred) (ZB-V)",
        "dualpipev": "warm-up's end: 2p − r of stage r, r + 1 of stage 2p − 1 − r; cool-down: p − ⌈r/2⌉ of "
                     "stage r (⌊r/2⌋ + 1 W deferred), ⌈r/2⌉ of the other (all deferred) (DualPipeV)",
    }[schedule]
