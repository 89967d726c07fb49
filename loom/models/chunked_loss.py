"""The output projection and cross entropy, chunk by chunk over the tokens (issue 26): forward and
backward never hold the [tokens, vocab] logits, their fp32 copy or their gradient, only one chunk's.

An autograd Function keeps the head's input, the weight, the targets and each token's fp32
logsumexp; backward recomputes each chunk's logits, turns them into the gradient of the logits
(softmax - one-hot) and accumulates the weight's gradient in fp32. The logits' dtype is the one
forward computed in (autocast's, or the parameters'), so gradients match the unchunked path's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

IGNORE = -100  # a target without loss (the same as loom.train.task.IGNORE)


@dataclass(frozen=True)
class VocabShard:
    """Tensor parallelism: this rank's weight holds vocabulary rows [start, start + its rows) of the
    head; the logsumexp and the target's logit are combined over `group`."""

    start: int
    group: dist.ProcessGroup


def _local_targets(t: torch.Tensor, start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each target's row in this shard (clamped in range) and whether this shard owns it."""
    local = t - start
    owned = (local >= 0) & (local < rows)
    return local.clamp(0, rows - 1), owned


def _lse_and_target_logit(logits: torch.Tensor, t: torch.Tensor,
                          shard: VocabShard | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's logsumexp over the whole vocabulary and its target's logit (fp32, [c] each).
    Under TP `logits` (the chunk's fp32 copy, not needed after) is overwritten: no second copy."""
    if shard is None:
        return torch.logsumexp(logits, dim=-1), logits.gather(1, t.clamp(min=0).unsqueeze(1)).squeeze(1)
    # Vocabulary-parallel: the global max first (a stable exp), then the sums of exp and the
    # target's logit (0 on every rank but its owner) in one all-reduce.
    top = funcol.all_reduce(logits.max(dim=-1).values, "max", shard.group).wait()
    local, owned = _local_targets(t, shard.start, logits.shape[1])
    picked = torch.where(owned, logits.gather(1, local.unsqueeze(1)).squeeze(1), 0.0)
    sums = torch.stack([logits.sub_(top[:, None]).exp_().sum(dim=-1), picked])
    sums = funcol.all_reduce(sums, "sum", shard.group).wait()
    return top + sums[0].log(), sums[1]


class _ChunkedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                chunk: int, shard: VocabShard | None) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        lse = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        dtype = h.dtype
        for start in range(0, h.shape[0], chunk):
            logits = F.linear(h[start:start + chunk], weight)  # under autocast: its dtype
            dtype = logits.dtype
            logits = logits.float()
            t = targets[start:start + chunk]
            lse_c, picked = _lse_and_target_logit(logits, t, shard)
            lse[start:start + chunk] = lse_c
            total += torch.where(t != IGNORE, lse_c - picked, 0.0).sum()
            del logits
        ctx.save_for_backward(h, weight, targets, lse)
        ctx.chunk, ctx.dtype, ctx.autocast = chunk, dtype, torch.is_autocast_enabled(h.device.type)
        ctx.vocab_start = shard.start if shard is not None else 0
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
                local, owned = _local_targets(t, ctx.vocab_start, g.shape[1])
                g.scatter_add_(1, local.unsqueeze(1), -owned.float().unsqueeze(1))
                g = g.mul_(torch.where(t != IGNORE, grad, 0.0)[:, None]).to(dtype)
                if dh is not None:
                    dh[start:start + chunk] = g @ w
                if ctx.needs_input_grad[1]:
                    # In the compute dtype, as the unchunked head's. A 16-bit weight's gradient is
                    # summed in place in its dtype (each chunk's product accumulated in fp32 by the
                    # matmul, rounded once into it): no fp32 copy of [V, h] beside a chunk's; an fp32
                    # weight's (autocast) in fp32.
                    if dw is None:
                        dw = g.t() @ hc
                        if tokens > chunk and weight.dtype == torch.float32:
                            dw = dw.float()
                    elif dw.dtype == g.dtype:
                        dw.addmm_(g.t(), hc)
                    else:
                        dw += g.t() @ hc
                del g
        # dh: this shard's part under TP (the caller marks it Partial: DTensor sums it over the group)
        return dh, (dw.to(weight.dtype) if dw is not None else None), None, None, None


def chunked_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                          masked: bool = False, reduction: str = "mean",
                          shard: VocabShard | None = None) -> torch.Tensor:
    """Cross entropy of the logits h @ weight.T ([..., d] hidden states, [V, d] weight, [...]
    targets) computed `chunk` tokens at a time; the same values as loom.train.task.cross_entropy.
    `masked`: IGNORE targets carry no loss (a batch with none left gives 0, not NaN). `shard`:
    `weight` is this rank's rows of a vocabulary-parallel head (every rank of its group passes the
    same h and targets; h's gradient is this rank's part of the sum over the group)."""
    h, targets = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    total = _ChunkedCE.apply(h, weight, targets, max(int(chunk), 1), shard)
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
    logits. Chunked (`loss_chunk` tokens at a time) unless loss_chunk is 0 (then from the full
    logits; under TP the vocabulary-parallel loss of the sharded logits, inside loss_parallel).

    Under TP (the weight a DTensor sharded over the vocabulary, the input replicated by the plan:
    loom/models/gpt/tensor_parallel.py) each rank computes its shard's chunk logits, [c, V/tp],
    and the logsumexp and target logits are combined over the TP group (VocabShard)."""

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None, loss_chunk: int = 0,
                masked: bool = False, reduction: str = "mean") -> torch.Tensor:
        if targets is None:
            return super().forward(x)
        if loss_chunk <= 0:
            return cross_entropy(super().forward(x), targets, masked, reduction)
        if not isinstance(self.weight, DTensor):
            return chunked_cross_entropy(x, self.weight, targets, loss_chunk, masked, reduction)
        w = self.weight
        if w.placements != (Shard(0),) or not isinstance(x, DTensor) or x.placements != (Replicate(),):
            raise ValueError(f"the chunked vocabulary-parallel loss needs the head's weight sharded over the "
                             f"vocabulary and its input replicated, got {w.placements} and "
                             f"{getattr(x, 'placements', 'a plain tensor')}")
        local = w.to_local()
        shard = VocabShard(w.device_mesh.get_local_rank() * local.shape[0], w.device_mesh.get_group())
        # The input's gradient is this rank's part of the sum over the vocabulary: DTensor sums it
        # (all-reduce, or reduce-scatter back to the sequence-parallel layout).
        h = x.to_local(grad_placements=[Partial()])
        return chunked_cross_entropy(h, local, targets, loss_chunk, masked, reduction, shard)
