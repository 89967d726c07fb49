"""The loss the planner picks (issue 39): loom chunks its loss (train.loss_chunk) and makes the gradients
in forward, which costs no matmul; under GPipe and the split-backward schedules a chunk's logits are
computed again in backward, and there the search runs the full logits where they fit under the
headroom rule (search._loss_of), pricing the recompute where they do not."""

from __future__ import annotations

import dataclasses

import pytest

from loom.config import load_config
from loom.plan.candidate import Candidate, Workload, head_recomputed
from loom.plan.efficiency import compute_fraction
from loom.plan.explain import candidate_of, explain
from loom.plan.hardware import Cluster, lookup
from loom.plan.search import TIGHT, emit_config, estimate, record_workload, search, with_split
from loom.plan.shapes import from_preset

SHAPE = from_preset("1b")
H100 = lookup("H100-SXM")
CHUNKED = Workload(SHAPE, 2048, 64, loss_chunk=512)


@pytest.mark.parametrize("schedule, pp, chunk, recomputed", [
    ("gpipe", 2, 512, True), ("zb", 2, 512, True), ("zbv", 2, 512, True), ("dualpipev", 2, 512, True),
    ("1f1b", 2, 512, False), ("interleaved", 2, 512, False), ("gpipe", 2, 0, False), ("none", 1, 512, False),
])
def test_which_schedules_recompute_the_chunked_loss(schedule, pp, chunk, recomputed):
    c = Candidate("ddp", 8 // pp, pp=pp, schedule=schedule, virtual_stages=2 if schedule == "zb" else 1,
                  grad_accum=8)
    assert head_recomputed(dataclasses.replace(CHUNKED, loss_chunk=chunk), c) is recomputed


def test_the_recompute_is_one_head_matmul_per_micro_batch_on_the_last_stage():
    """GPipe, chunked against the full logits: the step's recompute differs by micro-batches ×
    2·s·b·h·V/tp at the compute rate, and nothing else of the time does."""
    cluster = Cluster(H100, 8, 1)
    c = Candidate("ddp", 2, tp=2, pp=2, schedule="gpipe", micro_batch=2, grad_accum=16)
    chunked = estimate(CHUNKED, c, cluster)["step_time_breakdown_s"]
    full = estimate(dataclasses.replace(CHUNKED, loss_chunk=0), c, cluster)["step_time_breakdown_s"]
    rate = H100.bf16_tflops * 1e12 * compute_fraction(H100, SHAPE, 2)
    want = 16 * 2 * (2 * 2048) * SHAPE.d_model * SHAPE.vocab_size / 2 / rate
    assert chunked["recompute"] - full["recompute"] == pytest.approx(want, rel=1e-9)
    assert chunked["compute"] == full["compute"] and chunked["optimizer"] == full["optimizer"]
    one = dataclasses.replace(c, schedule="1f1b")  # the gradients made in forward: no recompute
    assert estimate(CHUNKED, one, cluster)["step_time_breakdown_s"]["recompute"] == 0


@pytest.mark.parametrize("memory_gb", [80, 48])
def test_the_search_takes_the_full_logits_only_under_the_headroom(memory_gb):
    """Each recomputing candidate runs the full logits exactly when they fit under TIGHT of the GPU (then
    it is faster and its label says so); every other candidate keeps the config's chunk."""
    gpu = dataclasses.replace(H100, memory_gb=memory_gb)
    cluster = Cluster(gpu, 8, 1)
    plan = search(CHUNKED, cluster)
    kinds = set()
    for record in plan.candidates[::7]:  # a sample: pricing twice is the slow part
        c = candidate_of(record)
        if not head_recomputed(CHUNKED, c):
            assert not record["full_logits"] and "logits" not in record["label"]
            continue
        split = with_split(CHUNKED, tuple(record["pp_stage_layers"]))  # the stages as the search split them
        full = estimate(dataclasses.replace(split, loss_chunk=0), c, cluster)
        roomy = full["memory_bytes"]["total"] <= TIGHT * memory_gb * 1e9
        assert record["full_logits"] is roomy and record["label"].endswith(" full logits") is roomy
        chunked = estimate(split, c, cluster)
        assert record["step_time_s"] == (full if roomy else chunked)["step_time_s"]
        assert full["step_time_s"] < chunked["step_time_s"]
        assert record_workload(CHUNKED, record).loss_chunk == (0 if roomy else 512)
        kinds.add(roomy)
    assert kinds == {True, False}  # both kinds happen on each GPU size


def test_emit_writes_the_chosen_loss_and_explain_prices_it():
    plan = search(CHUNKED, Cluster(H100, 8, 1))
    full = next(i for i, r in enumerate(plan.candidates) if r["full_logits"] and r["runs_in_loom"])
    chunked = next(i for i, r in enumerate(plan.candidates)
                   if not r["full_logits"] and r["runs_in_loom"] and r["pp"] > 1)
    base = load_config(None)
    assert emit_config(base, plan.candidates[full]).train.loss_chunk == 0
    assert emit_config(base, plan.candidates[chunked]).train.loss_chunk == base.train.loss_chunk
    for index in (full, chunked):
        text = explain(plan, index)
        assert "✗" not in text and "✓" in text
        record = plan.candidates[index]
        assert ("loss recompute" in text) is (not record["full_logits"] and head_recomputed(
            CHUNKED, candidate_of(record)))
        assert ("loss: the full logits" in text) is record["full_logits"]
