"""Planted bugs that once only a spawned-rank test or a golden text caught, each now caught by a fast
in-process test of tests/unit/test_trust3_tests.py (issue 38): MoE capacity under top_k > 1, the GPU
ledger's IO under exposed communication, clipping across meshes, a resumed loader, the LoRA merge's
scale, the Hugging Face export's RoPE rows and the planner's TP-replicated parameters; and a folder of
traces that is not one run's ranks (tests/unit/bad_input_cases_traces3.py)."""

from __future__ import annotations

from planted import Bug

T = "tests/unit/test_trust3_tests.py"
CASES = "tests/unit/test_bad_input.py::test_bad_input"

BUGS = [
    Bug("moe-capacity-no-topk", "an expert's capacity counts tokens, not their top_k choices",
        "loom/models/gpt/moe.py",
        "        capacity = math.ceil(self.cfg.moe_capacity_factor * k * tokens / e)\n",
        "        capacity = math.ceil(self.cfg.moe_capacity_factor * tokens / e)\n",
        (f"{T}::test_capacity_counts_every_choice_of_top_k_2",)),
    Bug("ledger-io-under-comm-twice", "IO under exposed NCCL counted as IO and as exposed communication",
        "loom/observe/ledger.py",
        "            io_m = cov[2] & ~cov[0] & ~cov[1]\n",
        "            io_m = cov[2] & ~cov[0]\n",
        (f"{T}::test_gpu_ledger_partition_where_every_kind_overlaps_every_other",)),
    Bug("clip-norm-summed-across-meshes", "the norms of the grads on different meshes are added, not their "
        "squares", "loom/train/optim.py",
        "    total = torch.linalg.vector_norm(torch.stack(norms)) if len(norms) > 1 else norms[0]\n",
        "    total = torch.stack(norms).sum() if len(norms) > 1 else norms[0]\n",
        (f"{T}::test_clip_norm_over_two_meshes_is_the_root_of_the_squares",)),
    Bug("sampler-resume-from-zero", "a resumed run's map-style loader starts again at global batch 0",
        "loom/data/loader.py",
        "                                     start_step=start_step, num_steps=t.steps - start_step)\n",
        "                                     start_step=0, num_steps=t.steps - start_step)\n",
        (f"{T}::test_resumed_loader_continues_at_the_checkpoints_step",)),
    Bug("lora-merge-scale-inverted", "the merged export scales B A by rank / alpha",
        "loom/train/export_lora.py",
        "    return cfg.lora.alpha / cfg.lora.rank\n",
        "    return cfg.lora.rank / cfg.lora.alpha\n",
        (f"{T}::test_merged_export_scales_the_update_by_alpha_over_rank",)),
    Bug("hf-export-rope-permutation", "the Hugging Face export keeps loom's interleaved q/k rows",
        "loom/models/gpt/llama_layout.py",
        "        out[hf_name(name)] = to_halves(t, heads, gpt.head_dim) if heads else t\n",
        "        out[hf_name(name)] = t\n",
        (f"{T}::test_hf_export_q_and_k_rows_rotate_as_llama_rotates_them",)),
    Bug("plan-tp-replicated-zeroed", "the planner splits the norms' gains over tp like the matrices",
        "loom/plan/memory.py",
        "    replicated = shape.tp_replicated_params(layers, last, moe_layers) if (c.tp > 1 and shape.known)",
        "    replicated = 0 if (c.tp > 1 and shape.known)",
        (f"{T}::test_tp_memory_holds_the_replicated_norm_gains_whole",)),
    Bug("trace-copy-as-a-rank", "a rank's trace copied under another rank's name is analyzed as that rank",
        "loom/observe/ledger.py", "    refuse_copies(files)\n", "",
        (f"{CASES}[analyze-trace-copied-rank]",)),
    Bug("trace-world-sizes-mixed", "traces recording different world sizes are analyzed as one run",
        "loom/observe/ledger.py", "    if len(worlds) > 1:", "    if False:",
        (f"{CASES}[analyze-trace-world-sizes]",)),
    Bug("forked-ranks-share-numpy", "gloo ranks forked from the test forkserver keep its numpy stream "
        "(a spawned or torchrun rank has its own)", "tests/distributed.py", "    np.random.seed()\n", "",
        ("tests/distributed/test_checkpoint.py::test_resume_restores_every_rng_stream_of_every_rank",)),
]
