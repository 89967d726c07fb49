"""`loom plan`: read the model and cluster from the command line, search, print, emit."""

from __future__ import annotations

import json
from pathlib import Path

from loom.errors import ConfigError
from loom.files import atomic_write
from loom.plan.candidate import Workload
from loom.plan.hardware import Cluster, lookup, with_overrides
from loom.plan.memory import RECIPES
from loom.plan.search import config_candidate, emit_config, estimate, search
from loom.plan.shapes import ModelShape, from_hf_config, from_params, from_preset


def model_shape(cfg, model: str | None, params: float | None) -> ModelShape:
    """--params, else --model (a preset name or a Hugging Face config.json), else the config's model."""
    if params is not None:
        return from_params(params)
    if model is not None:
        return from_hf_config(model) if model.endswith(".json") else from_preset(model)
    overrides = {k: v for k, v in vars(cfg.model).items() if k not in ("preset", "max_seq_len") and v is not None}
    return from_preset(cfg.model.preset, **overrides)


def run(args) -> int:
    from loom.config import load_config, resolve_dims, to_toml, validate

    config, model = args.config, args.model
    if config is not None and str(config).endswith(".json"):  # a Hugging Face config.json in place of a TOML
        config, model = None, model or str(config)
    cfg = load_config(config, args.set)
    if args.recipe not in RECIPES:
        raise ConfigError(f"--recipe {args.recipe!r} is not one of {', '.join(RECIPES)}")
    for flag, value in (("--gpus-per-node", args.gpus_per_node), ("--nodes", args.nodes)):
        if value < 1:
            raise ConfigError(f"{flag} {value} must be ≥ 1")
    cluster = with_overrides(Cluster(lookup(args.gpu), args.gpus_per_node, args.nodes), args.hw)
    shape = model_shape(cfg, model, args.params)
    precision = "bf16" if cfg.train.precision == "fp32" else cfg.train.precision  # GPUs train in 16-bit
    workload = Workload(shape, cfg.data.seq_len, cfg.train.batch_size, precision, args.recipe)
    dims = resolve_dims(cfg.parallel, cluster.world_size)  # the config's own degrees must divide
    plan = search(workload, cluster)
    yours = None
    if workload.global_batch % (dims.dp * cfg.train.grad_accum) == 0:
        yours = estimate(workload, config_candidate(cfg, dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp),
                         cluster)
    if args.format == "json":
        print(json.dumps({**plan.to_dict(), "config": yours}, indent=1))
    else:
        from loom.plan.report import render_table

        print(render_table(plan))
        if yours is not None:
            verdict = "fits" if yours["fits"] else f"does not fit: {yours['why_not']}"
            print(f"your config ({yours['label']}, micro-batch {yours['micro_batch']} × {yours['grad_accum']}): "
                  f"{yours['memory_bytes']['total'] / 1e9:.1f} GB per GPU, {yours['tokens_per_s']:,.0f} tokens/s, "
                  f"{verdict}")
    if args.emit:
        best = plan.candidates[plan.recommended]
        emitted = emit_config(cfg, best)
        if shape.known and model is not None and not model.endswith(".json"):
            emitted.model.preset = model
        validate(emitted, cluster.world_size, cuda_available=True)
        header = (f"# loom plan: {best['label']} on {cluster.describe()}\n# run: loom train {args.emit} "
                  f"--nproc {cluster.gpus_per_node} --nnodes {cluster.nodes}\n")
        atomic_write(Path(args.emit), (header + to_toml(emitted)).encode())
        if args.format != "json":
            print(f"wrote {args.emit}")
    if args.trace:
        _trace(cfg, plan, model)
    return 0


def _trace(cfg, plan, model: str | None) -> None:
    """Run the real model and strategy under FakeTensorMode at the target world size."""
    import dataclasses

    from loom.plan.trace import traced_vs_analytic

    best = plan.candidates[plan.recommended]
    strategy = best["strategy"] if best["tp"] == best["pp"] == 1 and best["offload"] == "none" else "zero3"
    traced_cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, strategy=strategy, tp=1, pp=1,
                                                                         offload="none"))
    if model is not None and not model.endswith(".json"):
        traced_cfg.model.preset = model
    result = traced_vs_analytic(traced_cfg, plan.cluster.world_size)
    traced, analytic = result["traced"], result["analytic"]
    print(f"\ntraced under FakeTensorMode: the real model and {strategy} on a fake process group of "
          f"{plan.cluster.world_size} ranks (rank 0; torch recipe, micro-batch {traced['micro_batch']} × "
          f"{traced['seq_len']} tokens)")
    print(f"  {'MB per rank':<14} {'traced':>12} {'analytic':>12} {'ratio':>7}")
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "model_state_bytes"):
        print(f"  {key.removesuffix('_bytes'):<14} {traced[key] / 1e6:12.3f} {analytic[key] / 1e6:12.3f} "
              f"{result['ratio'][key]:7.3f}")
    print(f"  {'step peak':<14} {traced['peak_bytes'] / 1e6:12.3f}")
