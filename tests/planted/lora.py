"""Planted bugs in LoRA fine-tuning (issue 29): the adapted linear and experts, which linears are
targeted, the frozen base, the adapters' split under TP and their initialization per shard, the
adapters-only checkpoint and the base's fingerprint, and the PEFT and merged exports."""

from __future__ import annotations

from planted import Bug

LORA = "loom/models/lora.py"
MOE = "loom/models/gpt/moe.py"
TP = "loom/parallel/tensor_parallel.py"
APPLY = "loom/parallel/apply.py"
CKPT = "loom/train/checkpoint.py"
BASE = "loom/train/lora_base.py"
EXPORT = "loom/train/export_lora.py"
STEP = "loom/train/moe_step.py"
UNIT = "tests/unit/test_lora.py"
RANKS = "tests/distributed/test_lora_ranks.py"
MATCH = f"{RANKS}::test_lora_matches_single_process"
SAVED = "tests/distributed/test_lora_checkpoint.py"
EXPORTS = f"{SAVED}::test_exports_load_in_peft_and_transformers_and_another_base_is_refused"
CASES = "tests/unit/test_bad_input.py::test_bad_input"

BUGS = [
    Bug("lora-scale-ignored", "the adapters' update is not scaled by alpha / r", LORA,
        "                          self.lora_B.t(), alpha=self.lora_scale)\n",
        "                          self.lora_B.t())\n",
        (f"{UNIT}::test_adapted_linear_is_the_base_plus_the_scaled_low_rank_update",)),
    Bug("lora-scale-ignored-experts", "the experts' (and TP's) update is not scaled by alpha / r", LORA,
        "    return F.linear(F.linear(x, a) * scale, b)\n", "    return F.linear(F.linear(x, a), b)\n",
        (f"{UNIT}::test_adapted_experts_equal_each_expert_as_an_adapted_swiglu",)),
    Bug("lora-b-random", "B starts random like A, so step 0 is not the base model", LORA,
        '    if name.endswith("lora_B"):\n        return torch.zeros(shape)\n',
        '    if name.endswith("lora_X"):\n        return torch.zeros(shape)\n',
        (f"{UNIT}::test_step_zero_equals_the_base_and_the_gradient_reaches_only_adapters",)),
    Bug("lora-base-trains", "the base is not frozen", LORA,
        "                done[id(param)] = nn.Parameter(param.detach().to(keep), requires_grad=trains)\n",
        "                done[id(param)] = nn.Parameter(param.detach().to(keep), requires_grad=True)\n",
        (f"{UNIT}::test_the_base_is_frozen_in_its_dtype_and_only_adapters_train", f"{MATCH}[ddp]",
         f"{RANKS}::test_gradient_collectives_carry_the_adapters_alone")),
    Bug("lora-adapters-in-base-dtype", "the adapters are stored in the base's 16-bit dtype", LORA,
        "                keep = torch.float32 if trains else dtype\n", "                keep = dtype\n",
        (f"{UNIT}::test_the_base_is_frozen_in_its_dtype_and_only_adapters_train",
         f"{RANKS}::test_bf16_with_the_base_in_bf16_is_close_to_fp32")),
    Bug("lora-router-adapted", "all-linear adapts the MoE router too", LORA,
        '    return name.rsplit(".", 1)[-1] in ("router", "shared_gate", "gate", "shared_expert_gate")\n',
        '    return name.rsplit(".", 1)[-1] in ("shared_gate", "gate", "shared_expert_gate")\n',
        (f"{UNIT}::test_all_linear_on_moe_adapts_experts_and_shared_but_not_routers",)),
    Bug("lora-target-silent", "a target that names nothing is ignored", LORA,
        "        if not found:\n            raise ConfigError(",
        "        if False:\n            raise ConfigError(",
        (f"{CASES}[lora-target-no-match]",
         f"{UNIT}::test_any_targets_adapt_something_or_say_why_in_one_line")),
    Bug("lora-init-ignores-shard", "each rank initializes its shard of an adapter as if it were whole", LORA,
        "            return block(adapter_value(self.seed, name, shape), offset, size)\n",
        "            return adapter_value(self.seed, name, size)\n",
        (f"{MATCH}[zero3-units-ac]", f"{RANKS}::test_moe_experts_adapted_under_ep")),
    Bug("lora-expert-down-unadapted", "the experts' down projection leaves out its adapter", MOE,
        "            if w in adapters:\n", '            if w in adapters and w != "w2":\n',
        (f"{UNIT}::test_adapted_experts_equal_each_expert_as_an_adapted_swiglu",)),
    Bug("lora-moe-routing-trains", "under LoRA the MoE balancing still moves the base's routing", STEP,
        "                block.aux_weight = block.bias_update_rate = 0.0\n", "                pass\n",
        (f"{RANKS}::test_moe_experts_adapted_under_ep",)),
    Bug("lora-tp-norms-train", "sequence parallelism's norms come back trainable", APPLY,
        "            q.requires_grad_(name not in frozen)\n", "            pass\n",
        (f"{MATCH}[zero2-tp2-sp]",)),
    Bug("lora-tp-rowwise-plain", "the row split leaves the adapters unsplit plain tensors", TP,
        '        _distribute(module, device_mesh, {"weight": Shard(1), "bias": Replicate(), '
        '"lora_A": Shard(1),\n                                          "lora_B": Replicate()}, '
        'self.src_data_rank)\n',
        "        super()._partition_linear_fn(name, module, device_mesh)\n", (f"{MATCH}[zero2-tp2-sp]",)),
    Bug("lora-checkpoint-whole", "a LoRA checkpoint holds the whole model", CKPT,
        "    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)\n",
        "    return StateDictOptions()\n",
        (f"{SAVED}::test_resume_is_bit_exact_and_the_checkpoint_holds_the_adapters_alone",)),
    Bug("lora-base-unchecked", "a resume does not check the base", CKPT,
        '    lora_base.check(meta.get("lora_base"), lora_base.identity(cfg), path)\n', "",
        (EXPORTS,)),
    Bug("lora-fingerprint-header-only", "the fingerprint reads the header alone, not the weights' bytes",
        BASE,
        "            digest.update(fh.read(SAMPLE))\n            fh.seek(max(size - SAMPLE, 0))\n"
        "            digest.update(fh.read(SAMPLE))\n", "",
        (f"{UNIT}::test_the_fingerprint_tells_bases_apart_and_follows_moved_files",)),
    Bug("lora-fingerprint-path", "moving the base's files makes it another base", BASE,
        '    if saved == now or (saved is not None and now is not None\n'
        '                        and saved.get("fingerprint") == now.get("fingerprint")):\n',
        "    if saved == now:\n",
        (f"{UNIT}::test_the_fingerprint_tells_bases_apart_and_follows_moved_files",)),
    Bug("lora-peft-q-rows", "the PEFT adapter's q/k B rows stay in loom's interleaved order", EXPORT,
        '        if heads and which == "lora_B":\n', '        if heads and which == "lora_X":\n', (EXPORTS,)),
    Bug("lora-merge-unscaled", "the merged export adds B A without alpha / r", EXPORT,
        "            base[weight] = merged(base[weight], t, tensors[name[:-1] + \"B\"], scale)\n",
        "            base[weight] = merged(base[weight], t, tensors[name[:-1] + \"B\"], 1.0)\n", (EXPORTS,)),
    Bug("lora-auto-fp32", "lora.base_dtype = auto keeps the base in fp32 under bf16 compute",
        "loom/config.py",
        '    return cfg.train.precision if cfg.lora.base_dtype == "auto" else cfg.lora.base_dtype\n',
        '    return "fp32" if cfg.lora.base_dtype == "auto" else cfg.lora.base_dtype\n',
        (f"{UNIT}::test_base_dtype_bf16_with_bf16_precision_freezes_in_bf16",
         f"{RANKS}::test_bf16_with_the_base_in_bf16_is_close_to_fp32")),
    Bug("lora-init-from-reads-adapters", "model.init_from a loom checkpoint asks it for the adapters too",
        CKPT,
        "    model_sd = {k: v for k, v in get_model_state_dict(model).items() if not is_adapter(k)}\n",
        "    model_sd = dict(get_model_state_dict(model))\n",
        (f"{SAVED}::test_lora_from_a_loom_checkpoint_starts_from_its_weights",)),
    Bug("lora-peft-hf-names", "a Hugging Face module's adapter loses its model. prefix", EXPORT,
        "        hf = hf_name(weight) if gpt is not None else weight\n",
        '        hf = hf_name(weight) if gpt is not None else weight.removeprefix("model.")\n',
        (f"{SAVED}::test_a_hugging_face_decoder_run_as_itself_exports_an_adapter_peft_loads",)),
]
