"""parallel.pp_stage_layers: the blocks of each pipeline stage, as given, in the run and in the plan.
An even split leaves the head's stage the busiest (the 1b's head is 3.4 of its blocks at 4,096
tokens); the planner balances the stages by FLOPs, prices the split it chose, and writes it into the
config it emits. A split that cannot run is one line, before launch where the model is known."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from fuzz import FUZZ, must_read
from hypothesis import example, given
from hypothesis import strategies as st

from loom.config import load_config, rank_stages, stage_sizes, stages_per_rank, validate
from loom.errors import ConfigError
from loom.layout import validate_pipeline
from loom.parallel.pipeline import SCHEDULES, stage_layers
from loom.plan.candidate import Candidate, Workload
from loom.plan.hardware import Cluster, lookup
from loom.plan.search import (
    _split_of,
    config_candidate,
    config_workload,
    emit_config,
    estimate,
    record_workload,
    search,
)
from loom.plan.shapes import balanced_split, from_preset, stage_flops_per_token, worthwhile_split
from loom.plan.step import busiest_pipeline_rank


def test_the_split_given_is_the_split_run():
    assert stage_layers(6, 2, 1, [5, 1]) == [[0, 1, 2, 3, 4], [5]]
    assert stage_layers(6, 2, 2, [1, 2, 2, 1]) == [[0], [1, 2], [3, 4], [5]]
    assert stage_layers(6, 2) == [[0, 1, 2], [3, 4, 5]]  # none given: even
    shape = dataclasses.replace(from_preset("1b"), stage_split=(5, 5, 5, 1))
    assert [shape.stage_layers(s, 4) for s in range(4)] == [(0, 5), (5, 5), (10, 5), (15, 1)]
    assert [shape.stage_blocks(s, 2) for s in range(2)] == [8, 8]  # another stage count splits evenly


@pytest.mark.parametrize(("split", "error"), [
    ([3, 1, 1], r"gives 3 stages, but the pipeline runs 2; give 2 block counts"),
    ([4, 0], r"leaves a stage without blocks; give each stage at least one"),
    ([3, 2], r"sums to 5 blocks, but the model has 4; give counts that sum to 4, e.g. \[2, 2\]"),
])
def test_a_split_that_cannot_run_is_one_line(split, error):
    with pytest.raises(ConfigError, match=rf"^parallel.pp_stage_layers = \[[\d, ]+\] {error}"):
        validate_pipeline(4, 2, 1, "1f1b", 2, split=split)


def test_the_stage_count_is_checked_before_launch():
    cfg = load_config(None, ["parallel.pp=2", "parallel.pp_schedule=zbv", "parallel.pp_stage_layers=[3, 1]",
                             "train.device=cpu", "train.batch_size=4", "parallel.strategy=ddp"])
    with pytest.raises(ConfigError, match=r"^parallel.pp_stage_layers = \[3, 1\] gives 2 stages, but pp 2 "
                                          r"× 2 stages per rank \(zbv\) runs 4; give 4 block counts"):
        validate(cfg, 2, cuda_available=False)
    for bad, match in (("[3, 0]", r"= \[3, 0\]: 0 must be ≥ 1 \(each stage holds at least one block\)"),
                       ('["3"]', r"must be a list of integers, got \['3'\]"),
                       ("[true]", r"must be a list of integers"), ("3", r"must be a list of integers")):
        with pytest.raises(ConfigError, match=f"^parallel.pp_stage_layers.*{match}"):
            load_config(None, [f"parallel.pp_stage_layers={bad}"])


def test_a_split_without_a_pipeline_is_said_to_do_nothing():
    from loom.config import inert_settings

    cfg = load_config(None, ["parallel.pp_stage_layers=[1, 1]", "train.device=cpu", "parallel.strategy=ddp"])
    notes = inert_settings(cfg, validate(cfg, 1, cuda_available=False))
    assert notes == ["parallel.pp_stage_layers = [1, 1] has no effect with parallel.pp = 1 (no pipeline)"]


@FUZZ
@example(n_layers=6, pp=2, schedule="1f1b", virtual=1, split=[5, 1])  # valid uneven splits, which random
@example(n_layers=6, pp=2, schedule="zbv", virtual=1, split=[2, 1, 1, 2])  # lists seldom are
@given(n_layers=st.integers(1, 9), pp=st.integers(1, 4), schedule=st.sampled_from(SCHEDULES),
       virtual=st.integers(1, 3), split=st.lists(st.integers(-2, 9), max_size=9))
def test_any_split_runs_as_given_or_is_one_line(n_layers, pp, schedule, virtual, split):
    """Read as `--set` (the config's checks), then against the model (validate_pipeline): accepted, the
    stages hold exactly the blocks given, in order; otherwise one line."""
    sets = [f"parallel.pp={pp}", f"parallel.pp_schedule={schedule}", f"parallel.pp_virtual_stages={virtual}",
            f"parallel.pp_stage_layers={split}", f"parallel.microbatches={4 * pp}", "train.device=cpu",
            f"train.batch_size={4 * pp}", "parallel.strategy=ddp"]

    def check():
        cfg = load_config(None, sets)
        validate(cfg, pp, cuda_available=False)
        p = cfg.parallel
        validate_pipeline(n_layers, pp, p.pp_virtual_stages, p.pp_schedule, 4 * pp, split=p.pp_stage_layers)
        return p

    p = must_read(check)
    if p is None or pp == 1:
        return
    stages = stage_layers(n_layers, pp, stages_per_rank(schedule, virtual), p.pp_stage_layers)
    assert [i for stage in stages for i in stage] == list(range(n_layers))
    if split:
        assert [len(stage) for stage in stages] == split


def test_the_balanced_split_takes_blocks_off_the_heads_stage():
    shape = from_preset("1b")
    assert balanced_split(shape, 4096, 4, "1f1b", 1) == (5, 5, 5, 1)
    assert balanced_split(shape, 4096, 4, "zbv", 2)[::7] == (1, 1)  # a V: both ends on rank 0
    w = Workload(shape, 4096, 64)
    c = Candidate("ddp", 1, pp=4, schedule="1f1b", grad_accum=16)
    even = busiest_pipeline_rank(w, c)
    balanced = busiest_pipeline_rank(dataclasses.replace(w, shape=dataclasses.replace(
        shape, stage_split=(5, 5, 5, 1))), c)
    assert even[1] > 1.5 and balanced[1] < 1.05  # the busiest rank's FLOPs over the mean's


def _compositions(n: int, k: int):
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        yield [b - a for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize("name", ["small", "125m", "1b", "tiny-moe"])
@pytest.mark.parametrize(("pp", "schedule", "virtual"),
                         [(2, "1f1b", 1), (3, "1f1b", 1), (4, "gpipe", 1), (2, "zbv", 2),
                          (2, "interleaved", 2)])
def test_the_balanced_split_is_the_best_there_is(name, pp, schedule, virtual):
    """Against every split of the blocks: no other leaves its busiest rank fewer FLOPs."""
    per = stages_per_rank(schedule, virtual)
    owner = {s: r for r in range(pp) for s in rank_stages(r, pp, per, schedule)}
    for n_layers in (6, 8, 10):
        for seq in (128, 4096):
            shape = dataclasses.replace(from_preset(name), n_layers=n_layers)

            def busiest(sizes) -> float:
                split = dataclasses.replace(shape, stage_split=tuple(sizes))
                flops = stage_flops_per_token(split, seq, pp * per)
                return max(sum(f for s, f in enumerate(flops) if owner[s] == r) for r in range(pp))

            best = min(busiest(sizes) for sizes in _compositions(n_layers, pp * per))
            split = balanced_split(shape, seq, pp, schedule, virtual)
            assert busiest(split or stage_sizes(n_layers, pp * per)) == pytest.approx(best, rel=1e-12)
            assert not split or busiest(split) < busiest(stage_sizes(n_layers, pp * per))


def test_the_plan_runs_the_split_it_emits():
    """The search's pipelines price the balanced split, label it, and emit it; the emitted config,
    planned again as `loom train` plans it, gives the same step and memory."""
    cluster = Cluster(lookup("H100-SXM"), 4)
    w = Workload(from_preset("1b"), 4096, 64)
    plan = search(w, cluster)
    piped = [r for r in plan.candidates if r["pp"] == 4 and r["pp_schedule"] == "1f1b" and r["runs_in_loom"]]
    assert piped and all(r["pp_stage_layers"] == [5, 5, 5, 1] for r in piped)
    record = min(piped, key=lambda r: r["step_time_s"])
    assert " blocks 5/5/5/1" in record["label"]
    cfg = emit_config(load_config(None, ["model.preset=1b", "data.seq_len=4096", "train.batch_size=64",
                                         "train.precision=bf16"]), record)
    assert cfg.parallel.pp_stage_layers == [5, 5, 5, 1]
    again = config_workload(cfg, from_preset("1b"))
    assert again.shape.stage_split == (5, 5, 5, 1) == record_workload(w, record).shape.stage_split
    priced = estimate(again, config_candidate(cfg, 1, record["dp"], record["tp"], 4), cluster)
    assert priced["step_time_s"] == pytest.approx(record["step_time_s"], rel=1e-9)
    assert priced["memory_bytes"]["total"] == pytest.approx(record["memory_bytes"]["total"], rel=1e-9)


def test_the_even_split_stays_where_the_balanced_breaks_the_headroom():
    """The balanced split's extra blocks sit on earlier ranks, which hold more micro-batches in flight:
    where that breaks the headroom rule and the even split keeps it, the even split is priced."""
    from loom.plan.memory import gpu_memory
    from loom.plan.search import TIGHT, with_split

    w = Workload(from_preset("8b"), 4096, 32)
    c = Candidate("ddp", 1, pp=2, schedule="1f1b", grad_accum=16)
    split = balanced_split(w.shape, 4096, 2, "1f1b", 1)
    assert split == (17, 15)  # rank 0, two micro-batches in flight, takes a block off the head's
    even, balanced = gpu_memory(w, c).total, gpu_memory(with_split(w, split), c).total
    assert balanced > even
    between = (even + balanced) / 2 / TIGHT / 1e9  # GB: a device whose headroom lies between the two
    gpu = dataclasses.replace(lookup("H100-SXM"), memory_gb=between)
    assert _split_of(w, c, Cluster(gpu, 2), "cuda")[0].shape.stage_split == ()
    roomy = dataclasses.replace(lookup("H100-SXM"), memory_gb=2 * between)
    chosen, mem = _split_of(w, c, Cluster(roomy, 2), "cuda")
    assert chosen.shape.stage_split == split and mem.total == balanced  # its memory, priced once


def test_launch_says_the_blocks_and_the_split_worth_trying():
    """`loom train` (and --dry-run) prints each stage's blocks, and the balanced split where its busiest
    rank runs 5% less or more; not once that split is the one given."""
    from loom.plan.step import pipeline_text

    sets = ["model.preset=1b", "model.tie_embeddings=false", "parallel.pp=4", "data.seq_len=4096"]
    cfg = load_config(None, sets)
    text = pipeline_text(cfg, from_preset("1b"))
    assert text.endswith("; blocks per stage 4/4/4/4; the busiest rank runs 1.52× the mean rank's FLOPs, "
                         "1.03× with parallel.pp_stage_layers = [5, 5, 5, 1]")
    given = load_config(None, [*sets, "parallel.pp_stage_layers=[5, 5, 5, 1]"])
    given = pipeline_text(given, from_preset("1b"))
    assert given.endswith("; blocks per stage 5/5/5/1")
    small = pipeline_text(load_config(None, ["model.preset=small", "parallel.pp=2"]), from_preset("small"))
    assert small.endswith("; blocks per stage 2/2")  # a 256-token vocabulary: nothing worth moving


def test_a_split_is_offered_where_it_takes_five_percent_off_the_busiest_rank():
    """The 70B's head is a block's worth beside 20 a stage: balancing gains 1%, within what a FLOPs count
    can tell, so neither the search nor launch offers it (nor labels the record); the 1b's gains a third."""
    assert balanced_split(from_preset("70b"), 4096, 4, "1f1b", 1) == (20, 20, 21, 19)
    assert worthwhile_split(from_preset("70b"), 4096, 4, "1f1b", 1) == ()
    assert worthwhile_split(from_preset("1b"), 4096, 4, "1f1b", 1) == (5, 5, 5, 1)
    plan = search(Workload(from_preset("70b"), 4096, 64), Cluster(lookup("H100-SXM"), 8, 4))
    piped = [r for r in plan.candidates if r["pp"] == 4 and r["pp_schedule"] == "1f1b"]
    assert piped and not any(r["pp_stage_layers"] for r in piped)
