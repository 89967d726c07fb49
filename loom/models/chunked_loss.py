"""The output projection and cross entropy, chunk by chunk over the tokens (issue 26): forward and
backward never hold the [tokens, vocab] logits, their fp32 copy or their gradient, only one chunk's.

An autograd Function computes each chunk's logits once, in forward: their loss, and at once their
gradient (softmax - one-hot), which becomes h's and the weight's gradients for a unit upstream
gradient; backward only scales those by the upstream scalar (issue 39: no second head matmul). The
logits' dtype is the one forward computed in (autocast's, or the parameters'), so gradients match
the unchunked path's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from loom.parallel.backward_pass import takes_inputs, takes_weights

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


def _loss_and_softmax(logits: torch.Tensor, t: torch.Tensor,
                      shard: VocabShard | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's logsumexp over the whole vocabulary and its target's logit (fp32, [c] each);
    `logits` (the chunk's fp32 copy) is turned into the softmax in place: no second copy."""
    if shard is None:
        lse = torch.logsumexp(logits, dim=-1)
        picked = logits.gather(1, t.clamp(min=0).unsqueeze(1)).squeeze(1)
        logits.sub_(lse[:, None]).exp_()
        return lse, picked
    # Vocabulary-parallel: the global max first (a stable exp), then the sums of exp and the
    # target's logit (0 on every rank but its owner) in one all-reduce.
    top = funcol.all_reduce(logits.max(dim=-1).values, "max", shard.group).wait()
    local, owned = _local_targets(t, shard.start, logits.shape[1])
    picked = torch.where(owned, logits.gather(1, local.unsqueeze(1)).squeeze(1), 0.0)
    sums = torch.stack([logits.sub_(top[:, None]).exp_().sum(dim=-1), picked])
    sums = funcol.all_reduce(sums, "sum", shard.group).wait()
    logits.div_(sums[0][:, None])
    return top + sums[0].log(), sums[1]


def _backprop_chunk(g: torch.Tensor, t: torch.Tensor, vocab_start: int, scale, dtype: torch.dtype,
                    hc: torch.Tensor, w: torch.Tensor, dh: torch.Tensor | None, dw: torch.Tensor | None,
                    need_w: bool, weight_dtype: torch.dtype, tokens: int) -> torch.Tensor | None:
    """One chunk's softmax `g` (fp32, [c, V], overwritten) -> the logits' gradient (softmax −
    one-hot, times `scale`, 0 where IGNORE) -> h's gradient into `dh` and the weight's added to
    `dw` (returned)."""
    local, owned = _local_targets(t, vocab_start, g.shape[1])
    g.scatter_add_(1, local.unsqueeze(1), -owned.float().unsqueeze(1))
    g = g.mul_(torch.where(t != IGNORE, scale, 0.0)[:, None]).to(dtype)
    if dh is not None:
        dh.copy_(g @ w)  # under autocast, its cached low-precision weight
    if need_w:
        # In the compute dtype, as the unchunked head's. A 16-bit weight's gradient is summed in
        # place in its dtype (each chunk's product accumulated in fp32 by the matmul, rounded once
        # into it): no fp32 copy of [V, h] beside a chunk's; an fp32 weight's (autocast) in fp32.
        hc = hc.to(dtype)
        if dw is None:
            dw = g.t() @ hc
            if tokens > g.shape[0] and weight_dtype == torch.float32:
                dw = dw.float()
        elif dw.dtype == g.dtype:
            dw.addmm_(g.t(), hc)
        else:
            dw += g.t() @ hc
    return dw


class _ChunkedCE(torch.autograd.Function):
    """`in_forward` (the default): the loss is the step's last op and its upstream gradient a scalar,
    so each chunk's gradients are computed in forward from the logits it already holds, for a unit
    upstream gradient, and backward only scales them: the head's matmul runs once per chunk. Forward
    then keeps h's gradient (fp32 [tokens, d]; h itself is not kept) and the weight's ([V, d]: the
    buffer backward would make at once anyway). Otherwise (GPipe, whose last stage runs every
    micro-batch's forward before any backward: one weight-sized gradient per micro-batch) forward
    keeps h and each token's logsumexp, and backward computes each chunk's logits again; so it does
    under a split backward (zb, zbv, dualpipev), whose input and weight passes both run this node's
    backward: each takes only its own gradient (loom/parallel/backward_pass.py), the logits again in
    each."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                chunk: int, shard: VocabShard | None, in_forward: bool) -> torch.Tensor:
        need_h, need_w = ctx.needs_input_grad[:2]
        in_forward = in_forward and (need_h or need_w)
        tokens, vocab_start = h.shape[0], shard.start if shard is not None else 0
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        lse = torch.empty(tokens, dtype=torch.float32, device=h.device) if not in_forward else None
        dh = torch.empty(h.shape, dtype=torch.float32, device=h.device) if in_forward and need_h else None
        dw = None
        autocast = torch.is_autocast_enabled(h.device.type)
        dtype = h.dtype
        for start in range(0, tokens, chunk):
            hc, t = h[start:start + chunk], targets[start:start + chunk]
            logits = F.linear(hc, weight)  # under autocast: its dtype (and its cached weight)
            dtype = logits.dtype
            g = logits.float()
            del logits
            lse_c, picked = _loss_and_softmax(g, t, shard)
            total += torch.where(t != IGNORE, lse_c - picked, 0.0).sum()
            if in_forward:  # (the weight as the logits took it: autocast's cached cast, or itself)
                dw = _backprop_chunk(g, t, vocab_start, 1.0, dtype, hc, weight,
                                     dh[start:start + chunk] if dh is not None else None, dw, need_w,
                                     weight.dtype, tokens)
            elif lse is not None:
                lse[start:start + chunk] = lse_c
            del g
        ctx.in_forward, ctx.h_dtype, ctx.w_dtype = in_forward, h.dtype, weight.dtype
        if in_forward:
            # Not saved tensors: backward hands them on and drops its reference, so autograd takes
            # the weight's gradient as it is (a saved tensor would make it copy [V, d]).
            ctx.grads = dh, dw
        else:
            ctx.save_for_backward(h, weight, targets, lse)
            ctx.chunk, ctx.dtype, ctx.autocast, ctx.vocab_start = chunk, dtype, autocast, vocab_start
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # dh: this shard's part under TP (the caller marks it Partial: DTensor sums it over the group)
        if ctx.in_forward:
            if ctx.grads is None:  # a split backward (zb, zbv, dualpipev) runs a node twice: not this path
                raise RuntimeError("the chunked loss's gradients from forward were taken already: a "
                                   "second backward through it needs grad_in_forward=False")
            (dh, dw), ctx.grads = ctx.grads, None
            return ((dh.mul_(grad).to(ctx.h_dtype) if dh is not None else None),
                    (dw.mul_(grad.to(dw.dtype)).to(ctx.w_dtype) if dw is not None else None),
                    None, None, None, None)
        h, weight, targets, lse = ctx.saved_tensors
        chunk, dtype, tokens = ctx.chunk, ctx.dtype, h.shape[0]
        # a split backward's input pass takes h's, its weight pass the weight's (backward_pass.py)
        need_h = ctx.needs_input_grad[0] and takes_inputs()
        need_w = ctx.needs_input_grad[1] and takes_weights()
        dh = torch.empty_like(h) if need_h else None
        dw = None
        # Under autocast (loom's step runs backward inside the forward's context) the matmuls take
        # autocast's cached low-precision weight, as the unchunked path does: no second copy.
        with torch.autocast(h.device.type, dtype=dtype, enabled=ctx.autocast):
            w = weight if ctx.autocast else weight.to(dtype)
            for start in range(0, tokens, chunk) if need_h or need_w else ():
                hc = h[start:start + chunk]
                g = F.linear(hc.to(dtype), w).float().sub_(lse[start:start + chunk, None]).exp_()
                dw = _backprop_chunk(g, targets[start:start + chunk], ctx.vocab_start, grad, dtype, hc, w,
                                     dh[start:start + chunk] if dh is not None else None, dw,
                                     need_w, weight.dtype, tokens)
                del g
        return dh, (dw.to(weight.dtype) if dw is not None else None), None, None, None, None


def chunked_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                          masked: bool = False, reduction: str = "mean",
                          shard: VocabShard | None = None, grad_in_forward: bool = True) -> torch.Tensor:
    """Cross entropy of the logits h @ weight.T ([..., d] hidden states, [V, d] weight, [...]
    targets) computed `chunk` tokens at a time; the same values as loom.train.task.cross_entropy.
    `masked`: IGNORE targets carry no loss (a batch with none left gives 0, not NaN). `shard`:
    `weight` is this rank's rows of a vocabulary-parallel head (every rank of its group passes the
    same h and targets; h's gradient is this rank's part of the sum over the group).
    `grad_in_forward`: the gradients computed in forward (one head matmul per chunk; see _ChunkedCE)."""
    h, targets = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    total = _ChunkedCE.apply(h, weight, targets, max(int(chunk), 1), shard, grad_in_forward)
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
                masked: bool = False, reduction: str = "mean", grad_in_forward: bool = True) -> torch.Tensor:
        if targets is None:
            return super().forward(x)
        if loss_chunk <= 0:
            return cross_entropy(super().forward(x), targets, masked, reduction)
        if not isinstance(self.weight, DTensor):
            return chunked_cross_entropy(x, self.weight, targets, loss_chunk, masked, reduction,
                                         grad_in_forward=grad_in_forward)
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
        return chunked_cross_entropy(h, local, targets, loss_chunk, masked, reduction, shard, grad_in_forward)
