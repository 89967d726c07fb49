"""Planted bugs in what makes a GPU step fast (issue 39): CUDA's grouped experts, host reads in a
steady step, the step's values read a step late."""

from __future__ import annotations

from planted import Bug

GROUPED = "tests/unit/test_grouped_experts.py"
GROUPED_RANKS = "tests/distributed/test_moe_ranks.py"
SYNCS = "tests/distributed/test_host_syncs.py"

COMPILE = "tests/distributed/test_compile.py"
LOSS = "tests/unit/test_chunked_loss.py"

BUGS = [
    Bug("lora-add-apart", "LoRA's update added to the base output as a separate op",
        "loom/models/lora.py",
        "        if isinstance(base, DTensor):  # tensor parallel's split adapters: as the plan lays them"
        " out\n",
        "        if True:\n",
        ("tests/unit/test_lora.py::test_the_update_joins_the_base_output_inside_its_matmul",)),
    Bug("loss-logits-twice", "the chunked loss computes each chunk's logits again in backward",
        "loom/models/chunked_loss.py",
        "        in_forward = in_forward and (need_h or need_w)\n", "        in_forward = False\n",
        (f"{LOSS}::test_the_head_matmul_runs_once_per_chunk[grad-in-forward]",)),
    Bug("loss-grad-unscaled", "the gradients from forward handed on without the upstream gradient",
        "loom/models/chunked_loss.py",
        "            return ((dh.mul_(grad).to(ctx.h_dtype) if dh is not None else None),\n",
        "            return ((dh.to(ctx.h_dtype) if dh is not None else None),\n",
        (f"{LOSS}::test_fp32_matches_the_full_logits[grad-in-forward-False-mean-7]",)),
    Bug("compile-breaks-checkpointed-moe", "dynamo left to refuse an MoE block's tally inside a checkpoint",
        "loom/parallel/apply.py",
        "    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True\n", "",
        (f"{COMPILE}::test_blocks_compile_whole[tiny-moe-full-lora]",)),
    Bug("moe-bincount", "the routing counts choices with bincount (its size depends on the values)",
        "loom/models/gpt/moe.py",
        "    return torch.zeros(n, dtype=torch.long, device=index.device)"
        ".index_add_(0, index, torch.ones_like(index))\n",
        "    return torch.bincount(index, minlength=n)\n",
        (f"{COMPILE}::test_blocks_compile_whole[tiny-moe-none-base]",)),
    Bug("moe-tally-recompute-traced", "the tally's recompute check traced by dynamo (a break per block)",
        "loom/models/gpt/moe.py",
        "        recomputing = not torch.compiler.is_compiling()"
        " and torch._C._current_graph_task_id() != -1\n",
        "        recomputing = torch._C._current_graph_task_id() != -1\n",
        (f"{COMPILE}::test_blocks_compile_whole[tiny-moe-none-base]",)),
    Bug("grouped-any-dtype", "CUDA's grouped path taken in fp32 too (the kernel is bf16)",
        "loom/models/gpt/moe.py",
        "    ok = run == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] >= 8\n",
        "    ok = torch.cuda.get_device_capability(device)[0] >= 8\n",
        (f"{GROUPED}::test_the_device_picks_the_path",)),
    Bug("loss-grad-twice", "a second backward scales the gradients from forward again, silently",
        "loom/models/chunked_loss.py",
        "            if ctx.grads is None:", "            if False:",
        (f"{LOSS}::test_a_second_backward_through_gradients_from_forward_is_one_line",)),
    Bug("grouped-rows-unaligned", "the grouped layout starts an expert's rows right after the last one's",
        "loom/models/gpt/moe.py",
        "    padded = (counts + align - 1) // align * align\n", "    padded = counts\n",
        (f"{GROUPED}::test_layout_starts_every_expert_aligned_and_keeps_its_rows_in_order",)),
    Bug("grouped-lora-dropped", "the grouped experts run without their LoRA adapters",
        "loom/models/gpt/moe.py",
        "                if spec is not None and w in self.lora_weights:\n",
        "                if False:\n",
        (f"{GROUPED}::test_grouped_experts_equal_the_loop[top2-lora]",)),
    Bug("grouped-ep-grad-unscaled", "the grouped experts' weights skip ep's gradient scale",
        "loom/models/gpt/moe.py",
        "                out = torch._grouped_mm(h, stacked(w).to(dtype).transpose(-2, -1), offs=ends)\n",
        "                out = torch._grouped_mm(h, local_view(getattr(self, w)).to(dtype).transpose(-2, -1),"
        " offs=ends)\n",
        (f"{GROUPED_RANKS}::test_grouped_experts_match_single_process[ep2]",)),
    Bug("grouped-reads-sizes", "the grouped experts read the split sizes on the host anyway",
        "loom/models/gpt/moe.py",
        "        dest, ends, length = grouped_layout(counts, rows.shape[0], GROUP_ROWS)\n",
        "        dest, ends, length = grouped_layout(torch.tensor(counts.tolist()), rows.shape[0],"
        " GROUP_ROWS)\n",
        (f"{GROUPED}::test_the_grouped_block_reads_nothing_on_the_host_the_loop_reads_its_split_sizes",
         f"{SYNCS}::test_a_steady_step_reads_nothing_on_the_host[moe-ep1-grouped]")),
    Bug("aux-loss-one-hot", "the aux loss counts choices with one_hot (which checks its classes on the host)",
        "loom/models/gpt/moe.py",
        "        counts = torch.zeros(sequences, e, device=chosen.device).scatter_add_(\n"
        "            1, chosen, torch.ones(chosen.shape, device=chosen.device))\n",
        "        counts = F.one_hot(chosen, e).sum(1).float()\n",
        (f"{GROUPED}::test_the_grouped_block_reads_nothing_on_the_host_the_loop_reads_its_split_sizes",)),
    Bug("loss-read-in-forward", "the model reads its loss on the host in forward",
        "loom/models/gpt/model.py",
        "        gate, up = self.w1(x), self.w3(x)\n",
        "        gate, up = self.w1(x), self.w3(x)\n        gate.float().sum().item()\n",
        (f"{SYNCS}::test_a_steady_step_reads_nothing_on_the_host[ddp]",
         f"{SYNCS}::test_a_steady_step_reads_nothing_on_the_host[tp2-sp]")),
]

SDPA = "tests/unit/test_sdpa_kernels.py"
BUGS += [
    Bug("sdpa-grouped-to-math", "grouped k/v handed to CUDA's SDPA where flash cannot run (the math kernel)",
        "loom/parallel/sdpa.py",
        "            k, v, grouped = expand_heads(k, q.shape[1]), expand_heads(v, q.shape[1]), False\n",
        "            pass\n",
        (f"{SDPA}::test_a_cuda_fp32_block_keeps_what_the_plan_says[4-2]",)),
    Bug("plan-kv-grouped-on-cuda", "the plan keeps grouped k/v on CUDA in fp32",
        "loom/plan/shapes.py",
        "    if device != \"cuda\" or (elem < 4 and shape.head_dim <= 256 and not masked):\n",
        "    if True:\n",
        (f"{SDPA}::test_the_plan_prices_repeated_heads_on_cuda_in_fp32_or_masked",
         f"{SDPA}::test_a_cuda_fp32_block_keeps_what_the_plan_says[4-2]")),
]
BUGS += [
    Bug("plan-document-mask-free", "the plan leaves out the document mask that attention keeps as its bias",
        "loom/plan/shapes.py",
        "    per_layer = split / tp + (norms / tp if sp else norms) + linear_inputs + rope + mask\n",
        "    per_layer = split / tp + (norms / tp if sp else norms) + linear_inputs + rope\n",
        (f"{SDPA}::test_a_block_under_documents_keeps_what_the_plan_says[fp32-cpu]",)),
]

FIT = "tests/unit/test_gpu_fit.py"
BUGS += [
    Bug("gpu-fit-held-out-sees-the-row", "the held-out fit is fitted with the row it predicts",
        "bench/gpu_fit.py", "        others = rows[:i] + rows[i + 1:]\n", "        others = rows\n",
        (f"{FIT}::test_held_out_error_is_apart_from_in_sample",)),
    Bug("gpu-fit-all-unknowns", "every unknown fitted however few the rows",
        "bench/gpu_fit.py", "    names = present[: max(len(rows) // 2, 1)]\n", "    names = present\n",
        (f"{FIT}::test_few_rows_fit_few_unknowns",)),
]

MUON = "tests/unit/test_muon.py"
BUGS += [
    Bug("muon-skip-read-on-host", "Muon's non-finite skip read on the host beside a fused AdamW",
        "loom/train/step.py",
        "    return inner if isinstance(inner, MuonAdamW) and inner.takes_found_inf() else None\n",
        "    return None\n", (f"{MUON}::test_the_training_step_skips_on_the_device[True]",)),
    Bug("muon-skip-nan-momentum", "a flagged Muon step lerps its NaN gradients into the momentum",
        "loom/train/muon.py",
        "            grad = p.grad if skip is None else torch.where(skip, 0.0, p.grad)\n",
        "            grad = p.grad\n",
        (f"{MUON}::test_a_flagged_step_changes_nothing_even_with_nan_gradients",)),
    Bug("muon-skip-adamw-steps", "Muon's AdamW side steps a flagged step",
        "loom/train/muon.py", "                self._adamw.found_inf = found_inf\n", "                pass\n",
        (f"{MUON}::test_a_flagged_step_changes_nothing_even_with_nan_gradients",)),
]

FFN = f"{GROUPED}::test_the_feed_forward_keeps_what_the_plan_says"
BUGS += [
    Bug("moe-combine-index-add", "the experts' rows combined by index_add, whose backward keeps them",
        "loom/models/gpt/moe.py",
        ".scatter_add(0, token[:, None].expand_as(out), out)\n",
        ".index_add(0, token, out)\n", (f"{FFN}[loop]",)),
    Bug("moe-grouped-index-copy", "the grouped layout filled by index_copy, whose backward keeps the rows",
        "loom/models/gpt/moe.py",
        "        x = x.new_zeros(length, x.shape[1]).scatter(0, dest[:, None].expand_as(x), x)\n",
        "        x = x.new_zeros(length, x.shape[1]).index_copy(0, dest, x)\n", (f"{FFN}[grouped]",)),
    Bug("plan-grouped-experts-as-loop", "the plan prices CUDA's grouped experts as the loop",
        "loom/plan/shapes.py", "    if grouped_experts:\n        routed = rows",
        "    if False:\n        routed = rows", (f"{FFN}[grouped]",)),
]

FP16 = "tests/unit/test_fp16_skip.py"
BUGS += [
    Bug("fp16-loss-flag-dropped", "under fp16 a fused AdamW steps past a non-finite loss, finite gradients",
        "loom/train/step.py", "                torch.maximum(found, skipped.to(found.device), out=found)\n",
        "                pass\n",
        (f"{FP16}::test_a_non_finite_loss_leaves_the_weights[nan-loss-only-True]",)),
    Bug("fp16-skip-read-on-host", "under fp16 the loss's flag is read on the host beside a fused AdamW",
        "loom/train/step.py", "        if getattr(optimizer, \"_step_supports_amp_scaling\", False):\n",
        "        if False:\n", (f"{FP16}::test_a_fused_step_reads_nothing_on_the_host",)),
]
BUGS += [
    Bug("sdpa-heads-tiled", "k/v heads tiled (repeat), not one per query group (repeat_interleave)",
        "loom/parallel/sdpa.py", "t.repeat_interleave(heads // t.shape[1], dim=1)",
        "t.repeat(1, heads // t.shape[1], 1, 1)",
        (f"{SDPA}::test_repeated_heads_give_the_grouped_result[causal]",)),
]

BUGS += [
    Bug("grouped-down-keeps-product", "the grouped experts' w2 keeps its input, the SwiGLU product",
        "loom/models/gpt/moe.py", "        if spec is not None and \"w2\" in self.lora_weights:\n",
        "        if True:\n", (f"{FFN}[grouped]",)),
    Bug("grouped-down-product-wrong", "the grouped down's backward recomputes w2's input as gate · up",
        "loom/models/gpt/lean_ops.py",
        "            product = F.silu(gate).mul_(up)\n            grad_w = torch._grouped_mm",
        "            product = gate * up\n            grad_w = torch._grouped_mm",
        ("tests/unit/test_grouped_experts.py::test_grouped_experts_equal_the_loop[top2-base]",)),
    Bug("grouped-down-gradients-swapped", "the grouped down returns the up gradient for the gate's",
        "loom/models/gpt/lean_ops.py",
        "            grad_gate, grad_up = _swiglu_grads(gate, up, torch._grouped_mm(grad, weight, offs=ends",
        "            grad_up, grad_gate = _swiglu_grads(gate, up, torch._grouped_mm(grad, weight, offs=ends",
        ("tests/unit/test_grouped_experts.py::test_grouped_experts_equal_the_loop[top2-base]",)),
    Bug("plan-grouped-experts-unwired", "the step's plan prices CUDA's grouped experts as the loop",
        "loom/plan/shapes.py", " or precision != \"bf16\" or any(w % 8 for w in widths):\n",
        " or True:\n",
        ("tests/unit/test_plan_moe.py::test_cudas_grouped_experts_are_priced_where_they_run",)),
]

CHOICE = "tests/unit/test_plan_loss_choice.py"
BUGS += [
    Bug("loss-choice-ignores-headroom", "the search takes the full logits wherever a chunk recomputes",
        "loom/plan/search.py", "    if full_mem.total <= room:\n", "    if True:\n",
        (f"{CHOICE}::test_the_search_takes_the_full_logits_only_under_the_headroom[48]",)),
    Bug("loss-recompute-unpriced", "the chunked loss's recompute under GPipe left out of the step time",
        "loom/plan/step.py", "    if not w.shape.known or not head_recomputed(w, c):\n        return 0.0\n",
        "    if True:\n        return 0.0\n",
        (f"{CHOICE}::test_the_recompute_is_one_head_matmul_per_micro_batch_on_the_last_stage",)),
    Bug("emit-drops-full-logits", "--emit keeps the chunk of a candidate priced with the full logits",
        "loom/plan/search.py", "        t.loss_chunk = 0\n", "        pass\n",
        (f"{CHOICE}::test_emit_writes_the_chosen_loss_and_explain_prices_it",)),
]
BUGS += [
    Bug("reason-split-unnamed", "the reason names a micro-batch split of the pick by the label alone",
        "loom/plan/search.py", "    if name == picked[\"label\"]:  # a micro-batch split",
        "    if False:  # a micro-batch split",
        ("tests/unit/test_first_hour2_plan_reasons.py::"
         "test_a_faster_micro_batch_split_of_the_pick_is_named_by_its_micro_batch",)),
]
BUGS += [
    Bug("head-recompute-gpipe-only", "the split backwards taken to make the loss gradients in forward",
        "loom/plan/candidate.py", '(c.schedule == "gpipe" or c.split_backward)', '(c.schedule == "gpipe")',
        (f"{CHOICE}::test_which_schedules_recompute_the_chunked_loss[zbv-2-512-True]",)),
]
