"""No host synchronization in a steady step's data, forward and backward, on every layout: on a GPU
each one stalls the host until the device drains, and the device idles while the host catches up.

Counted on spawned gloo ranks by bench/host_reads.py (a dispatch mode over the ops that read a
tensor's values on the host: item, _local_scalar_dense, nonzero, is_nonzero; and `Tensor.tolist`,
which reads without the dispatcher), from the third step on. The optimizer's phase is apart: on
CPU the foreach AdamW's step counters are read by the library, on CUDA loom runs the fused one,
which reads nothing. The reads that remain are by design and named per layout: the per-expert
loop's split sizes (CPU's path; CUDA's grouped GEMM, run here in its CPU form, reads none) and
expert parallelism's all-to-all sizes, which torch takes as host lists.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from distributed import run_ranks
from test_strategies import make_config

TINY_MOE = ("model.preset=tiny-moe",)
LORA = ("lora.rank=4",)
# (strategy, world, keys, whether the experts run grouped (CUDA's path), the reads by design)
CASES = {
    "ddp": ("ddp", 2, (), False, {}),
    "zero2": ("zero2", 2, (), False, {}),
    "zero3-lora": ("zero3", 2, LORA, False, {}),
    "tp2-sp": ("zero3", 2, ("parallel.tp=2", "parallel.sequence_parallel=true"), False, {}),
    "cp2": ("zero3", 2, ("parallel.cp=2",), False, {}),
    "pp2": ("zero3", 2, ("parallel.pp=2", "parallel.pp_schedule=1f1b"), False, {}),
    "moe-ep1-grouped": ("zero3", 2, TINY_MOE, True, {}),
    "moe-ep1-lora-grouped": ("zero3", 2, (*TINY_MOE, *LORA), True, {}),
    "moe-ep1-loop": ("zero3", 2, TINY_MOE, False, {"moe.py:forward": 1}),
    "moe-ep2-grouped": ("zero3", 2, (*TINY_MOE, "parallel.ep=2"), True,
                        {"expert_parallel.py:send_to_experts": 1}),
}


def _rank_reads(cfg, grouped: bool) -> dict[str, float]:
    """bench/host_reads.py's count on this rank."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from host_reads import steady_reads

    return steady_reads(cfg, grouped)


@pytest.mark.parametrize("case", list(CASES))
def test_a_steady_step_reads_nothing_on_the_host(corpus, case):
    strategy, world, keys, grouped, by_design = CASES[case]
    cfg = make_config(corpus, strategy, "train.steps=4", "train.grad_accum=1", *keys)
    for rank, reads in enumerate(run_ranks(_rank_reads, world, cfg, grouped)):
        # by design: once per MoE block's forward call (2 blocks; the step's forward calls)
        design = {site: n * 2 for site, n in by_design.items()}
        assert reads == design, f"rank {rank}: host reads per step {reads}"
