"""`loom plan`: read the model and cluster from the command line, search, print, emit."""

from __future__ import annotations

import json
from pathlib import Path

from loom.config import Config, load_config, resolve_dims, shape_overrides, to_toml, validate
from loom.errors import ConfigError
from loom.files import atomic_write
from loom.plan.candidate import Workload
from loom.plan.hardware import Cluster, lookup, with_overrides
from loom.plan.memory import RECIPES
from loom.plan.report import render_table
from loom.plan.search import Plan, config_candidate, emit_config, estimate, search
from loom.plan.shapes import ModelShape, from_hf_config, from_params, from_preset


def model_shape(cfg, model: str | None, params: float | None) -> ModelShape:
    """--params, else --model (a preset name or a Hugging Face config.json), else the config's model
    (a pretrained folder's config.json when model.init_from names one)."""
    if params is not None:
        return from_params(params)
    if model is not None:
        return from_hf_config(model) if model.endswith(".json") else from_preset(model)
    if cfg.model.init_from:
        folder = Path(cfg.model.init_from).expanduser()
        if not (folder / "config.json").is_file():
            raise ConfigError(f"loom plan reads the shape of model.init_from from a Hugging Face folder's "
                              f"config.json, which {folder} lacks; pass --model PRESET or --model FILE.json")
        return from_hf_config(folder / "config.json")
    overrides = shape_overrides(cfg.model)
    overrides.pop("max_seq_len", None)
    return from_preset(cfg.model.preset, **overrides)


def run(args) -> tuple[Config, Plan, str | None]:
    """Search and print (and --emit); returns (config, plan, model) for `loom plan --trace`, which
    the CLI runs from loom/train/trace.py (it needs torch and the training code)."""
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
        print(render_table(plan))
        if yours is not None:
            verdict = "fits" if yours["fits"] else f"does not fit: {yours['why_not']}"
            print(f"your config ({yours['label']}, micro-batch {yours['micro_batch']} × "
                  f"{yours['grad_accum']}): {yours['memory_bytes']['total'] / 1e9:.1f} GB per GPU, "
                  f"{yours['tokens_per_s']:,.0f} tokens/s, {verdict}")
    if args.emit:
        best = plan.candidates[plan.recommended]
        emitted = emit_config(cfg, best)
        if shape.known and model is not None and not model.endswith(".json"):
            emitted.model.preset = model
        validate(emitted, cluster.world_size, cuda_available=True, this_machine=False)
        header = (f"# loom plan: {best['label']} on {cluster.describe()}\n# run: loom train {args.emit} "
                  f"--nproc {cluster.gpus_per_node} --nnodes {cluster.nodes}\n")
        atomic_write(Path(args.emit), (header + to_toml(emitted)).encode())
        if args.format != "json":
            print(f"wrote {args.emit}")
    return cfg, plan, model
