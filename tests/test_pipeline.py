"""loom.parallel.pipeline: stage split, validation, and each schedule against a single-process reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks

from loom.errors import ConfigError
from loom.models.gpt import GPT, build_model, preset
from loom.parallel.pipeline import (
    bubble_fraction,
    build_stage,
    rank_stages,
    stage_layers,
    validate_pipeline,
)

SEED = 7
RTOL = 1e-5


# ---------------------------------------------------------------- stage split and formulas

@pytest.mark.parametrize(("n_layers", "pp", "virtual"), [(4, 2, 1), (5, 2, 1), (7, 3, 1), (10, 4, 1),
                                                        (8, 2, 2), (9, 4, 2), (3, 3, 1), (1, 1, 1)])
def test_stage_layers_balanced_and_covering(n_layers: int, pp: int, virtual: int) -> None:
    stages = stage_layers(n_layers, pp, virtual)
    assert len(stages) == pp * virtual
    assert [i for s in stages for i in s] == list(range(n_layers))  # every layer once, in order
    sizes = [len(s) for s in stages]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    assert sizes[-1] == min(sizes)  # the last stage also runs the head and the loss


def test_stage_layers_extra_layers_go_to_middle_stages_first() -> None:
    assert stage_layers(7, 3) == [[0, 1], [2, 3, 4], [5, 6]]
    assert [len(s) for s in stage_layers(10, 4)] == [2, 3, 3, 2]  # middle stages first
    assert [len(s) for s in stage_layers(11, 4)] == [3, 3, 3, 2]  # then the first stage, never the last
    assert [len(s) for s in stage_layers(6, 4)] == [1, 2, 2, 1]
    assert stage_layers(5, 2) == [[0, 1, 2], [3, 4]]


def test_rank_stages_round_robin() -> None:
    assert rank_stages(0, 2, 2) == [0, 2]
    assert rank_stages(1, 2, 2) == [1, 3]
    assert rank_stages(2, 4, 3) == [2, 6, 10]
    assert rank_stages(1, 4) == [1]


def test_bubble_fraction() -> None:
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 8, virtual=2) == pytest.approx(3 / 19)
    assert bubble_fraction(1, 4) == 0.0


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((4, 8, 1, "1f1b", 8), {}, "parallel.pp = 8 is more than the model's 4 layers; use pp ≤ 4"),
        ((4, 2, 1, "zigzag", 4), {}, "pp_schedule = 'zigzag' is unknown"),
        ((4, 4, 1, "1f1b", 2), {}, "microbatches = 2 is fewer than parallel.pp = 4"),
        ((8, 4, 2, "interleaved", 2), {}, "microbatches = 2 is fewer than parallel.pp = 4"),
        ((4, 2, 1, "interleaved", 4), {}, "needs parallel.pp_virtual_stages ≥ 2"),
        ((6, 2, 2, "interleaved", 4), {}, "not divisible by pp × virtual stages = 2 × 2 = 4"),
        ((4, 2, 2, "1f1b", 4), {}, "pp_virtual_stages = 2 needs parallel.pp_schedule = 'interleaved'"),
        ((8, 2, 2, "interleaved", 5), {}, "microbatches = 5 is not a multiple of 2"),
        ((4, 2, 1, "gpipe", 0), {}, "microbatches must be a positive integer"),
        ((4, 0, 1, "gpipe", 4), {}, "pp must be a positive integer"),
        ((4, 2, 1, "gpipe", 4), {"tie_embeddings": True}, "set model.tie_embeddings=false"),
    ],
)
def test_validate_pipeline_errors(args: tuple, kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate_pipeline(*args, **kwargs)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_validate_pipeline_accepts() -> None:
    validate_pipeline(4, 2, 1, "gpipe", 1)  # gpipe runs with fewer micro-batches than stages
    validate_pipeline(4, 2, 1, "1f1b", 2)
    validate_pipeline(8, 2, 2, "interleaved", 4)
    validate_pipeline(4, 4, 1, "1f1b", 6)
    validate_pipeline(4, 1, 1, "1f1b", 1, tie_embeddings=True)  # pp = 1 splits nothing


# ---------------------------------------------------------------- build_stage

@pytest.mark.parametrize(("n_layers", "pp", "virtual"), [(4, 2, 2), (3, 2, 1)])
def test_build_stage_keeps_names_and_init(n_layers: int, pp: int, virtual: int) -> None:
    cfg = preset("tiny", n_layers=n_layers)
    full = build_model(cfg, device="cpu")
    full.init_weights(SEED)
    meta = build_model(cfg, device="meta")
    num_stages = pp * virtual
    stages = [build_stage(meta, s, num_stages, ids) for s, ids in enumerate(stage_layers(n_layers, pp, virtual))]
    assert isinstance(meta.layers, torch.nn.ModuleList) and meta.output is not None  # left unchanged

    full_params = dict(full.named_parameters())
    names = [n for stage in stages for n, _ in stage.named_parameters()]
    assert len(names) == len(set(names)) and set(names) == set(full_params)
    for stage in stages:
        assert all(p.is_meta for p in stage.parameters())  # nothing materialized
        stage.to_empty(device="cpu")
        stage.init_weights(SEED)
        for name, p in stage.named_parameters():
            assert torch.equal(p, full_params[name]), name

    # Chained stages compute the full model's logits.
    tokens = _batch(cfg)[:, :-1]
    with torch.no_grad():
        h = tokens
        for stage in stages:
            h = stage(h)
        torch.testing.assert_close(h, full(tokens), rtol=1e-6, atol=1e-6)
    assert stages[0].tok_embeddings is not None and stages[1].tok_embeddings is None
    assert stages[0].output is None and stages[-1].output is not None


def test_build_stage_refuses_tied_embeddings_and_materialized_models() -> None:
    tied = build_model(preset("tiny", tie_embeddings=True), device="meta")
    with pytest.raises(ConfigError, match="set model.tie_embeddings=false"):
        build_stage(tied, 0, 2, [0])
    build_stage(tied, 0, 1, [0, 1])  # a single stage keeps the tie
    with pytest.raises(ValueError, match="meta device"):
        build_stage(build_model(preset("tiny"), device="cpu"), 0, 2, [0])


# ---------------------------------------------------------------- schedules vs single process

def _batch(cfg) -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    return torch.randint(0, cfg.vocab_size, (8, 17), generator=g)


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
    """On one rank: build this rank's stage(s), run two pipeline steps; grads after each, loss of the first."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from loom.parallel.pipeline import build_schedule, pipeline_step

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (pp,), mesh_dim_names=("pp",))
    rank = mesh.get_local_rank("pp")
    cfg = preset("tiny", n_layers=n_layers)
    num_stages = pp * virtual
    layers = stage_layers(n_layers, pp, virtual)
    indices = rank_stages(rank, pp, virtual)
    full = build_model(cfg, device="meta")
    stages: list[GPT] = [build_stage(full, i, num_stages, layers[i]) for i in indices]
    for stage in stages:
        stage.to_empty(device="cpu")
        stage.init_weights(SEED)
    schedule = build_schedule(stages, indices, num_stages, mesh.get_group("pp"), "cpu", schedule_name,
                              microbatches)
    tokens = _batch(cfg)
    is_first, is_last = 0 in indices, num_stages - 1 in indices

    def step() -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        loss = pipeline_step(schedule, tokens[:, :-1], tokens[:, 1:], is_first, is_last)
        return loss, {n: p.grad.clone() for s in stages for n, p in s.named_parameters()}

    loss, grads = step()
    _, accumulated = step()  # no zero_grad: gradients must add up, as in gradient accumulation
    return loss, grads, accumulated


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize(("schedule", "virtual", "n_layers"), [("gpipe", 1, 2), ("1f1b", 1, 2), ("interleaved", 2, 4)])
def test_schedule_matches_single_process(schedule: str, virtual: int, n_layers: int) -> None:
    pp, microbatches = 2, 4
    validate_pipeline(n_layers, pp, virtual, schedule, microbatches)
    ref_loss, ref_grads = _reference(n_layers)
    results = run_ranks(_rank_pipeline, pp, schedule, pp, virtual, n_layers, microbatches)

    losses = [loss for loss, _, _ in results]
    assert losses[0] is None  # only the last stage's rank has the loss
    assert abs(losses[-1].item() - ref_loss.item()) <= RTOL * abs(ref_loss.item())

    seen: set[str] = set()
    for _, grads, accumulated in results:
        assert not seen & grads.keys()  # each parameter lives on one rank
        seen |= grads.keys()
        for name, grad in grads.items():
            assert _rel(grad, ref_grads[name]) < RTOL, name
            assert _rel(accumulated[name], 2 * ref_grads[name]) < RTOL, name
    assert seen == ref_grads.keys()
