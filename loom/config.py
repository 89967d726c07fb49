"""The run configuration: one dataclass per TOML section, dotted `--set` overrides, validation.

Everything a run does is decided here, before any process starts, so that a bad value is one
line of error instead of a traceback from rank 3.
"""

from __future__ import annotations

import ctypes.util
import dataclasses
import difflib
import importlib.util
import json
import os
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loom import strategies
from loom.errors import ConfigError

PRECISIONS = ("fp32", "bf16", "fp16")
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")
OFFLOADS = ("none", "cpu")
ENGINES = ("torch", "deepspeed")
DEEPSPEED_OFFLOADS = ("none", "cpu", "nvme")
OPTIMIZER_IMPLS = ("auto", "foreach", "fused")
DEVICES = ("auto", "cpu", "cuda")
TOKENIZERS = ("auto", "byte", "bpe")  # or the path of a Hugging Face tokenizer.json
DATA_FORMATS = ("text", "sft")
TRACKERS = ("tensorboard", "wandb")
WANDB_MODES = ("offline", "online")
NONFINITE_POLICIES = ("skip", "stop")
CKPT_ERROR_POLICIES = ("stop", "continue")
PREEMPT_SIGNALS = ("USR1", "USR2")  # signals free for this use: INT, TERM and HUP already stop a run


@dataclass
class ModelConfig:
    preset: str = "small"
    # Any of these replaces the preset's value; None keeps the preset's.
    vocab_size: int | None = None
    d_model: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    ffn_hidden: int | None = None
    max_seq_len: int | None = None
    tie_embeddings: bool | None = None
    # Start from these weights: a Hugging Face model folder (config.json + safetensors), a loom
    # checkpoint (RUN/checkpoints/step_N) or a loom export (.safetensors). The shape comes from it.
    init_from: str = ""


@dataclass
class DataConfig:
    # "stdlib" | text file | directory | glob | .bin token file | `loom data prepare` folder |
    # JSONL / Parquet / Arrow file or folder | a Hugging Face dataset saved with save_to_disk
    source: str = "stdlib"
    # auto (the init_from folder's tokenizer.json, else byte) | byte | bpe | path of a tokenizer.json
    tokenizer: str = "auto"
    text_field: str = "text"  # records: the field holding the text
    format: str = "text"  # text | sft (prompt/completion or messages; loss on the completion only)
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    messages_field: str = "messages"  # sft: a chat as [{role, content}], through the chat template
    # Several sources mixed by weight, e.g. [{source = "a.jsonl", weight = 3}, {source = "b", weight = 1}]
    # (each entry may set its own text_field); replaces data.source.
    mix: list[dict] = field(default_factory=list)
    streaming: bool = False  # read records as a stream (corpora larger than memory)
    bpe_vocab_size: int = 2048
    bin_dtype: str = "uint16"
    seq_len: int = 128
    eval_fraction: float = 0.02
    num_workers: int = 1
    prefetch_factor: int = 4
    pin_memory: bool = True
    cache_dir: str = "~/.cache/loom"


@dataclass
class ParallelConfig:
    strategy: str = "zero3"
    dp_replicate: int = 1  # hsdp: replica groups (across nodes)
    dp_shard: int = -1  # hsdp: ranks sharing one shard group; -1 = world / dp_replicate
    engine: str = "torch"  # torch (DDP, ZeroRedundancyOptimizer, FSDP2) | deepspeed (ZeRO 0-3, offload)
    offload: str = "none"  # torch engine: none | cpu (FSDP2 CPUOffloadPolicy, needs an accelerator)
    offload_optimizer: str = "none"  # deepspeed engine, ZeRO 1-3: none | cpu | nvme
    offload_params: str = "none"  # deepspeed engine, ZeRO-3: none | cpu | nvme
    nvme_path: str = ""  # deepspeed NVMe offload: a directory on a local NVMe disk
    deepspeed_config: str = ""  # a DeepSpeed JSON merged over the config loom derives
    ddp_bucket_mb: float = 25.0
    ddp_static_graph: bool = False
    reshard_after_forward: bool | None = None  # None = by strategy: zero2 False, zero3/hsdp True
    fsdp_unit_mb: float = 25.0  # FSDP2: consecutive modules share a unit up to this size (0: one each)
    fsdp_prefetch: int = 1  # units all-gathered ahead in forward and backward
    pp: int = 1  # pipeline stages (outermost mesh dim)
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved
    pp_virtual_stages: int = 1  # interleaved: stages per pipeline rank
    microbatches: int = 0  # pipeline micro-batches per micro-step; 0 = pp
    tp: int = 1  # tensor-parallel degree (innermost mesh dim: the ranks of one node)
    sequence_parallel: bool = False  # tp: shard norms and residuals along the sequence
    activation_checkpointing: str = "none"  # none | full | selective
    ac_every: int = 2  # selective: checkpoint every k-th block


@dataclass
class TrainConfig:
    steps: int = 60
    seed: int = 0
    batch_size: int = 16  # global batch, sequences per optimizer step
    grad_accum: int = 1
    precision: str = "fp32"  # fp32 | bf16 | fp16 (fp16 uses loss scaling)
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping (the norm is still measured)
    optimizer_impl: str = "auto"  # auto | foreach | fused
    eval_every: int = 0  # 0 = only at the end
    eval_batches: int = 2
    log_every: int = 10
    device: str = "auto"  # auto | cpu | cuda
    compile: bool = False
    ckpt_every: int = 0  # save a checkpoint every N steps (0: only at the end)
    # ... and every this many minutes of training (0: off), so a crash loses at most that much
    ckpt_every_min: float = 30.0
    keep_last: int = 2  # checkpoints kept; older ones are removed once a newer one is complete
    ckpt_async: bool = False  # write checkpoints in the background while training goes on
    on_ckpt_error: str = "stop"  # a checkpoint that cannot be written: stop the run, or continue without it
    # the scheduler's early warning before preemption or the time limit (sbatch --signal=USR1@120):
    # stop at the next step with a checkpoint; under Slurm with requeue, `scontrol requeue` the job
    preempt_signal: str = "USR1"
    requeue: bool = False
    on_nonfinite: str = "skip"  # a NaN/Inf loss or gradient norm: skip the update, or stop the run
    collective_timeout_s: float = 600.0  # a collective waiting longer fails, naming who did not arrive
    log_to: list[str] = field(default_factory=list)  # any of "tensorboard", "wandb" (rank 0 writes)
    wandb_project: str = "loom"
    wandb_mode: str = "offline"  # offline (no network: `wandb sync` later) | online


@dataclass
class ProfileConfig:
    """torch.profiler on a schedule: skip `wait` steps, warm up `warmup`, record `active`."""
    enabled: bool = False  # `loom profile` turns it on
    wait: int = 1
    warmup: int = 1
    active: int = 3
    record_shapes: bool = True  # collective sizes (bytes) come from the recorded shapes
    with_stack: bool = False
    memory_snapshot: bool = True  # on GPUs: a CUDA memory snapshot of the profiled steps


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------
# Loading and overrides


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _did_you_mean(word: str, choices: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f"; did you mean '{close[0]}'?" if close else f"; known: {', '.join(sorted(choices))}"


def _coerce(path: str, value: Any, hint: Any) -> Any:
    """Check `value` against the field's type hint; ints are accepted where floats are."""
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        example = '["tensorboard"]' if item is str else '[{source = "a.jsonl", weight = 1}]'
        if not isinstance(value, list) or not all(isinstance(v, item) for v in value):
            raise ConfigError(f"{path} must be a list of {'strings' if item is str else 'tables'}, got "
                              f"{value!r}; e.g. --set '{path}={example}'")
        return value
    args = typing.get_args(hint)
    if type(None) in args:
        if value is None:
            return None
        hint = next(a for a in args if a is not type(None))
    ok = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
    }[hint](value)
    if not ok:
        raise ConfigError(
            f"{path} must be {hint.__name__}, got {type(value).__name__} {value!r}; "
            f"e.g. --set {path}={_example(hint)}"
        )
    return float(value) if hint is float else value


def _example(hint: type) -> str:
    return {bool: "true", int: "2", float: "0.5", str: "value"}[hint]


def _apply(cfg: Config, path: str, value: Any) -> None:
    section, _, key = path.partition(".")
    sections = {f.name: _hints(type(getattr(cfg, f.name))) for f in dataclasses.fields(Config)}
    if section not in sections or not key:
        raise ConfigError(f"unknown config section '{section}' in '{path}'{_did_you_mean(section, sections)}")
    hints = sections[section]
    if key not in hints:
        # The key may belong to another section (train.strategy -> parallel.strategy).
        elsewhere = [f"{s}.{key}" for s, keys in sections.items() if key in keys]
        if not elsewhere:
            elsewhere = [f"{section}.{k}" for k in difflib.get_close_matches(key, list(hints), n=1)]
        hint = f"; did you mean '{elsewhere[0]}'?" if elsewhere else f"; known: {', '.join(hints)}"
        raise ConfigError(f"unknown config key '{path}'{hint}")
    setattr(getattr(cfg, section), key, _coerce(path, value, hints[key]))


def _parse_value(text: str) -> Any:
    """`--set` values are TOML values (3, 0.5, true, "x"); a bare word is a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Defaults ← TOML file ← `--set section.key=value` overrides, each checked as it is applied."""
    cfg = Config()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist; pass an existing .toml file")
        _apply_toml(cfg, path.read_text(), str(path))
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set '{item}' must look like section.key=value, e.g. --set train.steps=10")
        _apply(cfg, key.strip(), _parse_value(text.strip()))
    cfg.parallel.strategy = strategies.ALIASES.get(cfg.parallel.strategy, cfg.parallel.strategy)
    return cfg


def load_config_text(text: str, origin: str = "config") -> Config:
    """A Config from TOML text (a checkpoint's saved config)."""
    cfg = Config()
    _apply_toml(cfg, text, origin)
    return cfg


def _apply_toml(cfg: Config, text: str, origin: str) -> None:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{origin} is not valid TOML ({e}); fix the syntax at that position") from None
    for section, table in data.items():
        if not isinstance(table, dict):
            owners = [f.name for f in dataclasses.fields(Config)
                      if section in _hints(type(getattr(cfg, f.name)))]
            fix = (f"put it under [{owners[0]}]" if owners else
                   f"no section has that key "
                   f"(sections: {', '.join(f.name for f in dataclasses.fields(Config))})")
            raise ConfigError(f"{origin}: '{section}' is outside any [section] table; {fix}")
        for key, value in table.items():
            _apply(cfg, f"{section}.{key}", value)


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML (None values, meaning 'the preset's', are left out)."""
    lines: list[str] = []
    for section, table in cfg.to_dict().items():
        lines.append(f"[{section}]")
        for key, value in table.items():
            if value is None:
                continue
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


# ---------------------------------------------------------------------------------------------
# Validation: everything that can be known before a process group starts


def _choice(path: str, value: str, choices: typing.Sequence[str]) -> None:
    if value not in choices:
        raise ConfigError(
            f"{path} = '{value}' is not one of {', '.join(choices)}"
            f"{_did_you_mean(value, choices) if difflib.get_close_matches(value, choices, n=1) else ''}")


def _positive(path: str, value: float, minimum: float = 1) -> None:
    if value < minimum:
        raise ConfigError(f"{path} = {value} must be ≥ {minimum}; set it to {minimum} or more")


@dataclass(frozen=True)
class ParallelDims:
    """The mesh [pp, dp_replicate, dp_shard, tp]; their product is the world size."""

    dp_replicate: int
    dp_shard: int
    tp: int = 1
    pp: int = 1

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp


def resolve_dims(p: ParallelConfig, world_size: int) -> ParallelDims:
    """The strategy's use of the dp ranks: replicate over them (ddp, zero1), shard over them
    (zero2, zero3) or both (hsdp: dp_replicate × dp_shard)."""
    _positive("parallel.tp", p.tp)
    _positive("parallel.pp", p.pp)
    tp, pp = p.tp, p.pp
    if world_size % (pp * tp):
        raise ConfigError(f"pp × tp = {pp} × {tp} = {pp * tp} does not divide the world size {world_size}; "
                          f"pick degrees whose product divides {world_size}")
    dp = world_size // (pp * tp)
    s = strategies.lookup(p.strategy)
    if s.dp_mesh != "hybrid":
        replicate, shard = s.dp_dims(dp)
        return ParallelDims(dp_replicate=replicate, dp_shard=shard, tp=tp, pp=pp)
    shard = p.dp_shard if p.dp_shard != -1 else dp // max(p.dp_replicate, 1)
    product = pp * p.dp_replicate * shard * tp
    if product != world_size or shard < 1:
        raise ConfigError(
            f"hsdp needs pp × dp_replicate × dp_shard × tp = world size, but {pp} × {p.dp_replicate} × "
            f"{p.dp_shard} × {tp} = {pp * p.dp_replicate * p.dp_shard * tp} ≠ {world_size}; "
            f"set parallel.dp_replicate × parallel.dp_shard = {dp}")
    return ParallelDims(dp_replicate=p.dp_replicate, dp_shard=shard, tp=tp, pp=pp)


def validate(cfg: Config, world_size: int, cuda_available: bool | None = None,
             this_machine: bool = True) -> ParallelDims:
    """Check every value and their combinations for `world_size` ranks; returns the dp layout."""
    p, t, d = cfg.parallel, cfg.train, cfg.data
    _choice("parallel.strategy", p.strategy, (*strategies.STRATEGIES, *strategies.ALIASES))
    _choice("parallel.offload", p.offload, OFFLOADS)
    _choice("parallel.engine", p.engine, ENGINES)
    _choice("parallel.offload_optimizer", p.offload_optimizer, DEEPSPEED_OFFLOADS)
    _choice("parallel.offload_params", p.offload_params, DEEPSPEED_OFFLOADS)
    _choice("parallel.activation_checkpointing", p.activation_checkpointing, ACTIVATION_CHECKPOINTING)
    _choice("train.precision", t.precision, PRECISIONS)
    _choice("train.optimizer_impl", t.optimizer_impl, OPTIMIZER_IMPLS)
    _choice("train.device", t.device, DEVICES)
    _choice("train.on_nonfinite", t.on_nonfinite, NONFINITE_POLICIES)
    _choice("train.on_ckpt_error", t.on_ckpt_error, CKPT_ERROR_POLICIES)
    _choice("train.preempt_signal", t.preempt_signal, PREEMPT_SIGNALS)
    if d.tokenizer in TOKENIZERS or not d.tokenizer.endswith(".json"):
        _choice("data.tokenizer", d.tokenizer, TOKENIZERS)
    elif this_machine and not Path(d.tokenizer).expanduser().is_file():
        raise ConfigError(f"data.tokenizer = '{d.tokenizer}' does not exist; give the path of a Hugging Face "
                          f"tokenizer.json, or auto, byte or bpe")
    _choice("data.format", d.format, DATA_FORMATS)
    for tracker in t.log_to:
        _choice("train.log_to", tracker, TRACKERS)
    _choice("train.wandb_mode", t.wandb_mode, WANDB_MODES)
    _choice("data.bin_dtype", d.bin_dtype, ("uint16", "uint32"))
    _positive("train.grad_accum", t.grad_accum)
    _positive("train.steps", t.steps)
    _positive("train.batch_size", t.batch_size)
    _positive("train.log_every", t.log_every)
    _positive("data.seq_len", d.seq_len)
    _positive("parallel.ac_every", p.ac_every)
    _positive("parallel.ddp_bucket_mb", p.ddp_bucket_mb, 0.001)
    if p.fsdp_unit_mb < 0:
        raise ConfigError(f"parallel.fsdp_unit_mb = {p.fsdp_unit_mb} must be ≥ 0 (0: no grouping of "
                          f"modules into FSDP units), e.g. 25")
    _positive("data.prefetch_factor", d.prefetch_factor)
    _positive("train.keep_last", t.keep_last)
    _positive("train.collective_timeout_s", t.collective_timeout_s, 0.001)
    if not isinstance(t.ckpt_every_min, (int, float)) or isinstance(t.ckpt_every_min, bool) \
            or t.ckpt_every_min < 0:
        raise ConfigError(f"train.ckpt_every_min = {t.ckpt_every_min!r} must be a number ≥ 0 (0: no "
                          f"checkpoints by time), e.g. 30")
    if t.ckpt_every < 0:
        raise ConfigError(f"train.ckpt_every = {t.ckpt_every} must be ≥ 0 (0 saves only at the end), "
                          f"e.g. 100")
    prof = cfg.profile
    if min(prof.wait, prof.warmup) < 0 or prof.active < 1:
        raise ConfigError(f"profile.wait = {prof.wait}, warmup = {prof.warmup} must be ≥ 0 and "
                          f"profile.active = {prof.active} ≥ 1, e.g. --set profile.active=3")
    if prof.enabled and prof.wait + prof.warmup + prof.active > t.steps:
        raise ConfigError(f"the profiler needs profile.wait + warmup + active = "
                          f"{prof.wait + prof.warmup + prof.active} steps but train.steps = {t.steps}; "
                          f"raise train.steps or lower profile.active")
    if t.eval_batches < 0 or t.eval_every < 0:
        raise ConfigError("train.eval_batches and train.eval_every must be ≥ 0 (0 turns eval off / to "
                          "the end)")
    if d.num_workers < 0:
        raise ConfigError(f"data.num_workers = {d.num_workers} must be ≥ 0 (0 loads in the main process)")
    if not 0 <= d.eval_fraction < 1:
        raise ConfigError(f"data.eval_fraction = {d.eval_fraction} must be in [0, 1), e.g. 0.02")
    if t.lr <= 0:
        raise ConfigError(f"train.lr = {t.lr} must be > 0, e.g. 3e-4")
    for name, beta in (("beta1", t.beta1), ("beta2", t.beta2)):
        if not 0 <= beta < 1:
            raise ConfigError(f"train.{name} = {beta} must be in [0, 1) (an AdamW decay rate), "
                              f"e.g. --set train.{name}={0.9 if name == 'beta1' else 0.95}")
    for name, value, example in (("eps", t.eps, "1e-8"), ("weight_decay", t.weight_decay, "0.1"),
                                 ("warmup_steps", t.warmup_steps, "10"), ("grad_clip", t.grad_clip, "1.0")):
        if value < 0:
            raise ConfigError(f"train.{name} = {value} must be ≥ 0, e.g. --set train.{name}={example}"
                              f"{' (0 turns clipping off)' if name == 'grad_clip' else ''}")
    if not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError(f"train.min_lr_ratio = {t.min_lr_ratio} must be in [0, 1] (the final LR as a "
                          f"fraction of train.lr), e.g. --set train.min_lr_ratio=0.1")
    _check_engine(p, this_machine)
    fixed = sorted(set(shape_overrides(cfg.model)) - {"max_seq_len"})
    if cfg.model.init_from and fixed:
        raise ConfigError(f"model.{fixed[0]} is set, but model.init_from = '{cfg.model.init_from}' gives the "
                          f"model's shape; remove model.{fixed[0]} (only model.max_seq_len may change)")
    if p.offload != "none":
        if not strategies.lookup(p.strategy).shards_params:
            raise ConfigError(
                f"parallel.offload = '{p.offload}' needs a sharded strategy (zero2, zero3 or hsdp), "
                f"not '{p.strategy}'; set parallel.strategy=zero3 or parallel.offload=none")
        if cuda_available is None:
            import torch

            cuda_available = torch.cuda.is_available()
        if not cuda_available or t.device == "cpu":
            raise ConfigError(
                "parallel.offload = 'cpu' uses FSDP2's CPUOffloadPolicy, which needs an accelerator, "
                "and this run is on CPU only; set parallel.offload=none")
    if t.device == "cuda" and cuda_available is False:
        raise ConfigError("train.device = 'cuda' but no CUDA device is visible; set train.device=cpu or auto")
    dims = resolve_dims(p, world_size)
    if dims.tp > 1 and strategies.lookup(p.strategy).shards_optimizer_only and t.precision == "fp16":
        # GradScaler unscales the optimizer's params' grads; under TP, ZeRO-1 links them at step only.
        raise ConfigError("zero1 with parallel.tp > 1 does not take fp16 loss scaling; "
                          "use train.precision=bf16 (no scaler needed) or parallel.strategy=zero2")
    if p.sequence_parallel and d.seq_len % dims.tp:
        raise ConfigError(f"parallel.sequence_parallel splits data.seq_len = {d.seq_len} over "
                          f"tp = {dims.tp}; use a seq_len divisible by {dims.tp}")
    if dims.pp > 1 and t.precision == "fp16":
        raise ConfigError("fp16 loss scaling is not wired into the pipeline schedules; "
                          "use train.precision=bf16")
    per = dims.dp * t.grad_accum * (pipeline_microbatches(p) if dims.pp > 1 else 1)
    if t.batch_size % per:
        multiples = ", ".join(str(per * k) for k in range(1, 4))
        pipeline = f" × pipeline micro-batches ({pipeline_microbatches(p)})" if dims.pp > 1 else ""
        raise ConfigError(
            f"train.batch_size = {t.batch_size} is not divisible by grad_accum ({t.grad_accum}) × "
            f"data-parallel size ({dims.dp}){pipeline} = {per}; use a multiple of {per} such as {multiples}")
    return dims


def _check_engine(p: ParallelConfig, this_machine: bool) -> None:
    """What each engine runs: offload to the host or NVMe of optimizer or parameters alone is
    DeepSpeed's; DeepSpeed here runs data parallelism (ZeRO 0-3), not TP, PP or hybrid sharding.
    `this_machine`: also check what the run needs here (DeepSpeed, libaio, the NVMe folder, the
    JSON file); `loom plan --emit` writes configs for other machines."""
    s = strategies.lookup(p.strategy)
    if p.engine == "torch":
        for key in ("offload_optimizer", "offload_params"):
            if getattr(p, key) != "none":
                raise ConfigError(f"parallel.{key} = '{getattr(p, key)}' is DeepSpeed's offload; set "
                                  f"parallel.engine=deepspeed (the torch engine offloads with "
                                  f"parallel.offload)")
        return
    if this_machine and importlib.util.find_spec("deepspeed") is None:
        raise ConfigError('parallel.engine = \'deepspeed\' needs DeepSpeed, which is not installed; '
                          'install it with pip install -e ".[deepspeed]" or set parallel.engine=torch')
    if s.deepspeed_stage is None:
        raise ConfigError(f"parallel.strategy = '{p.strategy}' has no DeepSpeed equivalent here; use zero3 "
                          f"with parallel.engine=deepspeed, or parallel.engine=torch")
    if p.tp > 1 or p.pp > 1:
        raise ConfigError(f"parallel.engine = 'deepspeed' runs data parallelism (ZeRO 0-3) only, not "
                          f"tp = {p.tp}, pp = {p.pp}; set parallel.tp=1 and parallel.pp=1, or "
                          f"parallel.engine=torch")
    if p.offload != "none":
        raise ConfigError("parallel.offload is the torch engine's (FSDP2); with parallel.engine=deepspeed "
                          "set parallel.offload_optimizer and/or parallel.offload_params instead")
    if p.offload_optimizer != "none" and s.deepspeed_stage == 0:
        raise ConfigError(f"parallel.offload_optimizer = '{p.offload_optimizer}' needs ZeRO 1-3 (DeepSpeed "
                          f"offloads the partitioned optimizer states); set parallel.strategy=zero1, zero2 "
                          f"or zero3")
    if p.offload_params != "none" and s.deepspeed_stage != 3:
        raise ConfigError(f"parallel.offload_params = '{p.offload_params}' needs zero3 (only ZeRO-3 "
                          f"partitions the parameters); set parallel.strategy=zero3 or "
                          f"parallel.offload_params=none")
    nvme = "nvme" in (p.offload_optimizer, p.offload_params)
    if nvme and not p.nvme_path:
        raise ConfigError("NVMe offload needs parallel.nvme_path, a directory on a local NVMe disk, e.g. "
                          "--set parallel.nvme_path=/local_nvme/loom")
    if not this_machine:
        return
    if nvme and ctypes.util.find_library("aio") is None:
        raise ConfigError("NVMe offload reads and writes through libaio, which is not installed; install it "
                          "with apt-get install libaio-dev (Debian/Ubuntu) or offload to cpu")
    if nvme:
        path = Path(p.nvme_path).expanduser()
        if not path.is_dir() or not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(f"parallel.nvme_path = '{p.nvme_path}' is not a writable directory; create it "
                              f"(mkdir -p {p.nvme_path}) or point at one on a local NVMe disk")
    if p.deepspeed_config:
        path = Path(p.deepspeed_config).expanduser()
        if not path.is_file():
            raise ConfigError(f"parallel.deepspeed_config = '{p.deepspeed_config}' does not exist; pass a "
                              f"DeepSpeed JSON file")
        try:
            user = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"parallel.deepspeed_config {path} is not valid JSON ({e}); fix it") from None
        if not isinstance(user, dict):
            raise ConfigError(f"parallel.deepspeed_config {path} must hold a JSON object of DeepSpeed "
                              f"settings")
        _check_zero_section(path, user.get("zero_optimization"))


def _check_zero_section(path: Path, zero: object) -> None:
    """DeepSpeed validates its zero_optimization section strictly (an unknown key is an error): ask
    it now, before any rank starts, and say which key."""
    if not isinstance(zero, dict):
        return
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig  # only with a user's JSON
    from pydantic import ValidationError

    try:
        DeepSpeedZeroConfig(**zero)
    except ValidationError as e:
        error = e.errors()[0]
        where = ".".join(str(x) for x in ("zero_optimization", *error["loc"]))
        what = ("is not a DeepSpeed setting" if error["type"] == "extra_forbidden"
                else f"is invalid: {error['msg']}")
        raise ConfigError(f"parallel.deepspeed_config {path}: {where} {what}; see DeepSpeed's config "
                          f"documentation for the section's keys") from None


def shape_overrides(m: ModelConfig) -> dict[str, Any]:
    """The model shape fields the config sets over its preset (None keeps the preset's)."""
    return {k: v for k, v in vars(m).items() if k not in ("preset", "init_from") and v is not None}


def pipeline_microbatches(p: ParallelConfig) -> int:
    """Micro-batches a pipeline step splits each rank's micro-batch into (0 means pp)."""
    return p.microbatches or p.pp
