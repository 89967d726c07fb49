"""`loom plan`: read the model and cluster from the command line, search, print, emit."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from loom.config import (
    Config,
    ModelConfig,
    ParallelConfig,
    ParallelDims,
    load_config,
    pipeline_microbatches,
    shape_overrides,
    to_toml,
    validate,
)
from loom.errors import ConfigError
from loom.files import atomic_write
from loom.hf_config import read_hf_config
from loom.layout import check_experts, check_layout
from loom.models.gpt.config import PRESETS, preset
from loom.plan import device, lora, muon, starting_point
from loom.plan.candidate import Workload
from loom.plan.explain import explain
from loom.plan.hardware import GPU, Cluster, lookup, with_overrides
from loom.plan.memory import RECIPES
from loom.plan.report import render_table
from loom.plan.search import Plan, config_candidate, emit_config, estimate, loss_chunk_of, search, size_text
from loom.plan.shapes import ModelShape, from_hf_config, from_params, from_preset, llama_like


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


TARGET_TOKENS = 2**20  # a realistic global batch: about a million tokens per optimizer step
MAX_REALISTIC_SEQ = 8192
PARAMS_ONLY_SEQ = 4096


def workload_of(args, cfg, shape: ModelShape, model: str | None, world: int,
                precision: str) -> tuple[Workload, str]:
    """The batch the plan prices, and a line saying where it came from. A config file (or --set)
    gives its own data.seq_len and train.batch_size; a bare model (--model, --params, a
    config.json) planned for GPUs gets a realistic workload — the model's sequence length, about a
    million tokens per step, rounded to a multiple of the GPUs — rather than loom's CPU demo batch."""
    chosen = _set_keys(args.set)
    chunk, every = loss_chunk_of(cfg, model), cfg.parallel.reduce_every_micro_step
    adapters = lora.from_config(cfg, precision)  # LoRA: its base stored in the priced precision under auto
    own_batch = args.config is not None and not str(args.config).endswith(".json")
    if own_batch or args.gpu == "local":
        w = Workload(shape, cfg.data.seq_len, cfg.train.batch_size, precision, args.recipe, chunk, every,
                     lora=adapters, muon=muon.from_config(cfg), documents=cfg.data.packing == "documents")
        return w, f"the config's batch: {w.global_batch} × {w.seq_len} tokens"
    if "data.seq_len" in chosen:
        seq, why = cfg.data.seq_len, "data.seq_len"
    elif args.params is not None:
        seq, why = PARAMS_ONLY_SEQ, "assumed for a parameter count"
    else:
        seq, why = min(model_seq_len(cfg, model), MAX_REALISTIC_SEQ), "the model's"
    if "train.batch_size" in chosen:
        batch = cfg.train.batch_size
        size = f"train.batch_size {batch}"
    else:
        batch = max(1, math.ceil(TARGET_TOKENS / seq / world)) * world
        size = f"{batch} sequences ≈ {batch * seq / 1e6:.2f}M tokens, a multiple of {world} GPUs"
    w = Workload(shape, seq, batch, precision, args.recipe, chunk, every, lora=adapters,
                 muon=muon.from_config(cfg), documents=cfg.data.packing == "documents")
    return w, (f"assumed workload: {size} × {seq} tokens ({why} sequence length); "
               f"change with --set train.batch_size=… --set data.seq_len=…")


def model_seq_len(cfg, model: str | None) -> int:
    """The longest sequence the model was built for: a preset's max_seq_len or a config.json's
    max_position_embeddings (the config's data.seq_len when the file does not say)."""
    path = Path(model) if model and model.endswith(".json") else None
    if path is None and model is None and cfg.model.init_from:
        path = Path(cfg.model.init_from).expanduser() / "config.json"
    if path is not None:
        return read_hf_config(path).max_position_embeddings or cfg.data.seq_len
    return preset(model or cfg.model.preset).max_seq_len


MAX_PER_NODE = 1024  # devices (ranks) on one node
MAX_NODES = 65536


def cluster_of(args, cfg) -> Cluster:
    """The catalog GPU named by --gpu, or this machine as `loom plan --calibrate` measured it."""
    for flag, value, most in (("--gpus-per-node", args.gpus_per_node, MAX_PER_NODE),
                              ("--nodes", args.nodes, MAX_NODES)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} {value} must be ≥ 1")
        if value is not None and value > most:
            raise ConfigError(f"{flag} {value} is more than loom plans for (at most {most:,}); "
                              f"give the cluster's real size")
    nodes = args.nodes or 1
    if args.gpu != "local":
        return with_overrides(Cluster(lookup(args.gpu), args.gpus_per_node or 8, nodes), args.hw)
    profile = device.load()
    ranks = args.gpus_per_node or (2 if profile.device == "cpu" else 1)
    return with_overrides(local_cluster(profile, ranks, nodes), args.hw)


def local_cluster(profile: device.DeviceProfile, ranks: int, nodes: int = 1) -> Cluster:
    """This machine as a cluster of `ranks` devices per node: a CPU's memory is shared by its ranks."""
    entry = profile.ranks_entry(ranks)
    shared = profile.device == "cpu"
    memory = profile.memory_bytes / (ranks if shared else 1)
    link = entry["collectives"].get("all_reduce", {}).get("bytes_per_s", 1e9)
    big = max(entry["elementwise_bytes"].values())
    gpu = GPU(f"local {profile.device}", profile.peak_flops(ranks) / 1e12, memory / 1e9, big / 1e12,
              link / 1e9, link / 1e9, big / 1e9)
    return Cluster(gpu, ranks, nodes, profile=profile)


def checked_config(cfg: Config, cluster: Cluster, precision: str | None = None) -> ParallelDims:
    """The config's combinations, checked as `loom train` checks them (config.validate; load_config
    checked each value) for this cluster, except that its batch need not divide: the search prices
    only the layouts that divide it, or the plan's own workload; and `precision`, when given, is the
    one the plan prices and --emit writes (a LoRA base in bf16 planned from an fp32 config). Returns
    the config's own degrees."""
    # a batch every layout of this world divides (dp divides the world size)
    per = cluster.world_size * cfg.train.grad_accum * pipeline_microbatches(cfg.parallel)
    train = dataclasses.replace(cfg.train, batch_size=per, precision=precision or cfg.train.precision)
    dividing = dataclasses.replace(cfg, train=train)
    cuda = cluster.profile is None or cluster.profile.device == "cuda"
    return validate(dividing, cluster.world_size, cuda_available=cuda, this_machine=False)


def planned_precision(cfg: Config, local: bool) -> str:
    """The compute dtype a plan prices and --emit writes: GPUs train in 16-bit (bf16, or a LoRA base's
    own 16-bit dtype), this machine in the config's precision."""
    if cfg.train.precision != "fp32" or local:
        return cfg.train.precision
    base = cfg.lora.base_dtype if cfg.lora.rank is not None else "auto"
    return base if base in ("bf16", "fp16") else "bf16"


def plan_inputs(args) -> tuple[Config, str | None, ModelShape]:
    """The config, the model named and its shape: all that can be wrong without the machine's profile,
    checked before a first `loom plan` spends minutes calibrating (the CLI calls this first)."""
    config, model = args.config, args.model
    if args.explain is not None and args.format == "json":  # (the text would break a JSON reader)
        raise ConfigError(f"--explain {args.explain} prints its terms as text, not JSON; drop --format json, "
                          f"or read candidate {args.explain} from --format json's candidates")
    if config is not None and str(config).endswith(".json"):  # a Hugging Face config.json in place of a TOML
        config, model = None, model or str(config)
    if model is not None and args.params is not None:  # --params would win and --model be ignored
        raise ConfigError(f"--params {args.params:g} and --model {model} both give the model's size; "
                          f"pass only one of them")
    cfg = load_config(config, args.set)
    if args.recipe not in RECIPES:
        raise ConfigError(f"--recipe {args.recipe!r} is not one of {', '.join(RECIPES)}")
    changed = sorted(key for key in _set_keys(args.set) if key.startswith("model.") and key != "model.preset")
    if model is not None and changed:  # --model's shape is planned whole: the --set would be ignored
        fix = (f"plan the changed model without --model: --set model.preset={model} and the --set"
               if model in PRESETS else "change the model's config.json instead")
        raise ConfigError(f"--model {model} gives the whole model, so --set {changed[0]} would be ignored; "
                          f"{fix}")
    return cfg, model, model_shape(cfg, model, args.params)


def check_model_layout(cfg, shape: ModelShape) -> None:
    """The config's own layout against the model planned, as `loom train` checks it once the world's
    degrees are (after config.validate: the same first message for the same config)."""
    if shape.known:
        check_layout(cfg, shape.n_layers, shape.n_heads, shape.n_kv_heads, shape.ffn_hidden, shape.vocab_size,
                     None, shape.tie_embeddings)  # (any length: a long-context plan sets max_seq_len after)
        check_experts(cfg, shape.moe_experts)


def _set_keys(items) -> set[str]:
    """The keys a list of --set SECTION.KEY=VALUE items sets."""
    return {item.partition("=")[0].strip() for item in items}


def run(args) -> tuple[Config, Plan, str | None]:
    """Search and print (and --emit); returns (config, plan, model) for `loom plan --trace`, which
    the CLI runs from loom/train/trace.py (it needs torch and the training code)."""
    cfg, model, shape = plan_inputs(args)
    cluster = cluster_of(args, cfg)
    local = cluster.profile is not None
    precision = planned_precision(cfg, local)
    dims = checked_config(cfg, cluster, precision if cfg.lora.rank is not None else None)
    check_model_layout(cfg, shape)
    workload, origin = workload_of(args, cfg, shape, model, cluster.world_size, precision)
    if args.emit:  # a model --emit cannot write is refused before anything is printed
        planned_model(cfg, shape, model, workload.seq_len)
    plan = search(workload, cluster)
    plan.workload_origin = origin
    # The config's own layout, priced beside the search: on its own batch, or on the plan's batch when
    # --set pins parallel keys (the user asked about that layout; the table alone would ignore it).
    yours, pinned = None, sorted(_set_keys(args.set) & _PARALLEL_KEYS)
    priced = cfg
    if pinned and workload.global_batch != cfg.train.batch_size:
        batch = dataclasses.replace(cfg.train, batch_size=workload.global_batch)
        priced = dataclasses.replace(cfg, train=batch)
    split = dims.dp * cfg.train.grad_accum
    if workload.global_batch == priced.train.batch_size and workload.global_batch % split == 0:
        yours = estimate(workload, config_candidate(priced, dims.dp_replicate, dims.dp_shard, dims.tp,
                                                    dims.pp), cluster)
    elif pinned and args.format != "json" and args.explain is None:
        print(f"your layout ({', '.join(pinned)}) is not priced: the plan's batch of "
              f"{workload.global_batch} sequences does not split over dp × grad_accum = {split}; "
              f"pass --set train.batch_size=N with N a multiple of {split} to price it", flush=True)
    if args.explain is not None:
        print(explain(plan, args.explain))
    elif args.format == "json":
        print(plan_json({**plan.to_dict(), "config": yours}))
    else:
        print(render_table(plan))
        if yours is not None:
            verdict = "fits" if yours["fits"] else f"does not fit: {yours['why_not']}"
            print(f"your config ({yours['label']}, micro-batch {yours['micro_batch']} × "
                  f"{yours['grad_accum']}): {size_text(yours['memory_bytes']['total'])} per "
                  f"{'GPU' if not local or cluster.profile.device == 'cuda' else 'rank'}, "
                  f"{yours['tokens_per_s']:,.0f} tokens/s, {verdict}")
    if args.emit:
        emit_all(args.emit, cfg, plan, cluster, shape, model, quiet=args.format == "json",
                 overwrite=getattr(args, "overwrite", False))
    return cfg, plan, model


def emit_all(target: str, cfg, plan: Plan, cluster: Cluster, shape: ModelShape, model: str | None,
             quiet: bool, overwrite: bool = False) -> None:
    """The recommendation to TARGET, and every other recommendable candidate (the best of each
    distinct layout that fits and loom runs, both engines) beside it as TARGET-STEM.N.toml.
    An existing file is replaced only under `overwrite`, which also removes the alternatives an
    earlier --emit wrote beside TARGET, so that none of another plan is left among these."""
    target = Path(target)
    best = plan.candidates[plan.recommended]
    suffix = target.suffix or ".toml"
    chosen = [(target, best)] + [(target.with_name(f"{target.stem}.{i}{suffix}"), plan.candidates[i])
                                 for i in plan.recommendable if i != plan.recommended]
    existing = [path for path, _ in chosen if path.exists() or path.is_symlink()]
    if any(path.is_dir() for path in existing):
        raise ConfigError(f"--emit {target}: {next(p for p in existing if p.is_dir())} is a folder; --emit "
                          f"names the TOML file to write, e.g. --emit {target / 'run.toml'}")
    if existing and not overwrite:
        raise ConfigError(f"--emit {target}: {existing[0]} already exists; pass --overwrite to replace it "
                          f"(and its alternatives {target.stem}.N{suffix}), or --emit a new file name")
    if overwrite:
        for old in target.parent.glob(f"{target.stem}.*{suffix}"):
            if old.name[len(target.stem) + 1:-len(suffix)].isdigit() and _emitted_by_loom(old):
                old.unlink()
    job = planned_model(cfg, shape, model, plan.workload.seq_len)
    tokens_per_step = plan.workload.global_batch * plan.workload.seq_len
    changes, said = starting_point.make_starting_point(cfg, shape.num_params, tokens_per_step)
    for path, record in chosen:
        emitted = emit_config(cfg, record)
        emitted.model, emitted.data = dataclasses.replace(job), dataclasses.replace(cfg.data)
        starting_point.apply(emitted, changes)
        emitted.data.seq_len, emitted.train.batch_size = plan.workload.seq_len, plan.workload.global_batch
        emitted.train.precision = plan.workload.precision
        validate(emitted, cluster.world_size, cuda_available=True, this_machine=False)
        header = (f"# loom plan: {record['label']} on {cluster.describe()}: {record['tokens_per_s']:,.0f} "
                  f"tokens/s predicted\n# run: loom train {path} --nproc {cluster.gpus_per_node} "
                  f"--nnodes {cluster.nodes}\n# model: {_model_words(job)}, {plan.workload.precision}, "
                  f"batch {plan.workload.global_batch} × {plan.workload.seq_len} tokens\n")
        if plan.workload.lora is not None:
            header += (f"# LoRA: {plan.workload.lora.describe()}; the base frozen in "
                       f"{plan.workload.lora.base_bytes} bytes per parameter\n")
        atomic_write(path, (header + starting_point.annotate(to_toml(emitted), changes)).encode())
    if not quiet:
        others = f" and {len(chosen) - 1} alternatives ({chosen[1][0].name} …)" if len(chosen) > 1 else ""
        print(f"wrote {target}{others}")
        if said:
            print(f"in it: {said}")


_PARALLEL_KEYS = frozenset(f"parallel.{f.name}" for f in dataclasses.fields(ParallelConfig))
SHAPE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "tie_embeddings")
EMIT_PARAMS_TOLERANCE = 0.10  # a Llama-style shape for --params must be this close to the count
LLAMA_PRESETS = ("1b", "8b", "70b")  # the bases of a shape --emit writes


def planned_model(cfg, shape: ModelShape, model: str | None, seq_len: int) -> ModelConfig:
    """The model section that builds the model the plan priced: a preset by name; a model folder's
    config.json as init_from when the folder holds weights, else its shape; a parameter count as a
    Llama-style shape of about that many parameters; else the config's own model."""
    if model is None and shape.known:
        return cfg.model
    if shape.known and not model.endswith(".json"):
        return ModelConfig(preset=model, max_seq_len=seq_len if seq_len > preset(model).max_seq_len else None)
    if shape.known and any(Path(model).parent.glob("*.safetensors")):
        return ModelConfig(init_from=str(Path(model).parent))
    if not shape.known:
        sized = llama_like(shape.num_params)
        if abs(sized.num_params / shape.num_params - 1) > EMIT_PARAMS_TOLERANCE:
            raise ConfigError(f"--emit needs a model shape, and --params {shape.num_params:g} is too small "
                              f"for a Llama-style one (the nearest has {sized.num_params:,}); pass --model "
                              f"PRESET or --model config.json")
        shape = sized
    # Llama-3's RoPE and norms from the preset nearest in size, so that its name does not contradict
    # the size; every shape field below replaces the preset's
    base = min(LLAMA_PRESETS, key=lambda name: abs(math.log(preset(name).num_params() / shape.num_params)))
    moe = read_hf_config(Path(model)).gpt_moe_fields() if shape.moe else {}  # a config.json's experts
    return ModelConfig(preset=base, **{k: getattr(shape, k) for k in SHAPE_FIELDS}, **moe,
                       max_seq_len=max(seq_len, preset(base).max_seq_len))


def _model_words(m: ModelConfig) -> str:
    if m.init_from:
        return f"the weights of {m.init_from}"
    params = preset(m.preset, **shape_overrides(m)).num_params()
    shaped = " with its shape below" if m.d_model is not None else ""
    return f"preset {m.preset}{shaped} ({params / 1e9:.3g}B parameters)"


def _emitted_by_loom(path: Path) -> bool:
    """Whether `path` is a plain file an earlier --emit wrote (its first line is emit's header)."""
    try:
        with open(path, "rb") as f:
            return not path.is_symlink() and f.read(13) == b"# loom plan: "
    except OSError:
        return False


def plan_json(record: dict) -> str:
    """The plan as JSON, indented, each of its (thousands of) candidates on one line: json's C encoder
    writes a line at once, where its indenting Python encoder takes most of `loom plan`'s time."""
    mark = "\x00candidates\x00"
    text = json.dumps({**record, "candidates": mark}, indent=1)
    rows = ",\n  ".join(json.dumps(c) for c in record["candidates"])
    return text.replace(json.dumps(mark), f"[\n  {rows}\n ]" if rows else "[]", 1)
