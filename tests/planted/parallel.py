"""Planted bugs in the parallel engines: FSDP2 units, resharding and prefetch, DDP and its gradient
sync, ZeRO-1, the deepspeed engine's stage and offload, activation checkpointing, mixed precision
and loss scaling, tensor and pipeline parallelism, and the step's loss and gradient norm."""

from __future__ import annotations

from planted import Bug

STRAT = "tests/distributed/test_strategies.py"
KEYS = "tests/distributed/test_config_keys.py"
MATCH = f"{STRAT}::test_strategy_matches_single_process"
PP = f"{STRAT}::test_pipeline_parallel_matches_single_process"
PRECISION = f"{STRAT}::test_mixed_precision_computes_in_low_precision_and_tracks_fp32"
RESHARD = f"{KEYS}::test_reshard_after_forward_overrides_strategy"
AC = f"{KEYS}::test_activation_checkpointing_wraps_every_kth_block"
BF16 = f"{KEYS}::test_bf16_gathers_in_bf16_and_reduces_gradients_in_fp32"
DS_ENGINE = "tests/distributed/test_deepspeed.py::test_engine_runs_the_stage_and_offload_it_was_asked_for"
PLAN_UNITS = "tests/distributed/test_plan_measured.py::test_measured_matches_plan[zero3-units]"

BUGS = [
    # FSDP2 (zero2, zero3, hsdp)
    Bug("zero3-as-zero2", "zero3 keeps every unit gathered from forward to backward (the table's "
        "reshard_after_forward False)",
        "loom/strategies.py",
        'Strategy("zero3", 3, "fsdp2", "shard", frozenset({PARAMS, GRADS, OPTIMIZER}), True,',
        'Strategy("zero3", 3, "fsdp2", "shard", frozenset({PARAMS, GRADS, OPTIMIZER}), False,',
        (RESHARD, PLAN_UNITS)),
    Bug("fsdp-never-reshards", "apply_fsdp passes reshard_after_forward=False whatever the strategy or key",
        "loom/parallel/fsdp.py",
        '"reshard_after_forward": reshard_after_forward(p)}',
        '"reshard_after_forward": False}',
        (RESHARD, PLAN_UNITS)),
    Bug("head-unit-resharded", "the head's unit, which backward needs first, is resharded after forward "
        "and gathered again",
        "loom/parallel/fsdp.py",
        'keep = {"reshard_after_forward": False} if head_unit and i == len(groups) - 1 else {}',
        "keep = {}",
        (RESHARD,)),
    Bug("fsdp-prefetch-ignored", "parallel.fsdp_prefetch is ignored (always FSDP2's implicit depth 1)",
        "loom/parallel/fsdp.py",
        "_set_prefetch(units, p.fsdp_prefetch)",
        "_set_prefetch(units, 1)",
        (f"{KEYS}::test_fsdp_prefetch_depth",)),
    Bug("fsdp-unit-mb-in-kb", "fsdp_unit_mb groups modules by KiB, not MiB (every module its own unit)",
        "loom/strategies.py",
        "if held >= unit_mb * 2**20:",
        "if held >= unit_mb * 2**10:",
        (f"{KEYS}::test_fsdp_unit_mb_groups_modules",)),
    Bug("hsdp-shards-only", "hsdp shards over dp_shard and never replicates across dp_replicate",
        "loom/parallel/fsdp.py",
        'dp_mesh in ("hybrid", "replicate")',
        'dp_mesh in ("replicate",)',
        (f"{MATCH}[hsdp]",)),
    # gradient sync under accumulation
    Bug("grad-sync-every-micro-step", "gradients sync on every micro-step of gradient accumulation",
        "loom/train/step.py",
        "sync = micro == t.grad_accum - 1 or (sharded and cfg.parallel.reduce_every_micro_step)",
        "sync = True",
        (f"{MATCH}[ddp]", f"{MATCH}[zero3-units-once]")),
    Bug("fsdp-sync-ignored", "FSDP2 is told to sync gradients on every micro-step (the flag ignored)",
        "loom/parallel/apply.py",
        "model.set_requires_gradient_sync(enabled)",
        "model.set_requires_gradient_sync(True)",
        (f"{MATCH}[zero3-units-once]",)),
    Bug("fsdp-grads-unsharded-in-accumulation", "FSDP2 syncs only on the last micro-step, holding the "
        "unsharded gradients between (parallel.reduce_every_micro_step ignored)",
        "loom/train/step.py",
        "or (sharded and cfg.parallel.reduce_every_micro_step)",
        "or False",
        (f"{MATCH}[zero3-units]", f"{MATCH}[hsdp]")),
    Bug("replicas-sync-every-micro-step", "ddp under TP (FSDP2 replicating the model) all-reduces its whole "
        "gradients on every micro-step, though holding them whole saves nothing",
        "loom/train/step.py",
        " and strategies.GRADS in strategies.lookup(cfg.parallel.strategy).sharded",
        "",
        ("tests/distributed/test_plan_measured.py::test_measured_matches_plan[tp2xddp-ac-accum2]",)),
    Bug("ddp-no-sync-inverted", "DDP's no_sync is applied to the last micro-step instead of the others",
        "loom/parallel/apply.py",
        "with (contextlib.nullcontext() if enabled else model.no_sync()):",
        "with (model.no_sync() if enabled else contextlib.nullcontext()):",
        (f"{MATCH}[ddp]",)),
    Bug("ddp-bucket-ignored", "parallel.ddp_bucket_mb is ignored (DDP's 25 MB buckets)",
        "loom/parallel/ddp.py",
        "bucket_cap_mb=p.ddp_bucket_mb,",
        "bucket_cap_mb=25,",
        (f"{KEYS}::test_ddp_bucket_mb_sets_all_reduces_per_backward",)),
    # the loss and the gradient norm
    Bug("loss-not-averaged-over-accum", "each micro-step's loss is not divided by grad_accum (gradients "
        "summed: Adam and clipping hide it from the weights)",
        "loom/train/step.py",
        "scaled = loss / t.grad_accum",
        "scaled = loss",
        (f"{MATCH}[ddp]",)),
    Bug("pipeline-loss-not-averaged-over-accum", "under a pipeline the schedule's loss is not divided by "
        "grad_accum",
        "loom/train/step.py",
        "return loss * scale[\"value\"] / accum if sft else loss / accum",
        "return loss * scale[\"value\"] / accum if sft else loss",
        (f"{PP}[pp2-gpipe]",)),
    Bug("clip-norm-per-shard", "the gradient norm is taken over this rank's shards of the gradients",
        "loom/train/optim.py",
        "norm = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=foreach)",
        "norm = torch.nn.utils.get_total_norm([getattr(p.grad, '_local_tensor', p.grad) for p in group], "
        "foreach=foreach)",
        (f"{MATCH}[zero3]",)),
    Bug("clip-norm-per-stage", "under a pipeline the gradient norm is each stage's own",
        "loom/train/optim.py",
        "if pp_group is not None:  # each pipeline rank holds different layers: add their squares",
        "if False:",
        (f"{PP}[pp2-gpipe]",)),
    Bug("zero1-not-sharding", "zero1 builds a plain AdamW: every rank holds every optimizer state",
        "loom/train/optim.py",
        'if engine == "torch" and strategies.lookup(strategy).shards_optimizer_only:',
        "if False:",
        (f"{STRAT}::test_model_state_bytes_match_formula[zero1-2]",)),
    # activation checkpointing
    Bug("ac-every-ignored", "selective activation checkpointing ignores ac_every (checkpoints every block)",
        "loom/parallel/activation_checkpointing.py",
        'step = every if mode == "selective" else 1',
        "step = 1",
        (AC, f"{STRAT}::test_activation_checkpointing_same_losses_lower_peak[selective]")),
    Bug("ac-wrong-blocks", "selective checkpoints blocks k-1, 2k-1, ... instead of 0, k, 2k, ...",
        "loom/parallel/activation_checkpointing.py",
        "if int(key) % step == 0:",
        "if (int(key) + 1) % step == 0:",
        (AC,)),
    # mixed precision
    Bug("fp16-scaler-off", "fp16 gets no loss scaler",
        "loom/parallel/precision.py",
        'if precision != "fp16":',
        'if precision != "float16":',
        (f"{PRECISION}[zero2-fp16]", f"{PRECISION}[ddp-fp16]")),
    Bug("fp16-loss-not-scaled", "the scaler exists, but backward runs on the unscaled loss",
        "loom/train/step.py",
        "(scaler.scale(scaled) if scaler else scaled).backward()",
        "scaled.backward()",
        (f"{PRECISION}[zero2-fp16]",)),
    Bug("bf16-reduce-in-bf16", "FSDP2 reduces bf16 gradients in bf16, not fp32",
        "loom/parallel/fsdp.py",
        "reduce_dtype=torch.float32",
        "reduce_dtype=DTYPES[precision]",
        (BF16, f"{PRECISION}[hsdp-bf16]")),
    Bug("fsdp-params-stay-fp32", "FSDP2 computes in fp32 under bf16 (param_dtype not set)",
        "loom/parallel/fsdp.py",
        "MixedPrecisionPolicy(param_dtype=DTYPES[precision],",
        "MixedPrecisionPolicy(param_dtype=torch.float32,",
        (BF16, f"{PRECISION}[zero3-bf16]")),
    Bug("ddp-autocast-off", "ddp and zero1 run bf16/fp16 without autocast (everything in fp32)",
        "loom/parallel/precision.py",
        'if precision == "fp32" or fsdp:',
        "if True:",
        (f"{PRECISION}[ddp-bf16]",)),
    # tensor and pipeline parallelism
    Bug("sp-norms-not-split", "with sequence parallelism the blocks' norms are not SequenceParallel (their "
        "gains' gradients never summed over the tp ranks)",
        "loom/models/gpt/tensor_parallel.py",
        '            plan["attention_norm"] = SequenceParallel()\n'
        '            plan["ffn_norm"] = SequenceParallel()',
        "            pass",
        (f"{STRAT}::test_tensor_parallel_matches_single_process[tp2-sp]",)),
    Bug("pp-1f1b-runs-gpipe", "parallel.pp_schedule = 1f1b runs GPipe",
        "loom/parallel/pipeline.py",
        '"1f1b": Schedule1F1B,',
        '"1f1b": ScheduleGPipe,',
        ("tests/distributed/test_pipeline_schedules.py::test_schedule_matches_single_process[1f1b-1-2]",)),
    Bug("pp-microbatches-ignored", "parallel.microbatches is ignored (always pp micro-batches)",
        "loom/config.py",
        "return p.microbatches or p.pp",
        "return p.pp",
        (f"{PP}[pp2-1f1b-m4]",)),
    Bug("pp-loss-mean-over-world", "under a pipeline the mean loss divides by every rank, not the last "
        "stage's",
        "loom/train/step.py",
        "global_mean(loss_sum / t.grad_accum, d.world_size // cfg.parallel.pp)",
        "global_mean(loss_sum / t.grad_accum, d.world_size)",
        (f"{PP}[pp2-gpipe]",)),
    # the deepspeed engine
    Bug("ds-zero2-as-stage1", "the deepspeed engine runs zero2 as ZeRO stage 1",
        "loom/parallel/deepspeed_engine.py",
        "stage = strategies.lookup(p.strategy).zero_stage",
        "stage = min(strategies.lookup(p.strategy).zero_stage, 1) if p.strategy == \"zero2\" "
        "else strategies.lookup(p.strategy).zero_stage",
        (DS_ENGINE,)),
    Bug("ds-cpu-offload-dropped", "the deepspeed engine drops offload_optimizer = cpu (NVMe kept)",
        "loom/parallel/deepspeed_engine.py",
        '        if where != "none":',
        '        if where == "nvme":',
        (DS_ENGINE,)),
    # measuring collectives
    Bug("comms-reduce-scatter-output", "CollectiveCounter reads a reduce-scatter's payload from its output "
        "(one shard) instead of its input",
        "loom/observe/collectives.py",
        '"c10d::_reduce_scatter_base_": ("reduce_scatter", "input_tensor", False),',
        '"c10d::_reduce_scatter_base_": ("reduce_scatter", "output_tensor", False),',
        ("tests/distributed/test_comms.py::test_fsdp2_gathers_and_reduce_scatters_padded_units",)),
    Bug("zero3-init-dtype-argument", "ZeRO-3's model built with zero.Init(dtype=torch.float32), which "
        "DeepSpeed "
        "ignores where the device has no fp16 (a bf16 model)",
        "loom/parallel/deepspeed_engine.py",
        "deepspeed.zero.Init(config_dict_or_path=fp32)",
        "deepspeed.zero.Init(config_dict_or_path=ds, dtype=torch.float32)",
        ("tests/distributed/test_deepspeed.py::test_zero3_builds_in_fp32_where_the_device_has_no_fp16",)),
    Bug("offload-buffers-on-host", "under CPU offload the RoPE tables stay in host memory with the "
        "parameters (the first GPU run's crash)", "loom/parallel/apply.py",
        "    if offload:\n", "    if False:\n",
        ("tests/unit/test_model.py::test_offload_keeps_buffers_on_the_compute_device",)),
    Bug("ddp-on-one-rank",
        "a one-replica ddp run wraps DDP anyway (its buckets hold 4Ψ through the next forward)",
        "loom/parallel/ddp.py",
        "    if d.grad_mesh.size() == 1:\n        return model\n", "",
        ("tests/unit/test_memory_vs_plain_loop.py::test_one_rank_ddp_peaks_as_a_plain_loop",)),
    Bug("plan-one-replica-holds-grads",
        "the planner keeps a one-replica ddp step's gradients through forward",
        "loom/plan/memory.py",
        "    elif no_ddp(w, c) and c.grad_accum == 1 and not pipelined:\n", "    elif False:\n",
        ("tests/unit/test_memory_vs_plain_loop.py::test_the_plan_frees_one_replicas_gradients_until_backward",)),
    Bug("deepspeed-builds-shm-allreduce", "DeepSpeed's CPU backend compiles its shared-memory all-reduce, "
        "which only its inference path calls (a minute on a fresh machine)",
        "loom/parallel/deepspeed_engine.py",
        '    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False\n', "",
        ("tests/distributed/test_deepspeed.py::test_zero_stages_match_the_torch_engine",)),
]
