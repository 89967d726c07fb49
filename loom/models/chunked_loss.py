"""The output projection and cross entropy, chunk by chunk over the tokens (issue 26): forward and
backward never hold the [tokens, vocab] logits, their fp32 copy or their gradient, only one chunk's.

An autograd Function keeps the head's input, the weight, the targets and each token's fp32
logsumexp; backward recomputes each chunk's logits, turns them into the gradient of the logits
(softmax - one-hot) and accumulates the weight's gradient in fp32. The logits' dtype is the one
forward computed in (autocast's, or the parameters'), so gradients match the unchunked path's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

IGNORE = -100  # a target without loss (the same as loom.train.task.IGNORE)


class _ChunkedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                chunk: int) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        lse = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        dtype = h.dtype
        for start in range(0, h.shape[0], chunk):
            logits = F.linear(h[start:start + chunk], weight)  # under autocast: its dtype
            dtype = logits.dtype
            logits = logits.float()
            t = targets[start:start + chunk]
            lse_c = torch.logsumexp(logits, dim=-1)
            lse[start:start + chunk] = lse_c
            picked = logits.gather(1, t.clamp(min=0).unsqueeze(1)).squeeze(1)
            total += torch.where(t != IGNORE, lse_c - picked, 0.0).sum()
            del logits
        ctx.save_for_backward(h, weight, targets, lse)
        ctx.chunk, ctx.dtype, ctx.autocast = chunk, dtype, torch.is_autocast_enabled(h.device.type)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        h, weight, targets, lse = ctx.saved_tensors
        chunk, dtype, tokens = ctx.chunk, ctx.dtype, h.shape[0]
        dh = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        dw = None
        # Under autocast (loom's step runs backward inside the forward's context) the matmuls take
        # autocast's cached low-precision weight, as the unchunked path does: no second copy.
        with torch.autocast(h.device.type, dtype=dtype, enabled=ctx.autocast):
            w = weight if ctx.autocast else weight.to(dtype)
            for start in range(0, tokens, chunk):
                hc = h[start:start + chunk].to(dtype)
                t = targets[start:start + chunk]
                # softmax from the saved logsumexp, in place; the one-hot's -1; 0 where IGNORE
                g = F.linear(hc, w).float().sub_(lse[start:start + chunk, None]).exp_()
                g.scatter_add_(1, t.clamp(min=0).unsqueeze(1), torch.full_like(g[:, :1], -1.0))
                g = g.mul_(torch.where(t != IGNORE, grad, 0.0)[:, None]).to(dtype)
                if dh is not None:
                    dh[start:start + chunk] = g @ w
                if ctx.needs_input_grad[1]:
                    part = g.t() @ hc  # in the compute dtype, as the unchunked head's
                    if tokens <= chunk:
                        dw = part
                    elif dw is None:
                        dw = part.float()  # chunks summed in fp32
                    else:
                        dw += part
                del g
        return dh, (dw.to(weight.dtype) if dw is not None else None), None, None


def chunked_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                          masked: bool = False, reduction: str = "mean") -> torch.Tensor:
    """Cross entropy of the logits h @ weight.T ([..., d] hidden states, [V, d] weight, [...]
    targets) computed `chunk` tokens at a time; the same values as loom.train.task.cross_entropy.
    `masked`: IGNORE targets carry no loss (a batch with none left gives 0, not NaN)."""
    h, targets = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    total = _ChunkedCE.apply(h, weight, targets, max(int(chunk), 1))
    if reduction == "sum":
        return total
    count = (targets != IGNORE).sum().clamp(min=1) if masked else targets.numel()
    return total / count


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, masked: bool = False,
                  reduction: str = "mean") -> torch.Tensor:
    """Mean (or sum) next-token cross entropy of logits [B, T, V] against targets [B, T], in fp32
    whatever the compute dtype (a bf16 log-softmax over a large vocabulary loses the loss's
    precision). `masked`: targets equal to IGNORE carry no loss (a batch with none left gives 0,
    not NaN)."""
    logits, targets = logits.float().flatten(0, 1), targets.flatten()
    if not masked:
        return F.cross_entropy(logits, targets, reduction=reduction)
    total = F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum")
    return total if reduction == "sum" else total / (targets != IGNORE).sum().clamp(min=1)


class Head(nn.Linear):
    """The output projection; given targets it returns the loss instead of the logits, computed
    inside this module's call so FSDP2 (and DeepSpeed ZeRO-3) hold its weight gathered, as for the
    logits. Chunked (`loss_chunk` tokens at a time) unless loss_chunk is 0 or the weight is a
    DTensor (TP: the vocabulary-parallel loss of the sharded logits, inside loss_parallel)."""

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None, loss_chunk: int = 0,
                masked: bool = False, reduction: str = "mean") -> torch.Tensor:
        if targets is None:
            return super().forward(x)
        if loss_chunk <= 0 or isinstance(self.weight, DTensor):
            return cross_entropy(super().forward(x), targets, masked, reduction)
        return chunked_cross_entropy(x, self.weight, targets, loss_chunk, masked, reduction)
