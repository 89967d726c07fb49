"""The planner's micro-batches in flight (loom/plan/in_flight.py) against torch's own schedules: each
rank's action order, as torch.distributed.pipelining builds it, walked action by action as torch runs
it (a forward keeps its micro-batch's tensors; a full backward frees them; B, the input gradient, keeps
them, the graph retained, and adds its linears' output gradients; W frees both). The largest of the
planner's moments must be the walk's peak, whatever a deferred W weighs against a live micro-batch."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.pipelining.schedules import _ComputationType as Kind

from loom.config import rank_stages, stages_per_rank
from loom.parallel.pipeline import _CLASSES
from loom.plan.in_flight import Chunk, overlapped_pairs, rank_moments


class _StageShape:
    """What torch's multi-stage schedules read of a stage to build their action orders."""

    def __init__(self, index: int, num_stages: int, pp: int, rank: int) -> None:
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, num_stages, pp, rank
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.stage_index_to_group_rank: dict = {}
        self.submod, self.device, self.has_backward = torch.nn.Identity(), torch.device("cpu"), True


def _torch_order(schedule: str, pp: int, virtual: int, m: int, rank: int) -> tuple[list[int], list]:
    v = stages_per_rank(schedule, virtual)
    stages = rank_stages(rank, pp, v, schedule)
    shapes = [_StageShape(s, pp * v, pp, rank) for s in stages]
    built = _CLASSES[schedule](shapes, n_microbatches=m, loss_fn=lambda out, target: out)
    return stages, built.pipeline_order[rank]


def _peak(stages: list[int], actions: list, w_weight: float) -> float:
    """The largest, over the rank's actions, of its live micro-batches plus `w_weight` per deferred W."""
    live, deferred = dict.fromkeys(stages, 0), dict.fromkeys(stages, 0)
    peak = 0.0
    for action in actions:
        if action is None:
            continue
        for a in (action.sub_actions if action.computation_type == Kind.OVERLAP_F_B else [action]):
            kind, s = a.computation_type, a.stage_index
            if kind == Kind.FORWARD:
                live[s] += 1
            elif kind == Kind.FULL_BACKWARD:
                live[s] -= 1
            elif kind == Kind.BACKWARD_INPUT:
                deferred[s] += 1
            elif kind == Kind.BACKWARD_WEIGHT:
                live[s], deferred[s] = live[s] - 1, deferred[s] - 1
            peak = max(peak, sum(live.values()) + w_weight * sum(deferred.values()))
    return peak


def _planned(moments: tuple, w_weight: float) -> float:
    return max(sum(ch.live + w_weight * ch.deferred for ch in moment) for moment in moments)


CASES = [(schedule, p, v, m)
         for schedule, virtuals in (("interleaved", (1, 2, 3)), ("zb", (1, 2, 3)), ("zbv", (2,)),
                                    ("dualpipev", (2,)))
         for v in virtuals
         for p, m in ((2, 4), (2, 6), (3, 6), (4, 4), (4, 6), (4, 8), (4, 16), (8, 16), (8, 32))
         if not (schedule in ("zbv", "dualpipev") and m < 2 * p)]  # a V needs m ≥ 2p (loom refuses less)


@pytest.mark.parametrize("schedule,p,v,m", CASES)
def test_in_flight_peaks_match_torch_orders(schedule: str, p: int, v: int, m: int) -> None:
    for rank in range(p):
        stages, actions = _torch_order(schedule, p, v, m, rank)
        moments = rank_moments(schedule, p, v, m, rank)
        assert all([ch.stage for ch in moment] == stages for moment in moments)
        for w_weight in (0.1, 0.5, 0.8, 1.0, 1.5, 3.0, 20.0):  # a deferred W's output gradients: ~0.5 dense
            assert _planned(moments, w_weight) == pytest.approx(_peak(stages, actions, w_weight)), \
                (rank, w_weight)


def test_single_stage_schedules() -> None:
    assert [rank_moments("1f1b", 4, 1, 16, r) for r in range(4)] == [((Chunk(r, 4 - r),),) for r in range(4)]
    assert rank_moments("1f1b", 4, 1, 2, 0) == ((Chunk(0, 2),),)
    assert rank_moments("gpipe", 4, 1, 16, 3) == ((Chunk(3, 16),),)
    assert rank_moments("1f1b", 1, 1, 8, 0) == ((Chunk(0, 1),),)


def test_a_v_holds_the_head_once_on_rank_0() -> None:
    # rank 0 runs the first stage and the last: 2p − 1 of the first's micro-batches, one of the last's
    warm, cool = rank_moments("zbv", 4, 1, 16, 0)
    assert warm == (Chunk(0, 7), Chunk(7, 1, 1))
    assert rank_moments("zbv", 4, 1, 16, 3)[1] == (Chunk(3, 4, 4), Chunk(4, 3, 3))  # the cool-down's W's
    assert rank_moments("dualpipev", 4, 1, 16, 0)[0] == (Chunk(0, 8), Chunk(7, 1))


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("extra", [0, 1, 5, 16])
def test_dualpipev_overlapped_pairs_match_torch_orders(p: int, extra: int) -> None:
    """DualPipeV's OVERLAP_F_B actions per rank, as torch builds them (the planner's share of each
    rank's passes that can hide the expert all-to-alls, loom/plan/step.py's _ep_exposed)."""
    m = 2 * p + extra
    for rank in range(p):
        actions = _torch_order("dualpipev", p, 2, m, rank)[1]
        pairs = sum(a.computation_type == Kind.OVERLAP_F_B for a in actions)
        assert overlapped_pairs(p, m, rank) == pairs, (p, m, rank)
    assert min(overlapped_pairs(p, m, r) for r in range(p)) == overlapped_pairs(p, m, 0)
