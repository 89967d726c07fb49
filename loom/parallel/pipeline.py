"""Pipeline parallelism: split the GPT into stages by layer and run them with torch.distributed.pipelining.

A stage is the GPT class with the parts it doesn't hold removed (gpt.py), keeping the full
model's parameter names, so `init_weights(seed)` gives each stage the full model's values and
checkpoints map 1:1. The embedding lives on the first stage, norm + head + loss on the last.

Schedules: `gpipe` and `1f1b` run one stage per rank; `interleaved` (Interleaved 1F1B) runs
`virtual` stages per rank, assigned round-robin: rank r holds stages r, r + pp, r + 2pp, ...
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from loom.errors import ConfigError
from loom.models.gpt import GPT

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


def validate_pipeline(n_layers: int, pp: int, virtual: int, schedule: str, microbatches: int,
                      *, tie_embeddings: bool = False) -> None:
    """Raise a one-line ConfigError for a pipeline setup that cannot run (checks the batch not at all)."""
    for name, value in (("pp", pp), ("pp_virtual_stages", virtual), ("microbatches", microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"parallel.{name} must be a positive integer, got {value!r}")
    if schedule not in SCHEDULES:
        raise ConfigError(f"parallel.pp_schedule = {schedule!r} is unknown; choose one of: {', '.join(SCHEDULES)}")
    if pp > n_layers:
        raise ConfigError(f"parallel.pp = {pp} is more than the model's {n_layers} layers; use pp ≤ {n_layers}")
    if pp > 1 and tie_embeddings:
        # The embedding (first stage) and the head (last stage) would share one weight across ranks.
        raise ConfigError("pipeline parallelism cannot split tied embeddings; set model.tie_embeddings=false")
    if schedule == "interleaved":
        if virtual < 2:
            raise ConfigError(
                f"parallel.pp_schedule = 'interleaved' needs parallel.pp_virtual_stages ≥ 2, got {virtual}; "
                "raise it or use the 1f1b schedule"
            )
        if n_layers % (pp * virtual):
            raise ConfigError(
                f"interleaved pipeline: the model's {n_layers} layers are not divisible by "
                f"pp × virtual stages = {pp} × {virtual} = {pp * virtual}; change pp, pp_virtual_stages or n_layers"
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


def bubble_fraction(pp: int, microbatches: int, virtual: int = 1) -> float:
    """Idle fraction of a pipeline step: (p−1)/(m+p−1), interleaved (p−1)/(v·m+p−1)."""
    return (pp - 1) / (virtual * microbatches + pp - 1)


def build_stage(model: GPT, stage_index: int, num_stages: int, layer_ids: list[int]) -> GPT:
    """The stage module for `stage_index`, from a GPT on the meta device; `model` is left unchanged.

    Only the structure is copied (meta tensors have no storage), so one full model can give every
    stage a rank holds; materialize with `to_empty` + `init_weights(seed)` afterwards.
    """
    if any(not t.is_meta for t in [*model.parameters(), *model.buffers()]):
        raise ValueError("build_stage needs the model on the meta device (build_model(cfg, 'meta'))")
    if not isinstance(model.layers, nn.ModuleList):
        raise TypeError("build_stage needs the full model (layers as an nn.ModuleList), not a stage")
    if num_stages > 1 and model.cfg.tie_embeddings:
        raise ConfigError("pipeline parallelism cannot split tied embeddings; set model.tie_embeddings=false")
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index {stage_index} is outside 0..{num_stages - 1}")
    n_layers = len(model.layers)
    if not layer_ids or any(not 0 <= i < n_layers for i in layer_ids):
        raise ValueError(f"layer_ids {layer_ids} must be a non-empty list of indices in 0..{n_layers - 1}")

    stage = copy.deepcopy(model)
    # Keyed by the original index, so names stay "layers.<i>.…" as in the full model.
    stage.layers = nn.ModuleDict({str(i): stage.layers[i] for i in layer_ids})
    if stage_index > 0:
        stage.tok_embeddings = None  # takes hidden states from the previous stage
    if stage_index < num_stages - 1:
        stage.norm = None  # returns hidden states to the next stage
        stage.output = None
    return stage


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of logits [b, T, V] against targets [b, T], as the plain training loop."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _scaled(loss_fn: LossFn, microbatches: int) -> LossFn:
    # The schedule sums the micro-batch gradients; dividing each loss by m makes that sum the
    # gradient of the mean over the whole batch (micro-batches of equal size).
    def scaled_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_fn(output, target) / microbatches

    return scaled_loss


def build_schedule(stages: list[GPT], stage_indices: list[int], num_stages: int,
                   pp_group: dist.ProcessGroup | None, device: torch.device | str, schedule: str,
                   microbatches: int, loss_fn: LossFn = cross_entropy_loss):
    """Wrap this rank's stage module(s) in PipelineStages and return the torch schedule for them.

    `loss_fn(logits, targets)` is the unscaled mean loss of one micro-batch; the schedule gets it
    divided by `microbatches` (see `pipeline_step` for the loss it reports).
    """
    if schedule not in SCHEDULES:
        raise ConfigError(f"parallel.pp_schedule = {schedule!r} is unknown; choose one of: {', '.join(SCHEDULES)}")
    if len(stages) != len(stage_indices):
        raise ValueError(f"{len(stages)} stage modules but {len(stage_indices)} stage indices")
    device = torch.device(device)
    pipeline_stages = [PipelineStage(module, index, num_stages, device, group=pp_group)
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
    args = (inputs,) if is_first else ()
    losses: list[torch.Tensor] | None = [] if is_last else None
    # return_outputs=False: the last stage would otherwise concatenate every micro-batch's logits.
    schedule.step(*args, target=targets if is_last else None, losses=losses, return_outputs=False)
    if losses is None:
        return None
    # Each recorded loss is already divided by the micro-batch count: their sum is the mean.
    return torch.stack([loss.detach() for loss in losses]).sum()
