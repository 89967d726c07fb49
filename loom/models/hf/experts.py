"""Hugging Face MoE decoders' experts (Qwen2-MoE, Qwen3-MoE): transformers 5 holds each block's experts
fused in memory (`mlp.experts.gate_up_proj` [E, 2·H, d]: each expert's gate rows, then its up rows;
`mlp.experts.down_proj` [E, d, H]), while their folders keep one tensor per expert
(`mlp.experts.J.gate_proj.weight` [H, d], `up_proj`, `down_proj`). This maps one to the other, so that
model.init_from reads each rank's block from the per-expert tensors and `loom export --layout hf`
writes them back apart.
"""

from __future__ import annotations

import torch

MOE_DECODERS = ("qwen2_moe", "qwen3_moe")
# fused parameter (name ending) -> the per-expert tensors it stacks, in order along its dim 1
FUSED = {"mlp.experts.gate_up_proj": ("gate_proj", "up_proj"), "mlp.experts.down_proj": ("down_proj",)}


def fused_parts(name: str) -> tuple[str, tuple[str, ...]] | None:
    """(the experts' prefix, the per-expert tensors it stacks) of a fused parameter, else None."""
    for ending, parts in FUSED.items():
        if name.endswith(ending):
            return name[: -len(ending)] + "mlp.experts", parts
    return None


def expert_name(prefix: str, expert: int, part: str) -> str:
    return f"{prefix}.{expert}.{part}.weight"


def split_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with fused experts, under the folders' per-expert names."""
    out = {}
    for name, tensor in tensors.items():
        fused = fused_parts(name)
        if fused is None:
            out[name] = tensor
            continue
        prefix, parts = fused
        for j in range(tensor.shape[0]):
            for part, piece in zip(parts, tensor[j].chunk(len(parts), dim=0)):
                out[expert_name(prefix, j, part)] = piece.contiguous()
    return out
