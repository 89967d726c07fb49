"""Planted bugs in the zero-bubble pipeline schedules (zb, zbv, dualpipev): placement, FSDP2 under a
split backward, evaluation, validation."""

from __future__ import annotations

from planted import Bug

ZB = "tests/distributed/test_zero_bubble.py"
SCHEDULES = "tests/distributed/test_pipeline_schedules.py"
MEASURED = "tests/distributed/test_plan_measured.py"

BUGS = [
    Bug("zb-zero3-reshards", "FSDP2 units reshard after forward under a split backward (zero3's default)",
        "loom/parallel/fsdp.py",
        "    if splits_backward(p):\n        return False\n", "",
        (f"{ZB}::test_schedules_match_single_process[zero3-units-2]",)),
    Bug("v-placed-round-robin", "V stages placed round-robin (r, r + pp), not (r, 2pp − 1 − r)",
        "loom/config.py",
        "        return [rank, 2 * pp - 1 - rank]", "        return [rank, rank + pp]",
        ("tests/unit/test_pipeline.py::test_rank_stages_v_places_first_and_last_stage_on_rank_0",
         f"{SCHEDULES}::test_schedule_matches_single_process[zbv-1-4]")),
    Bug("zb-eval-walks-backward", "eval runs torch's eval() of a V schedule (its backward actions included)",
        "loom/parallel/pipeline.py",
        '    training = getattr(schedule, "pipeline_order_with_comms", None)\n    if training is None:',
        '    training = getattr(schedule, "pipeline_order_with_comms", None)\n    if True:',
        (f"{ZB}::test_schedules_compose_as_1f1b_does[lora]",)),
    Bug("v-microbatches-unchecked", "a V schedule accepted with fewer micro-batches than its 2·pp stages",
        "loom/layout.py",
        "    if schedule in V_SCHEDULES and microbatches < 2 * pp:",
        "    if schedule in V_SCHEDULES and microbatches < pp:",
        ("tests/unit/test_pipeline.py::test_validate_pipeline_errors",
         "tests/unit/test_bad_input.py::test_bad_input[parallel-v-microbatches]")),
    Bug("zb-ddp-through-ddp", "ddp under a split backward in DDP (its reducer never sees W's gradients)",
        "loom/strategies.py",
        "return self.engine == \"fsdp2\" or tp > 1 or ep > 1 or split_backward",
        "return self.engine == \"fsdp2\" or tp > 1 or ep > 1",
        (f"{ZB}::test_schedules_match_single_process[ddp-2]",)),
]

OVERLAP = "tests/distributed/test_fb_overlap_ranks.py"
OVERLAP_UNIT = "tests/unit/test_fb_overlap.py"

BUGS += [
    Bug("overlap-backward-first", "DualPipeV's overlapped sides take compute turns backward first",
        "loom/parallel/fb_overlap.py",
        "(mine == theirs if side == FORWARD else mine < theirs)",
        "(mine < theirs if side == FORWARD else mine == theirs)",
        (f"{OVERLAP_UNIT}::test_compute_turns_alternate_and_never_wait_forever[3-3]",)),
    Bug("overlap-nested-exchanges-split",
        "a nested exchange (the dispatch's rows) ends a compute segment too",
        "loom/parallel/fb_overlap.py",
        "    outer = turns is not None and not _local.depth\n",
        "    outer = turns is not None\n",
        (f"{OVERLAP_UNIT}::test_nested_exchanges_are_one_segment",)),
    Bug("overlap-never-registered", "dualpipev under ep runs its F+B actions one after the other",
        "loom/train/step.py",
        "    if fb_overlap.overlaps(p):", "    if False:",
        (f"{OVERLAP}::test_overlap_changes_no_bit[ep2-free-and-ac]",)),
    Bug("overlap-backward-sends-nothing-back", "an overlapped backward keeps its input gradient from the V's "
        "stage before it on the rank", "loom/parallel/fb_overlap.py",
        "            if bwd.stage_index - 1 in stages:\n", "            if False:\n",
        (f"{OVERLAP}::test_overlap_changes_no_bit[ep2-free-and-ac]",)),
    Bug("overlap-one-group",
        "the overlapped backward exchanges over the forward's group (two threads, one order lost)",
        "loom/parallel/fb_overlap.py",
        '    return getattr(_local, "groups", {}).get(group, group)\n', "    return group\n",
        (f"{OVERLAP_UNIT}::test_the_backward_side_exchanges_over_its_own_group",)),
    Bug("overlap-ignores-its-key", "parallel.dualpipev_overlap = false still overlaps",
        "loom/parallel/fb_overlap.py",
        '    return p.pp_schedule == "dualpipev" and p.ep > 1 and p.dualpipev_overlap\n',
        '    return p.pp_schedule == "dualpipev" and p.ep > 1\n',
        (f"{OVERLAP_UNIT}::test_overlap_is_for_dualpipev_under_ep",
         f"{OVERLAP}::test_overlap_changes_no_bit[ep2-free-and-ac]")),
    Bug("rank-synced-as-one-stage", "a rank of several pipeline stages priced as one stage for its gradient "
        "sync (a V's rank 0 without one end)", "loom/plan/comm.py",
        "    stage_params = rank_sum(c, heaviest, shape.stage_params)\n",
        "    stage_params = shape.stage_params(heaviest, c.pp)\n",
        ("tests/unit/test_plan_schedules.py::test_a_v_rank_0_syncs_and_steps_both_ends",
         "tests/distributed/test_plan_measured.py::test_measured_matches_plan[pp2-zbv-ddp2]")),
    Bug("rank-steps-one-stage", "a rank of several pipeline stages priced as one stage for its optimizer "
        "step",
        "loom/plan/step.py", "    params = rank_sum(c, heaviest, shape.stage_params)\n",
        "    params = shape.stage_params(heaviest, c.pp)\n",
        ("tests/unit/test_plan_schedules.py::test_a_v_rank_0_syncs_and_steps_both_ends",)),
    Bug("moe-rank-of-most-blocks-unpriced", "an MoE model's multi-stage ranks priced at the ends and the "
        "fullest only, not the rank with the most MoE blocks", "loom/plan/memory.py",
        "    return sorted(ends | {fullest, most_moe})\n", "    return sorted(ends | {fullest})\n",
        ("tests/unit/test_plan_schedules.py::test_a_rank_of_several_stages_is_priced_near_the_worst_rank"
         "[interleaved-deepseek-v3]",)),
    Bug("1f1b-zero3-units-held-gathered", "the plan holds every zero3 unit gathered beside all of a 1F1B "
        "stage's micro-batches, though the forward between two backwards reshards them",
        "loom/plan/memory.py", "        elif reshards:\n", "        elif False:\n",
        ("tests/distributed/test_plan_measured.py::test_measured_matches_plan[pp2-zero3-blocks-one-rank]",)),
    Bug("pipeline-embedding-gradient-unpriced", "the plan forgets the embedding's new gradient beside the "
        "one a pipeline stage accumulates over its micro-batches",
        "loom/plan/memory.py", "if fsdp and stage == 0 and trains_embeddings:\n", "if False:\n",
        ("tests/distributed/test_plan_measured.py::test_measured_matches_plan[pp2-zero3-units-one-rank]",)),
    Bug("plain-ops-unpriced", "the plan prices the lean ops where a torch whose weight pass takes no "
        "autograd Function (2.11) runs plain ones under a split backward", "loom/plan/candidate.py",
        "    return c.split_backward and not w.weight_pass_takes_functions\n", "    return False\n",
        ("tests/unit/test_plan_schedules.py::test_plain_ops_are_priced_where_the_weight_pass_takes_no_function",)),
    Bug("plain-norms-unpriced", "a plain norm's fp32 input and normalized tensor left out of the plan",
        "loom/plan/shapes.py", "    norms = 2 * sb * 4 * h / (tp if sequence_parallel and tp > 1 else 1)\n",
        "    norms = 0\n",
        ("tests/unit/test_lean_block.py::test_plain_ops_keep_the_planners_formula[shape0-fp32]",)),
    Bug("split-input-pass-unpriced", "a split schedule's input pass priced without its norm temporaries "
        "beside every saved tensor", "loom/plan/memory.py",
        '("pipeline input backward", saved + norm_backward, gathered + pending)',
        '("pipeline input backward", saved, gathered + pending)',
        ("tests/unit/test_plan_schedules.py::"
         "test_a_split_input_pass_keeps_every_saved_tensor_beside_its_norm_temporaries",
         f"{MEASURED}::test_pipeline_activation_peak_in_16_bit[zbv-lean]")),
    Bug("zero-bubble-16bit-gradients-unpriced", "the 16-bit gradients a zb or zbv stage's W leaves to its "
        "next B left out of the plan", "loom/plan/memory.py",
        "held_grads[s] = e * ((shape.stage_params(s, total) - routed_s) / tp + routed_s / c.ep)\n",
        "held_grads[s] = 0.0\n",
        ("tests/unit/test_plan_schedules.py::"
         "test_zero_bubble_stages_keep_16_bit_gradients_from_their_w_to_their_next_b",
         f"{MEASURED}::test_pipeline_activation_peak_in_16_bit[zbv-plain]")),
    Bug("input-gradients-every-stage", "a V's turn priced as holding its input gradients, as a stage whose "
        "send holds them", "loom/plan/memory.py",
        "    input_grads = m * boundary * backward if c.split_backward else 0.0\n",
        "    input_grads = sum(m * boundary for s in stages if s > 0) if c.split_backward else 0.0\n",
        ("tests/unit/test_plan_schedules.py::test_input_gradients_are_held_where_a_send_holds_them",)),
    Bug("sent-output-counted-twice", "a multi-stage schedule's output sent to another rank priced both as "
        "saved and among the sends held", "loom/plan/memory.py",
        "else 0.0 if sends_held and s + 1 not in stages else residual", "else residual",
        ("tests/unit/test_plan_schedules.py::test_an_output_a_send_holds_is_counted_once",)),
    Bug("top-block-backward-unpriced", "a stage's whole backward priced without its top block's SwiGLU and "
        "weight gradients", "loom/plan/memory.py",
        "        top_block = max(swiglu, norm)", "        top_block = 0.0",
        ("tests/unit/test_plan_schedules.py::test_a_whole_backward_begins_in_the_top_blocks_swiglu",
         f"{MEASURED}::test_pipeline_activation_peak_in_16_bit[1f1b]")),
    Bug("installed-version-misread", "`loom plan` takes torch 2.11 for one whose weight pass takes Functions",
        "loom/plan/search.py", "(int(numbers[1]), int(numbers[2])) >= (2, 13)",
        "(int(numbers[1]), int(numbers[2])) >= (2, 11)",
        ("tests/unit/test_plan_schedules.py::test_the_installed_torch_says_whether_plain_ops_run",)),
    Bug("receive-buffer-kept-twice", "a later stage's first block priced as keeping a tensor of its own, not "
        "its receive buffer", "loom/plan/memory.py",
        " + output[s] - (boundary if s > 0 else 0.0) for s in stages}", " + output[s] for s in stages}",
        ("tests/unit/test_plan_schedules.py::test_a_later_stage_keeps_its_receive_buffer_not_a_copy",
         f"{MEASURED}::test_pipeline_activation_peak_on_one_replica[gpipe-zero3-fp32]")),
    Bug("gpipe-first-backward-holds-gradients", "GPipe's first backward priced beside every accumulated "
        "gradient, none of which it has made yet", "loom/plan/memory.py",
        "(name, a, b - unmade if name in _GPIPE_FIRST_BACKWARD else b)", "(name, a, b)",
        ("tests/unit/test_plan_schedules.py::test_gpipe_first_backward_holds_no_accumulated_gradient",
         f"{MEASURED}::test_pipeline_activation_peak_on_one_replica[gpipe-zero3-fp32]")),
    Bug("gpipe-second-backward-unpriced", "GPipe's second backward, one micro-batch fewer beside every "
        "gradient, left out of the plan", "loom/plan/memory.py",
        "        if c.grad_accum > 1:\n            moments.extend(",
        "        if False:\n            moments.extend(",
        ("tests/unit/test_plan_schedules.py::test_gpipe_first_backward_holds_no_accumulated_gradient",
         f"{MEASURED}::test_pipeline_activation_peak_on_one_replica[gpipe-ddp-bf16]")),
    Bug("gpipe-second-backward-end-unpriced", "GPipe's second backward's end (every gradient, FSDP2's 16-bit "
        "ones not added yet) left out", "loom/plan/memory.py",
        "                moments.append((SECOND + \"pipeline backward's end\"",
        "                moments.append((\"unpriced\"",
        ("tests/unit/test_plan_schedules.py::test_gpipe_first_backward_holds_no_accumulated_gradient",)),
    Bug("final-norm-fp32-copy", "the final norm priced as keeping an fp32 copy of its input beside it",
        "loom/plan/shapes.py", "kept_by_norm = sb * (h * (4 if autocast and elem < 4 else elem) + 4)",
        "kept_by_norm = sb * h * (4 + (4 if autocast and elem < 4 else elem))",
        ("tests/unit/test_plan_schedules.py::test_the_final_norm_keeps_its_input_and_rstd",)),
    Bug("last-stage-top-block-unpriced", "the last stage's backward priced without its top block's, after "
        "its final norm's", "loom/plan/memory.py",
        "        if top_block and not c.split_backward:  # then the top block's",
        "        if False:  # then the top block's",
        ("tests/unit/test_plan_schedules.py::test_a_whole_backward_begins_in_the_top_blocks_swiglu",)),
    Bug("first-stage-whole-backward-unpriced", "under a split schedule torch's first stage's W (a whole "
        "backward) priced without its top block's", "loom/plan/memory.py",
        "    whole = not c.split_backward or stage == 0\n", "    whole = not c.split_backward\n",
        ("tests/unit/test_plan_schedules.py::test_a_whole_backward_begins_in_the_top_blocks_swiglu",
         f"{MEASURED}::test_pipeline_activation_peak_on_one_replica[zb-zero3-fp32]")),
    Bug("norm-gradients-not-kept-for-w", "a deferred W priced without the norms' output gradients it takes "
        "to their weights (lean ops)", "loom/plan/memory.py",
        "    per_w += 2 * sb * h * e / (tp if sp else 1) if c.split_backward else 0.0",
        "    per_w += 2 * sb * h * e / (tp if sp else 1) if plain else 0.0",
        ("tests/unit/test_plan_schedules.py::test_memory_each_schedule_holds",)),
    Bug("first-stage-keeps-w-gradients", "torch's first stage priced as keeping output gradients for W, "
        "though it runs no B", "loom/plan/memory.py", " * per_w * (ch.stage > 0)\n", " * per_w\n",
        ("tests/unit/test_plan_schedules.py::test_memory_each_schedule_holds",
         f"{MEASURED}::test_pipeline_activation_peak_on_one_replica[zb-zero3-fp32]")),
    Bug("one-stage-runtime-sends-unheld", "zb on one stage a rank priced as freeing its sends, which torch's "
        "runtime holds to the step's end", "loom/plan/memory.py",
        "    sends_held = c.schedule in RUNTIME_SCHEDULES\n", "    sends_held = len(stages) > 1\n",
        ("tests/unit/test_plan_schedules.py::test_memory_each_schedule_holds",)),
    Bug("pipeline-output-dropped-with-dh", "a pipeline's last stage priced as dropping its output, h, once "
        "the chunked loss made h's gradient in forward", "loom/plan/shapes.py",
        " + (sb * h * elem if pipelined else 0)\n", "\n",
        ("tests/unit/test_plan_schedules.py::test_the_final_norm_keeps_its_input_and_rstd",
         f"{MEASURED}::test_pipeline_activation_peak_in_16_bit[1f1b]")),
    Bug("1f1b-input-gradient-send-unheld", "1F1B priced as freeing a backward's input gradient before its "
        "send fires with the next forward's receive", "loom/plan/memory.py",
        "        sent = boundary * backward  #", "        sent = 0.0  #",
        ("tests/unit/test_plan_schedules.py::test_1f1b_holds_a_backwards_input_gradient_in_its_send",
         f"{MEASURED}::test_pipeline_activation_peak_in_16_bit[1f1b]")),
]

PASSES = "tests/unit/test_backward_pass.py"
BUGS += [
    Bug("split-pass-takes-every-weight", "a split backward's input pass computes the weights' gradients "
        "too (each Function's weight matmul done twice)", "loom/parallel/backward_pass.py",
        "    return _pass != INPUT\n", "    return True\n",
        (f"{PASSES}::test_the_two_passes_give_the_full_backwards_gradients_computing_each_once",)),
    Bug("stage-backward-pass-unnamed", "the pipeline stage runs every backward as a full one",
        "loom/parallel/pipeline.py", "        with backward_pass(backward_type):",
        "        with backward_pass(\"full\"):",
        (f"{PASSES}::test_the_pipeline_stage_runs_each_backward_in_its_pass",)),
    Bug("chunked-loss-weight-in-input-pass", "the chunked loss's input pass computes the head's gradient too",
        "loom/models/chunked_loss.py", "        need_w = ctx.needs_input_grad[1] and takes_weights()\n",
        "        need_w = ctx.needs_input_grad[1]\n",
        (f"{PASSES}::test_the_two_passes_give_the_full_backwards_gradients_computing_each_once",)),
]
