"""Attention with grouped k/v heads (GQA) on the kernel each device runs well.

torch's fused kernels differ in what they take (torch 2.11 and 2.13 alike):
- CPU's flash kernel takes grouped heads, any float dtype, and a mask (as a bias);
- CUDA's flash kernel takes grouped heads, but only 16-bit, head_dim ≤ 256, sm80+ and no mask;
- CUDA's memory-efficient kernel takes fp32 and a mask, but not grouped heads.
Asked for grouped heads where flash cannot run (an fp32 run, document masks), torch falls to the
math kernel, which keeps the B·H·T² scores for backward: 128 MiB per sequence and layer at 1024
tokens and 32 heads. There k and v are repeated to the query heads first, so the efficient kernel
runs and keeps them (2·(H − H_kv)·head_dim elements per token more, priced by
loom/plan/shapes.py::attention_kv_width).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def expand_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, H_kv, T, D] -> [B, heads, T, D], each k/v head repeated for its group of query heads."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def takes_grouped_heads(device: torch.device, dtype: torch.dtype, head_dim: int, masked: bool) -> bool:
    """Whether the fused kernel this device runs takes grouped k/v heads as they are (see above).
    `dtype` is what the kernel sees: autocast's, where autocast is on."""
    if device.type != "cuda":
        return True
    return (not masked and dtype in (torch.float16, torch.bfloat16) and head_dim <= 256
            and torch.cuda.get_device_capability(device)[0] >= 8)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
           attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """scaled_dot_product_attention of q [B, H, T, D] over k, v [B, H_kv, S, D], H_kv dividing H."""
    grouped = k.shape[1] != q.shape[1]
    if grouped:
        cuda = q.device.type == "cuda"
        dtype = torch.get_autocast_dtype("cuda") if cuda and torch.is_autocast_enabled("cuda") else q.dtype
        if not takes_grouped_heads(q.device, dtype, q.shape[-1], attn_mask is not None):
            k, v, grouped = expand_heads(k, q.shape[1]), expand_heads(v, q.shape[1]), False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                          enable_gqa=grouped)
