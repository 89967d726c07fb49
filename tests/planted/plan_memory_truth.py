"""Planted bugs in the planner's memory moments found by measuring them on gloo ranks (loom/plan/memory.py),
each caught by the unit moments and the measured run; and in what the measuring found: TP untying a tied
embedding and head."""

from __future__ import annotations

from planted import Bug

MOMENTS = "tests/unit/test_plan_moments.py"
MEASURED = "tests/distributed/test_plan_measured.py::test_measured_matches_plan"

BUGS = [
    Bug("plan-head-rs-drops-held-weight-grad",
        "the head's reduce-scatter priced without the head weight's gradient FSDP2 keeps through it",
        "loom/plan/memory.py", "            held_head = e * vh_grad if c.shard_size > 1 else 0.0\n",
        "            held_head = 0.0\n",
        (f"{MOMENTS}::test_the_head_reduce_scatter_holds_the_head_weight_gradient_and_writes_its_shard[cpu]",
         f"{MEASURED}[zero2-units]")),
    Bug("plan-head-rs-output-uncounted",
        "the head's reduce-scatter priced without the sharded gradient it writes",
        "loom/plan/memory.py",
        "            rebuilt_head = 4 * grad_units[-1] / c.shard_size\n",
        "            rebuilt_head = 0.0\n",
        (f"{MOMENTS}::test_the_head_reduce_scatter_holds_the_head_weight_gradient_and_writes_its_shard[cuda]",)),
    Bug("plan-head-rs-output-only-without-shards",
        "a later micro-step's head reduce-scatter priced without its output (the earlier shards there)",
        "loom/plan/memory.py", "            rebuilt_head = 4 * grad_units[-1] / c.shard_size\n",
        "            rebuilt_head = 4 * grad_units[-1] / c.shard_size if held < 0 else 0.0\n",
        (f"{MOMENTS}::test_a_later_micro_step_reduces_the_head_beside_the_shards_the_earlier_left",)),
    Bug("plan-pipeline-reduces-as-one-unit",
        "a pipeline stage's reduction priced as the end of one backward (the later units rebuilt, not "
        "gathered)", "loom/plan/memory.py",
        "    if fsdp and pipelined:\n        last_params", "    if False:\n        last_params",
        (f"{MOMENTS}::test_a_pipeline_reduces_its_first_unit_beside_the_later_units_gathered_with_their_gradients",
         f"{MEASURED}[pp2-zero3-units]")),
    Bug("plan-pipeline-head-reduced-in-backward",
        "a pipeline's last stage priced with the head's reduce-scatter in its backward (its sync is off "
        "there)",
        "loom/plan/memory.py", "        if own_head and not pipelined:", "        if own_head:",
        (f"{MOMENTS}::test_a_pipeline_last_stage_reduce_scatters_no_head_in_its_backward",
         f"{MEASURED}[pp2-zero3-units]")),
    Bug("plan-tp-embedding-gradient-sliced-free",
        "under TP the embedding's gradient priced at its shard (DTensor makes it whole, then slices it)",
        "loom/plan/memory.py", "e * vh_grad * (tp + 1) + e * units[0] + previous",
        "e * vh_grad + e * units[0] + previous",
        (f"{MOMENTS}::test_under_tp_the_embedding_gradient_is_whole_over_the_vocabulary_then_sliced",
         f"{MEASURED}[tp2-zero3-units]")),
    Bug("plan-tp-tied-embedding-as-without-tp",
        "under TP the tied embedding's backward priced as without it (no whole gradient, no slice)",
        "loom/plan/memory.py", "            whole = e * vh * (tp + 1) if tp > 1 else e * vh",
        "            whole = e * vh",
        (f"{MOMENTS}::"
         "test_under_tp_a_tied_embedding_adds_its_whole_gradient_sliced_to_the_head_shard",
         f"{MEASURED}[tp2-zero3-units-tied]")),
    Bug("tp-unties-embeddings",
        "TP leaves a tied embedding and head as two parameters: a Hugging Face model trains them apart, "
        "loom's GPT moves the weight twice a step", "loom/parallel/tensor_parallel.py",
        "        head.weight = embedding.weight\n", "        pass\n",
        ("tests/distributed/test_hf_adapters.py::test_hf_family_matches_single_process[qwen2-tied-tp2]",
         f"{MEASURED}[tp2-zero3-units-tied]")),
    Bug("plan-gpipe-last-head-backward-resharded",
        "GPipe's last head backward priced with the blocks resharded (no forward reshards them after the "
        "first backward)", "loom/plan/memory.py",
        'if fsdp and pipelined and reshards and c.schedule == "gpipe" and c.grad_accum > 1:',
        'if False:',
        (f"{MOMENTS}::test_gpipe_last_head_backward_has_every_unit_gathered",
         f"{MEASURED}[pp2-gpipe-zero3-units]")),
    Bug("plan-cp-no-wo-copy",
        "under cp a block priced without wo's sequence-major copy of the attention's output",
        "loom/plan/memory.py", "        per_layer += copy\n", "        pass\n",
        ("tests/unit/test_plan_cp.py::test_activations_per_rank_are_those_of_seq_over_cp",)),
]
