"""Planted bugs in op-level selective activation checkpointing (parallel.activation_checkpointing =
"op"): its policy, which blocks it wraps, and the planner's memory and recompute for it."""

from __future__ import annotations

from planted import Bug

UNIT = "tests/unit/test_op_checkpointing.py"
KEEPS = (f"{UNIT}::test_op_keeps_exactly_the_planned_matmul_and_attention_outputs",)
SPLIT = (f"{UNIT}::test_op_saved_bytes_split_by_tp_and_sequence_parallel",)
PRICED = (f"{UNIT}::test_op_is_priced_between_full_and_none",)
AC = "loom/parallel/activation_checkpointing.py"
MEASURED = ("tests/distributed/test_plan_measured.py::test_activation_peak_where_the_model_drifted"
            "[zero3-fp32-op-vocab]",)

BUGS = [
    Bug("op-policy-recomputes-all", "the op policy saves nothing: op is full checkpointing", AC,
        "    return CheckpointPolicy.MUST_SAVE if op in OP_SAVED else CheckpointPolicy.PREFER_RECOMPUTE\n",
        "    return CheckpointPolicy.PREFER_RECOMPUTE\n", KEEPS),
    Bug("op-policy-misses-cpu-attention", "the policy lists the GPU attention kernels but not CPU's", AC,
        "    _aten._scaled_dot_product_flash_attention_for_cpu.default,\n", "", KEEPS),
    Bug("op-without-context-fn", "op wraps the blocks without the selective checkpoint's contexts", AC,
        '    extra = {"context_fn": op_context_fn} if mode == "op" else {}\n', "    extra = {}\n", KEEPS),
    Bug("op-wraps-every-kth", "op wraps every ac_every-th block, as selective does", AC,
        '    step = every if mode == "selective" else 1\n', '    step = 1 if mode == "full" else every\n',
        (f"{UNIT}::test_op_same_loss_and_gradients_as_no_checkpointing",)),
    Bug("op-saved-rows-split", "the row linears' (wo, w2) outputs priced as split by TP",
        "loom/plan/shapes.py", "    rows = sb * 2 * h * elem\n", "    rows = sb * 2 * h * elem / tp\n",
        SPLIT),
    Bug("op-saved-no-logsumexp", "attention's log-sum-exp left out of what op keeps",
        "loom/plan/shapes.py",
        "    split = sb * (elem * (2 * h + 2 * shape.kv_dim + 2 * f) + 4 * shape.n_heads) / tp\n",
        "    split = sb * elem * (2 * h + 2 * shape.kv_dim + 2 * f) / tp\n", KEEPS),
    Bug("op-memory-as-full", "the planner prices op's blocks as keeping their input only",
        "loom/plan/memory.py", "    if op and ckpt:\n        per_ckpt = op_saved_bytes_per_layer",
        "    if False:\n        per_ckpt = op_saved_bytes_per_layer", (*PRICED, *MEASURED)),
    Bug("op-recompute-as-full", "the catalog prices op's recompute as a whole forward again",
        "loom/plan/step.py", '    if c.activation_checkpointing == "op" and gpu is not None:\n',
        '    if c.activation_checkpointing == "op" and gpu is None:\n', PRICED),
    Bug("op-measured-recompute-as-full", "on a measured device op's recompute is a whole block's forward",
        "loom/plan/step.py",
        'if recompute and c.activation_checkpointing == "op":  # the matmuls and attention are kept',
        'if recompute and c.activation_checkpointing == "opx":  # the matmuls and attention are kept',
        (f"{UNIT}::test_op_on_a_measured_device_recomputes_the_elementwise_part",)),
]
