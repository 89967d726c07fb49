"""Planted bugs in mixtures of experts (the router, dispatch and combine, balancing, capacity), expert
parallelism (the all-to-all, the experts' split and gradients, the mesh) and Hugging Face MoE folders
(issue 28)."""

from __future__ import annotations

from planted import Bug

MOE = "loom/models/gpt/moe.py"
EP = "loom/parallel/expert_parallel.py"
STEP = "loom/train/moe_step.py"
UNIT = "tests/unit/test_moe.py"
HF = "tests/unit/test_moe_hf.py"
RANKS = "tests/distributed/test_moe_ranks.py"
MATCH = f"{RANKS}::test_moe_matches_single_process"
EP2, EP4, PP2 = f"{MATCH}[ep2-zero3-units]", f"{MATCH}[ep4-zero3]", f"{MATCH}[ep2xpp2]"
DDP2 = f"{MATCH}[ep2-ddp-op]"

BUGS = [
    Bug("moe-weights-unnormalized", "moe_norm_topk is ignored", MOE,
        "            weights = weights / weights.sum(-1, keepdim=True).clamp(min=1e-20)\n",
        "            weights = weights\n", (f"{HF}::test_mixtral_reads_as_loom_gpt_with_its_logits",)),
    Bug("moe-bias-weighs", "the balancing bias enters the weights, not only the choice", MOE,
        "        weights = scores.gather(1, chosen)\n",
        "        weights = (scores + self.expert_bias.float()).gather(1, chosen)\n",
        (f"{UNIT}::test_bias_chooses_but_does_not_weigh",)),
    Bug("moe-combine-unsorted", "the experts' outputs are added to the tokens in expert order, not back",
        MOE, "        token, weight = token[order], weight[order]\n", "        weight = weight[order]\n",
        (f"{UNIT}::test_dropless_equals_a_per_token_loop",)),
    Bug("moe-aux-batch-f", "the aux loss's f counts over the micro-batch, not each sequence", MOE,
        "        f = counts / counts.sum(-1, keepdim=True)\n",
        "        f = (counts.sum(0) / counts.sum()).expand(sequences, -1)\n",
        (f"{UNIT}::test_aux_loss_closed_form_on_a_planted_routing",)),
    Bug("moe-aux-weight-ignored", "the aux loss's gradient ignores its weight", MOE,
        "        return grad, torch.full((), ctx.weight, dtype=torch.float32, device=grad.device), None\n",
        "        return grad, torch.ones((), dtype=torch.float32, device=grad.device), None\n",
        (f"{UNIT}::test_aux_loss_gradient_joins_with_its_weight",)),
    Bug("moe-aux-per-micro-step", "the aux weight is not divided over the accumulated micro-batches", STEP,
        "            block.aux_weight = block.cfg.moe_aux_loss_coef / calls\n",
        "            block.aux_weight = block.cfg.moe_aux_loss_coef\n", (EP2,)),
    Bug("moe-bias-sign", "the bias moves towards the busy experts", STEP,
        "            block.expert_bias += rate * torch.sign(block_load.mean() - block_load)\n",
        "            block.expert_bias += rate * torch.sign(block_load - block_load.mean())\n",
        (f"{UNIT}::test_bias_update_closed_form",)),
    Bug("moe-bias-local-load", "each rank moves the bias by its own tokens' load", STEP,
        "        dist.all_reduce(tally, group=d.grad_mesh.get_group())\n", "        pass\n", (EP2,)),
    Bug("moe-recompute-counted", "activation checkpointing's recompute is tallied again", MOE,
        "        if not self.training or recomputing or inferring_shapes():\n",
        "        if not self.training or inferring_shapes():\n",
        (f"{UNIT}::test_recompute_is_not_tallied_again[full]",)),
    Bug("moe-pipeline-pass-counted", "the pipeline's metadata pass is tallied as a training call", MOE,
        "        if not self.training or recomputing or inferring_shapes():\n",
        "        if not self.training or recomputing:\n", (PP2,)),
    Bug("moe-capacity-off-by-one", "an expert takes one token past its capacity", MOE,
        "        return (place < capacity).view(bsz, tokens, k)\n",
        "        return (place <= capacity).view(bsz, tokens, k)\n",
        (f"{UNIT}::test_capacity_drops_the_closed_form_count",)),
    Bug("ep-grad-unscaled", "expert gradients are not divided by ep (ep times the mean)", MOE,
        "        grad_scale = 1.0 / self.ep.size if self.ep is not None else 1.0\n",
        "        grad_scale = 1.0\n", (EP2, DDP2)),
    Bug("ep-splits-swapped", "the rows each rank receives are taken for the rows it sends", EP,
        "    arrived = _AllToAll.apply(rows, got_rows, sent_rows, ep.group)",
        "    arrived = _AllToAll.apply(rows, sent_rows, sent_rows, ep.group)",
        (EP4,)),
    Bug("ep-local-order", "received rows are not regrouped by local expert", EP,
        "    return arrived[order], per_expert, (order, got_rows, sent_rows)\n",
        "    return arrived, per_expert, (torch.arange(len(order)), got_rows, sent_rows)\n", (EP4,)),
    Bug("ep-experts-not-split", "every ep rank keeps all the experts and reads them as its own",
        "loom/parallel/apply.py",
        "            shard_experts(module, d.mesh[\"ep\"])\n", "            pass\n", (EP2,)),
    Bug("ep-outer-mesh-dim", "ep taken as the outer part of dp_shard", "loom/parallel/mesh.py",
        "        mesh[(\"edp_shard\", \"ep\")]._flatten(\"dp_shard\")\n",
        "        mesh[(\"ep\", \"edp_shard\")]._flatten(\"dp_shard\")\n", (f"{MATCH}[ep2-zero2-dp4-ac]",)),
    Bug("mixtral-expert-offset", "a rank's expert block is read from expert 0", "loom/models/pretrained.py",
        "for j in range(offset[0], offset[0] + size[0])])\n", "for j in range(size[0])])\n",
        (f"{HF}::test_each_rank_reads_only_its_experts",)),
    Bug("qwen-gate-up-swapped", "the fused experts put up rows before gate rows", "loom/models/hf/experts.py",
        'FUSED = {"mlp.experts.gate_up_proj": ("gate_proj", "up_proj"),',
        'FUSED = {"mlp.experts.gate_up_proj": ("up_proj", "gate_proj"),',
        (f"{HF}::test_qwen_moe_folders_read_fused_and_export_apart",)),
    Bug("ep-dense-model-let-through", "ep on a dense model is not refused", "loom/layout.py",
        "    if ep > 1 and experts == 0:\n", "    if False:\n",
        ("tests/unit/test_bad_input.py::test_bad_input[moe-ep-dense-model]",)),
    Bug("moe-bias-not-saved", "the balancing bias is left out of checkpoints", MOE,
        'self.register_buffer("expert_bias", torch.zeros(cfg.moe_experts), persistent=True)',
        'self.register_buffer("expert_bias", torch.zeros(cfg.moe_experts), persistent=False)',
        (f"{RANKS}::test_checkpoints_reshard_across_ep_degrees",)),
    Bug("moe-trackers-miss-aux", "TensorBoard/wandb never get the aux loss", "loom/train/tracking.py",
        '"moe_aux_loss": "moe/aux_loss", ', "", (f"{UNIT}::test_trackers_get_the_routing_scalars",)),
    Bug("moe-init-experts-from-zero", "a rank's experts are initialized as experts 0.. whatever it holds",
        "loom/models/gpt/model.py", "for e in range(offset[0], offset[0] + size[0])]",
        "for e in range(size[0])]", (f"{UNIT}::test_experts_initialize_alike_whichever_a_rank_holds",)),
    Bug("moe-every-ignored", "moe_every is ignored: every block from moe_dense_first on is MoE",
        "loom/models/gpt/config.py", "and (layer - self.moe_dense_first) % self.moe_every == 0",
        "and True", (f"{UNIT}::test_dense_first_and_every",)),
]
