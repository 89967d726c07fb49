"""One rank's step peak (issue 39's memory goal, CPU form): `loom train` with ddp on one rank holds what
a hand-written loop over the same model holds, measured by the same tracker (torch's MemTracker, as
loom's memory.json measures a CPU step). With one replica loom runs no DDP: its buckets would keep the
gradients' 4Ψ through the next forward, the step's activation peak, where the plain loop has freed
them (zero_grad(set_to_none=True))."""

from __future__ import annotations

import sys
from pathlib import Path

from in_process import world_of_one

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from loop_memory import BATCH, SEQ, gradient_bytes, loom_peak, plain_loop_peak  # noqa: E402


def test_one_rank_ddp_peaks_as_a_plain_loop(corpus):
    with world_of_one():
        loom = loom_peak(corpus)
    plain = plain_loop_peak()
    assert gradient_bytes() > 0.1 * plain  # the bucket this guards against would show
    said = f"loom {loom / 2**20:.2f} MiB, plain loop {plain / 2**20:.2f} MiB"
    assert abs(loom / plain - 1) < 0.02, said


def test_the_plan_frees_one_replicas_gradients_until_backward():
    """The planner's side: a one-replica ddp (or zero1) step holds its gradients only from backward on,
    so its buffers at the peak are 4Ψ below two replicas' (whose DDP buckets stay allocated); under
    gradient accumulation the later micro-steps hold them, as DDP's do."""
    from loom.plan.candidate import Candidate, Workload
    from loom.plan.memory import stage_memory
    from loom.plan.shapes import from_preset

    w = Workload(from_preset("small"), SEQ, BATCH)
    for strategy in ("ddp", "zero1"):
        one, two = (stage_memory(w, Candidate(strategy, dp, micro_batch=BATCH // dp), 0, device="cpu")
                    for dp in (1, 2))
        assert one.grads == two.grads > 0
        assert two.buffers - one.buffers == one.grads, strategy
    accumulating = stage_memory(w, Candidate("ddp", 1, micro_batch=BATCH // 2, grad_accum=2), 0, device="cpu")
    halves = stage_memory(w, Candidate("ddp", 2, micro_batch=BATCH // 2), 0, device="cpu")
    assert accumulating.buffers >= halves.buffers
