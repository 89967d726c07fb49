"""One optimizer step, the same for every layout, and evaluation.

A step runs grad_accum micro-batches (forward, backward; gradients sync on the last one only)
or, under a pipeline, the schedule's micro-batches through the stages; then the loss is averaged
over the whole global batch, gradients are clipped and the optimizer steps (or skips a
non-finite step on every rank alike). Values stay on the device: the caller reads them a step
late, so on a GPU the host never waits for the step it has just queued.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from loom import strategies
from loom.config import Config, pipeline_microbatches, rank_stages, splits_backward, stages_per_rank
from loom.models.gpt.lean_ops import plain_ops
from loom.models.gpt.model import GPT
from loom.parallel import fb_overlap, precision
from loom.parallel.apply import gradient_sync, uses_fsdp
from loom.parallel.context_parallel import SequenceSplit
from loom.parallel.mesh import Dist, local_view
from loom.parallel.pipeline import build_schedule, pipeline_eval, pipeline_step
from loom.parallel.tensor_parallel import loss_context
from loom.parallel.zero1 import local_optimizer
from loom.train import faults, moe_step
from loom.train.meters import PhaseTimer
from loom.train.muon import MuonAdamW
from loom.train.optim import clip_grad_norm
from loom.train.task import IGNORE, cross_entropy, split_batch


@dataclass
class Pipeline:
    schedule: Any  # torch.distributed.pipelining schedule over this rank's stage(s)
    first: bool  # holds the embedding: feeds the tokens
    last: bool  # holds the head: computes the loss
    group: dist.ProcessGroup
    # SFT: this step's loss units per loss token (see token_scale), read by the schedule's loss
    token_scale: dict = field(default_factory=dict)


def build_pipeline(parts: list[nn.Module], cfg: Config, d: Dist,
                   split: SequenceSplit | None = None) -> Pipeline:
    p = cfg.parallel
    num_stages = p.pp * stages_per_rank(p.pp_schedule, p.pp_virtual_stages)
    stage_ids = rank_stages(d.mesh["pp"].get_local_rank(), p.pp, p.pp_virtual_stages, p.pp_schedule)
    accum = cfg.train.grad_accum
    scale: dict = {}
    head = chunked_head(parts, stage_ids.index(num_stages - 1), cfg) if num_stages - 1 in stage_ids else None

    # The chunked loss's gradients computed in its forward, except under GPipe (every micro-batch's
    # forward first: each would hold a weight-sized gradient until the backwards) and a split
    # backward (torch's weight pass may run a node's backward again, which these gradients allow
    # once: loom/models/chunked_loss.py)
    grad_in_forward = p.pp_schedule != "gpipe" and not splits_backward(p)

    def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        sft = cfg.data.format == "sft"  # the sum over its loss tokens, in units of the global mean
        if split is not None:  # the last stage's output holds this cp rank's tokens only
            targets = split.shard(targets)
        reduction = "sum" if sft else "mean"
        if head is not None:  # the last stage's norm output, through the head chunk by chunk
            loss = head(output, targets=targets, loss_chunk=cfg.train.loss_chunk, masked=sft,
                        reduction=reduction, grad_in_forward=grad_in_forward)
        else:  # the last stage's logits
            loss = cross_entropy(output, targets, masked=sft, reduction=reduction)
        # The schedule sums micro-batch gradients; over grad_accum steps they must average too.
        return loss * scale["value"] / accum if sft else loss / accum

    schedule = build_schedule(parts, stage_ids, num_stages, d.mesh["pp"].get_group(), d.device,
                              p.pp_schedule, pipeline_microbatches(p), loss_fn)
    if fb_overlap.overlaps(p):  # one micro-batch's all-to-alls under another's compute
        fb_overlap.register(schedule, serial_compute=p.tp > 1 or p.cp > 1,
                            backward_groups={d.ep.group: fb_overlap.twin_group(d.mesh, "ep")})
    return Pipeline(schedule, 0 in stage_ids, num_stages - 1 in stage_ids, d.mesh["pp"].get_group(), scale)


def chunked_head(parts: list[nn.Module], last: int, cfg: Config) -> nn.Module | None:
    """The chunked loss under a pipeline (train.loss_chunk > 0, loom's GPT): the last stage, parts[last],
    returns its norm's output and the schedule's loss calls this head on it, so the stage never
    holds the full logits. None: the last stage returns logits (loss_chunk 0, other models)."""
    stage = getattr(parts[last], "module", parts[last])  # DDP wraps a stage
    if cfg.train.loss_chunk <= 0 or not isinstance(stage, GPT) or plain_ops():  # (plain_ops: see driver.py)
        return None
    stage.head_in_loss = True
    return stage.output


def token_scale(batches: list[torch.Tensor], cfg: Config,
                d: Dist) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
    """SFT: the global batch's loss is the mean over all of its loss tokens, whatever the layout.
    Micro-batches hold different numbers of them, so each micro-batch's loss unit (one of the
    accum × dp (× pipeline micro-batches) units the step averages) is rescaled: this returns
    units / loss tokens of the global batch, counted on the device (one small all-reduce; tp and pp
    ranks hold copies of their dp rank's batch, cp ranks each count their own tokens of it), and each
    micro-batch's weight (its loss tokens × that). None for text, where every unit holds the same
    number of tokens."""
    if cfg.data.format != "sft":
        return None, None
    p = cfg.parallel
    counts = torch.stack([_loss_tokens(b, d) for b in batches]).float()
    tokens = counts.sum()
    dist.all_reduce(tokens)
    # dp × cp ranks each average their own tokens' loss into the gradient
    units = cfg.train.grad_accum * d.grad_mesh.size() * (pipeline_microbatches(p) if p.pp > 1 else 1)
    scale = units * p.tp * p.pp / tokens.clamp(min=1)
    return scale, counts * scale


def autocast(cfg: Config, device: torch.device):
    return precision.autocast(cfg.train.precision, uses_fsdp(cfg.parallel), device)


def global_mean(t: torch.Tensor, contributors: int) -> torch.Tensor:
    """The mean of `t` over the ranks that hold a value (the others add 0)."""
    dist.all_reduce(t)  # SUM: gloo has no AVG
    return t / contributors


@dataclass
class StepValues:
    loss: torch.Tensor  # global mean loss (device)
    grad_norm: torch.Tensor  # global gradient norm (device)
    skipped: torch.Tensor  # 1.0 when the update was skipped as non-finite (device)
    lr: float
    data_wait_s: float
    moe: torch.Tensor | None = None  # a mixture of experts' routing this step (loom/train/moe_step.py)


def train_step(model: nn.Module, optimizer, scheduler, scaler, batches, params: list[torch.Tensor],
               cfg: Config, d: Dist, pipe: Pipeline | None, loss_fn, timer: PhaseTimer | None = None,
               step: int = 0) -> StepValues:
    """One optimizer step over grad_accum micro-batches; gradients sync on the last one only (FSDP2
    sharding them: on each, unless parallel.reduce_every_micro_step is false, so that they stay sharded;
    FSDP2 replicating them, ddp and zero1 under TP or EP, holds them whole either way: on the last)."""
    t = cfg.train
    sharded = uses_fsdp(cfg.parallel) and strategies.GRADS in strategies.lookup(cfg.parallel.strategy).sharded
    timer = timer or PhaseTimer(d.device)
    optimizer.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), device=d.device)
    micro_batches, data_wait = _next_batches(batches, t.grad_accum, timer, d.device)
    scale, weights = token_scale(micro_batches, cfg, d)
    if pipe is not None:
        pipe.token_scale["value"] = scale
    for micro, batch in enumerate(micro_batches):
        if pipe is not None:
            # The stages sync gradients themselves (no_sync on all but each step's last backward).
            with timer.phase("pipeline"), autocast(cfg, d.device), loss_context(cfg.parallel.tp):
                inputs, targets = split_batch(batch)
                loss = pipeline_step(pipe.schedule, inputs if pipe.first else None,
                                     targets if pipe.last else None, pipe.first, pipe.last)
            if loss is not None:
                # undo 1/accum
                loss_sum += local_view(faults.after_forward(step, d.rank, loss)) * t.grad_accum
            continue
        sync = micro == t.grad_accum - 1 or (sharded and cfg.parallel.reduce_every_micro_step)
        with (gradient_sync(model, enabled=sync), autocast(cfg, d.device),
              loss_context(cfg.parallel.tp)):
            with timer.phase("forward"):
                loss = faults.after_forward(step, d.rank, loss_fn(model, batch))
                if weights is not None:  # SFT: this micro-batch's share of the global batch's loss tokens
                    loss = loss * weights[micro]
                scaled = loss / t.grad_accum
            with timer.phase("backward"):
                (scaler.scale(scaled) if scaler else scaled).backward()
        loss_sum += local_view(loss.detach())
    # Mean loss over the global batch: each rank's micro-steps, then all ranks (with a pipeline
    # only the last stage's dp × tp ranks hold a loss; the others add 0). Every rank gets the
    # same value, so every rank takes the same decision on a non-finite step.
    global_loss = global_mean(loss_sum / t.grad_accum, d.world_size // cfg.parallel.pp)
    with timer.phase("optimizer"):
        grad_norm, skipped, lr = _optimizer_step(optimizer, scheduler, scaler, params, t, pipe, global_loss)
        moe = moe_step.after_step(model, d, moe_step.experts_of(model),
                                  pipe.group if pipe is not None else None)
    return StepValues(global_loss, grad_norm, skipped, lr, data_wait, moe)


def deepspeed_train_step(engine, scheduler, batches, cfg: Config, d: Dist, loss_fn,
                         timer: PhaseTimer | None = None, step: int = 0) -> StepValues:
    """The same step run by DeepSpeed's engine: it scales each micro-batch's loss by 1/grad_accum
    in backward, reduces and partitions the gradients, and at the last micro-batch clips and
    steps, skipping a step whose gradients are not finite (every rank alike). The LR schedule is
    loom's, stepped here as on the torch engine."""
    t = cfg.train
    timer = timer or PhaseTimer(d.device)
    loss_sum = torch.zeros((), device=d.device)
    micro_batches, data_wait = _next_batches(batches, t.grad_accum, timer, d.device)
    _, weights = token_scale(micro_batches, cfg, d)
    for micro, batch in enumerate(micro_batches):
        with timer.phase("forward"):
            loss = faults.after_forward(step, d.rank, loss_fn(engine, batch))
            if weights is not None:  # SFT: this micro-batch's share of the global batch's loss tokens
                loss = loss * weights[micro]
        with timer.phase("backward"):
            engine.backward(loss)
        loss_sum += loss.detach().float()
        if micro < t.grad_accum - 1:
            engine.step()  # not the boundary: DeepSpeed only counts the micro-batch
    global_loss = global_mean(loss_sum / t.grad_accum, d.world_size)
    lr = scheduler.get_last_lr()[0]
    with timer.phase("optimizer"):
        engine.step()
        scheduler.step()
        moe = moe_step.after_step(engine.module, d, moe_step.experts_of(engine.module))
    norm = engine.get_global_grad_norm()
    grad_norm = torch.as_tensor(float("nan") if norm is None else norm, dtype=torch.float32, device=d.device)
    skipped = torch.tensor(0.0 if engine.was_step_applied() else 1.0, device=d.device)
    return StepValues(global_loss, grad_norm, skipped, lr, data_wait, moe)


def _next_batches(batches, count: int, timer: PhaseTimer,
                  device: torch.device) -> tuple[list[torch.Tensor], float]:
    """The step's micro-batches on the device (all of them first: SFT counts their loss tokens
    before the first backward), and the seconds spent waiting for them."""
    wait_start = time.perf_counter()
    with timer.phase("data"):
        fetched = [next(batches).to(device, non_blocking=True) for _ in range(count)]
    return fetched, time.perf_counter() - wait_start


def _loss_tokens(batch: torch.Tensor, d: Dist) -> torch.Tensor:
    """The loss tokens of `batch` this rank computes the loss of (its cp share of each sequence)."""
    return (SequenceSplit(d.cp).shard(split_batch(batch)[1]) != IGNORE).sum()


def _optimizer_step(optimizer, scheduler, scaler, params: list[torch.Tensor], t, pipe: Pipeline | None,
                    loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Unscale, clip, step (unless the loss or grad norm is NaN/Inf) and advance the schedule.

    Returns (grad norm, skipped flag, lr used). A fused AdamW, and Muon beside one, skip on the
    device (their `found_inf` input, as under a GradScaler): no host sync. Other optimizers read the
    flag on the host before stepping (free on CPU). Under fp16 the scaler already skips overflowed
    gradients (that is its normal operation), so only the loss decides there: for a fused AdamW by
    joining the scaler's flags on the device (an overflow also halves the scale), else on the host.
    """
    if scaler:
        scaler.unscale_(optimizer)
    # Under CPU offload the gradients, so their norm, are in host memory: the norm joins the loss's
    # device (one stacked read per step), the skip flag the parameters' (a fused step's found_inf).
    grad_norm = clip_grad_norm(params, t.grad_clip, pipe.group if pipe is not None else None).to(loss.device)
    lr = scheduler.get_last_lr()[0]
    finite = torch.isfinite(loss) if scaler else torch.isfinite(loss) & torch.isfinite(grad_norm)
    skipped = (~finite).float()
    if scaler:
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            # a fused AdamW takes the scaler's overflow flags on the device: the loss's flag joins them
            for found in scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
                torch.maximum(found, skipped.to(found.device), out=found)
            scaler.step(optimizer)
        elif finite.item():
            scaler.step(optimizer)  # skips the step when fp16 gradients overflowed
        scaler.update()
    elif (fused := _takes_found_inf(optimizer)) is not None:
        fused.found_inf = skipped.to(params[0].device)
        try:
            optimizer.step()
        finally:
            del fused.found_inf
    elif finite.item():
        optimizer.step()
    scheduler.step()
    return grad_norm, skipped, lr


def _takes_found_inf(optimizer) -> torch.optim.Optimizer | None:
    """The optimizer that takes the step (ZeRO-1 steps its local one) if it skips on a device flag:
    a fused AdamW, or Muon with one inside (loom/train/muon.py)."""
    inner = local_optimizer(optimizer)
    if isinstance(inner, torch.optim.AdamW) and inner.defaults.get("fused"):
        return inner
    return inner if isinstance(inner, MuonAdamW) and inner.takes_found_inf() else None


def evaluate(model: nn.Module, loader, d: Dist, cfg: Config, loss_fn,
             pipe: Pipeline | None = None) -> float | None:
    """Mean loss over the held-out batches (under a pipeline: forward-only through the stages)."""
    if loader is None:
        return None
    model.eval()
    total = torch.zeros((), device=d.device)
    count = 0
    with torch.no_grad(), autocast(cfg, d.device), loss_context(cfg.parallel.tp):
        for batch in loader:
            batch = batch.to(d.device, non_blocking=True)
            if pipe is None:
                total += local_view(loss_fn(model, batch))
            else:
                losses: list[torch.Tensor] | None = [] if pipe.last else None
                inputs, targets = split_batch(batch)
                pipeline_eval(pipe.schedule, inputs.contiguous() if pipe.first else None,
                              targets if pipe.last else None, losses)
                if losses:  # each was divided by micro-batches × grad_accum (see build_pipeline)
                    total += (local_view(torch.stack([x.detach() for x in losses]).sum())
                              * cfg.train.grad_accum)
            count += 1
    model.train()
    contributors = d.world_size // cfg.parallel.pp  # with a pipeline only the last stage has a loss
    return global_mean(total / max(count, 1), contributors).item()
