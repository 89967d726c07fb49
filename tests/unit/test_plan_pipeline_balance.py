"""A pipeline runs at its busiest rank's pace. The planner splits the blocks as the run does
(config.stage_sizes), prices the stage holding the most parameters, and times the step on the rank
whose stages run the most FLOPs: the head's (the 1b's 128,256 × 2048 head is three and a half of
its blocks at 4,096 tokens), or rank 0 of a V, which holds both ends."""

from __future__ import annotations

from pathlib import Path

import pytest

from loom.parallel.pipeline import stage_layers
from loom.plan.candidate import Candidate, Workload
from loom.plan.device import load
from loom.plan.hardware import Cluster, lookup
from loom.plan.memory import gpu_memory, stage_memory
from loom.plan.search import estimate
from loom.plan.shapes import from_preset, stage_flops_per_token
from loom.plan.step import busiest_pipeline_rank

PRESETS = ("small", "125m", "1b", "8b", "70b", "mixtral-8x7b", "deepseek-v3")


def test_the_planner_splits_the_blocks_as_the_run_does():
    for n_layers in range(1, 49):
        shape = from_preset("small", n_layers=n_layers)
        for stages in range(1, n_layers + 1):
            run = stage_layers(n_layers, stages)
            assert [shape.stage_layers(s, stages) for s in range(stages)] == [(x[0], len(x)) for x in run]
    shape = from_preset("deepseek-v3")  # 61 blocks
    for stages in (2, 4, 8, 16):
        assert [shape.stage_layers(s, stages) for s in range(stages)] == \
            [(x[0], len(x)) for x in stage_layers(shape.n_layers, stages)]


@pytest.mark.parametrize("name", PRESETS)
def test_the_stages_flops_sum_to_the_models(name):
    shape = from_preset(name)
    for stages in (1, 2, 4, 8):
        if stages <= shape.n_layers:
            assert sum(stage_flops_per_token(shape, 4096, stages)) == \
                pytest.approx(shape.flops_per_token(4096), rel=1e-12)


def _busiest(schedule: str, pp: int = 4, virtual: int = 1, name: str = "1b") -> tuple[int, float]:
    w = Workload(from_preset(name), 4096, 64)
    return busiest_pipeline_rank(w, Candidate("ddp", 1, pp=pp, schedule=schedule, virtual_stages=virtual,
                                              grad_accum=16))


def test_the_head_makes_its_rank_the_busiest():
    shape = from_preset("1b")
    block = 6 * shape.layer_params + 12 * shape.n_heads * shape.head_dim * 4096
    head = 6 * (shape.vocab_size * shape.d_model + shape.d_model)
    total = 16 * block + head
    assert 3 * block < head < 4 * block  # the 1b's head: three and a half of its blocks at 4,096 tokens
    assert _busiest("1f1b") == (3, pytest.approx(4 * (4 * block + head) / total))
    assert _busiest("interleaved", virtual=2) == (3, pytest.approx(4 * (4 * block + head) / total))
    assert _busiest("zbv") == (0, pytest.approx(4 * (4 * block + head) / total))  # stages 0 and 7: both ends
    assert _busiest("1f1b", pp=1) == (0, 1.0)
    # the 70B's head is about one block beside 20 a stage
    assert 1.03 < _busiest("1f1b", name="70b")[1] < 1.06


def test_a_pipeline_step_is_priced_at_its_busiest_rank():
    """On a catalog GPU the same FLOPs per GPU cost `imbalance` times more in a pipeline than under
    data parallelism (the compute fraction does not depend on pp), and the bubble is priced on the
    mean rank's passes."""
    w = Workload(from_preset("1b"), 4096, 64)
    cluster = Cluster(lookup("H100-SXM"), 4, 1)
    flat = estimate(w, Candidate("ddp", 4, grad_accum=16), cluster)["step_time_breakdown_s"]
    for schedule in ("1f1b", "zbv"):
        c = Candidate("ddp", 1, pp=4, schedule=schedule, grad_accum=64)
        piped = estimate(w, c, cluster)["step_time_breakdown_s"]
        _, imbalance = busiest_pipeline_rank(w, c)
        assert piped["compute"] == pytest.approx(imbalance * flat["compute"], rel=1e-9), schedule
    one_f_one_b = estimate(w, Candidate("ddp", 1, pp=4, schedule="1f1b", grad_accum=64), cluster)
    parts = one_f_one_b["step_time_breakdown_s"]
    # 1F1B's (p − 1)/(m + p − 1) of the mean rank's passes, not of the busiest's
    mean_busy = parts["compute"] / busiest_pipeline_rank(w, Candidate("ddp", 1, pp=4, schedule="1f1b",
                                                                      grad_accum=64))[1]
    assert parts["bubble"] == pytest.approx(mean_busy * 3 / 64, rel=1e-9)


def test_the_measured_device_prices_a_vs_rank_0_with_both_ends():
    """On a measured profile (tests/data/device_cpu.json) a V's rank 0 runs the embedding's backward
    and the head beside its blocks: more than 1F1B's last rank, which holds the head alone."""
    from loom.plan.command import local_cluster

    cluster = local_cluster(load(Path(__file__).parents[1] / "data" / "device_cpu.json"), 2)
    w = Workload(from_preset("small", vocab_size=16384, n_layers=8), 128, 16, "fp32")
    times = {s: estimate(w, Candidate("ddp", 1, pp=2, schedule=s, grad_accum=16), cluster)
             ["step_time_breakdown_s"]["compute"] for s in ("1f1b", "zbv")}
    assert times["zbv"] > times["1f1b"]


def test_an_uneven_split_prices_its_fullest_middle_stage():
    """10 blocks over 4 stages: 2, 3, 3, 2 (the extra blocks to the middle); where a block outweighs
    the embedding and the head (the small preset's 256-token vocabulary), stage 1 holds the most
    parameters and gpu_memory prices it."""
    shape = from_preset("small", n_layers=10)
    assert [shape.stage_blocks(s, 4) for s in range(4)] == [2, 3, 3, 2]
    assert shape.priced_stages(4) == [0, 1, 3]
    w = Workload(shape, 128, 16, "fp32")
    c = Candidate("zero1", 1, pp=4, schedule="1f1b", grad_accum=16)
    assert gpu_memory(w, c).total == max(stage_memory(w, c, s).total for s in range(4))
