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
        (f"{COMPILE}::test_blocks_compile_whole[tiny-moe-full-base]",)),
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
        (f"{COMPILE}::test_blocks_compile_whole[tiny-moe-none-lora]",)),
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
