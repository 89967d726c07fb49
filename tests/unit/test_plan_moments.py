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
