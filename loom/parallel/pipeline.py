"""Pipeline parallelism, the model-independent part: which layers each stage holds, which stages
each rank runs, and torch.distributed.pipelining's schedules over them.

Each model builds its own stage modules (loom/models/gpt/pipeline.py, loom/models/hf/adapter.py):
the embedding on the first stage, norm + head + loss on the last, the full model's parameter
names kept so checkpoints map 1:1.

Schedules: `gpipe` and `1f1b` run one stage per rank; `interleaved` (Interleaved 1F1B) and `zb`
(interleaved zero bubble, ZB1P) run `virtual` stages per rank, assigned round-robin: rank r holds
stages r, r + pp, r + 2pp, ...; `zbv` (zero bubble, V) and `dualpipev` (DeepSeek's DualPipe in its V
form) run two stages per rank in a V: rank r holds stages r and 2pp − 1 − r, so the first and the last
stage share rank 0. The zero-bubble schedules split each backward into B (the input gradient, which
the previous stage waits for) and W (the weight gradient, deferred into the bubble); torch assigns W's
gradients itself, without autograd's hooks, so DDP's reducer never sees them: ddp and zero1 replicate
through FSDP2 there (strategies.Strategy.uses_fsdp). The bubble of each is the planner's
loom.plan.step.bubble_fraction.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.distributed.pipelining.schedules import _ComputationType

from loom.config import stage_sizes
from loom.errors import ConfigError
from loom.layout import refuse_more_stages_than_layers
from loom.parallel.backward_pass import backward_pass

# An action's kind (private, the same in torch 2.11 and 2.13; see pipeline_eval)
_Kind = _ComputationType
_BACKWARD = {_Kind.FULL_BACKWARD, _Kind.BACKWARD_INPUT, _Kind.BACKWARD_WEIGHT, _Kind.SEND_B, _Kind.RECV_B,
             _Kind.REDUCE_GRAD}

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev")
_CLASSES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
            "zb": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def stage_layers(n_layers: int, pp: int, virtual: int = 1, split: Sequence[int] = ()) -> list[list[int]]:
    """The layer indices of each of the pp × virtual stages, in order, split by config.stage_sizes:
    `split` (parallel.pp_stage_layers) where given, else evenly (the extra layers to the middle
    stages, then the first, never the last)."""
    num_stages = pp * virtual
    refuse_more_stages_than_layers(n_layers, pp, virtual)
    stages, start = [], 0
    for size in stage_sizes(n_layers, num_stages, tuple(split)):
        stages.append(list(range(start, start + size)))
        start += size
    return stages


@functools.cache
def weight_pass_takes_functions() -> bool:
    """Whether this torch's split backward can compute a weight gradient from a Python autograd
    Function's node (torch 2.13 can; 2.11 reads input metadata that such nodes do not expose there):
    tried once on a two-element product through torch's own input and weight passes. Where it cannot,
    loom's GPT runs plain ops for its Functions that take a parameter (loom/models/gpt/lean_ops.py) and
    its last stage the full logits instead of the chunked loss."""

    class Product(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x * w

        @staticmethod
        def backward(ctx, grad):
            x, w = ctx.saved_tensors
            return grad * w, grad * x

    x, w = torch.ones(2, requires_grad=True), nn.Parameter(torch.ones(2))
    y = Product.apply(x * 2, w)
    try:
        _, groups = stage_backward_input([y], [torch.ones(2)], [x], iter([w]))
        stage_backward_weight(iter([w]), groups)
    except RuntimeError:
        return False
    return True


_inferring = threading.local()


def inferring_shapes() -> bool:
    """Whether this thread runs a pipeline stage's metadata pass (torch runs a real forward and backward
    once before the first step to learn the shapes): not training, so a module that tallies what its
    training forward did (an MoE block's routing) skips it."""
    return getattr(_inferring, "on", False)


class _Stage(PipelineStage):
    """torch's PipelineStage, its metadata pass marked (inferring_shapes), its first step connecting
    only neighbours on other ranks."""

    def _get_init_p2p_neighbors_ops(self):
        # torch 2.11 lists a neighbour on this very rank too (the two middle stages of a V), and gloo
        # cannot send to itself; those stages hand tensors over in memory, so nothing connects them.
        return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != self.group_rank]

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
        # Every backward of a stage goes through here, its kind named: the Functions that take a
        # weight compute only the gradients this pass takes (loom/parallel/backward_pass.py).
        with backward_pass(backward_type):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)

    def _forward_metadata_inference(self, *args, **kwargs):  # torch 2.13's metadata pass
        with _marked_inferring():
            return super()._forward_metadata_inference(*args, **kwargs)

    def _shape_inference(self, *args, **kwargs):  # torch 2.11's: a training-mode forward on zeros
        with _marked_inferring():
            return super()._shape_inference(*args, **kwargs)


@contextlib.contextmanager
def _marked_inferring():
    _inferring.on = True
    try:
        yield
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
    if schedule in ("gpipe", "1f1b"):
        if len(pipeline_stages) != 1:
            raise ValueError(f"the {schedule} schedule runs one stage per rank, got {len(pipeline_stages)}")
        return _CLASSES[schedule](pipeline_stages[0], **kwargs)
    return _CLASSES[schedule](pipeline_stages, **kwargs)


def receive_buffers(schedule) -> list[torch.Tensor]:
    """The tensors this rank's stages receive into, allocated at the first step and kept: a buffer per
    micro-batch for each input (all but the first stage) and for each output's gradient (all but the
    last). A memory measurement that starts after the first step must be given them."""
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    return [info.buffer for stage in stages
            for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values())
            for info in infos if isinstance(getattr(info, "buffer", None), torch.Tensor)]


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


def pipeline_eval(schedule, inputs: torch.Tensor | None, targets: torch.Tensor | None,
                  losses: list | None) -> None:
    """Forward only through the stages, each micro-batch's loss appended to `losses` (last stage).

    torch's eval() of the schedules that run from an action list (interleaved, zb, zbv, dualpipev)
    still walks the training order, backward actions included; under a V the stage that hands its
    input gradient to the stage beside it on the same rank then fails. Those schedules evaluate
    through their training order less its backward actions (and their sends and receives): a
    subsequence of an order that runs, so it runs, each forward waiting only on earlier forwards."""
    args = (inputs,) if inputs is not None else ()
    training = getattr(schedule, "pipeline_order_with_comms", None)
    if training is None:  # gpipe, 1f1b: eval() runs forwards only
        schedule.eval(*args, target=targets, losses=losses)
        return
    forward = getattr(schedule, "_loom_forward_order", None)
    if forward is None:
        forward = schedule._loom_forward_order = {rank: list(_forward_actions(actions))
                                                  for rank, actions in training.items()}
    schedule.pipeline_order_with_comms = forward
    try:
        schedule.eval(*args, target=targets, losses=losses)
    finally:
        schedule.pipeline_order_with_comms = training


def _forward_actions(actions):
    """The forward part of one rank's lowered action list (DualPipeV's overlapped F+B: its F)."""
    for action in actions:
        kind = action.computation_type
        if kind == _Kind.OVERLAP_F_B:
            yield from (a for a in action.sub_actions if a.computation_type == _Kind.FORWARD)
        elif kind not in _BACKWARD:
            yield action
