"""Planted bugs in the loop's control-plane collectives (issue 40, item 2: planned beside the engines',
so the report raises no false "Off plan") and in ending train()'s process group (item 4: no thread of
gloo's left running at a script's exit)."""

from __future__ import annotations

from planted import Bug

TESTS = "tests/unit/test_first_hour2_control_plane.py"
MEASURED = f"{TESTS}::test_planned_collectives_are_the_measured_ones"

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
        "loop's collectives out (TP)", "loom/observe/report.py",
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
]
