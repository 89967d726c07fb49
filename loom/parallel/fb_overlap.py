"""DualPipeV's overlapped forward and backward: under expert parallelism, one micro-batch's forward
runs on the schedule's thread while another's backward runs on a helper thread, so that each one's
expert all-to-alls run while the other computes.

torch's ScheduleDualPipeV pairs, in its steady state, the forward of one of a rank's stages with the
full backward of the other (an OVERLAP_F_B action); with no function registered for that action it
runs the two one after the other, and the all-to-alls stay exposed. Here the two run at once:

- The backward side exchanges over a process group of its own (the same ep ranks, `exchange_group`),
  so each group's all-to-alls are issued by one thread per rank, in that thread's program order, the
  same on every rank of the group, whatever the two threads' timing.
- Where compute issues collectives of its own (tensor or context parallelism), the two sides'
  compute segments (their work between expert exchanges, `exchange_segment`) take turns, the
  forward's first, so those too keep one order on every rank: one side computes while the other
  exchanges. Otherwise the two run free.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function
from torch.distributed.pipelining.schedules import _ComputationType, _wait_batch_p2p

_local = threading.local()  # inside an overlapped action: this thread's side, turns, groups, depth
FORWARD, BACKWARD = "forward", "backward"
TURN_WAIT = "fb_overlap_wait"  # the profiler range of a side waiting for its turn (loom/observe/ledger.py)


class _ComputeTurns:
    """The two sides' compute segments in turns, the forward's first; a side that has finished gives
    the other every turn. A side waits only between its segments, holding no turn."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._done = {FORWARD: 0, BACKWARD: 0}
        self._left: set[str] = set()

    def _my_turn(self, side: str) -> bool:
        other = BACKWARD if side == FORWARD else FORWARD
        mine, theirs = self._done[side], self._done[other]
        return other in self._left or (mine == theirs if side == FORWARD else mine < theirs)

    def begin(self, side: str) -> None:
        with self._cv:
            if not self._my_turn(side):
                with record_function(TURN_WAIT):  # the ledger's: neither compute nor communication
                    self._cv.wait_for(lambda: self._my_turn(side))

    def end(self, side: str) -> None:
        with self._cv:
            self._done[side] += 1
            self._cv.notify_all()

    def leave(self, side: str) -> None:
        with self._cv:
            self._left.add(side)
            self._cv.notify_all()


@contextlib.contextmanager
def exchange_segment() -> Iterator[None]:
    """Marks an exchange (expert all-to-alls): where the compute segments end and begin again for a
    side of an overlapped action with compute turns; nested uses are one exchange (the dispatch's
    counts and rows)."""
    turns = getattr(_local, "turns", None)
    outer = turns is not None and not _local.depth
    if outer:
        turns.end(_local.side)
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1
        if outer:
            turns.begin(_local.side)


def exchange_group(group):
    """The process group this thread exchanges over in place of `group` (the backward side of an
    overlapped action: its own group of the same ranks)."""
    return getattr(_local, "groups", {}).get(group, group)


def _on_this_device(work: Callable[[], None]) -> Callable[[], None]:
    """`work` on this thread's CUDA device and stream, which are per thread: the helper's would be
    device 0 and its default stream (what torch runs for an autograd backward on another thread)."""
    if not torch.cuda.is_initialized():
        return work
    device, stream = torch.cuda.current_device(), torch.cuda.current_stream()

    def there() -> None:
        torch.cuda.set_device(device)
        with torch.cuda.stream(stream):
            work()

    return there


def _side(side: str, turns: _ComputeTurns | None, groups: dict, work: Callable[[], None]) -> None:
    _local.side, _local.turns, _local.groups, _local.depth = side, turns, groups, 0
    try:
        if turns is not None:
            turns.begin(side)
        work()
    finally:
        _local.turns, _local.groups = None, {}
        if turns is not None:
            turns.leave(side)


class OverlapForwardBackward:
    """The function a DualPipeV schedule runs for its OVERLAP_F_B actions (register())."""

    def __init__(self, serial_compute: bool, backward_groups: dict) -> None:
        self.serial_compute = serial_compute
        self.backward_groups = backward_groups  # a group the forward side exchanges over -> the backward's
        self._helper = ThreadPoolExecutor(1, thread_name_prefix="loom-overlap-backward")

    def __call__(self, action, ctx) -> None:
        schedule = ctx.schedule_ref
        kinds = [a.computation_type for a in action.sub_actions]
        if kinds != [_ComputationType.FORWARD, _ComputationType.FULL_BACKWARD]:
            raise RuntimeError(f"DualPipeV's overlapped action {action} holds {kinds}, not a forward and "
                               "a full backward: this torch's schedule is not the one loom overlaps")
        fwd, bwd = action.sub_actions
        stages = {s.stage_index: s for s in schedule._stages}
        fwd_stage, bwd_stage = stages[fwd.stage_index], stages[bwd.stage_index]
        # What torch's own runtime does before each compute (its _perform_action), here on the schedule's
        # thread before the two start: the stages gathered, the neighbours' tensors received.
        for stage in (fwd_stage, bwd_stage):
            schedule._assert_unsharded(stage)
        if not fwd_stage.is_first and fwd.stage_index - 1 not in stages:
            _wait_batch_p2p(schedule.fwd_recv_ops.pop((fwd.stage_index, fwd.microbatch_index)))
        if not bwd_stage.is_last and bwd.stage_index + 1 not in stages:
            _wait_batch_p2p(schedule.bwd_recv_ops.pop((bwd.stage_index, bwd.microbatch_index)))
        schedule.backward_counter[bwd.stage_index] += 1
        last_backward = schedule.backward_counter[bwd.stage_index] == schedule._n_microbatches

        def forward() -> None:
            mb = fwd.microbatch_index
            with record_function(f"PP:{fwd}"):
                output = fwd_stage.forward_one_chunk(mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb],
                                                     save_forward_output=False)
                schedule._maybe_compute_loss(fwd_stage, output, ctx.target_mbs, mb)
            if fwd.stage_index + 1 in stages:  # the V's turn: the next stage is on this rank
                stages[fwd.stage_index + 1].set_local_fwd_input(output, mb)

        def backward() -> None:
            mb = bwd.microbatch_index
            with record_function(f"PP:{bwd}"):
                bwd_stage.backward_one_chunk(mb, loss=schedule._maybe_get_loss(bwd_stage, mb),
                                             full_backward=True, last_backward=last_backward)
            if bwd.stage_index - 1 in stages:
                stages[bwd.stage_index - 1].set_local_bwd_input(bwd_stage.get_local_bwd_output(mb), mb)

        turns = _ComputeTurns() if self.serial_compute else None
        helper = self._helper.submit(_side, BACKWARD, turns, self.backward_groups, _on_this_device(backward))
        try:
            _side(FORWARD, turns, {}, forward)
        finally:
            helper.result()
        _overlapped[0] += 1


_overlapped = [0]


def overlapped_actions() -> int:
    """How many OVERLAP_F_B actions this process has run overlapped (its tests read it)."""
    return _overlapped[0]


def overlaps(p) -> bool:
    """Whether a run of ParallelConfig `p` overlaps forwards and backwards (and a profile of it must
    record the helper thread too)."""
    return p.pp_schedule == "dualpipev" and p.ep > 1 and p.dualpipev_overlap


def twin_group(mesh, dim: str) -> dist.ProcessGroup:
    """A second process group of this rank's ranks along the DeviceMesh's `dim`: every rank makes
    every group of the dim, in one order, as torch's new_group needs."""
    i = mesh.mesh_dim_names.index(dim)
    mine = None
    for ranks in mesh.mesh.movedim(i, -1).reshape(-1, mesh.size(i)).tolist():
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def register(schedule, serial_compute: bool, backward_groups: dict) -> OverlapForwardBackward:
    """Run `schedule`'s (a ScheduleDualPipeV's) OVERLAP_F_B actions overlapped. `serial_compute` where
    compute issues collectives of its own (tensor or context parallelism), which must keep one order;
    `backward_groups`: for each group the expert exchanges use, the backward side's own."""
    overlap = OverlapForwardBackward(serial_compute, backward_groups)
    schedule.register_custom_function(_ComputationType.OVERLAP_F_B, overlap)
    return overlap
