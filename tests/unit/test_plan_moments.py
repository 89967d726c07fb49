"""Moments of the step the planner compares (loom/plan/memory.py _step_peak), by hand, for FSDP2 with
a unit per block: what zero2 and zero3 hold while the head's gradient is reduce-scattered, and at
the topmost block's all-gather for its backward (measured on gloo ranks:
tests/distributed/test_plan_measured.py, the units and blocks cases)."""

from __future__ import annotations

import dataclasses

import pytest

from loom.plan.candidate import Candidate, Workload
from loom.plan.memory import stage_memory
from loom.plan.shapes import ModelShape, head_backward_bytes

SHAPE = ModelShape("units", vocab_size=8192, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=512)


def moments(strategy: str, device: str = "cpu", tie: bool = False) -> tuple[dict, Candidate]:
    shape = dataclasses.replace(SHAPE, tie_embeddings=tie)
    w = Workload(shape, 32, 4, "fp32", "torch")
    c = Candidate(strategy, 2, micro_batch=2, grad_accum=1, fsdp_unit_mb=0)
    named: list = []
    stage_memory(w, c, 0, 0.0, device, moments=named)
    return {name: (act, buf) for name, act, buf in named}, c


def test_zero2_reduce_scatters_the_head_beside_every_other_unit_gathered():
    zero2, c = moments("zero2")
    zero3, _ = moments("zero3")
    units = c.fsdp_unit_params(SHAPE, SHAPE.n_layers)
    others = 4 * (sum(units) - units[-1])  # fp32: every unit but the head's, resharded first
    assert zero2["head reduce-scatter"][0] == zero3["head reduce-scatter"][0]
    assert zero2["head reduce-scatter"][1] - zero3["head reduce-scatter"][1] == pytest.approx(others)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_head_reduce_scatter_holds_the_head_weight_gradient_and_writes_its_shard(device):
    """zero3: the head's unit resharded, the other sharded gradients not rebuilt; the fp32 input (gloo:
    and its copy), the head weight's gradient (the unit's last parameter, kept by FSDP2's foreach_reduce
    to its end) and the head's sharded gradient written (measured on gloo: tests/distributed/
    test_plan_measured.py, zero2-units, 1.39 of the plan without the last two)."""
    zero3, c = moments("zero3", device)
    units = c.fsdp_unit_params(SHAPE, SHAPE.n_layers)
    grads = 4 * sum(units) / 2  # the sharded gradients at rest, none rebuilt yet
    weight = SHAPE.vocab_size * SHAPE.d_model
    inputs = (8 if device == "cpu" else 4) * units[-1]
    expected = inputs + 4 * weight + 4 * units[-1] / 2 - grads
    assert zero3["head reduce-scatter"][1] == pytest.approx(expected)


@pytest.mark.parametrize("device,copies", [("cpu", 4), ("cuda", 3)])
def test_zero3_all_gathers_the_top_block_for_its_backward(device, copies):
    """The all-gather's output, the unit's unsharded copy and the next unit's prefetched output
    (gloo: its own copy of the output too) beside the activations the loss left."""
    zero3, c = moments("zero3", device)
    units = c.fsdp_unit_params(SHAPE, SHAPE.n_layers)
    act, buf = zero3["block backward"]
    assert act == zero3["head reduce-scatter"][0]  # the loss and the head done
    held = zero3["loss"][1] - 4 * units[-1]  # the loss moment's buffers less the head's unit, resharded
    assert buf == pytest.approx(held + copies * 4 * units[-2])
    assert "block backward" not in moments("zero2", device)[0]  # zero2 gathers nothing again


def test_the_final_norm_backward_holds_its_temporaries_beside_the_head_gradient():
    """After the head's backward: the loss's tensors gone, the norm's input gradient (compute dtype)
    and four fp32 [s·b, h] temporaries; the head weight's gradient still held."""
    named, _ = moments("ddp")

    logits_grad, _ = head_backward_bytes(SHAPE, 32, 2, 4)
    rows = 32 * 2 * SHAPE.d_model
    norm = named["head backward"][0] - logits_grad + rows * (16 + 4)
    assert named["final norm backward"][0] == pytest.approx(norm)
    assert named["final norm backward"][1] == named["head backward"][1]


def pipeline_moments(strategy: str, stage: int) -> tuple[dict, Candidate]:
    w = Workload(SHAPE, 32, 8, "fp32", "torch")
    c = Candidate(strategy, 2, pp=2, schedule="1f1b", micro_batch=1, grad_accum=4, fsdp_unit_mb=0)
    named: list = []
    stage_memory(w, c, stage, 0.0, "cpu", moments=named)
    return {name: (act, buf) for name, act, buf in named}, c


def test_a_pipeline_reduces_its_first_unit_beside_the_later_units_gathered_with_their_gradients():
    """Stage 0 (the embedding and two blocks, a unit each) reduces after its last backward, the embedding
    first: resharded, its fp32 input, gloo's copy, its gradient (held) and the shard it writes, beside the
    blocks gathered with their unsharded gradients; no gradient rebuilt yet (measured on gloo ranks:
    tests/distributed/test_plan_measured.py, pp2-zero3-units)."""
    named, c = pipeline_moments("zero3", 0)
    units = c.fsdp_unit_params(SHAPE, 2, first=True, last=False)
    emb, blocks = units[0], sum(units[1:])
    assert emb == SHAPE.vocab_size * SHAPE.d_model
    grads = 4 * sum(units) / 2
    expected = 8 * emb + 4 * emb + 4 * emb / 2 + 4 * blocks + 4 * blocks - grads
    receive = named["at rest"][1]  # the pipeline's receive buffers, in every moment
    assert named["pipeline reduce-scatter"] == (0.0, pytest.approx(expected + receive))


def test_a_pipeline_last_stage_reduce_scatters_no_head_in_its_backward():
    named, _ = pipeline_moments("zero3", 1)
    assert "head reduce-scatter" not in named and "pipeline reduce-scatter" in named
    assert "head reduce-scatter" in moments("zero3")[0]


def tp_moments(tie: bool) -> tuple[dict, Candidate, ModelShape]:
    shape = dataclasses.replace(SHAPE, tie_embeddings=tie)
    w = Workload(shape, 32, 4, "fp32", "torch")
    c = Candidate("zero3", 2, tp=2, micro_batch=2, grad_accum=1, fsdp_unit_mb=0)
    named: list = []
    stage_memory(w, c, 0, 0.0, "cpu", moments=named)
    return {name: (act, buf) for name, act, buf in named}, c, shape


def test_under_tp_the_embedding_gradient_is_whole_over_the_vocabulary_then_sliced():
    """DTensor's embedding backward makes the weight's gradient Replicate ([V, h] on every TP rank), and
    FSDP2 slices it to the weight's shard, a copy, at the end of backward: beside the embedding's unit
    (gathered) and the first block's reduce-scatter input; the embedding's own sharded gradient not
    rebuilt yet (measured on gloo ranks: tests/distributed/test_plan_measured.py, tp2-zero3-units)."""
    named, c, shape = tp_moments(False)
    units = c.fsdp_unit_params(shape, shape.n_layers)
    vh = shape.vocab_size * shape.d_model / 2  # a TP rank's rows of the embedding
    block = (units[1] - 2 * shape.d_model) / 2 + 2 * shape.d_model  # its norms' gains whole on a TP rank
    expected = 4 * vh * 2 + 4 * vh + 4 * vh + 4 * block - 4 * vh / 2
    assert named["embedding gradient"] == (0.0, pytest.approx(expected))


def test_under_tp_a_tied_embedding_adds_its_whole_gradient_sliced_to_the_head_shard():
    """Tied: the embedding's backward adds its gradient to the head's, the whole one (Replicate) sliced to
    the head's shard first: the head's, the whole, the slice and their sum, beside the root gathered (the
    weight and the final norm) with its norm's gradient and the first block's reduce-scatter input; the
    root's sharded gradient not rebuilt yet (measured: tp2-zero3-units-tied)."""
    named, c, shape = tp_moments(True)
    units = c.fsdp_unit_params(shape, shape.n_layers)
    vh = shape.vocab_size * shape.d_model / 2
    root = vh + shape.d_model
    block = (units[0] - 2 * shape.d_model) / 2 + 2 * shape.d_model
    expected = 4 * vh * (1 + 2 + 1 + 1) + 4 * root + 4 * (root - vh) + 4 * block - 4 * root / 2
    assert named["tied embedding"] == (0.0, pytest.approx(expected))
    assert "embedding gradient" not in named


def test_gpipe_last_head_backward_has_every_unit_gathered():
    """GPipe runs every micro-batch's forward first, so no forward reshards a unit after the first
    backward: the last micro-batch's head backward holds every unit gathered, where 1F1B's holds the
    head's alone (its forwards in between reshard the blocks) (measured: pp2-gpipe-zero3-units); and
    beside the stage's accumulated unsharded gradients, which the first backward's head backward has
    not made yet (measured on gloo, zero3 pp 2: 0.87 of the plan that held them there)."""
    w = Workload(SHAPE, 32, 8, "fp32", "torch")
    named = {}
    for schedule in ("gpipe", "1f1b"):
        c = Candidate("zero3", 2, pp=2, schedule=schedule, micro_batch=1, grad_accum=4, fsdp_unit_mb=0)
        got: list = []
        stage_memory(w, c, 1, 0.0, "cpu", moments=got)
        named[schedule] = {name: (act, buf) for name, act, buf in got}
    units = c.fsdp_unit_params(SHAPE, 2, first=False, last=True)
    gp = named["gpipe"]
    accumulated = 4 * sum(units)  # fp32, the stage's whole
    assert gp["gpipe head backward"][1] - gp["head backward"][1] == pytest.approx(4 * sum(units[:-1])
                                                                                   + accumulated)
    assert "gpipe head backward" not in named["1f1b"]


def test_a_later_micro_step_reduces_the_head_beside_the_shards_the_earlier_left():
    """Reducing every micro-step, the second's head reduce-scatter writes its output beside the sharded
    gradients the first left (it is added to them after): the same moment as one micro-step's plus those
    gradients (measured on gloo, zero2 with a unit per module and grad_accum 2: 1.10 of the plan when
    the output was counted only where no gradient existed yet)."""
    w = Workload(SHAPE, 32, 4, "fp32", "torch")
    buffers = {}
    for accum in (1, 2):
        c = Candidate("zero2", 2, micro_batch=1, grad_accum=accum, fsdp_unit_mb=0)
        named: list = []
        stage_memory(w, c, 0, 0.0, "cpu", moments=named)
        buffers[accum] = {name: buf for name, _, buf in named}["head reduce-scatter"]
    grads = 4 * sum(c.fsdp_unit_params(SHAPE, SHAPE.n_layers)) / 2
    assert buffers[2] - buffers[1] == pytest.approx(grads)
