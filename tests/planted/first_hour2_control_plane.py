"""Planted bugs in the loop's control-plane collectives (issue 40, item 2: planned beside the engines',
so the report raises no false "Off plan") and in ending train()'s process group (item 4: no thread of
gloo's left running at a script's exit)."""

from __future__ import annotations

from planted import Bug

TESTS = "tests/unit/test_first_hour2_control_plane.py"
MEASURED = f"{TESTS}::test_planned_collectives_are_the_measured_ones"
TP = f"{TESTS}::test_tensor_parallel_collectives_are_the_measured_ones"

BUGS = [
    Bug("loop-counts-not-in-kinds", "the loop's collectives are listed apart but not counted in their kinds",
        "loom/plan/comm.py",
        "counts[op.kind] = None if known is None else known + op.count",
        "counts[op.kind] = None if known is None else known",
        (f"{TESTS}::test_the_default_profile_is_not_off_plan_but_a_real_miss_is", f"{MEASURED}[zero3-1-2]")),
    Bug("loop-norm-on-one-rank", "the gradient norm's all-reduce planned on a shard group of one, where "
        "DTensor issues none", "loom/plan/comm.py",
        "if s.shards_params and c.shard_size > 1:",
        "if s.shards_params and c.shard_size >= 1:",
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
        'name == "tp" and placement.is_shard()',
        'name == "tp"',
        (f"{TESTS}::test_the_tensors_split_over_tp_are_those_sharded_on_its_mesh_dimension",)),
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
        "kept = per_param * ((units[-1] - whole) / c.tp + whole) if units else 0.0",
        "kept = per_param * units[-1] / c.tp if units else 0.0",
        (f"{TP}[zero3-1-2-2-4]", f"{TP}[zero3-1-2-2-4-parallel.fsdp_unit_mb=0]")),
    Bug("tp-zero3-as-zero2", "zero3 under TP planned as zero2: its units not gathered again in backward",
        "loom/plan/comm.py",
        "gathered = micro_steps * param_bytes + micro_steps * (param_bytes - kept)",
        "gathered = micro_steps * param_bytes",
        (f"{TP}[zero3-1-2-2-4-parallel.fsdp_unit_mb=0]",)),
    Bug("moe-tally-unplanned", "a mixture of experts' router tally left out of the loop's collectives",
        "loom/plan/comm.py",
        "    if shape.moe:\n        loop.append(",
        "    if False:\n        loop.append(",
        (f"{TESTS}::test_a_mixture_of_experts_loop_collectives_are_the_measured_ones",)),
    Bug("moe-loop-planned-under-ep", "the loop planned under expert parallelism, whose experts' norm "
        "group it does not know", "loom/plan/comm.py",
        "if c.engine == \"deepspeed\" or (c.tp > 1 and c.pp > 1) or c.ep > 1 or \\",
        "if c.engine == \"deepspeed\" or (c.tp > 1 and c.pp > 1) or \\",
        (f"{TESTS}::test_a_mixture_of_experts_loop_is_not_planned_under_ep_or_pp",)),
]
