"""Planted bugs in the loop's control-plane collectives (issue 40, item 2: planned beside the engines',
so the report raises no false "Off plan") and in ending train()'s process group (item 4: no thread of
gloo's left running at a script's exit)."""

from __future__ import annotations

from planted import Bug

TESTS = "tests/unit/test_first_hour2_control_plane.py"
MEASURED = f"{TESTS}::test_planned_collectives_are_the_measured_ones"
TP = f"{TESTS}::test_tensor_parallel_collectives_are_the_measured_ones"
MOE = f"{TESTS}::test_a_mixture_of_experts_loop_collectives_are_the_measured_ones"
MEASURED_RUN = "tests/distributed/test_plan_measured.py::test_measured_matches_plan"
PP = f"{TESTS}::test_each_pipeline_rank_is_planned_its_own_collectives"

BUGS = [
    Bug("loop-counts-not-in-kinds", "the loop's collectives are listed apart but not counted in their kinds",
        "loom/plan/comm.py",
        "counts[op.kind] = None if known is None else known + op.count",
        "counts[op.kind] = None if known is None else known",
        (f"{TESTS}::test_the_default_profile_is_not_off_plan_but_a_real_miss_is", f"{MEASURED}[zero3-1-2]")),
    Bug("loop-norm-on-one-rank", "the gradient norm's all-reduce planned on a shard group of one, where "
        "DTensor issues none", "loom/plan/comm.py",
        "if s.shards_params and c.shard_size > 1 and dense:",
        "if s.shards_params and c.shard_size >= 1 and dense:",
        (f"{MEASURED}[zero3-1-1]",)),
    Bug("loop-bucket-order-short", "DDP's bucket order broadcast without the count of its indices",
        "loom/plan/comm.py",
        "4 * (trained_tensors + 1 + buckets)",
        "4 * (trained_tensors + buckets)",
        (f"{MEASURED}[ddp-2-1]", f"{TESTS}::test_the_loop_collectives_are_listed_apart_by_what_they_carry")),
    Bug("train-group-kept-alive", "train() keeps its mesh referenced when its process group ends: gloo's "
        "and the store's threads outlive the call, into the interpreter's exit", "loom/train/driver.py",
        "            d = watcher = None  # nothing here holds the group when it ends\n",
        "            watcher = None\n",
        (f"{TESTS}::test_train_in_process_leaves_no_thread_and_no_group",
         f"{TESTS}::test_a_script_that_trains_then_exits_returns_0")),
    Bug("group-threads-left-to-exit", "the process group destroyed but not collected: its threads are "
        "joined whenever the collector runs, at worst in the interpreter's teardown", "loom/parallel/mesh.py",
        "        gc.collect()\n",
        "",
        (f"{TESTS}::test_train_in_process_leaves_no_thread_and_no_group",)),
    Bug("loop-pipeline-norm-unplanned", "a pipeline's all-reduce of its stages' squared norms left out",
        "loom/plan/comm.py",
        "    if c.pp > 1:\n        loop.append(",
        "    if c.pp > 2:\n        loop.append(",
        (f"{TESTS}::test_a_pipeline_adds_its_stages_norms",)),
    Bug("report-flags-unplanned-loop-total", "the total count still flagged where the plan leaves the "
        "loop's collectives out (a mixture of experts)", "loom/observe/report.py",
        "if off and loop_unplanned and label in LOOP_COUNTS:",
        "if off and loop_unplanned and label in LOOP_COUNTS[1:]:",
        (f"{TESTS}::test_where_the_loop_is_not_planned_its_extra_counts_are_not_a_miss",)),
]
BUGS += [
    Bug("group-ended-under-a-launcher", "train() ends the group it started on a launcher's ranks too: a "
        "script's second train() (a run, then its resume) races the old group on the same port and hangs",
        "loom/parallel/mesh.py",
        "        if starts and alone:\n",
        "        if starts:\n",
        ("tests/unit/test_group_lifetime.py::"
         "test_a_launchers_rank_keeps_it_for_the_next_call_and_ends_it_at_exit",)),
    Bug("tp-loss-one-chunk", "the vocabulary-split loss's statistics planned as one chunk's",
        "loom/plan/comm.py",
        "calls = 2 * math.ceil(tokens / chunk) if chunk > 0 else 3",
        "calls = 2 if chunk > 0 else 3",
        (f"{TP}[zero3-1-2-2-4]",)),
    Bug("tp-norm-not-over-tp", "the gradient norm's partial sums over tp left out", "loom/plan/comm.py",
        "count, payload = (1, 4 * split) if split else (0, 0)",
        "count, payload = (0, 0)",
        (f"{TP}[zero3-1-1-2-2]", f"{TP}[ddp-2-1-2-4]")),
    Bug("tp-norm-whole-over-tp", "the norms' gains (whole on each TP rank) planned in the norm's sum over tp",
        "loom/train/record.py",
        'name == dim and placement.is_shard()',
        'name == dim',
        (f"{TESTS}::test_the_tensors_split_over_a_dimension_are_those_sharded_on_it",)),
    Bug("lora-tp-grads-unplanned", "LoRA's adapter factors whole on each TP rank: their gradients' "
        "all-reduce over tp left out", "loom/plan/comm.py",
        "        if w.lora is not None and not shape.moe:  # the adapter factors whole on each TP rank",
        "        if False:",
        (f"{TP}[zero3-1-2-2-4-lora.rank=4]",)),
    Bug("lora-tp-frozen-embedding-reduced", "LoRA's frozen embedding priced with its input gradient's "
        "reduction over tp", "loom/plan/comm.py",
        "+ (2 if c.pp == 1 else 1) - frozen_input",
        "+ (2 if c.pp == 1 else 1)",
        (f"{TP}[zero3-1-2-2-4-lora.rank=4]",)),
    Bug("sp-norm-grads-unplanned", "sequence parallel's norm gradients, all-reduced over tp, left out",
        "loom/plan/comm.py",
        "if c.sequence_parallel and not shape.moe and (w.lora is None or w.lora.train_norms):",
        "if False:",
        (f"{TP}[zero3-1-2-2-4-parallel.sequence_parallel=true]",)),
    Bug("tp-kept-unit-split-whole", "zero3's unit kept gathered priced as split over tp, its norms too",
        "loom/plan/comm.py",
        "per_param * ((units[-1] - whole) / c.tp + whole)",
        "per_param * units[-1] / c.tp",
        (f"{TP}[zero3-1-2-2-4]", f"{TP}[zero3-1-2-2-4-parallel.fsdp_unit_mb=0]")),
    Bug("tp-zero3-as-zero2", "zero3 under TP planned as zero2: its units not gathered again in backward",
        "loom/plan/comm.py",
        "gathered = micro_steps * param_bytes + micro_steps * (param_bytes - kept)",
        "gathered = micro_steps * param_bytes",
        (f"{TP}[zero3-1-2-2-4-parallel.fsdp_unit_mb=0]",)),
    Bug("moe-tally-unplanned", "a mixture of experts' router tally left out of the loop's collectives",
        "loom/plan/comm.py",
        "        if blocks:\n            loop.append(",
        "        if False:\n            loop.append(",
        (f"{TESTS}::test_a_mixture_of_experts_loop_collectives_are_the_measured_ones",)),
    Bug("pp-loss-statistics-on-every-stage", "within a pipeline, the vocabulary-split loss's statistics "
        "planned on every stage, not the last alone", "loom/plan/comm.py",
        "loop += tp_loop_collectives(w, c, trained_tensors, tp_split_tensors, total - 1 in stages)",
        "loop += tp_loop_collectives(w, c, trained_tensors, tp_split_tensors)",
        (f"{PP}[tiny-zero3-1-1-2]", f"{MEASURED_RUN}[pp2xtp2-moe]")),
    Bug("pp-tally-of-every-block", "within a pipeline, each stage's router tally planned over every MoE "
        "block of the model", "loom/plan/comm.py",
        "blocks = sum(shape.moe_layers_in(*shape.stage_layers(stage, total)) for stage in stages)",
        "blocks = shape.moe_layers",
        (f"{PP}[tiny-moe-zero3-1-1-1]",)),
    Bug("pp-stages-tallies-unplanned", "the stages' sums of their tallies (and the largest imbalance) over "
        "pp left out", "loom/plan/comm.py",
        "        if c.pp > 1:  # the stages' sums",
        "        if False:  # the stages' sums",
        (f"{PP}[tiny-moe-zero3-1-1-1]",)),
    Bug("rank-plan-ignored", "each rank compared with the collectives of the rank that wrote the plan",
        "loom/train/record.py",
        'own = m.get("planned_collectives") or plan',
        "own = plan",
        (f"{PP}[tiny-zero3-1-1-2]", f"{PP}[tiny-zero3-1-2-1-parallel.fsdp_unit_mb=0]")),
    Bug("rank-plan-required", "a memory.json written before the ranks recorded their own plans no longer "
        "reads", "loom/train/record.py",
        'own = m.get("planned_collectives") or plan',
        'own = m["planned_collectives"]',
        (f"{TESTS}::test_a_rank_without_its_own_plan_is_compared_with_the_plans",)),
    Bug("rank-plan-not-recorded", "a rank's own planned collectives not recorded beside its measurements",
        "loom/train/driver.py",
        '"planned_collectives": {k: plan[k] for k in record.PLANNED_COLLECTIVES} if plan is not None',
        '"planned_collectives": None if plan is not None',
        (f"{MEASURED_RUN}[pp2xtp2-moe]",)),
    Bug("rank-plan-of-the-heaviest-stage", "a pipeline rank's collectives planned for the heaviest stage, "
        "not its own", "loom/train/record.py",
        "stage = pp_rank if c.pp > 1 and c.virtual_stages == 1 else None",
        "stage = None",
        (f"{PP}[tiny-ddp-1-1-2]", f"{PP}[tiny-zero3-1-2-1-parallel.fsdp_unit_mb=0]")),
    Bug("tp-stage-keeps-the-final-norm", "every pipeline stage planned with the final norm whole on each TP "
        "rank", "loom/plan/comm.py",
        "shape.tp_replicated_params(shape.stage_layers(heaviest, c.pp)[1], heaviest == c.pp - 1)",
        "shape.tp_replicated_params(shape.stage_layers(heaviest, c.pp)[1], True)",
        (f"{PP}[tiny-ddp-1-1-2]",)),
    Bug("pp-zero3-gathers-twice", "zero3 within a pipeline planned as gathering each unit twice a step, "
        "not in each micro-batch's forward and once in backward", "loom/plan/comm.py",
        "gathered = (m + 1) * (param_bytes - kept) + kept - lead",
        "gathered = 2 * (param_bytes - kept) + kept - lead",
        (f"{PP}[tiny-zero3-1-2-1-parallel.fsdp_unit_mb=0]",)),
    Bug("pp-zero3-gather-count", "zero3's all-gathers within a pipeline counted twice a unit",
        "loom/plan/comm.py",
        "gathers = (c.grad_accum + 1) * (units - keeps) + keeps - idle",
        "gathers = 2 * (units - keeps) + keeps - idle",
        (f"{PP}[tiny-zero3-1-2-1-parallel.fsdp_unit_mb=0]",)),
    Bug("split-backward-reshards", "a schedule that splits the backward planned as resharding zero3's units "
        "after each forward, as loom does not there", "loom/plan/comm.py",
        "reshards = s.reshard_after_forward and not c.split_backward",
        "reshards = s.reshard_after_forward",
        (f"{TESTS}::test_a_schedule_that_splits_the_backward_gathers_each_unit_once",)),
    Bug("pp-stage-keeps-a-unit", "a pipeline stage without the head planned as keeping its last unit "
        "gathered", "loom/plan/comm.py",
        "keeps = bool(units) and (last_stage or len(units) == 1)",
        "keeps = bool(units)",
        (f"{PP}[tiny-zero3-1-2-1-parallel.fsdp_unit_mb=0]",)),
    Bug("sp-norms-per-micro-batch-in-pp", "within a pipeline, sequence parallel's norm gradients planned as "
        "reduced each micro-batch", "loom/plan/comm.py",
        "times = c.grad_accum if c.pp == 1 else 1",
        "times = c.grad_accum",
        (f"{TESTS}::test_sequence_parallel_norms_reduce_once_within_a_pipeline",)),
    Bug("ep-experts-norm-with-the-rest", "the experts' partial norms planned in the rest's all-reduce over "
        "the shards, not apart over the ranks holding them", "loom/plan/comm.py",
        "dense = trained_tensors - ep_split_tensors if c.ep > 1 else trained_tensors",
        "dense = trained_tensors",
        (f"{MOE}[zero3-1-2-1-2-parallel.ep=2]", f"{TESTS}::test_the_experts_norm_is_reduced_apart")),
    Bug("ep-split-counted-over-tp", "the run counts the tensors split over tp where it means those over ep",
        "loom/train/record.py",
        'split_tensors(trained, "tp"), split_tensors(trained, "ep")',
        'split_tensors(trained, "tp"), split_tensors(trained, "tp")',
        (f"{MEASURED_RUN}[ep2-moe]",)),
    Bug("moe-tp-kept-unit-split", "zero3's kept unit under TP priced as split over tp, an MoE block's "
        "feed-forward too (each TP rank runs it whole)", "loom/plan/candidate.py",
        "        whole = norms + shape.moe_ffn_params() - routed  # shapes.tp_replicated_params",
        "        whole = norms",
        (f"{MOE}[zero3-1-2-2-4]",)),
    Bug("replicas-alone-unplanned", "FSDP2's all-reduce across one replica (ddp under TP on dp = 1) left "
        "out of the plan", "loom/plan/comm.py",
        "acc.issue(\"all_reduce\", dp_ranks, grad_bytes, alone=replicas)",
        "acc.issue(\"all_reduce\", dp_ranks, grad_bytes)",
        (f"{TP}[ddp-1-1-2-2]", f"{TP}[zero1-1-1-2-2]")),
    Bug("zero1-alone-unplanned", "ZeroRedundancyOptimizer's broadcasts on one rank left out of the plan",
        "loom/plan/comm.py",
        "acc.issue(\"broadcast\", dp_ranks, 4 * updated, alone=c.engine != \"deepspeed\")",
        "acc.issue(\"broadcast\", dp_ranks, 4 * updated)",
        (f"{MEASURED}[zero1-1-1]",)),
    Bug("experts-replicas-alone-unplanned", "ddp's experts all-reduced across edp = 1 (FSDP2 issues it) "
        "left out of the plan", "loom/plan/comm.py",
        "acc.issue(\"all_reduce\", n, grad_bytes, alone=True)",
        "acc.issue(\"all_reduce\", n, grad_bytes)",
        (f"{MOE}[ddp-2-1-1-2-parallel.ep=2]",)),
    Bug("ddp-bucket-order-under-fsdp", "DDP's bucket order planned where FSDP2 replicates the model (ddp "
        "under EP)", "loom/plan/comm.py",
        "elif not s.shards_params and not c.uses_fsdp and c.grad_sync_size > 1:",
        "elif not s.shards_params and c.grad_sync_size > 1:",
        (f"{MOE}[ddp-2-1-1-2-parallel.ep=2]",)),
]
