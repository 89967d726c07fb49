"""loom.parallel.pipeline and the GPT's stages: stage split, validation, the bubble (each schedule
against a single-process reference: tests/distributed/test_pipeline_schedules.py)."""

from __future__ import annotations

import pytest
import torch

from loom.config import rank_stages, stages_per_rank
from loom.errors import ConfigError
from loom.layout import validate_pipeline
from loom.models.gpt.config import preset
from loom.models.gpt.model import build_model
from loom.models.gpt.pipeline import build_stage
from loom.parallel.pipeline import stage_layers
from loom.plan.step import bubble_fraction

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


def test_rank_stages_v_places_first_and_last_stage_on_rank_0() -> None:
    for schedule in ("zbv", "dualpipev"):
        assert [rank_stages(r, 4, 1, schedule) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
        assert rank_stages(1, 2, 2, schedule) == [1, 2]
        assert stages_per_rank(schedule, 1) == stages_per_rank(schedule, 2) == 2
    assert rank_stages(1, 2, 2, "zb") == [1, 3] and stages_per_rank("zb", 3) == 3


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
        ((3, 2, 2, "interleaved", 4), {}, "4 pipeline stages (pp 2 × virtual 2) do not fit"),
        ((4, 2, 3, "zb", 4), {}, "6 pipeline stages (pp 2 × virtual 3) do not fit the model's 4 layers"),
        ((2, 2, 2, "1f1b", 2), {}, "pp_virtual_stages = 2 needs a schedule that runs several stages"),
        ((4, 2, 2, "1f1b", 4), {}, "pp_virtual_stages = 2 needs a schedule that runs several stages"),
        ((8, 2, 3, "zbv", 4), {}, "'zbv' runs exactly two stages per rank (a V), but"),
        ((6, 4, 1, "dualpipev", 8), {}, "splits the model into 2 × pp = 8 stages (two per rank"),
        ((8, 2, 1, "zbv", 3), {}, "microbatches = 3 is fewer than the 4 stages of the zbv schedule"),
        ((8, 4, 1, "dualpipev", 6), {}, "use microbatches ≥ 2 × pp = 8"),
        ((8, 4, 1, "zb", 2), {}, "= 2 is fewer than parallel.pp = 4, which the zb schedule"),
        ((8, 2, 2, "zb", 5), {}, "= 5 is not a multiple of 2 (microbatches // pp), which the zb"),
        ((8, 2, 1, "zbv", 4), {"tie_embeddings": True}, "set model.tie_embeddings=false"),
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
    validate_pipeline(6, 2, 2, "interleaved", 4)  # layers that do not divide: split as stage_sizes says
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
    stages = [build_stage(meta, s, num_stages, ids)
              for s, ids in enumerate(stage_layers(n_layers, pp, virtual))]
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


def _batch(cfg) -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    return torch.randint(0, cfg.vocab_size, (8, 17), generator=g)
