"""parallel.pp_stage_layers on gloo ranks: stages holding the blocks unevenly train as the single
process does (1f1b, zbv and interleaved as given; interleaved given no split over blocks its stages
do not divide, as config.stage_sizes splits them), and a checkpoint written under one split resumes
under another split, another schedule, and no pipeline."""

from __future__ import annotations

import pytest
from distributed import run_ranks
from test_strategies import ACCUM, make_config, reference_run
from test_zero_bubble import _model_keys, _rank_schedules, _stages, check_matches

LAYOUT = ("parallel.pp=2", "model.n_layers=6", "parallel.microbatches=4", f"train.batch_size={ACCUM * 4 * 2}")
SPLITS = {  # name: the schedule and its split of the 6 blocks
    "1f1b-5-1": ("parallel.pp_schedule=1f1b", "parallel.pp_stage_layers=[5, 1]"),
    "interleaved-1-1-3-1": ("parallel.pp_schedule=interleaved", "parallel.pp_virtual_stages=2",
                            "parallel.pp_stage_layers=[1, 1, 3, 1]"),
    "interleaved-even": ("parallel.pp_schedule=interleaved", "parallel.pp_virtual_stages=2"),  # 1/2/2/1
    "zbv-2-1-1-2": ("parallel.pp_schedule=zbv", "parallel.pp_stage_layers=[2, 1, 1, 2]"),
}


def test_uneven_stages_match_single_process(corpus):
    cfgs = [make_config(corpus, "zero3", *LAYOUT, *split) for split in SPLITS.values()]
    results = run_ranks(_rank_schedules, 2, cfgs)
    reference = reference_run(make_config(corpus, "ddp", *_model_keys(LAYOUT)))
    for i, name in enumerate(SPLITS):
        check_matches(results, i, name, reference)
        blocks = [{k.split(".")[1] for k in rank_results[i][1] if k.startswith("layers.")}
                  for rank_results in results]
        # the blocks each rank holds: the split's stages, placed as the schedule places them
        want = {"1f1b-5-1": [5, 1], "interleaved-1-1-3-1": [4, 2], "interleaved-even": [3, 3],
                "zbv-2-1-1-2": [4, 2]}[name]
        assert [len(b) for b in blocks] == want, (name, blocks)


@pytest.mark.parametrize("before, after", [
    ((2, [*_stages("1f1b", 2, 2), "parallel.pp_stage_layers=[7, 1]"]),
     (2, [*_stages("zbv", 2, 4), "parallel.pp_stage_layers=[1, 3, 3, 1]"])),
    ((2, [*_stages("zbv", 2, 4), "parallel.pp_stage_layers=[1, 3, 3, 1]"]),
     (2, ["parallel.strategy=ddp", "model.n_layers=8"])),
], ids=["1f1b-7-1-to-zbv-1-3-3-1", "zbv-1-3-3-1-to-ddp"])
def test_checkpoints_reshard_between_splits(tmp_path, before, after):
    """Every weight and Adam state as the other layout holds it, and the continued run's losses
    (test_checkpoint's check): the split is not in the checkpoint."""
    from test_checkpoint import test_resume_under_another_strategy_reshards_exactly as resharded_exactly

    resharded_exactly(tmp_path, before, after)
