"""Planted bugs in how the planner prices a pipeline's ranks: the split of the blocks, the busiest
rank's compute, the bubble on the mean rank, the stages whose memory is priced."""

from __future__ import annotations

from planted import Bug

BALANCE = "tests/unit/test_plan_pipeline_balance.py"
SPLIT = "tests/unit/test_stage_split.py"
SPLIT_RANKS = "tests/distributed/test_stage_split_ranks.py"
BAD = "tests/unit/test_bad_input.py::test_bad_input"
SCHEDULES = "tests/unit/test_plan_schedules.py"
PIPELINE = "tests/unit/test_pipeline.py"

BUGS = [
    Bug("planner-splits-its-own-way", "the planner gives the leftover blocks to the first stages, the run "
        "to the middle ones", "loom/plan/shapes.py",
        "        return stage_sizes(self.n_layers, stages, self.stage_split if len(self.stage_split) == "
        "stages else ())\n",
        "        return tuple(self.n_layers // stages + (s < self.n_layers % stages) "
        "for s in range(stages))\n",
        (f"{BALANCE}::test_the_planner_splits_the_blocks_as_the_run_does",)),
    Bug("pipeline-priced-balanced", "a pipeline's compute priced as FLOPs ÷ GPUs, as if every rank ran "
        "the same share (the head's rank is slower)", "loom/plan/step.py",
        "    if imbalance != 1.0:  # the pipeline runs at its busiest rank's pace\n"
        "        flops *= imbalance\n",
        "    if imbalance != 1.0:  # the pipeline runs at its busiest rank's pace\n        flops *= 1.0\n",
        (f"{BALANCE}::test_a_pipeline_step_is_priced_at_its_busiest_rank",)),
    Bug("head-not-on-the-last-stage", "the head's FLOPs left out of the last stage's share",
        "loom/plan/shapes.py",
        "(head if stage == len(sizes) - 1 else 0.0)",
        "(head if stage == -1 else 0.0)",
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
    Bug("split-not-run", "parallel.pp_stage_layers read and checked, but the stages built evenly",
        "loom/parallel/apply.py", "    layers = stage_layers(n_layers, p.pp, local, p.pp_stage_layers)\n",
        "    layers = stage_layers(n_layers, p.pp, local)\n",
        (f"{SPLIT_RANKS}::test_uneven_stages_match_single_process",)),
    Bug("split-not-planned", "the planner prices an even split whatever the shape's stage_split says",
        "loom/plan/shapes.py",
        "        return stage_sizes(self.n_layers, stages, self.stage_split if len(self.stage_split) == "
        "stages else ())\n",
        "        return stage_sizes(self.n_layers, stages)\n",
        (f"{SPLIT}::test_the_split_given_is_the_split_run",
         f"{SPLIT}::test_the_plan_runs_the_split_it_emits")),
    Bug("balance-returns-even", "the balanced split handed back even where it lightens nothing (a label and "
        "a config key that change nothing)", "loom/plan/shapes.py",
        "    return tuple(sizes) if best[0] < max(loads(even)) else ()\n", "    return tuple(sizes)\n",
        (f"{SPLIT}::test_the_balanced_split_is_the_best_there_is",)),
    Bug("balance-breaks-the-headroom", "the balanced split priced even where it breaks the headroom rule "
        "that the even split keeps", "loom/plan/search.py",
        "    if not split or cluster.gpu is None or mem.total <= TIGHT * cluster.gpu.memory_gb * GB:\n",
        "    if True:\n",
        (f"{SPLIT}::test_the_even_split_stays_where_the_balanced_breaks_the_headroom",)),
    Bug("split-not-emitted", "the plan prices a balanced split but --emit writes an even one",
        "loom/plan/search.py", "        p.pp_stage_layers = list(record.get(\"pp_stage_layers\", []))\n", "",
        (f"{SPLIT}::test_the_plan_runs_the_split_it_emits",)),
    Bug("split-sum-unchecked", "a split that does not sum to the model's blocks reaches the run",
        "loom/layout.py", "    if sum(shown) != n_layers:\n", "    if False:\n",
        (f"{SPLIT}::test_a_split_that_cannot_run_is_one_line", f"{BAD}[parallel-stage-layers-sum]")),
    Bug("split-count-checked-late", "a split of the wrong stage count found only once the model is built",
        "loom/config.py", "    if dims.pp > 1 and p.pp_stage_layers:\n        _check_stage_count(p)\n", "",
        (f"{SPLIT}::test_the_stage_count_is_checked_before_launch",)),
    Bug("launch-without-blocks", "the pipeline line at launch leaves out each stage's blocks and the split "
        "worth trying", "loom/plan/step.py",
        "    return text if shape is None or not shape.known else text + _blocks_text(cfg, shape)\n",
        "    return text\n",
        (f"{SPLIT}::test_launch_says_the_blocks_and_the_split_worth_trying",)),
    Bug("split-for-any-gain", "the search and launch balance the stages for any gain, a 1% one within "
        "what the FLOPs count can tell included", "loom/plan/shapes.py",
        "    return split if balanced <= (1 - SPLIT_WORTH) * even else ()\n", "    return split\n",
        (f"{SPLIT}::test_a_split_is_offered_where_it_takes_five_percent_off_the_busiest_rank",)),
    Bug("stage-without-blocks-accepted", "a split whose counts sum right but leave a stage empty reaches the "
        "run", "loom/layout.py", "    if min(shown) < 1:\n", "    if False:\n",
        (f"{SPLIT}::test_a_split_that_cannot_run_is_one_line",)),
    Bug("split-rule-allows-zero", "parallel.pp_stage_layers's rule takes a stage of 0 blocks, refused only "
        "once the model is known", "loom/config.py",
        '"parallel.pp_stage_layers": _count(1, MAX_LAYERS,',
        '"parallel.pp_stage_layers": _count(0, MAX_LAYERS,',
        (f"{BAD}[parallel-stage-layers-empty-stage]",)),
    Bug("split-inert-unsaid", "parallel.pp_stage_layers without a pipeline accepted without a word",
        "loom/config.py", 'for k in ("microbatches", "pp_schedule", "pp_stage_layers", "pp_virtual_stages")',
        'for k in ("microbatches", "pp_schedule", "pp_virtual_stages")',
        (f"{SPLIT}::test_a_split_without_a_pipeline_is_said_to_do_nothing",)),
    Bug("stages-built-evenly", "the pipeline's stage builder ignores the split it is given",
        "loom/parallel/pipeline.py", "    for size in stage_sizes(n_layers, num_stages, tuple(split)):\n",
        "    for size in stage_sizes(n_layers, num_stages):\n",
        (f"{SPLIT}::test_any_split_runs_as_given_or_is_one_line",)),
    Bug("balance-off-rank-0", "the balancing moves blocks off rank 0 whichever rank is the busiest",
        "loom/plan/shapes.py", "        busiest = max(range(pp), key=lambda r: (per_rank[r], -r))\n",
        "        busiest = 0\n",
        (f"{SPLIT}::test_the_balanced_split_takes_blocks_off_the_heads_stage",)),
    Bug("stage-layers-renumbered", "a stage's blocks keyed by their place in the stage, so a checkpoint's "
        "names depend on the split", "loom/models/gpt/pipeline.py",
        "    stage.layers = nn.ModuleDict({str(i): stage.layers[i] for i in layer_ids})\n",
        "    stage.layers = nn.ModuleDict({str(k): stage.layers[i] for k, i in enumerate(layer_ids)})\n",
        (f"{SPLIT_RANKS}::test_checkpoints_reshard_between_splits",)),
    Bug("interleaved-searched-where-layers-divide", "the search leaves out interleaved and zb over two "
        "stages per rank where the layers do not divide into the stages, though they run",
        "loom/plan/search.py",
        "    if 2 * pp <= shape.n_layers:  # (layers that do not divide split as config.stage_sizes says)\n"
        "        options += [(\"interleaved\", 2), (\"zb\", 2), (\"zbv\", 2)]",
        "    if 2 * pp <= shape.n_layers:  # (layers that do not divide split as config.stage_sizes says)\n"
        "        options += ([(\"interleaved\", 2), (\"zb\", 2)] if shape.n_layers % (2 * pp) == 0 else [])\n"
        "        options += [(\"zbv\", 2)]",
        (f"{SCHEDULES}::test_interleaved_is_searched_where_the_layers_do_not_divide",)),
    Bug("stage-count-unchecked", "more stages than layers let through until a rank builds its stage",
        "loom/layout.py",
        "says, in any schedule\n    refuse_more_stages_than_layers(n_layers, pp, local)\n", "says, in any "
        "schedule\n",
        (f"{PIPELINE}::test_validate_pipeline_errors",)),
]
