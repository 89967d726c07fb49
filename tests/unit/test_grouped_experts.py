"""The experts as grouped GEMMs (CUDA's path, `torch._grouped_mm`, which has the same product on a
CPU in fp32): its padded row layout, its equality with the per-expert loop (output and every
gradient, with LoRA too), and that it reads nothing on the host, where the loop reads the split
sizes once per block."""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from host_reads import host_reads  # noqa: E402 - bench/ is on the path from here on

from loom.models.gpt import moe
from loom.models.gpt.config import preset
from loom.models.gpt.moe import GROUP_ROWS, MoE, grouped_layout
from loom.models.lora import LoRASpec


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=1, max_size=9), st.sampled_from([1, 4, 8]))
def test_layout_starts_every_expert_aligned_and_keeps_its_rows_in_order(counts, align):
    rows = sum(counts)
    dest, ends, length = grouped_layout(torch.tensor(counts), rows, align)
    assert length == rows + len(counts) * (align - 1)
    padded = [-(-c // align) * align for c in counts]
    assert ends.tolist() == list(torch.tensor(padded).cumsum(0)) if counts else []
    assert ends.dtype == torch.int32 and int(ends[-1]) <= length
    start, first = 0, 0
    for c, p in zip(counts, padded):
        # the expert's rows, in their order, from its aligned start
        assert dest[first:first + c].tolist() == list(range(start, start + c))
        assert start % align == 0
        start, first = start + p, first + c


def _pair(lora: bool = False, **fields) -> tuple[MoE, MoE]:
    cfg = dataclasses.replace(preset("tiny-moe"), **fields)
    torch.manual_seed(0)
    loop = MoE(cfg)
    if lora:
        loop.experts.add_lora(LoRASpec(rank=4, alpha=8.0), ["w1", "w2"])
    for p in loop.parameters():
        torch.nn.init.normal_(p, std=0.3)
    grouped = copy.deepcopy(loop)
    grouped.experts.grouped = torch.float32
    return loop, grouped


@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
@pytest.mark.parametrize("fields", [{}, {"moe_top_k": 1, "moe_experts": 16}], ids=["top2", "top1-of-16"])
def test_grouped_experts_equal_the_loop(lora, fields):
    loop, grouped = _pair(lora, **fields)
    x = torch.randn(2, 16, 64)
    grads = torch.randn(2, 16, 64)
    outs = []
    for block in (loop, grouped):
        xi = x.clone().requires_grad_()
        y = block(xi)
        y.backward(grads)
        outs.append((y, xi.grad, {n: p.grad for n, p in block.named_parameters()}))
    (y0, gx0, g0), (y1, gx1, g1) = outs
    # fp32, summed in another order (the loop's down projection is fused with SwiGLU)
    torch.testing.assert_close(y1, y0, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gx1, gx0, rtol=1e-4, atol=1e-5)
    assert g0.keys() == g1.keys()
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-5, msg=name)
    assert GROUP_ROWS > 1  # the rows were laid out padded, as on CUDA


def test_an_expert_without_rows_gets_a_zero_gradient_on_the_grouped_path():
    _, grouped = _pair()
    rows = torch.randn(10, 64)
    counts = torch.tensor([3, 0, 2, 1, 0, 4, 0, 0])
    grouped.experts(rows, counts).sum().backward()
    w1 = grouped.experts.w1.grad
    assert w1[1].abs().sum() == 0 and w1[0].abs().sum() > 0


def test_the_grouped_block_reads_nothing_on_the_host_the_loop_reads_its_split_sizes():
    loop, grouped = _pair()
    x = torch.randn(2, 16, 64, requires_grad=True)
    for block, reads in ((grouped, 0), (loop, 1)):
        seen = []
        with host_reads(lambda: seen.append(1)):
            block(x).sum().backward()
        assert len(seen) == reads, block.experts.grouped


def test_the_device_picks_the_path(monkeypatch):
    cpu = torch.device("cpu")
    assert moe.grouped_dtype(cpu, torch.bfloat16, 64, 32) is None  # the loop stays for CPUs
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda")
    assert moe.grouped_dtype(cuda, torch.bfloat16, 64, 32) == torch.bfloat16
    assert moe.grouped_dtype(cuda, torch.float32, 64, 32) is None  # the kernel is bf16
    assert moe.grouped_dtype(cuda, torch.bfloat16, 64, 36) is None  # a width not 16-byte aligned
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert moe.grouped_dtype(cuda, torch.bfloat16, 64, 32) is None


@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped"])
def test_the_feed_forward_keeps_what_the_plan_says(grouped):
    """An MoE block's feed-forward, saved bytes against plan/shapes.py's moe_ffn_saved_bytes for each
    path (CUDA's grouped one run here in fp32): the padded rows and the SwiGLU product that w2's
    grouped GEMM keeps, and no copy of the rows or of the combined output kept for a shape (index_copy's
    and index_add's backward would). What the plan leaves out: the routing's int64 indices and fp32
    weights, T·k each, the aux loss's [B, E] and the layout's offsets."""
    from test_plan_formulas import kept_bytes

    from loom.plan.shapes import GROUP_ROWS as PLANNED_ROWS
    from loom.plan.shapes import from_gpt_config, moe_ffn_saved_bytes

    assert PLANNED_ROWS == GROUP_ROWS
    cfg = preset("tiny-moe")
    torch.manual_seed(0)
    block = MoE(cfg)
    for m in block.modules():
        if hasattr(m, "grouped"):
            m.grouped = torch.float32 if grouped else None
    batch, seq = 2, 64
    x = torch.randn(batch, seq, cfg.d_model, requires_grad=True)
    measured = kept_bytes(lambda: block(x), [*block.parameters(), x])
    shape = from_gpt_config(cfg, "tiny-moe")
    planned = moe_ffn_saved_bytes(shape, seq, batch, 4, grouped_experts=cfg.moe_experts if grouped else 0)
    choices = batch * seq * cfg.moe_top_k
    # int64 indices (chosen, order, token; the grouped layout's too), fp32 weights; aux; the offsets
    routing = choices * (5 * 8 + 4) + (batch + 1) * cfg.moe_experts * 4
    assert routing < choices * cfg.expert_hidden * 4  # far below the product the grouped path keeps
    assert 0 <= measured - planned <= routing, (measured, planned)
