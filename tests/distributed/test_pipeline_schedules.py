"""Each pipeline schedule (GPipe, 1F1B, interleaved) on gloo ranks against a single-process reference:
the loss and every gradient, gradients that accumulate over two steps, and the order in which each
rank runs its micro-batches' forwards and backwards (which is all that tells the schedules apart)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from test_pipeline import _batch

from loom.config import rank_stages, stages_per_rank
from loom.layout import validate_pipeline
from loom.models.gpt.config import preset
from loom.models.gpt.model import GPT, build_model
from loom.models.gpt.pipeline import build_stage
from loom.parallel.pipeline import stage_layers

SEED = 7
RTOL = 1e-5


def _reference(n_layers: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    cfg = preset("tiny", n_layers=n_layers)
    model = build_model(cfg, device="cpu")
    model.init_weights(SEED)
    tokens = _batch(cfg)
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _rank_pipeline(schedule_name: str, pp: int, virtual: int, n_layers: int, microbatches: int):
    """On one rank: build this rank's stage(s), run two pipeline steps; grads after each, loss of the
    first."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from loom.config import SPLIT_BACKWARD_SCHEDULES
    from loom.models.gpt.lean_ops import use_plain_ops
    from loom.parallel.pipeline import build_schedule, pipeline_step, weight_pass_takes_functions
    from loom.train.task import cross_entropy

    dist.init_process_group("gloo")
    # as the driver does
    use_plain_ops(schedule_name in SPLIT_BACKWARD_SCHEDULES and not weight_pass_takes_functions())
    mesh = init_device_mesh("cpu", (pp,), mesh_dim_names=("pp",))
    rank = mesh.get_local_rank("pp")
    cfg = preset("tiny", n_layers=n_layers)
    local = stages_per_rank(schedule_name, virtual)
    num_stages = pp * local
    layers = stage_layers(n_layers, pp, local)
    indices = rank_stages(rank, pp, virtual, schedule_name)
    full = build_model(cfg, device="meta")
    stages: list[GPT] = [build_stage(full, i, num_stages, layers[i]) for i in indices]
    for stage in stages:
        stage.to_empty(device="cpu")
        stage.init_weights(SEED)
    schedule = build_schedule(stages, indices, num_stages, mesh.get_group("pp"), "cpu", schedule_name,
                              microbatches, cross_entropy)
    tokens = _batch(cfg)
    is_first, is_last = 0 in indices, num_stages - 1 in indices
    order: list[str] = []  # this rank's micro-batch forwards (F) and backwards (B)
    for stage in stages:
        stage.register_forward_pre_hook(lambda *_: order.append("F"))
        next(stage.parameters()).register_hook(lambda grad: order.append("B"))  # once per backward

    def step() -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        loss = pipeline_step(schedule, tokens[:, :-1], tokens[:, 1:], is_first, is_last)
        return loss, {n: p.grad.clone() for s in stages for n, p in s.named_parameters()}

    loss, grads = step()
    order.clear()  # the first step also runs each stage once to infer the shapes it passes on
    _, accumulated = step()  # no zero_grad: gradients must add up, as in gradient accumulation
    return loss, grads, accumulated, "".join(order)


def _order(schedule: str, rank: int, pp: int, virtual: int, m: int) -> str:
    """What pipeline rank `rank` runs in one step, a forward (F) and a backward (B) per micro-batch
    and stage: GPipe every forward, then every backward; 1F1B w = pp − rank forwards (its warmup of
    pp − 1 − rank, and the first steady one), then a backward and a forward in turn, then the last w
    backwards; interleaved the same over its v stages, with torch's warmup of (v − 1) × the
    micro-batches per round + 2(pp − 1 − rank)."""
    if schedule == "gpipe":
        return "F" * m + "B" * m
    per_round = m // max(1, m // pp)
    w = pp - rank if schedule == "1f1b" else (virtual - 1) * per_round + 2 * (pp - 1 - rank) + 1
    return "F" * w + "BF" * (virtual * m - w) + "B" * w


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize(("schedule", "virtual", "n_layers"),
                         [("gpipe", 1, 2), ("1f1b", 1, 2), ("interleaved", 2, 4), ("zb", 1, 2), ("zb", 2, 4),
                          ("zbv", 1, 4), ("dualpipev", 1, 4)])
def test_schedule_matches_single_process(schedule: str, virtual: int, n_layers: int) -> None:
    pp, microbatches = 2, 4
    validate_pipeline(n_layers, pp, virtual, schedule, microbatches)
    ref_loss, ref_grads = _reference(n_layers)
    results = run_ranks(_rank_pipeline, pp, schedule, pp, virtual, n_layers, microbatches)

    losses = [loss for loss, _, _, _ in results]
    last = 0 if schedule in ("zbv", "dualpipev") else pp - 1  # a V ends on rank 0
    assert [loss is None for loss in losses] == [r != last for r in range(pp)]  # the last stage's rank only
    assert abs(losses[last].item() - ref_loss.item()) <= RTOL * abs(ref_loss.item())

    seen: set[str] = set()
    for _, grads, accumulated, _ in results:
        assert not seen & grads.keys()  # each parameter lives on one rank
        seen |= grads.keys()
        for name, grad in grads.items():
            assert _rel(grad, ref_grads[name]) < RTOL, name
            assert _rel(accumulated[name], 2 * ref_grads[name]) < RTOL, name
    assert seen == ref_grads.keys()
    orders = [order for _, _, _, order in results]
    if schedule in ("gpipe", "1f1b", "interleaved"):
        assert orders == [_order(schedule, r, pp, virtual, microbatches) for r in range(pp)]
    else:  # the zero-bubble orders are torch's own; each stage still runs each micro-batch once each way
        local = stages_per_rank(schedule, virtual)
        assert all(o.count("F") == o.count("B") == local * microbatches for o in orders), orders
