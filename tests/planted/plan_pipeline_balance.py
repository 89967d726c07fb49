"""Planted bugs in how the planner prices a pipeline's ranks: the split of the blocks, the busiest
rank's compute, the bubble on the mean rank, the stages whose memory is priced."""

from __future__ import annotations

from planted import Bug

BALANCE = "tests/unit/test_plan_pipeline_balance.py"

BUGS = [
    Bug("planner-splits-its-own-way", "the planner gives the leftover blocks to the first stages, the run "
        "to the middle ones", "loom/plan/shapes.py",
        "    return stage_sizes(n_layers, stages)[stage]\n",
        "    return n_layers // stages + (1 if stage < n_layers % stages else 0)\n",
        (f"{BALANCE}::test_the_planner_splits_the_blocks_as_the_run_does",)),
    Bug("pipeline-priced-balanced", "a pipeline's compute priced as FLOPs ÷ GPUs, as if every rank ran "
        "the same share (the head's rank is slower)", "loom/plan/step.py",
        "    if imbalance != 1.0:  # the pipeline runs at its busiest rank's pace\n"
        "        flops *= imbalance\n",
        "    if imbalance != 1.0:  # the pipeline runs at its busiest rank's pace\n        flops *= 1.0\n",
        (f"{BALANCE}::test_a_pipeline_step_is_priced_at_its_busiest_rank",)),
    Bug("head-not-on-the-last-stage", "the head's FLOPs left out of the last stage's share",
        "loom/plan/shapes.py",
        "if stage == stages - 1 else 0.0\n        out.append(",
        "if stage == -1 else 0.0\n        out.append(",
        (f"{BALANCE}::test_the_stages_flops_sum_to_the_models",
         f"{BALANCE}::test_the_head_makes_its_rank_the_busiest")),
    Bug("bubble-on-the-busiest-rank", "the fill and drain priced on the busiest rank's passes, not the "
        "mean rank's", "loom/plan/step.py",
        "        busy /= imbalance\n", "",
        (f"{BALANCE}::test_a_pipeline_step_is_priced_at_its_busiest_rank",)),
    Bug("v-rank-0-one-end", "on a measured device a V's rank 0 priced with the head but not the "
        "embedding's backward", "loom/plan/step.py",
        " + (embedding if stage == 0 else 0.0)\n", "\n",
        (f"{BALANCE}::test_the_measured_device_prices_a_vs_rank_0_with_both_ends",)),
    Bug("uneven-middle-stage-unpriced", "a dense model's memory priced on its end stages only, though an "
        "uneven split puts the extra blocks in the middle", "loom/plan/shapes.py",
        "        if self.known and stages > 2:\n            return list(_priced_stages(self, stages))",
        "        if self.moe and stages > 2:\n            return list(_priced_stages(self, stages))",
        (f"{BALANCE}::test_an_uneven_split_prices_its_fullest_middle_stage",)),
]
