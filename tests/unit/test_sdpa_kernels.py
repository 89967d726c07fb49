"""Grouped k/v heads on the kernel each device runs (loom/parallel/sdpa.py), and the planner's
price of it (loom/plan/shapes.py::attention_kv_width).

CUDA's memory-efficient kernel takes no grouped heads; asked for them where flash cannot run (fp32,
a mask), torch would run the math kernel and keep B·H·T² scores. loom repeats k and v first. That
path is CUDA's, but nothing in it needs CUDA: here the rule is forced on a CPU, the output and
gradients are compared with the grouped call, and autograd's saved bytes with the plan's for CUDA.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_plan_formulas import _saved_bytes, kept_bytes

from loom.models.gpt.config import preset
from loom.models.gpt.model import Block, rope_tables
from loom.parallel import sdpa
from loom.plan.shapes import ModelShape, activation_bytes_per_layer, attention_kv_width


@pytest.fixture
def cuda_rule(monkeypatch):
    """The kernel choice a CUDA device makes for an fp32 run: no fused kernel takes grouped heads."""
    monkeypatch.setattr(sdpa, "takes_grouped_heads", lambda device, dtype, head_dim, masked: False)


def _qkv(heads=4, kv_heads=2, t=24, d=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, n, t, d, generator=g, dtype=dtype, requires_grad=True)
            for n in (heads, kv_heads, kv_heads)]


def _attend_grads(mask: bool):
    q, k, v = _qkv()
    causal = torch.ones(24, 24, dtype=torch.bool).tril()
    out = sdpa.attend(q, k, v, is_causal=not mask, attn_mask=causal[None, None] if mask else None)
    out.square().sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("mask", [False, True], ids=["causal", "mask"])
def test_repeated_heads_give_the_grouped_result(monkeypatch, mask):
    grouped = _attend_grads(mask)
    monkeypatch.setattr(sdpa, "takes_grouped_heads", lambda *a: False)
    repeated = _attend_grads(mask)
    for a, b in zip(grouped, repeated):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_device_rule():
    cpu = torch.device("cpu")
    for dtype in (torch.float32, torch.bfloat16):
        assert sdpa.takes_grouped_heads(cpu, dtype, 64, masked=True)
    cuda = torch.device("cuda")  # the checks before the capability's: no device needed
    assert not sdpa.takes_grouped_heads(cuda, torch.float32, 64, masked=False)
    assert not sdpa.takes_grouped_heads(cuda, torch.bfloat16, 64, masked=True)
    assert not sdpa.takes_grouped_heads(cuda, torch.bfloat16, 512, masked=False)


def test_the_plan_prices_repeated_heads_on_cuda_in_fp32_or_masked():
    shape = ModelShape("m", 100, 2048, 1, 32, 8, 8192)
    assert attention_kv_width(shape, 4, "cpu", masked=True) == attention_kv_width(shape, 2, "cuda") == 512
    assert attention_kv_width(shape, 4, "cuda") == attention_kv_width(shape, 2, "cuda", masked=True) == 2048


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (8, 2)])
def test_a_cuda_fp32_block_keeps_what_the_plan_says(cuda_rule, heads, kv_heads):
    """The block's saved bytes under CUDA's fp32 kernel choice, byte for byte: the repeated k and v
    in place of the grouped ones (the plan for a CPU is short of it by 2·(H − H_kv)·Q·4 a token)."""
    seq, batch, d, f = 32, 2, 64, 192
    cfg = preset("tiny", d_model=d, ffn_hidden=f, n_heads=heads, n_kv_heads=kv_heads, max_seq_len=seq)
    shape = ModelShape("m", 100, d, 1, heads, kv_heads, f)
    torch.manual_seed(0)
    block = Block(cfg)
    x = torch.randn(batch, seq, d, requires_grad=True)
    rope = rope_tables(cfg.head_dim, seq, 10000.0)
    measured = _saved_bytes(block, x, rope, contextlib.nullcontext())
    planned = activation_bytes_per_layer(shape, seq, batch, 4, kv_width=attention_kv_width(shape, 4, "cuda"))
    assert measured == planned
    repeated = 2 * (heads - kv_heads) * cfg.head_dim * 4 * seq * batch
    assert planned - activation_bytes_per_layer(shape, seq, batch, 4) == repeated


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_block_under_documents_keeps_what_the_plan_says(monkeypatch, device, dtype):
    """packing = documents: the mask reaches the kernel as a bias it keeps (e·T a token), and on
    CUDA (the rule forced here) k and v are repeated, as no flash kernel takes a mask."""
    from loom.parallel.context_parallel import Sequence

    if device == "cuda":
        monkeypatch.setattr(sdpa, "takes_grouped_heads", lambda *a: False)
    seq, batch, d, f, heads, kv_heads = 32, 2, 64, 192, 4, 2
    cfg = preset("tiny", d_model=d, ffn_hidden=f, n_heads=heads, n_kv_heads=kv_heads, max_seq_len=seq)
    shape = ModelShape("m", 100, d, 1, heads, kv_heads, f)
    torch.manual_seed(0)
    block = Block(cfg).to(dtype)
    x = torch.randn(batch, seq, d, dtype=dtype, requires_grad=True)
    rope = rope_tables(cfg.head_dim, seq, 10000.0).to(dtype)
    docs = (torch.arange(seq) >= 12).long().expand(batch, seq)  # two documents a sequence
    where = Sequence(torch.arange(seq), docs, None)
    elem = dtype.itemsize
    measured = kept_bytes(lambda: block(x, rope, seq=where), [*block.parameters(), rope])
    measured += rope.untyped_storage().nbytes() if elem == 2 else 0  # FSDP2's cast of the table
    kv = attention_kv_width(shape, elem, device, masked=True)
    planned = activation_bytes_per_layer(shape, seq, batch, elem, kv_width=kv, mask_keys=seq)
    assert measured == planned
    mask = batch * seq * seq * elem
    assert planned - activation_bytes_per_layer(shape, seq, batch, elem, kv_width=kv) == mask
