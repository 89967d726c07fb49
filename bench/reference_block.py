"""The decoder block loom had before issue 26, kept as the reference the lean one is measured against
(bench/lean_block.py, tests/unit/test_lean_block.py): its RMSNorm keeps fp32 copies, RoPE keeps its
fp32 intermediates, attention repeats k, v to every head, and the MLP keeps silu(gate) and w2's input.

The classes subclass loom's modules, so they have loom's parameters (same names, same state_dict):
only the forwards are the old ones, verbatim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loom.models.gpt.config import GPTConfig
from loom.models.gpt.model import Attention, FeedForward, RMSNorm


def ref_apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    xf = x.float().unflatten(-1, (-1, 2))
    x_even, x_odd = xf[..., 0], xf[..., 1]
    cos = rope[0].float()[None, :, None, :]
    sin = rope[1].float()[None, :, None, :]
    rotated = torch.stack([x_even * cos - x_odd * sin, x_even * sin + x_odd * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)


class RefRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class RefAttention(Attention):
    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        q, k = ref_apply_rope(q, rope), ref_apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.n_rep > 1:
            k = k.repeat_interleave(self.n_rep, dim=1)
            v = v.repeat_interleave(self.n_rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class RefFeedForward(FeedForward):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class RefBlock(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attention_norm = RefRMSNorm(cfg.d_model, cfg.norm_eps)
        self.attention = RefAttention(cfg)
        self.ffn_norm = RefRMSNorm(cfg.d_model, cfg.norm_eps)
        self.feed_forward = RefFeedForward(cfg)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))
