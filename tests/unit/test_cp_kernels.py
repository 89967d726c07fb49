"""Context parallelism's attention pieces, checked the way a GPU would run them, on a CPU.

bench/cp_pieces.py simulates every rank of a cp ring in one process with loom's own piece
functions and compares output and gradients with one SDPA over the whole sequence. Here it runs
with the CPU's flash kernel, and with `EfficientKernel`: CUDA's memory-efficient kernel as its
contract reads — what it assumes of its inputs beyond their shapes — emulated in plain torch. That
contract is what loom got wrong on its first GPU (bf16 dq/dk off by more than their size, NaN with
documents) while every CPU test passed: the half-precision backward reads its output's rows as if
they lay H·D elements apart, whatever the strides say."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import cp_pieces  # noqa: E402

from loom.parallel import context_parallel as C  # noqa: E402


def _padded_rows(m: int) -> int:
    return -(-m // 32) * 32


class EfficientKernel:
    """torch.ops.aten._scaled_dot_product_efficient_attention and its backward, as the CUDA kernel
    behaves: an [B, T, H, D] output seen as [B, H, T, D]; a logsumexp with its rows padded to 32
    (garbage there); a bias whose rows must start 16-byte aligned; k/v with q's heads; rows that see
    no key come out NaN; and the half-precision backward's rowsum(dO·O), which reads O's rows H·D
    apart from the pointer it is given, ignoring O's strides. fp32 math on a CPU."""

    def forward(self, q, k, v, bias, compute_lse, dropout_p, is_causal):
        b, h, m, d = q.shape
        assert compute_lse and dropout_p == 0.0
        if k.shape[1] != h or v.shape[1] != h:
            raise RuntimeError("efficient attention: k/v must have q's heads")
        scores = self._scores(q, k, bias, is_causal)
        lse = torch.logsumexp(scores, -1)  # −inf where a row sees no key
        out = (torch.exp(scores - lse[..., None]) @ v.float()).to(q.dtype)  # NaN on such rows
        padded = torch.full((b, h, _padded_rows(m)), float("nan"))
        padded[..., :m] = lse
        return out.transpose(1, 2).contiguous().transpose(1, 2), padded, torch.empty(()), torch.empty(())

    def backward(self, grad, q, k, v, bias, out, lse, seed, offset, dropout_p, grad_input_mask, is_causal):
        b, h, m, d = q.shape
        if lse.shape[-1] != _padded_rows(m):
            raise RuntimeError("efficient attention backward: logsumexp rows not padded as its forward's")
        rows_apart = torch.as_strided(out, (b, h, m, v.shape[-1]), (out.stride(0), out.stride(1),
                                                                   h * v.shape[-1], 1), out.storage_offset())
        delta = (grad.float() * rows_apart.float()).sum(-1, keepdim=True)
        p = torch.exp(self._scores(q, k, bias, is_causal) - lse[..., :m, None])
        dv = p.transpose(-1, -2) @ grad.float()
        ds = p * (grad.float() @ v.float().transpose(-1, -2) - delta) * d**-0.5
        dq, dk = ds @ k.float(), ds.transpose(-1, -2) @ q.float()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None

    @staticmethod
    def _scores(q, k, bias, is_causal):
        if bias is not None and bias.stride(-2) % (16 // bias.element_size()):
            raise RuntimeError("attn_bias is not correctly aligned (strideM)")
        scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
        if bias is not None:
            scores = scores + bias.float()
        if is_causal:
            m, n = scores.shape[-2:]
            scores = scores.masked_fill(torch.ones(m, n, dtype=torch.bool).triu(1), float("-inf"))
        return scores


@pytest.fixture
def efficient_kernel(monkeypatch):
    """CPU tensors take the (emulated) CUDA path."""
    emulated = EfficientKernel()
    monkeypatch.setitem(C._KERNELS, "cpu", C._Efficient(emulated.forward, emulated.backward))


def _failures(results: dict) -> dict:
    return {case: r for case, r in results.items() if not r["ok"]}


def test_the_emulation_is_attention():
    """The emulated kernel, called as SDPA would be, is SDPA (so what it checks is its contract)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 20, 16, requires_grad=True) for _ in "qkv")
    mask = torch.rand(2, 1, 20, 20) > 0.3
    mask[..., 0] = True
    bias = C._Efficient._bias(mask, q)
    out, lse, seed, offset = EfficientKernel().forward(q, k, v, bias, True, 0.0, False)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    grad = torch.randn_like(ref)
    ref.backward(grad)
    dq, dk, dv, _ = EfficientKernel().backward(grad, q, k, v, bias, out, lse, seed, offset, 0.0,
                                               [True] * 3 + [False], False)
    for got, want in ((out, ref), (dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_cp_pieces_equal_one_attention_with_the_cpu_kernel():
    assert _failures(cp_pieces.check("cpu", small=True)) == {}


def test_cp_pieces_equal_one_attention_under_the_cuda_kernels_contract(efficient_kernel):
    """fp32, bf16 and fp16; cp 2 and 4; causal and packed documents; grouped k/v heads."""
    results = cp_pieces.check("cpu", small=True)
    assert _failures(results) == {}
    assert len(results) == 12


def test_the_ring_returns_its_output_in_the_kernels_layout(efficient_kernel):
    """The merged output the ring saves for backward is already [B, T, H, D] in memory: no copy
    per piece in backward, and the model's transpose back to [B, T, H·D] is free."""
    q = torch.randn(1, 4, 16, 8)
    out = C._kernel(q.device).output(q)
    assert C._rows_packed(out[:, :, 4:8]) is out[:, :, 4:8] or C._rows_packed(out[:, :, 4:8]).data_ptr() \
        == out[:, :, 4:8].data_ptr()
    assert out.to(torch.bfloat16).transpose(1, 2).is_contiguous()
