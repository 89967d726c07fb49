"""The run configuration: one dataclass per TOML section, dotted `--set` overrides, validation.

Everything a run does is decided here, before any process starts, so that a bad value is one
line of error instead of a traceback from rank 3: every field's type (its dataclass hint) and
range (`RULES`), their combinations (`validate`), and a user's DeepSpeed JSON
(`read_deepspeed_json`: the keys loom derives are loom's to set).
"""

from __future__ import annotations

import copy
import ctypes.util
import dataclasses
import datetime
import difflib
import functools
import importlib.util
import json
import math
import os
import re
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loom import strategies
from loom.checked import BadFile, Fields, read_json, read_text
from loom.errors import ConfigError
from loom.hf_config import MAX_FFN, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB, MAX_WIDTH
from loom.models.gpt.config import MOE_SCORES, MOE_TRAINING_FIELDS, PRESETS, preset

PRECISIONS = ("fp32", "bf16", "fp16")
ACTIVATION_CHECKPOINTING = ("none", "full", "selective", "op")
OFFLOADS = ("none", "cpu")
ENGINES = ("torch", "deepspeed")
DEEPSPEED_OFFLOADS = ("none", "cpu", "nvme")
OPTIMIZER_IMPLS = ("auto", "foreach", "fused")
OPTIMIZERS = ("adamw", "muon")  # muon: loom/train/muon.py, for the blocks' matrices; AdamW for the rest
MUON_UPDATE_SCALES = ("match_rms_adamw", "original")
MUON_NS_DTYPES = ("bf16", "fp32")
DEVICES = ("auto", "cpu", "cuda")
TOKENIZERS = ("auto", "byte", "bpe")  # or the path of a Hugging Face tokenizer.json
DATA_FORMATS = ("text", "sft")
TRACKERS = ("tensorboard", "wandb")
WANDB_MODES = ("offline", "online")
NONFINITE_POLICIES = ("skip", "stop")
CKPT_ERROR_POLICIES = ("stop", "continue")
PREEMPT_SIGNALS = ("USR1", "USR2")  # signals free for this use: INT, TERM and HUP already stop a run
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev")  # loom/parallel/pipeline.py
SPLIT_BACKWARD_SCHEDULES = ("zb", "zbv", "dualpipev")  # backward in two passes: inputs, then weights
V_SCHEDULES = ("zbv", "dualpipev")  # two stages per rank, placed in a V
BIN_DTYPES = ("uint16", "uint32")
CP_MODES = ("ring", "alltoall")  # loom/parallel/context_parallel.py
PACKINGS = ("concat", "documents")
LORA_BASE_DTYPES = ("auto", "fp32", "bf16", "fp16")


@dataclass
class ModelConfig:
    preset: str = "small"  # the model shape: a name of `loom presets` (tiny, small, 125m, 1b, 8b, 70b, …)
    # Any of these replaces the preset's value; None keeps the preset's.
    vocab_size: int | None = None  # tokens in the vocabulary (unset: a bpe or tokenizer.json tokenizer's)
    d_model: int | None = None  # the width: hidden size of every block
    n_layers: int | None = None  # transformer blocks
    n_heads: int | None = None  # attention (query) heads
    n_kv_heads: int | None = None  # key/value heads (grouped-query attention; n_heads: multi-head)
    ffn_hidden: int | None = None
    max_seq_len: int | None = None  # the longest sequence (RoPE positions) the model takes
    tie_embeddings: bool | None = None  # the output head shares the embedding's weights
    # Mixture of experts (loom/models/gpt/config.py says what each means); None keeps the preset's.
    moe_experts: int | None = None
    moe_top_k: int | None = None
    moe_shared_experts: int | None = None
    moe_every: int | None = None
    moe_dense_first: int | None = None
    moe_ffn_hidden: int | None = None
    moe_score: str | None = None
    moe_norm_topk: bool | None = None
    moe_route_scale: float | None = None
    moe_shared_gate: bool | None = None
    moe_aux_loss_coef: float | None = None
    moe_bias_update_rate: float | None = None
    moe_capacity_factor: float | None = None
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
    prompt_field: str = "prompt"  # sft records: the field holding the prompt
    completion_field: str = "completion"  # sft records: the field holding the completion
    messages_field: str = "messages"  # sft: a chat as [{role, content}], through the chat template
    # Several sources mixed by weight, e.g. [{source = "a.jsonl", weight = 3}, {source = "b", weight = 1}]
    # (each entry may set its own text_field); replaces data.source.
    mix: list[dict] = field(default_factory=list)
    streaming: bool = False  # read records as a stream (corpora larger than memory)
    bpe_vocab_size: int = 2048  # tokenizer bpe: the vocabulary it learns from the corpus
    bin_dtype: str = "uint16"  # a .bin token file's integers: uint16 | uint32
    # concat: windows cut across documents, attention sees the whole window | documents: attention
    # never crosses a document's end (its EOS) and positions restart at each document
    packing: str = "concat"
    seq_len: int = 128  # tokens per training sequence
    eval_fraction: float = 0.02  # the share of the corpus held out for eval
    num_workers: int = 1  # DataLoader worker processes per rank (0: in the main process)
    prefetch_factor: int = 4  # batches each worker loads ahead
    pin_memory: bool = True  # page-locked host batches (on GPUs: faster copies)
    cache_dir: str = "~/.cache/loom"  # where tokenized corpora are cached


@dataclass
class ParallelConfig:
    strategy: str = "zero3"  # ddp | zero1 | zero2 | zero3 (fsdp) | hsdp
    dp_replicate: int = 1  # hsdp: replica groups (across nodes)
    dp_shard: int = -1  # hsdp: ranks sharing one shard group; -1 = world / dp_replicate
    engine: str = "torch"  # torch (DDP, ZeroRedundancyOptimizer, FSDP2) | deepspeed (ZeRO 0-3, offload)
    offload: str = "none"  # torch engine: none | cpu (FSDP2 CPUOffloadPolicy, needs an accelerator)
    offload_optimizer: str = "none"  # deepspeed engine, ZeRO 1-3: none | cpu | nvme
    offload_params: str = "none"  # deepspeed engine, ZeRO-3: none | cpu | nvme
    nvme_path: str = ""  # deepspeed NVMe offload: a directory on a local NVMe disk
    deepspeed_config: str = ""  # a DeepSpeed JSON merged over the config loom derives
    ddp_bucket_mb: float = 25.0  # ddp/zero1: gradients all-reduced in buckets of this size
    ddp_static_graph: bool = False  # ddp: the same parameters used every step (DDP static_graph)
    reshard_after_forward: bool | None = None  # None = by strategy: zero2 False, zero3/hsdp True
    fsdp_unit_mb: float = 25.0  # FSDP2: consecutive modules share a unit up to this size (0: one each)
    fsdp_prefetch: int = 1  # units all-gathered ahead in forward and backward
    # FSDP2 under gradient accumulation: reduce-scatter each micro-step, so the gradients stay
    # sharded (ZeRO's 16Ψ/N, as DeepSpeed and torchtitan run it); false: once per step, holding the
    # unsharded fp32 gradients between micro-steps (fewer collectives, 4Ψ more memory per rank)
    reduce_every_micro_step: bool = True
    pp: int = 1  # pipeline stages (outermost mesh dim)
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved | zb (zero bubble) | zbv | dualpipev
    pp_virtual_stages: int = 1  # interleaved, zb: stages per pipeline rank (zbv, dualpipev: always 2)
    # dualpipev under ep: one micro-batch's forward beside another's backward, each one's expert
    # all-to-alls under the other's compute (false: the two one after the other, as torch runs them)
    dualpipev_overlap: bool = True
    microbatches: int = 0  # pipeline micro-batches per micro-step; 0 = pp
    # blocks in each pipeline stage, in stage order (pp × stages per rank of them, summing to the model's
    # layers): fewer on the head's stage balances its vocabulary-sized matmuls; empty: an even split
    pp_stage_layers: list[int] = field(default_factory=list)
    tp: int = 1  # tensor-parallel degree (innermost mesh dim: the ranks of one node)
    sequence_parallel: bool = False  # tp: shard norms and residuals along the sequence
    # context parallel: each sequence split over cp ranks (a chunk from the front and its mirror from
    # the back), attention exchanged between them; FSDP2 shards over dp_shard × cp
    cp: int = 1
    cp_mode: str = "ring"  # ring (k/v blocks passed around, isend/irecv) | alltoall (Ulysses: seq ↔ heads)
    # expert parallel: each MoE block's routed experts split over ep of the data-parallel ranks, tokens
    # sent to their experts' ranks and back with all-to-all; FSDP2 shards the experts over dp / ep
    ep: int = 1
    activation_checkpointing: str = "none"  # none | full | selective | op (keep matmul outputs)
    ac_every: int = 2  # selective: checkpoint every k-th block


@dataclass
class TrainConfig:
    steps: int = 60  # optimizer steps
    seed: int = 0  # the initial weights and the data order
    batch_size: int = 16  # global batch, sequences per optimizer step
    grad_accum: int = 1  # micro-steps per optimizer step (the global batch split over them)
    precision: str = "fp32"  # fp32 | bf16 | fp16 (fp16 uses loss scaling)
    lr: float = 3e-3  # peak learning rate (linear warmup, then cosine decay)
    min_lr_ratio: float = 0.1  # the final LR as a fraction of lr
    warmup_steps: int = 10  # steps of linear LR warmup
    weight_decay: float = 0.1  # AdamW's decoupled weight decay
    beta1: float = 0.9  # AdamW's decay of the gradient mean
    beta2: float = 0.95  # AdamW's decay of the squared-gradient mean
    eps: float = 1e-8  # AdamW's denominator term
    grad_clip: float = 1.0  # 0 disables clipping (the norm is still measured)
    # tokens per chunk of the output projection + cross entropy (no full logits); 0: the full logits
    loss_chunk: int = 512
    optimizer: str = "adamw"  # adamw | muon (the blocks' matrices; AdamW for the rest: [muon])
    optimizer_impl: str = "auto"  # auto | foreach | fused (AdamW's kernels)
    eval_every: int = 0  # 0 = only at the end
    eval_batches: int = 2  # held-out batches per eval (0: no eval)
    log_every: int = 10  # steps between progress lines
    device: str = "auto"  # auto | cpu | cuda
    compile: bool = False  # torch.compile each block
    ckpt_every: int = 0  # save a checkpoint every N steps (0: only at the end)
    # ... and every this many minutes of training (0: off), so a crash loses at most that much
    ckpt_every_min: float = 30.0
    keep_last: int = 2  # checkpoints kept; older ones are removed once a newer one is complete
    ckpt_async: bool = False  # write checkpoints in the background while training goes on
    on_ckpt_error: str = "stop"  # a checkpoint that cannot be written: stop the run, or continue without it
    # the scheduler's early warning before preemption or the time limit (sbatch --signal=USR1@120):
    # stop at the next step with a checkpoint; under Slurm with requeue, `scontrol requeue` the job
    preempt_signal: str = "USR1"
    requeue: bool = False  # on preempt_signal under Slurm: requeue the job after the checkpoint
    on_nonfinite: str = "skip"  # a NaN/Inf loss or gradient norm: skip the update, or stop the run
    collective_timeout_s: float = 600.0  # a collective waiting longer fails, naming who did not arrive
    log_to: list[str] = field(default_factory=list)  # any of "tensorboard", "wandb" (rank 0 writes)
    wandb_project: str = "loom"  # log_to wandb: the project
    wandb_mode: str = "offline"  # offline (no network: `wandb sync` later) | online


@dataclass
class ProfileConfig:
    """torch.profiler on a schedule: skip `wait` steps, warm up `warmup`, record `active`."""
    enabled: bool = False  # `loom profile` turns it on
    wait: int = 1  # steps skipped before the profiler warms up
    warmup: int = 1  # steps traced but discarded
    active: int = 3  # steps recorded
    record_shapes: bool = True  # collective sizes (bytes) come from the recorded shapes
    with_stack: bool = False  # Python stacks in the traces (larger files)
    memory_snapshot: bool = True  # on GPUs: a CUDA memory snapshot of the profiled steps


@dataclass
class LoRAConfig:
    """Low-rank adapters (loom/models/lora.py): the base model frozen, y = W x + (alpha/rank)·B A x
    trained for the targeted linears only."""
    rank: int | None = None  # None: full fine-tuning; set (e.g. 16) to train adapters only
    alpha: float = 16.0  # the adapters' output is scaled by alpha / rank
    dropout: float = 0.0  # on the adapters' input
    # q | k | v | o | gate | up | down | all-linear (every linear of the blocks), or module-name
    # patterns (fnmatch on the dotted name, e.g. "*.attention.wq")
    targets: list[str] = field(default_factory=lambda: ["all-linear"])
    train_embeddings: bool = False  # also train the embedding and the head
    train_norms: bool = False  # also train the norms' gains
    base_dtype: str = "auto"  # the frozen weights' dtype: auto (train.precision's) | fp32 | bf16 | fp16


@dataclass
class MuonConfig:
    """Muon (loom/train/muon.py) for the blocks' 2-D matrices when train.optimizer = "muon": each
    matrix's momentum orthogonalized by Newton-Schulz iterations. The embedding, head, norms and
    routers stay on AdamW (train.lr, betas, eps, weight_decay)."""
    lr: float | None = None  # None: train.lr (the match_rms_adamw scale makes AdamW's LR fit Muon)
    momentum: float = 0.95  # the momentum's decay
    nesterov: bool = True  # orthogonalize the Nesterov look-ahead (grad blended toward the momentum)
    ns_steps: int = 5  # Newton-Schulz iterations per matrix
    weight_decay: float | None = None  # decoupled, as AdamW's; None: train.weight_decay
    # match_rms_adamw: update RMS as AdamW's (0.2·sqrt(max(rows, cols)), Moonlight's and Kimi's);
    # original: sqrt(max(1, rows/cols)), Keller Jordan's
    update_scale: str = "match_rms_adamw"
    ns_dtype: str = "bf16"  # the iterations' precision (bf16 as published; fp32 for exact comparisons)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    muon: MuonConfig = field(default_factory=MuonConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------
# Every field's range. Its type is the dataclass hint; what else it must be is below. Both are
# checked as a value is applied (a TOML file, --set) and again by validate (a Config built in
# Python, a checkpoint's saved config). Fields without a rule are bools (or None).

MAX_COUNT = 2**31 - 1  # steps, batch sizes, degrees, intervals: beyond this a count is a typo
MAX_SEED = 2**32 - 1  # numpy's generators need seeds ≥ 0, torch's take up to 2**64 - 1
MAX_MB = 1e6  # bucket and unit sizes: a terabyte
MAX_TIMEOUT_S = 1e6  # about eleven days
MAX_EXPERTS = 65536
# Learning rates and weight decay: AdamW moves each weight by about lr a step, and decoupled decay
# shrinks it by lr × weight_decay a step; published values are lr ≤ 0.1 (Muon's too) and
# weight_decay ≤ 1. Far above these no run trains (torch's Adam cannot even take an lr of 1e39): a typo.
MAX_LR = 10
MAX_WEIGHT_DECAY = 100
SOURCE_KINDS = 'a text file, a directory, a glob, a .bin token file or "stdlib"'


@dataclass(frozen=True)
class Rule:
    """A number in [low, high] (`above` excludes low, `below` excludes high; a float must also be
    finite; `span` shows the whole interval in the message, not only the side broken), a string
    among `choices` (each item of a list), or a `name` — a path or a field name, neither blank nor
    holding a NUL (`optional`: "" means unset). `why` and `eg` go into the message."""

    low: float | None = None
    high: float | None = None
    above: bool = False
    below: bool = False
    span: bool = False
    choices: tuple[str, ...] = ()
    name: bool = False
    optional: bool = False
    why: str = ""
    eg: str = ""


def _count(low: int = 1, high: int = MAX_COUNT, why: str = "", eg: str = "") -> Rule:
    return Rule(low, high, why=why, eg=eg)


def _one_of(choices: typing.Iterable[str], why: str = "", eg: str = "") -> Rule:
    return Rule(choices=tuple(choices), why=why, eg=eg)


def _name(why: str, optional: bool = False, eg: str = "") -> Rule:
    return Rule(name=True, optional=optional, why=why, eg=eg)


RULES: dict[str, Rule] = {
    # model: shapes over the preset's (model.preset itself is checked by loom/models/gpt/config.py),
    # bounded as a Hugging Face config.json's are
    "model.vocab_size": _count(1, MAX_VOCAB), "model.d_model": _count(1, MAX_WIDTH),
    "model.n_layers": _count(1, MAX_LAYERS), "model.n_heads": _count(1, MAX_WIDTH),
    "model.n_kv_heads": _count(1, MAX_WIDTH), "model.ffn_hidden": _count(1, MAX_FFN),
    "model.max_seq_len": _count(1, MAX_POSITIONS),
    "model.moe_experts": _count(0, MAX_EXPERTS, "(0: dense blocks)"),
    "model.moe_top_k": _count(1, MAX_EXPERTS),
    "model.moe_shared_experts": _count(0, MAX_EXPERTS), "model.moe_every": _count(1, MAX_LAYERS),
    "model.moe_dense_first": _count(0, MAX_LAYERS),
    "model.moe_ffn_hidden": _count(0, MAX_FFN, "(0: ffn_hidden)"),
    "model.moe_score": _one_of(MOE_SCORES),
    "model.moe_route_scale": Rule(0, 1e6, above=True),
    "model.moe_aux_loss_coef": Rule(0, 1e6, why="(0 turns the auxiliary loss off)", eg="0.01"),
    "model.moe_bias_update_rate": Rule(0, 1e6, why="(0 turns aux-loss-free balancing off)", eg="0.001"),
    "model.moe_capacity_factor": Rule(0, 1e6, why="(0: dropless)", eg="1.25"),
    "model.init_from": _name("give a Hugging Face model folder, a loom checkpoint or a loom export, or leave "
                             "it unset", optional=True),
    # data
    "data.source": _name(f"give {SOURCE_KINDS} (an empty path would read the working directory)"),
    "data.tokenizer": _name("give auto, byte, bpe or the path of a tokenizer.json (or its folder)"),
    "data.text_field": _name("name the records' text field, e.g. text"),
    "data.format": _one_of(DATA_FORMATS),
    "data.prompt_field": _name("name the records' prompt field, e.g. prompt"),
    "data.completion_field": _name("name the records' completion field, e.g. completion"),
    "data.messages_field": _name("name the records' chat field, e.g. messages"),
    "data.bpe_vocab_size": _count(1, MAX_VOCAB),
    "data.bin_dtype": _one_of(BIN_DTYPES),
    "data.packing": _one_of(PACKINGS),
    "data.seq_len": _count(1, MAX_POSITIONS),
    "data.eval_fraction": Rule(0, 1, below=True, span=True, eg="0.02"),
    "data.num_workers": _count(0, 256, "(0 loads in the main process)"),
    "data.prefetch_factor": _count(1, 1024),
    "data.cache_dir": _name("give a folder for the tokenized cache, e.g. ~/.cache/loom"),
    # parallel
    "parallel.strategy": _one_of((*strategies.STRATEGIES, *strategies.ALIASES)),
    "parallel.dp_replicate": _count(),
    "parallel.dp_shard": _count(-1, why="(-1: world size / dp_replicate)"),
    "parallel.engine": _one_of(ENGINES),
    "parallel.offload": _one_of(OFFLOADS),
    "parallel.offload_optimizer": _one_of(DEEPSPEED_OFFLOADS),
    "parallel.offload_params": _one_of(DEEPSPEED_OFFLOADS),
    "parallel.nvme_path": _name("give a directory on a local NVMe disk, or leave it unset", optional=True),
    "parallel.deepspeed_config": _name("give a DeepSpeed JSON file, or leave it unset", optional=True),
    "parallel.ddp_bucket_mb": Rule(0, MAX_MB, above=True),
    "parallel.fsdp_unit_mb": Rule(0, MAX_MB, why="(0: no grouping of modules into FSDP units)"),
    "parallel.fsdp_prefetch": _count(0, 1024),
    "parallel.pp": _count(), "parallel.pp_schedule": _one_of(PP_SCHEDULES),
    "parallel.pp_virtual_stages": _count(1, MAX_LAYERS),
    "parallel.microbatches": _count(0, why="(0: one per stage)"),
    "parallel.pp_stage_layers": _count(1, MAX_LAYERS, "(each stage holds at least one block)", "[3, 3, 2]"),
    "parallel.tp": _count(),
    "parallel.cp": _count(), "parallel.cp_mode": _one_of(CP_MODES), "parallel.ep": _count(),
    "parallel.activation_checkpointing": _one_of(ACTIVATION_CHECKPOINTING),
    "parallel.ac_every": _count(1, MAX_LAYERS),
    # train
    "train.steps": _count(), "train.seed": _count(0, MAX_SEED),
    "train.batch_size": _count(), "train.grad_accum": _count(),
    "train.precision": _one_of(PRECISIONS),
    "train.lr": Rule(0, MAX_LR, above=True, eg="3e-4"),
    "train.min_lr_ratio": Rule(0, 1, span=True, why="(the final LR as a fraction of train.lr)"),
    "train.warmup_steps": _count(0),
    "train.weight_decay": Rule(0, MAX_WEIGHT_DECAY),
    "train.beta1": Rule(0, 1, below=True, span=True, why="(an AdamW decay rate)"),
    "train.beta2": Rule(0, 1, below=True, span=True, why="(an AdamW decay rate)"),
    "train.eps": Rule(0, above=True, why="(AdamW divides by it where a gradient is 0)", eg="1e-8"),
    "train.grad_clip": Rule(0, why="(0 turns clipping off)"),
    "train.loss_chunk": _count(0, why="(tokens per chunk of the loss; 0: the full logits)", eg="512"),
    "train.optimizer": _one_of(OPTIMIZERS),
    "train.optimizer_impl": _one_of(OPTIMIZER_IMPLS),
    "train.eval_every": _count(0, why="(0: only at the end)"),
    "train.eval_batches": _count(0, why="(0 turns eval off)"),
    "train.log_every": _count(),
    "train.device": _one_of(DEVICES, "loom trains on CUDA GPUs or on the CPU: set train.device=auto, which "
                                     "takes a GPU where there is one, or cpu"),
    "train.ckpt_every": _count(0, why="(0 saves only at the end)", eg="100"),
    "train.ckpt_every_min": Rule(0, why="(0: no checkpoints by time)"),
    "train.keep_last": _count(),
    "train.on_ckpt_error": _one_of(CKPT_ERROR_POLICIES),
    "train.preempt_signal": _one_of(PREEMPT_SIGNALS),
    "train.on_nonfinite": _one_of(NONFINITE_POLICIES),
    "train.collective_timeout_s": Rule(0, MAX_TIMEOUT_S, above=True),
    "train.log_to": _one_of(TRACKERS, eg='["tensorboard"]'),
    "train.wandb_project": _name("name the wandb project, e.g. loom"),
    "train.wandb_mode": _one_of(WANDB_MODES),
    # lora
    "lora.rank": _count(1, 65536, "(leave lora.rank unset for full fine-tuning)", eg="16"),
    "lora.alpha": Rule(0, 1e6, above=True, eg="16"),
    "lora.dropout": Rule(0, 1, below=True, span=True, eg="0.05"),
    "lora.targets": _name("name linears to adapt: q, k, v, o, gate, up, down, all-linear or a module-name "
                          "pattern", eg='["q", "v"]'),
    "lora.base_dtype": _one_of(LORA_BASE_DTYPES),
    # muon
    "muon.lr": Rule(0, MAX_LR, above=True, eg="0.02"),
    "muon.momentum": Rule(0, 1, below=True, span=True, why="(the momentum's decay rate)", eg="0.95"),
    "muon.ns_steps": _count(1, 99, "(Newton-Schulz iterations; 5 is the published choice)", eg="5"),
    "muon.weight_decay": Rule(0, MAX_WEIGHT_DECAY, eg="0.1"),
    "muon.update_scale": _one_of(MUON_UPDATE_SCALES),
    "muon.ns_dtype": _one_of(MUON_NS_DTYPES),
    # profile
    "profile.wait": _count(0), "profile.warmup": _count(0), "profile.active": _count(),
}


def _shown(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def _within(x: float, r: Rule) -> bool:
    return (not isinstance(x, float) or math.isfinite(x)) \
        and (r.low is None or (x > r.low if r.above else x >= r.low)) \
        and (r.high is None or (x < r.high if r.below else x <= r.high))


def _bounds(x: float, r: Rule) -> str:
    """The rule's interval, or only the side `x` breaks (a cap like MAX_COUNT is noise otherwise)."""
    low = None if r.low is None else f"{'>' if r.above else '≥'} {_number(r.low)}"
    high = None if r.high is None else f"{'<' if r.below else '≤'} {_number(r.high)}"
    if r.span and low and high:
        return f"in {'(' if r.above else '['}{_number(r.low)}, {_number(r.high)}{')' if r.below else ']'}"
    too_big = r.high is not None and (not isinstance(x, float) or math.isfinite(x)) and x > r.high
    return (high if too_big else low) or high or ""


def _example(path: str, rule: Rule) -> str:
    """The rule's example, else the field's default (or the default preset's, for model shapes)."""
    section, _, key = path.partition(".")
    value = getattr(getattr(Config(), section), key)
    if value is None and section == "model":
        value = getattr(PRESETS[ModelConfig.preset], key)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return rule.eg or (_number(value) if number else _toml_value(value))


def _check_rule(path: str, value: Any) -> None:
    """`value` (already of the field's type) against the field's rule: one line if it breaks it."""
    rule = RULES.get(path)
    if rule is None or value is None:
        return
    if rule.choices:
        for item in value if isinstance(value, list) else [value]:
            _choice(path, item, rule.choices, rule.why)
    elif rule.name:
        for item in value if isinstance(value, list) else [value]:
            _check_name(f"{path} = {_shown(value)}", item, rule)
    else:
        for item in value if isinstance(value, list) else [value]:
            if _within(item, rule):
                continue
            kind = "a finite number " if isinstance(item, float) else ""
            why = f" {rule.why}" if rule.why else ""
            which = f"{path} = {_shown(value)}" + (f": {_shown(item)}" if isinstance(value, list) else "")
            raise ConfigError(f"{which} must be {kind}{_bounds(item, rule)}{why}, "
                              f"e.g. --set {path}={_example(path, rule)}")


def _check_name(which: str, item: str, rule: Rule) -> None:
    """A path or field name (`which`: how the message names it): neither blank nor holding a NUL."""
    if "\x00" in item:
        raise ConfigError(f"{which} holds a NUL character; {rule.why}")
    if not item.strip() and (item or not rule.optional):
        raise ConfigError(f"{which} is {'blank' if item else 'empty'}; {rule.why}")


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
        example, items = {str: ('["a", "b"]', "strings"), int: ("[3, 3, 2]", "integers"),
                          dict: ('[{source = "a.jsonl", weight = 1}]', "tables")}[item]
        example = (RULES[path].eg if path in RULES else "") or example  # the key's own
        typed = isinstance(value, list) and all(isinstance(v, item) and type(v) is not bool for v in value)
        if not typed:
            raise ConfigError(f"{path} must be a list of {items}, got {_shown(value)}; "
                              f"e.g. --set '{path}={example}'")
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
            f"{path} must be {hint.__name__}, got {type(value).__name__} {_shown(value)}; "
            f"e.g. --set {path}={_typed_example(hint)}"
        )
    if hint is not float:
        return value
    try:
        return float(value)
    except OverflowError:  # an integer beyond any float
        raise ConfigError(f"{path} = {_shown(value)} must be a finite number, e.g. --set "
                          f"{path}={_typed_example(float)}") from None


def _typed_example(hint: type) -> str:
    return {bool: "true", int: "2", float: "0.5", str: "value"}[hint]


# What TOML reads a bare `--set` value as when it is no string: a str-typed key takes the text instead.
_NOT_TEXT = (bool, int, float, datetime.date, datetime.time)  # (datetime.datetime is a date)


def _apply(cfg: Config, path: str, value: Any, raw: str | None = None) -> None:
    """Set `path` to `value`, checked; `raw`: the `--set` text it was parsed from, taken as written
    by a str-typed key (`data.source=2024` or `=2024-01-01` names a file called that, not the number
    or the date)."""
    section, _, key = path.partition(".")
    sections = {f.name: _hints(type(getattr(cfg, f.name))) for f in dataclasses.fields(Config)}
    if section in sections and not key:
        first = f"{section}.{next(iter(sections[section]))}"
        raise ConfigError(f"'{path}' names the section [{section}] but no key; name one of its keys, e.g. "
                          f"--set {first}={_example(first, RULES.get(first, Rule()))}")
    if section not in sections:
        raise ConfigError(f"unknown config section '{section}' in '{path}'{_did_you_mean(section, sections)}")
    hints = sections[section]
    if key not in hints:
        # The key may belong to another section (train.strategy -> parallel.strategy).
        elsewhere = [f"{s}.{key}" for s, keys in sections.items() if key in keys]
        if not elsewhere:
            elsewhere = [f"{section}.{k}" for k in difflib.get_close_matches(key, list(hints), n=1)]
        hint = f"; did you mean '{elsewhere[0]}'?" if elsewhere else f"; known: {', '.join(hints)}"
        raise ConfigError(f"unknown config key '{path}'{hint}")
    kind = hints[key]
    if raw is not None and isinstance(value, _NOT_TEXT) and typing.get_origin(kind) is not list \
            and str in (typing.get_args(kind) or (kind,)):
        value = raw  # a str-typed key takes the text as written
    value = _coerce(path, value, hints[key])
    _check_rule(path, value)
    setattr(getattr(cfg, section), key, value)


def _parse_value(text: str) -> Any:
    """`--set` values are TOML values (3, 0.5, true, "x"); a bare word is a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = (),
                base: Config | None = None) -> Config:
    """Defaults (or `base`: the config of a run that a resume continues) ← TOML file ←
    `--set section.key=value` overrides, each checked as it is applied."""
    cfg = copy.deepcopy(base) if base is not None else Config()
    if path is not None:
        path = Path(path)
        if not path.is_file():  # (a folder, a pipe or /dev/null is no config either: they exist)
            what = ("is a folder, not a TOML file" if path.is_dir() else "is not a regular file (a device or "
                    "a pipe)" if path.exists() else "does not exist")
            raise ConfigError(f"config file {path} {what}; pass an existing .toml file")
        _apply_toml(cfg, read_text(path), str(path))
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set '{item}' must look like section.key=value, e.g. --set train.steps=10")
        _apply(cfg, key.strip(), _parse_value(text.strip()), text.strip())
    cfg.parallel.strategy = strategies.ALIASES.get(cfg.parallel.strategy, cfg.parallel.strategy)
    return cfg


def load_config_text(text: str, origin: str = "the saved config") -> Config:
    """A Config from TOML text (a checkpoint's saved config)."""
    cfg = Config()
    _apply_toml(cfg, text, origin)
    return cfg


_SECTION_NAMES = frozenset(f.name for f in dataclasses.fields(Config))


def _apply_toml(cfg: Config, text: str, origin: str) -> None:
    # Editors (Notepad, some Windows tools) write a UTF-8 byte-order mark that TOML does not allow.
    text = text.removeprefix("\ufeff")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{origin} is not valid TOML ({e}); fix the syntax at that position") from None
    for section, table in data.items():
        if isinstance(table, list) and section in _SECTION_NAMES and table \
                and all(isinstance(t, dict) for t in table):
            raise ConfigError(f"{origin}: [[{section}]] is an array of tables; write [{section}]")
        if not isinstance(table, dict) and section in _SECTION_NAMES:  # `train = 3`, `train = []`
            raise ConfigError(f"{origin}: '{section}' is a section, so it must be a [{section}] table, "
                              f"not {_shown(table)}; write [{section}] on a line of its own and its keys "
                              f"below it")
        if not isinstance(table, dict):
            owners = [f.name for f in dataclasses.fields(Config)
                      if section in _hints(type(getattr(cfg, f.name)))]
            fix = (f"put it under [{owners[0]}]" if owners else
                   f"no section has that key "
                   f"(sections: {', '.join(f.name for f in dataclasses.fields(Config))})")
            raise ConfigError(f"{origin}: '{section}' is outside any [section] table; {fix}")
        for key, value in table.items():
            try:
                _apply(cfg, f"{section}.{key}", value)
            except ConfigError as e:
                raise ConfigError(f"{origin}: {e}") from None


def config_changes(before: Config, after: Config) -> list[tuple[str, Any, Any]]:
    """(section.key, before, after) of every value that differs, in the sections' order."""
    old, new = before.to_dict(), after.to_dict()
    return [(f"{section}.{key}", value, new[section][key]) for section, table in old.items()
            for key, value in table.items() if value != new[section][key]]


def to_toml(cfg: Config | dict) -> str:
    """The resolved config as TOML (None values, meaning 'the preset's', are left out). A dict of
    sections is written the same way, any value that is not a table first, outside them."""
    tables = cfg.to_dict() if isinstance(cfg, Config) else cfg
    lines = [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in tables.items() if not isinstance(v, dict)]
    for section, table in tables.items():
        if not isinstance(table, dict):
            continue
        lines.append(f"[{_toml_key(section)}]")
        for key, value in table.items():
            if value is None:
                continue
            lines.append(f"{_toml_key(key)} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


# ---------------------------------------------------------------------------------------------
# Validation: everything that can be known before a process group starts


def _choice(path: str, value: str, choices: typing.Sequence[str], why: str = "") -> None:
    if value not in choices:
        raise ConfigError(
            f"{path} = '{value}' is not one of {', '.join(choices)}" + (f" ({why})" if why else "") +
            f"{_did_you_mean(value, choices) if difflib.get_close_matches(value, choices, n=1) else ''}")


@dataclass(frozen=True)
class ParallelDims:
    """The mesh [pp, dp_replicate, dp_shard, cp, tp]; their product is the world size."""

    dp_replicate: int
    dp_shard: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1  # expert parallel: the innermost ep of the dp_shard ranks split each MoE block's experts

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp


def resolve_dims(p: ParallelConfig, world_size: int) -> ParallelDims:
    """The strategy's use of the dp ranks: replicate over them (ddp, zero1), shard over them
    (zero2, zero3) or both (hsdp: dp_replicate × dp_shard)."""
    _check_rule("parallel.tp", p.tp)
    _check_rule("parallel.pp", p.pp)
    _check_rule("parallel.cp", p.cp)
    tp, pp, cp = p.tp, p.pp, p.cp
    if world_size % (pp * cp * tp):
        raise ConfigError(f"pp × cp × tp = {pp} × {cp} × {tp} = {pp * cp * tp} does not divide the world "
                          f"size {world_size}; pick degrees whose product divides {world_size}")
    dp = world_size // (pp * cp * tp)
    s = strategies.lookup(p.strategy)
    if s.dp_mesh != "hybrid":
        replicate, shard = s.dp_dims(dp)
        return _with_ep(p, ParallelDims(dp_replicate=replicate, dp_shard=shard, tp=tp, pp=pp, cp=cp))
    if p.dp_replicate == 1:  # one replica group: zero3's sharding plus an all-reduce over itself
        raise ConfigError("parallel.strategy = hsdp with parallel.dp_replicate = 1 is zero3 with a useless "
                          "all-reduce; use parallel.strategy=zero3, or set parallel.dp_replicate ≥ 2 "
                          "(the replica groups, e.g. one per node)")
    shard = p.dp_shard if p.dp_shard != -1 else dp // max(p.dp_replicate, 1)
    product = pp * p.dp_replicate * shard * cp * tp
    if product != world_size or shard < 1:
        raise ConfigError(
            f"hsdp needs pp × dp_replicate × dp_shard × cp × tp = world size, but {pp} × {p.dp_replicate} × "
            f"{p.dp_shard} × {cp} × {tp} = {pp * p.dp_replicate * p.dp_shard * cp * tp} ≠ {world_size}; "
            f"set parallel.dp_replicate × parallel.dp_shard = {dp}")
    return _with_ep(p, ParallelDims(dp_replicate=p.dp_replicate, dp_shard=shard, tp=tp, pp=pp, cp=cp))


def _with_ep(p: ParallelConfig, dims: ParallelDims) -> ParallelDims:
    """The layout with parallel.ep, which splits the experts over ep of the data-parallel ranks: the
    innermost of those that shard the model (zero2, zero3, hsdp's shard groups), or of the replicas
    (ddp, which then replicates through FSDP2 as under TP)."""
    _check_rule("parallel.ep", p.ep)
    if p.ep == 1:
        return dims
    s = strategies.lookup(p.strategy)
    if s.shards_optimizer_only or p.engine != "torch":
        engine = "the deepspeed engine" if p.engine != "torch" else f"parallel.strategy = '{p.strategy}'"
        raise ConfigError(f"parallel.ep = {p.ep} splits the experts over data-parallel ranks, which {engine} "
                          f"cannot; set parallel.strategy=zero3 (or ddp, zero2, hsdp) with "
                          f"parallel.engine=torch, or parallel.ep=1")
    if dims.cp > 1:
        raise ConfigError(f"parallel.ep = {p.ep} with parallel.cp = {dims.cp} is not supported yet; set "
                          f"parallel.cp=1 or parallel.ep=1")
    ranks = dims.dp_shard if dims.dp_shard > 1 else dims.dp_replicate
    if ranks % p.ep:
        what = "dp_shard, the ranks that shard the model" if dims.dp_shard > 1 else "dp, the replicas"
        raise ConfigError(f"parallel.ep = {p.ep} must divide {what} = {ranks} (world {dims.world_size} / "
                          f"(pp × cp × tp{' × dp_replicate' if dims.dp_shard > 1 else ''})); pick an ep "
                          f"dividing {ranks}")
    return dataclasses.replace(dims, ep=p.ep)


def is_placeholder(value: str) -> bool:
    """Whether a config value is one `loom plan --emit` left for the user: "<your …>"."""
    return value.startswith("<your ") and value.endswith(">")


def _check_placeholders(d: DataConfig, this_machine: bool) -> None:
    """A run on this machine needs the data and tokenizer an emitted config left as placeholders."""
    for key, value in (("data.source", d.source), ("data.tokenizer", d.tokenizer)):
        if this_machine and is_placeholder(value):
            raise ConfigError(f"{key} = '{value}' is a placeholder (of an emitted config or a recipe); set "
                              f"it in the config file or with --set {key}=PATH")


def validate(cfg: Config, world_size: int, cuda_available: bool | None = None,
             this_machine: bool = True) -> ParallelDims:
    """Check every value and their combinations for `world_size` ranks; returns the dp layout."""
    p, t, d = cfg.parallel, cfg.train, cfg.data
    _check_fields(cfg)
    _check_placeholders(d, this_machine)
    # Else a tokenizer.json, or a model folder holding one: what `loom data prepare --tokenizer` takes.
    given = Path(d.tokenizer).expanduser()
    if d.tokenizer not in TOKENIZERS and not (d.tokenizer.endswith(".json") or "/" in d.tokenizer
                                              or (this_machine and given.is_dir())
                                              or is_placeholder(d.tokenizer)):  # set on the run's machine
        _choice("data.tokenizer", d.tokenizer, TOKENIZERS)
    if d.tokenizer not in TOKENIZERS and this_machine and not (given.is_file()
                                                               or (given / "tokenizer.json").is_file()):
        raise ConfigError(f"data.tokenizer = '{d.tokenizer}' does not exist (or is a folder without a "
                          f"tokenizer.json); give the path of a Hugging Face tokenizer.json or of a model "
                          f"folder holding one, or auto, byte or bpe")
    _check_mix(d.mix)
    if d.mix and d.source != DataConfig.source:  # data.mix replaces data.source: one would be ignored
        raise ConfigError(f"data.source = {_shown(d.source)} and data.mix both name the training data; "
                          f"keep data.mix (add this source as an entry) or remove it")
    prof = cfg.profile
    if prof.enabled and prof.wait + prof.warmup + prof.active > t.steps:
        raise ConfigError(f"the profiler needs profile.wait + warmup + active = "
                          f"{prof.wait + prof.warmup + prof.active} steps but train.steps = {t.steps}; "
                          f"raise train.steps or lower profile.active")
    _check_muon(cfg)  # (before the engine's: DeepSpeed need not be installed to be refused)
    _check_engine(p, this_machine)
    fixed = sorted(set(shape_overrides(cfg.model)) - {"max_seq_len", *MOE_TRAINING_FIELDS})
    if cfg.model.init_from and fixed:
        raise ConfigError(f"model.{fixed[0]} is set, but model.init_from = '{cfg.model.init_from}' gives the "
                          f"model's shape; remove model.{fixed[0]} (only model.max_seq_len and the MoE "
                          f"balancing keys may change)")
    if p.offload != "none":
        if not strategies.lookup(p.strategy).shards_params:
            raise ConfigError(
                f"parallel.offload = '{p.offload}' needs a sharded strategy (zero2, zero3 or hsdp), "
                f"not '{p.strategy}'; set parallel.strategy=zero3 or parallel.offload=none")
        if cuda_available is None:
            cuda_available = _cuda()[0]
        if not cuda_available or t.device == "cpu":
            raise ConfigError(
                "parallel.offload = 'cpu' uses FSDP2's CPUOffloadPolicy, which needs an accelerator, "
                "and this run is on CPU only; set parallel.offload=none")
    if t.device == "cuda":
        told = (cuda_available, "no CUDA device is visible")
        cuda_available, why = _cuda() if cuda_available is None else told
        if not cuda_available:
            raise ConfigError(f"train.device = 'cuda' but {why}; this machine trains on the CPU: set "
                              f"train.device=cpu (or auto, which takes a GPU where there is one)")
    dims = resolve_dims(p, world_size)
    if this_machine:
        _check_model_size(cfg, world_size, bool(cuda_available) and t.device != "cpu")
    if dims.tp > 1 and strategies.lookup(p.strategy).shards_optimizer_only and t.precision == "fp16":
        # GradScaler unscales the optimizer's params' grads; under TP, ZeRO-1 links them at step only.
        raise ConfigError("zero1 with parallel.tp > 1 does not take fp16 loss scaling; "
                          "use train.precision=bf16 (no scaler needed) or parallel.strategy=zero2")
    if p.sequence_parallel and d.seq_len % dims.tp:
        raise ConfigError(f"parallel.sequence_parallel splits data.seq_len = {d.seq_len} over "
                          f"tp = {dims.tp}; use a seq_len divisible by {dims.tp}")
    _check_context_parallel(cfg, dims)
    _check_lora(cfg)
    if splits_backward(p):
        _check_split_backward(p)
    if dims.pp > 1 and p.pp_stage_layers:
        _check_stage_count(p)
    if dims.pp > 1 and t.precision == "fp16":
        raise ConfigError("fp16 loss scaling is not wired into the pipeline schedules; "
                          "use train.precision=bf16")
    per = dims.dp * t.grad_accum * (pipeline_microbatches(p) if dims.pp > 1 else 1)
    if t.batch_size % per:
        below = t.batch_size // per * per  # the nearest valid sizes around the one given
        multiples = " or ".join(str(n) for n in (below, below + per) if n > 0)
        pipeline = f" × pipeline micro-batches ({pipeline_microbatches(p)})" if dims.pp > 1 else ""
        raise ConfigError(
            f"train.batch_size = {t.batch_size} is not divisible by grad_accum ({t.grad_accum}) × "
            f"data-parallel size ({dims.dp}){pipeline} = {per}; use a multiple of {per}: {multiples}")
    return dims


def _check_muon(cfg: Config) -> None:
    """Muon's keys need train.optimizer = "muon"; Muon's step is loom's, not fused AdamW's, and
    DeepSpeed's engine steps its own optimizer."""
    t, p = cfg.train, cfg.parallel
    if t.optimizer != "muon":
        changed = [k for k, v in dataclasses.asdict(cfg.muon).items() if v != getattr(MuonConfig(), k)]
        if changed:
            raise ConfigError(f"muon.{changed[0]} is set but train.optimizer = '{t.optimizer}'; set "
                              f"train.optimizer=muon to train with Muon, or remove the [muon] keys")
        return
    if t.optimizer_impl == "fused":
        raise ConfigError("train.optimizer_impl = 'fused' is AdamW's one-kernel step, and Muon's "
                          "Newton-Schulz matmuls have none; set train.optimizer_impl=auto (or foreach)")
    if p.engine == "deepspeed":
        raise ConfigError("train.optimizer = 'muon' runs on the torch engine (DeepSpeed steps its own "
                          "optimizer); set parallel.engine=torch, or train.optimizer=adamw")
    if p.offload != "none":
        raise ConfigError(f"train.optimizer = 'muon' with parallel.offload = '{p.offload}': Muon's exchange "
                          f"of whole matrices runs on the device, and offload keeps them on the host; set "
                          f"parallel.offload=none (zero3 shards Muon's one momentum per matrix), or "
                          f"train.optimizer=adamw")
    if strategies.lookup(p.strategy).shards_optimizer_only and p.tp > 1:
        raise ConfigError(f"train.optimizer = 'muon' with zero1 and parallel.tp = {p.tp}: ZeRO-1 steps each "
                          f"rank's TP shard of a matrix alone, and Muon needs the whole matrix; set "
                          f"parallel.strategy=zero2 (or zero3), or parallel.tp=1")


def _check_stage_count(p: ParallelConfig) -> None:
    """parallel.pp_stage_layers names one count per stage: pp × the schedule's stages per rank (whether
    they sum to the model's layers is checked where the model is known: validate_pipeline)."""
    stages = p.pp * stages_per_rank(p.pp_schedule, p.pp_virtual_stages)
    given = len(p.pp_stage_layers)
    if given != stages:
        per = stages // p.pp
        runs = f"pp {p.pp} × {per} stages per rank ({p.pp_schedule})" if per > 1 else f"pp {p.pp}"
        raise ConfigError(f"parallel.pp_stage_layers = {_shown(p.pp_stage_layers)} gives {given} stage"
                          f"{'s' if given != 1 else ''}, but {runs} runs {stages}; give {stages} block "
                          f"counts in stage order, or leave it empty for an even split")


def _check_split_backward(p: ParallelConfig) -> None:
    """What a schedule that runs each backward in two passes (inputs, then weights) cannot take."""
    if p.reshard_after_forward:
        raise ConfigError(f"parallel.reshard_after_forward = true cannot run under pp_schedule = "
                          f"'{p.pp_schedule}': its deferred weight gradients need the stage's parameters "
                          f"gathered until the step's last backward; leave it unset or use the 1f1b schedule")
    if p.activation_checkpointing == "op":
        raise ConfigError(f"parallel.activation_checkpointing = 'op' cannot run under pp_schedule = "
                          f"'{p.pp_schedule}': torch's selective checkpoint allows one backward through a "
                          f"block and the schedule runs two (inputs, then weights); use full or selective, "
                          f"or the 1f1b schedule")


def _check_context_parallel(cfg: Config, dims: ParallelDims) -> None:
    """What context parallelism and document packing need of the sequence (the model's heads are
    checked where the model is known: loom/train/task.py)."""
    p, seq = cfg.parallel, cfg.data.seq_len
    if dims.cp > 1:
        split = 2 * dims.cp * (dims.tp if p.sequence_parallel else 1)
        why = " × tp (sequence parallel splits each rank's share again)" if p.sequence_parallel else ""
        if seq % split:
            raise ConfigError(f"parallel.cp = {dims.cp} splits each sequence into 2 × cp{why} = {split} "
                              f"chunks (one from the front and its mirror from the back per rank), but "
                              f"data.seq_len = {seq} is not divisible by {split}; use e.g. "
                              f"data.seq_len={max(split, seq // split * split)}")
        if p.engine == "deepspeed":
            raise ConfigError(f"parallel.cp = {dims.cp} is run by the torch engine; DeepSpeed's does not "
                              f"split sequences. Set parallel.cp=1, or parallel.engine=torch")
    if cfg.data.packing == "documents" and dims.pp > 1:
        raise ConfigError(f"data.packing = 'documents' is not wired through the pipeline's stages (pp = "
                          f"{dims.pp}) yet; set data.packing=concat, or parallel.pp=1")


def lora_base_dtype(cfg: Config) -> str:
    """The frozen base weights' dtype: lora.base_dtype, or under auto the compute dtype."""
    return cfg.train.precision if cfg.lora.base_dtype == "auto" else cfg.lora.base_dtype


def _check_lora(cfg: Config) -> None:
    """LoRA's keys together (the targets are matched against the model in loom/train/task.py)."""
    lora, t = cfg.lora, cfg.train
    if lora.rank is None:
        changed = [k for k, v in dataclasses.asdict(lora).items() if v != getattr(LoRAConfig(), k)]
        if changed:
            raise ConfigError(f"lora.{changed[0]} is set but lora.rank is not, so every weight trains; set "
                              f"lora.rank (e.g. 16) to train adapters, or remove lora.{changed[0]}")
        return
    if not lora.targets:
        raise ConfigError("lora.targets is empty, so nothing would train; name the linears to adapt, e.g. "
                          "--set 'lora.targets=[\"q\", \"v\"]' or [\"all-linear\"]")
    base = lora_base_dtype(cfg)
    if base not in ("fp32", t.precision):
        raise ConfigError(f"lora.base_dtype = '{base}' stores the frozen weights in {base}, but "
                          f"train.precision = '{t.precision}' computes in {t.precision}; set "
                          f"train.precision={base} or lora.base_dtype=auto")
    if cfg.parallel.engine == "deepspeed":
        raise ConfigError(f"lora.rank = {lora.rank} trains adapters on the torch engine; DeepSpeed's engine "
                          f"here trains every weight. Set parallel.engine=torch (zero3 shards the frozen "
                          f"base too), or remove lora.rank")


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
        if p.deepspeed_config:
            raise ConfigError(f"parallel.deepspeed_config = '{p.deepspeed_config}' is read by the deepspeed "
                              f"engine only; set parallel.engine=deepspeed, or remove it")
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
    if p.activation_checkpointing != "none":
        raise ConfigError(f"parallel.activation_checkpointing = '{p.activation_checkpointing}' is applied "
                          f"by the torch engine; DeepSpeed's runs every block as it is. Set "
                          f"parallel.activation_checkpointing=none, or parallel.engine=torch")
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
        read_deepspeed_json(p)


def _check_fields(cfg: Config) -> None:
    """Every field's type and rule (a Config built in Python has not been through load_config)."""
    for section in dataclasses.fields(Config):
        values = getattr(cfg, section.name)
        for key, hint in _hints(type(values)).items():
            path = f"{section.name}.{key}"
            _check_rule(path, _coerce(path, getattr(values, key), hint))


def _check_mix(mix: list[dict]) -> None:
    """data.mix entries' sources and weights, as data.source and the numbers above (the data's own
    reader, loom/data/mix.py, checks the rest of an entry)."""
    for i, entry in enumerate(mix):
        source, weight = entry.get("source"), entry.get("weight", 1)
        if not isinstance(source, str) or not source.strip() or "\x00" in source:
            raise ConfigError(f"data.mix[{i}] source = {_shown(source)} must name {SOURCE_KINDS}, e.g. "
                              f"{{source = \"a.jsonl\", weight = 3}}")
        if not _finite_positive(weight):
            raise ConfigError(f"data.mix[{i}] weight = {_shown(weight)} must be a finite number > 0, e.g. "
                              f"weight = 3")
        text_field = entry.get("text_field")
        if isinstance(text_field, str):  # as data.text_field (its type: loom/data/mix.py)
            _check_name(f"data.mix[{i}] text_field = {_shown(text_field)}", text_field,
                        RULES["data.text_field"])


def _finite_positive(x: Any) -> bool:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(float(x)) and x > 0
    except OverflowError:  # an integer beyond any float
        return False


def _cuda() -> tuple[bool, str]:
    """Whether this machine can train on CUDA, and if not, why."""
    import torch

    if torch.cuda.is_available():
        return True, ""
    if torch.version.cuda is None:
        return False, f"this PyTorch ({torch.__version__}) is built without CUDA"
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    return False, "no CUDA device is visible" + (f" (CUDA_VISIBLE_DEVICES={hidden!r})" if hidden is not None
                                                 else "")


# Bytes a trained parameter holds (the planner's "torch" recipe): fp32 weight and grad, Adam's m and v.
TRAINING_BYTES = ((strategies.PARAMS, 4), (strategies.GRADS, 4), (strategies.OPTIMIZER, 8))


def _check_model_size(cfg: Config, world_size: int, gpu: bool) -> None:
    """A model whose training state (weights, grads and AdamW's, 16 bytes a parameter as the planner
    counts it; a LoRA base's fp32 weights alone), sharded as the strategy shards it over every rank,
    cannot fit this machine's memory is refused now, not after a build that tries to allocate them.
    The shape is the preset's with the
    config's overrides (a pretrained folder's is checked where it is read); the vocabulary may
    still grow to the tokenizer's, so this is a lower bound."""
    p = cfg.parallel
    if cfg.model.init_from or "nvme" in (p.offload_params, p.offload_optimizer):
        return
    params = preset(cfg.model.preset, **shape_overrides(cfg.model)).num_params()
    if cfg.lora.rank is None:  # training holds weights, grads and AdamW's states, as the planner counts
        sharded = strategies.lookup(p.strategy).sharded
        per_rank = sum(n * params / (world_size if kind in sharded else 1) for kind, n in TRAINING_BYTES)
        what = f"of weights, grads and AdamW states ({p.strategy})"
    else:  # a frozen base: its weights alone
        per_rank, what = 4 * params / world_size, "of fp32 weights"
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if per_rank > memory and gpu:
        import torch

        if torch.cuda.is_available():  # (a caller may say there is CUDA where this host has none)
            memory += torch.cuda.get_device_properties(0).total_memory
    if per_rank > memory:
        raise ConfigError(f"the model has {params:,} parameters, {per_rank / 1e9:,.0f} GB {what} "
                          f"per rank even sharded over all {world_size} rank(s): more than this machine's "
                          f"{memory / 1e9:,.0f} GB of memory; shrink model.d_model, n_layers, ffn_hidden or "
                          f"vocab_size, or add ranks")


# ---------------------------------------------------------------------------------------------
# A user's DeepSpeed JSON (parallel.deepspeed_config), merged over the config loom derives

# What loom derives from its own keys (loom/parallel/deepspeed_engine.py::deepspeed_config), and
# from which: set in the JSON, DeepSpeed would run something other than what loom plans, reports
# and records (a ZeRO-3 run reported as ddp).
DEEPSPEED_DERIVED = {
    "train_batch_size": "train.batch_size",
    "train_micro_batch_size_per_gpu": "train.batch_size",
    "gradient_accumulation_steps": "train.grad_accum",
    "gradient_clipping": "train.grad_clip",
    "zero_optimization.stage": "parallel.strategy",
    "zero_optimization.cpu_offload": "parallel.offload_optimizer",
    "zero_optimization.cpu_offload_param": "parallel.offload_params",
    "zero_optimization.offload_optimizer.device": "parallel.offload_optimizer",
    "zero_optimization.offload_optimizer.nvme_path": "parallel.nvme_path",
    "zero_optimization.offload_param.device": "parallel.offload_params",
    "zero_optimization.offload_param.nvme_path": "parallel.nvme_path",
    "zero_optimization.reduce_bucket_size": "parallel.ddp_bucket_mb",
    "zero_optimization.allgather_bucket_size": "parallel.ddp_bucket_mb",
    "fp16.enabled": "train.precision", "bf16.enabled": "train.precision",
    "bfloat16.enabled": "train.precision",
    "amp.enabled": "train.precision", "torch_autocast.enabled": "train.precision",
    "optimizer": "train.lr, beta1, beta2, eps and weight_decay (loom's AdamW)",
    "scheduler": "train.lr, warmup_steps and min_lr_ratio (loom's LR schedule)",
    "elasticity": "train.batch_size and --nproc/--nnodes",
    # what loom does itself, inside the run directory, with nothing sent over the network
    "tensorboard": "train.log_to", "wandb": "train.log_to", "csv_monitor": "train.log_to",
    "comet": "train.log_to", "flops_profiler": "loom profile", "autotuning": "loom plan",
    "compile": "train.compile", "activation_checkpointing": "parallel.activation_checkpointing",
}
# Top-level flags and names DeepSpeed reads without checking their type (its sections it checks).
DEEPSPEED_FLAGS = ("wall_clock_breakdown", "memory_breakdown", "dump_state", "disable_allgather",
                   "prescale_gradients", "sparse_gradients", "dataloader_drop_last",
                   "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
                   "managed_gradient_accumulation")
DEEPSPEED_NAMES = ("communication_data_type", "seq_parallel_communication_data_type", "gradient_allreduce_op")
# DeepSpeed's other top-level keys: an unknown key close to one of them is a typo, which
# DeepSpeed would ignore (keys far from all of them are passed on, as DeepSpeed takes them).
DEEPSPEED_KEYS = ("steps_per_print", "gradient_predivide_factor", "zero_optimization", "fp16", "bf16",
                  "bfloat16", "amp", "torch_autocast", "data_types", "comms_logger", "checkpoint", "aio",
                  "pipeline", "hybrid_engine", "data_efficiency", "curriculum_learning",
                  "compression_training", "sparse_attention", "weight_quantization", "timers",
                  "tensor_parallel", "sequence_parallel_size", "log_level", "disable_python_gc",
                  "use_data_before_expert_parallelism", "vocabulary_size")
# DeepSpeed's config classes, by the JSON section each reads (to name a refused key in full)
DEEPSPEED_MODELS = {"DeepSpeedZeroConfig": "zero_optimization", "DeepSpeedFP16Config": "fp16",
                    "DeepSpeedBF16Config": "bf16"}


def read_deepspeed_json(p: ParallelConfig) -> dict:
    """parallel.deepspeed_config's settings, checked before any rank starts: a JSON object, none of
    the keys loom derives, the top-level flags typed, no near-miss of a DeepSpeed key, and
    DeepSpeed's own config classes satisfied (its sections' keys and types, its cross-checks).
    Anything else is one line naming the file and the key."""
    path = Path(p.deepspeed_config).expanduser()
    if not path.is_file():
        raise ConfigError(f"parallel.deepspeed_config = '{p.deepspeed_config}' does not exist; pass a "
                          f"DeepSpeed JSON file")
    source = f"parallel.deepspeed_config {path}"
    try:
        doc = Fields(read_json(path, source, max_bytes=1 << 20), source)
        _refuse_derived(doc.raw, source)
        doc.int("steps_per_print", default=None, min=1, max=MAX_COUNT)
        doc.float("gradient_predivide_factor", default=None, min=0, min_open=True, max=1e6)
        for flag in DEEPSPEED_FLAGS:
            doc.bool(flag, default=None)
        for name in DEEPSPEED_NAMES:
            doc.str(name, default=None)  # DeepSpeed checks the value, once it is a string
    except BadFile as e:
        raise ConfigError(str(e)) from None
    known = {*(key.split(".")[0] for key in DEEPSPEED_DERIVED), *DEEPSPEED_FLAGS, *DEEPSPEED_NAMES,
             *DEEPSPEED_KEYS}
    for key in doc.raw:
        close = [] if key in known else difflib.get_close_matches(key, known, n=1, cutoff=0.8)
        if close:
            raise ConfigError(f"{source}: {key} is not a DeepSpeed setting; did you mean {close[0]}?")
    _deepspeed_accepts(doc.raw, source, strategies.lookup(p.strategy).zero_stage)
    return doc.raw


def _refuse_derived(raw: dict, source: str) -> None:
    for key, ours in DEEPSPEED_DERIVED.items():
        node, parts = raw, key.split(".")
        for depth, part in enumerate(parts, 1):
            if part not in node:
                break
            node = node[part]
            if depth == len(parts):
                raise ConfigError(f"{source}: {key} = {_shown(node)} is loom's to set, from {ours}; remove "
                                  f"it from the JSON and set {ours} instead")
            if not isinstance(node, dict):  # a section given as a value (`"zero_optimization": true`)
                raise ConfigError(f"{source}: {'.'.join(parts[:depth])} must be a JSON object of DeepSpeed "
                                  f"settings, got {_shown(node)}")


def choose_deepspeed_accelerator() -> None:
    """Before `import deepspeed`: the accelerator it would find, named as DS_ACCELERATOR (a user's own
    stays), so that it does not probe and warn "Setting accelerator to CPU" on every rank."""
    if "DS_ACCELERATOR" not in os.environ:
        import torch

        os.environ["DS_ACCELERATOR"] = "cuda" if torch.cuda.is_available() else "cpu"


def _deepspeed_accepts(user: dict, source: str, stage: int) -> None:
    """DeepSpeed's own config reading, on the user's settings over a stand-in for loom's (micro-batch
    1, the strategy's stage; the global batch left to DeepSpeed, which counts the ranks of an
    initialized group): its pydantic sections refuse unknown keys and wrong types."""
    choose_deepspeed_accelerator()
    from deepspeed.runtime.config import DeepSpeedConfig  # only with a user's JSON
    from pydantic import ValidationError

    trial = {**user, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
             "zero_optimization": {**user.get("zero_optimization", {}), "stage": stage}}
    try:
        DeepSpeedConfig(trial)
    except ValidationError as e:
        error = e.errors()[0]
        section = DEEPSPEED_MODELS.get(e.title)
        where = ".".join(str(x) for x in ((section,) if section else ()) + tuple(error["loc"]))
        what = ("is not a DeepSpeed setting" if error["type"] == "extra_forbidden"
                else f"is invalid: {error['msg']}")
        raise ConfigError(f"{source}: {where} {what}; see DeepSpeed's config documentation for the section's "
                          f"keys") from None
    except Exception as e:  # noqa: BLE001 - DeepSpeed's other checks raise assertions, TypeErrors, …
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise ConfigError(f"{source}: DeepSpeed refuses it ({type(e).__name__}: {first}); fix that "
                          f"setting") from None


def shape_overrides(m: ModelConfig) -> dict[str, Any]:
    """The model shape fields the config sets over its preset (None keeps the preset's)."""
    return {k: v for k, v in vars(m).items() if k not in ("preset", "init_from") and v is not None}


def splits_backward(p: ParallelConfig) -> bool:
    """Whether the pipeline schedule computes weight gradients apart (zb, zbv, dualpipev)."""
    return p.pp > 1 and p.pp_schedule in SPLIT_BACKWARD_SCHEDULES


def stages_per_rank(schedule: str, virtual: int) -> int:
    """The stages each pipeline rank runs: two for the V schedules (whatever pp_virtual_stages says,
    1 or 2: validate_pipeline refuses the rest), else pp_virtual_stages."""
    return 2 if schedule in V_SCHEDULES else virtual


def rank_stages(rank: int, pp: int, virtual: int = 1, schedule: str = "1f1b") -> list[int]:
    """The stage indices held by pipeline rank `rank`: in a V (r, 2pp − 1 − r) for zbv and dualpipev,
    else round-robin (r, r + pp, r + 2pp, ...). Here, below the planner, so that it prices the same
    placement."""
    if schedule in V_SCHEDULES:
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(virtual)]


@functools.lru_cache(maxsize=4096)
def stage_sizes(n_layers: int, stages: int, split: tuple[int, ...] = ()) -> tuple[int, ...]:
    """Blocks in each of a pipeline's stages, in order: `split` (parallel.pp_stage_layers, checked by
    validate_pipeline) where given, else an even split, differing by at most one. The leftover
    blocks (n_layers mod stages) go to the middle stages first (from stage 1 on), then to the first
    (its embedding is a cheap lookup); the last, which also runs the norm, the vocabulary-sized head
    and the loss, never gets one. Here, below the planner, so that it prices the split that runs."""
    if split:
        if len(split) != stages or sum(split) != n_layers:
            raise ValueError(f"a split {split} of {n_layers} layers into {stages} stages")
        return tuple(split)
    base, extra = divmod(n_layers, stages)
    sizes = [base] * stages
    for s in (list(range(1, stages - 1)) + [0])[:extra]:  # extra < stages: the last is never reached
        sizes[s] += 1
    return tuple(sizes)


def pipeline_microbatches(p: ParallelConfig) -> int:
    """Micro-batches a pipeline step splits each rank's micro-batch into (0 means pp)."""
    return p.microbatches or p.pp


def inert_settings(cfg: Config, dims: ParallelDims) -> list[str]:
    """Keys set away from their defaults that the chosen layout never reads: a run is accepted, but
    a user who set one expected something of it (a note each, said once before launch)."""
    p, default = cfg.parallel, ParallelConfig()
    inert = []
    if p.strategy != "hsdp":
        inert += [f"parallel.{k} = {getattr(p, k)} has no effect with parallel.strategy = {p.strategy} "
                  f"(only hsdp splits the data-parallel ranks into replicas and shards)"
                  for k in ("dp_replicate", "dp_shard") if getattr(p, k) != getattr(default, k)]
    if dims.pp == 1:
        inert += [f"parallel.{k} = {getattr(p, k)!r} has no effect with parallel.pp = 1 (no pipeline)"
                  for k in ("microbatches", "pp_schedule", "pp_stage_layers", "pp_virtual_stages")
                  if getattr(p, k) != getattr(default, k)]
    if not p.dualpipev_overlap and not (dims.pp > 1 and p.pp_schedule == "dualpipev" and dims.ep > 1):
        inert.append("parallel.dualpipev_overlap = false has no effect unless parallel.pp_schedule = "
                     "dualpipev with pp > 1 and ep > 1 (it overlaps that schedule's expert all-to-alls)")
    if p.activation_checkpointing != "selective" and p.ac_every != default.ac_every:
        inert.append(f"parallel.ac_every = {p.ac_every} has no effect with parallel.activation_checkpointing "
                     f"= {p.activation_checkpointing!r} (only selective checkpoints every ac_every-th block)")
    # FSDP2's keys (loom/parallel/fsdp.py): ddp and zero1 wrap the model in FSDP2 only under tp, ep or
    # a split-backward schedule, and the deepspeed engine never does
    s = strategies.lookup(p.strategy)
    fsdp = p.engine == "torch" and s.uses_fsdp(dims.tp, dims.ep, splits_backward(p))
    why = ("parallel.engine = 'deepspeed' (an FSDP2 setting, the torch engine's)" if p.engine != "torch" else
           f"parallel.strategy = {p.strategy} (an FSDP2 setting: {p.strategy} runs on FSDP2 only under tp, "
           f"ep or a zb/zbv/dualpipev pipeline)")
    inert += [f"parallel.{k} = {_toml_value(getattr(p, k))} has no effect with {why}"
              for k in ("reshard_after_forward", "fsdp_unit_mb", "fsdp_prefetch")
              if not fsdp and getattr(p, k) != getattr(default, k)]
    if p.nvme_path and "nvme" not in (p.offload_optimizer, p.offload_params):
        inert.append(f"parallel.nvme_path = {p.nvme_path!r} has no effect without NVMe offload (the "
                     f"deepspeed engine's parallel.offload_optimizer or offload_params = nvme)")
    inert += _inert_moe_keys(cfg.model)
    if dims.tp == 1 and p.sequence_parallel:
        inert.append("parallel.sequence_parallel = true has no effect with parallel.tp = 1 (it splits "
                     "tensor parallelism's norms and residuals)")
    if dims.cp == 1 and p.cp_mode != default.cp_mode:
        inert.append(f"parallel.cp_mode = {p.cp_mode!r} has no effect with parallel.cp = 1 (no context "
                     f"parallelism)")
    return inert


def _inert_moe_keys(m: ModelConfig) -> list[str]:
    """The MoE keys set on a dense model (moe_experts 0: no block routes to experts). A pretrained
    model's shape is known only once its folder is read, so model.init_from's go without a note."""
    experts = m.moe_experts if m.moe_experts is not None else getattr(PRESETS.get(m.preset), "moe_experts", 1)
    if m.init_from or experts:
        return []
    return [f"model.{k} = {_toml_value(v)} has no effect on a dense model (model.moe_experts = 0: no block "
            f"routes to experts)" for k, v in vars(m).items()
            if k.startswith("moe_") and k != "moe_experts" and v is not None]
