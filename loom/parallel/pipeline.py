"""Pipeline parallelism, the model-independent part: which layers each stage holds, which stages
each rank runs, and torch.distributed.pipelining's schedules over them.

Each model builds its own stage modules (loom/models/gpt/pipeline.py, loom/models/hf/adapter.py):
the embedding on the first stage, norm + head + loss on the last, the full model's parameter
names kept so checkpoints map 1:1.

Schedules: `gpipe` and `1f1b` run one stage per rank; `interleaved` (Interleaved 1F1B) runs
`virtual` stages per rank, assigned round-robin: rank r holds stages r, r + pp, r + 2pp, ...
The bubble, (p−1)/(m+p−1) or (p−1)/(v·m+p−1), is the planner's loom.plan.step.bubble_fraction.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from loom.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved")

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def stage_layers(n_layers: int, pp: int, virtual: int = 1) -> list[list[int]]:
    """The layer indices of each of the pp × virtual stages, in order, sizes differing by at most one.

    Rule for the leftover layers (n_layers mod stages): they go to the middle stages first (from
    stage 1 on), then to the first stage (its embedding is a cheap lookup); the last stage, which
    also runs the norm, the vocabulary-sized head and the loss, never gets one.
    """
    num_stages = pp * virtual
    if num_stages < 1 or num_stages > n_layers:
        raise ConfigError(
            f"{num_stages} pipeline stages (pp {pp} × virtual {virtual}) do not fit the model's "
            f"{n_layers} layers; use at most one stage per layer"
        )
    base, extra = divmod(n_layers, num_stages)
    sizes = [base] * num_stages
    preference = list(range(1, num_stages - 1)) + [0]  # extra < num_stages: the last is never reached
    for s in preference[:extra]:
        sizes[s] += 1
    stages, start = [], 0
    for size in sizes:
        stages.append(list(range(start, start + size)))
        start += size
    return stages


def rank_stages(rank: int, pp: int, virtual: int = 1) -> list[int]:
    """The stage indices held by pipeline rank `rank`: round-robin, so r, r + pp, r + 2pp, ..."""
    return [rank + k * pp for k in range(virtual)]


def refuse_tied_embeddings(tied: bool, num_stages: int, fix: str) -> None:
    """The embedding (first stage) and the head (last stage) cannot share one weight across ranks."""
    if tied and num_stages > 1:
        raise ConfigError(f"pipeline parallelism cannot split tied embeddings; {fix}")


def validate_pipeline(n_layers: int, pp: int, virtual: int, schedule: str, microbatches: int,
                      *, tie_embeddings: bool = False) -> None:
    """Raise a one-line ConfigError for a pipeline setup that cannot run (checks the batch not at all)."""
    for name, value in (("pp", pp), ("pp_virtual_stages", virtual), ("microbatches", microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"parallel.{name} must be a positive integer, got {value!r}")
    if schedule not in SCHEDULES:
        raise ConfigError(f"parallel.pp_schedule = {schedule!r} is unknown; choose one of: "
                          f"{', '.join(SCHEDULES)}")
    if pp > n_layers:
        raise ConfigError(f"parallel.pp = {pp} is more than the model's {n_layers} layers; "
                          f"use pp ≤ {n_layers}")
    refuse_tied_embeddings(tie_embeddings, pp * virtual, "set model.tie_embeddings=false")
    if schedule == "interleaved":
        if virtual < 2:
            raise ConfigError(
                f"parallel.pp_schedule = 'interleaved' needs parallel.pp_virtual_stages ≥ 2, got {virtual}; "
                "raise it or use the 1f1b schedule"
            )
        if n_layers % (pp * virtual):
            raise ConfigError(
                f"interleaved pipeline: the model's {n_layers} layers are not divisible by "
                f"pp × virtual stages = {pp} × {virtual} = {pp * virtual}; change pp, pp_virtual_stages or "
                f"n_layers"
            )
    elif virtual != 1:
        raise ConfigError(
            f"parallel.pp_virtual_stages = {virtual} needs parallel.pp_schedule = 'interleaved'; "
            f"set it to 1 for {schedule!r}"
        )
    if schedule in ("1f1b", "interleaved") and microbatches < pp:
        raise ConfigError(
            f"parallel.microbatches = {microbatches} is fewer than parallel.pp = {pp}, "
            f"which the {schedule} schedule needs; use microbatches ≥ {pp}"
        )
    if schedule == "interleaved" and microbatches % (microbatches // pp):
        # torch runs the micro-batches in rounds of microbatches // pp; they must divide evenly.
        raise ConfigError(
            f"parallel.microbatches = {microbatches} is not a multiple of {microbatches // pp} "
            f"(microbatches // pp), which the interleaved schedule needs; use a multiple of pp = {pp}"
        )


_inferring = threading.local()


def inferring_shapes() -> bool:
    """Whether this thread runs a pipeline stage's metadata pass (torch runs a real forward and backward
    once before the first step to learn the shapes): not training, so a module that tallies what its
    training forward did (an MoE block's routing) skips it."""
    return getattr(_inferring, "on", False)


class _Stage(PipelineStage):
    """torch's PipelineStage, its metadata pass marked (inferring_shapes)."""

    def _forward_metadata_inference(self, *args, **kwargs):
        _inferring.on = True
        try:
            return super()._forward_metadata_inference(*args, **kwargs)
        finally:
            _inferring.on = False


def _scaled(loss_fn: LossFn, microbatches: int) -> LossFn:
    # The schedule sums the micro-batch gradients; dividing each loss by m makes that sum the
    # gradient of the mean over the whole batch (micro-batches of equal size).
    def scaled_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_fn(output, target) / microbatches

    return scaled_loss


def build_schedule(stages: list[nn.Module], stage_indices: list[int], num_stages: int,
                   pp_group: dist.ProcessGroup | None, device: torch.device | str, schedule: str,
                   microbatches: int, loss_fn: LossFn):
    """Wrap this rank's stage module(s) in PipelineStages and return the torch schedule for them.

    `loss_fn(logits, targets)` is the unscaled mean loss of one micro-batch; the schedule gets it
    divided by `microbatches` (see `pipeline_step` for the loss it reports).
    """
    if schedule not in SCHEDULES:
        raise ConfigError(f"parallel.pp_schedule = {schedule!r} is unknown; choose one of: "
                          f"{', '.join(SCHEDULES)}")
    if len(stages) != len(stage_indices):
        raise ValueError(f"{len(stages)} stage modules but {len(stage_indices)} stage indices")
    device = torch.device(device)
    pipeline_stages = [_Stage(module, index, num_stages, device, group=pp_group)
                       for module, index in zip(stages, stage_indices)]
    # scale_grads=False: torch's own scaling divides the whole .grad after the step, which would
    # also shrink gradients accumulated by earlier steps (gradient accumulation); the loss is
    # scaled instead.
    kwargs = {"n_microbatches": microbatches, "loss_fn": _scaled(loss_fn, microbatches), "scale_grads": False}
    if schedule == "interleaved":
        return ScheduleInterleaved1F1B(pipeline_stages, **kwargs)
    if len(pipeline_stages) != 1:
        raise ValueError(f"the {schedule} schedule runs one stage per rank, got {len(pipeline_stages)}")
    schedule_class = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    return schedule_class(pipeline_stages[0], **kwargs)


def pipeline_step(schedule, inputs: torch.Tensor | None, targets: torch.Tensor | None,
                  is_first: bool, is_last: bool) -> torch.Tensor | None:
    """One forward + backward of the whole local batch, split into the schedule's micro-batches.

    The batch size must be divisible by the micro-batch count (the caller checks), so that the
    mean of the micro-batch losses is the mean over the batch. Gradients accumulate into .grad.
    Returns the mean micro-batch loss (detached) on the rank holding the last stage, else None.
    """
    if is_first and inputs is None:
        raise ValueError("the first pipeline stage needs the input tokens")
    if is_last and targets is None:
        raise ValueError("the last pipeline stage needs the targets")
    args = (inputs.contiguous(),) if is_first else ()  # torch 2.11 checks the strides the stage saw first
    losses: list[torch.Tensor] | None = [] if is_last else None
    # return_outputs=False: the last stage would otherwise concatenate every micro-batch's logits.
    schedule.step(*args, target=targets if is_last else None, losses=losses, return_outputs=False)
    if losses is None:
        return None
    # Each recorded loss is already divided by the micro-batch count: their sum is the mean.
    return torch.stack([loss.detach() for loss in losses]).sum()
