"""What the planner prices: the workload (model, batch, precision) and one way to run it."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from loom import strategies
from loom.config import SPLIT_BACKWARD_SCHEDULES
from loom.plan.lora import LoRA
from loom.plan.muon import Muon
from loom.plan.shapes import ModelShape

# Where the offloadable states live. "optimizer": ZeRO-Offload (grads and optimizer states on
# the host, parameters on the GPU); "optimizer+params": everything sharded on the host (FSDP2's
# CPUOffloadPolicy); "optimizer-nvme": ZeRO-Infinity's optimizer states on NVMe (gradients staged
# through the host, parameters on the GPU); "nvme": ZeRO-Infinity (optimizer states and parameters
# on NVMe).
OFFLOADS = ("none", "optimizer", "optimizer+params", "optimizer-nvme", "nvme")


@dataclass(frozen=True)
class Workload:
    shape: ModelShape
    seq_len: int
    global_batch: int  # sequences per optimizer step
    precision: str = "bf16"  # compute dtype: activations and gathered parameters
    recipe: str = "torch"  # bytes per parameter of params/grads/optimizer (see memory.RECIPES)
    loss_chunk: int = 0  # train.loss_chunk: the head + loss chunk by chunk (0: the full logits)
    # parallel.reduce_every_micro_step: FSDP2 reduce-scatters each micro-step (gradients sharded)
    reduce_every_micro_step: bool = True
    # An MoE model's load imbalance: the busiest expert's tokens over the mean (1: ideal routing). Under
    # expert parallelism the busiest rank's experts take this many times the mean rows: their compute
    # and what they keep for backward scale by it (the slowest rank sets the step).
    moe_imbalance: float = 1.0
    # LoRA fine-tuning (plan/lora.py): the base frozen, adapters trained; None: every weight trains
    lora: LoRA | None = None
    # train.optimizer = "muon" (plan/muon.py): Muon for the blocks' matrices; None: AdamW for all
    muon: Muon | None = None
    # data.packing = "documents": attention under a document mask (on CUDA no flash kernel; sdpa.py)
    documents: bool = False
    # Whether the training torch's split backward takes loom's autograd Functions (torch 2.13 does, 2.11
    # does not: loom/parallel/pipeline.py weight_pass_takes_functions); see plain_ops below.
    weight_pass_takes_functions: bool = True

    @property
    def act_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


def plain_ops(w: Workload, c: Candidate) -> bool:
    """Whether the candidate's GPT runs plain autograd ops for its Functions that take a parameter
    (loom/models/gpt/lean_ops.py: its norms and SwiGLU keep more) and its last stage the full logits:
    under a split-backward schedule on a torch whose weight pass cannot start at such a Function."""
    return c.split_backward and not w.weight_pass_takes_functions


def loss_chunk(w: Workload, c: Candidate) -> int:
    """The loss chunk the candidate runs: the workload's (train.loss_chunk), 0 (the full logits) under
    plain_ops."""
    return 0 if plain_ops(w, c) else w.loss_chunk


def head_recomputed(w: Workload, c: Candidate) -> bool:
    """Whether the chunked loss runs each chunk's head matmul again in backward: under GPipe and the
    split-backward schedules, whose loss cannot make its gradients in forward (loom/train/step.py);
    everywhere else a chunk costs no recompute, so loom chunks."""
    return loss_chunk(w, c) > 0 and c.pp > 1 and (c.schedule == "gpipe" or c.split_backward)


@dataclass(frozen=True)
class Candidate:
    strategy: str  # a name in loom.strategies.STRATEGIES
    dp: int
    tp: int = 1
    pp: int = 1
    dp_shard: int = 0  # hsdp: ranks one shard spans (0: the whole dp group)
    offload: str = "none"
    schedule: str = "none"  # pipeline schedule: gpipe | 1f1b | interleaved | zb | zbv | dualpipev
    virtual_stages: int = 1
    activation_checkpointing: str = "none"  # none | selective | full
    ac_every: int = 2
    micro_batch: int = 1
    grad_accum: int = 1  # micro-batches per step per dp rank (the pipeline's micro-batches when pp > 1)
    sequence_parallel: bool = False
    framework: str = "torch"  # parallel.engine: torch, or deepspeed (which offload also needs)
    fsdp_unit_mb: float = 25.0  # parallel.fsdp_unit_mb: FSDP2 groups blocks into units this large
    # parallel.cp: ranks each sequence is split over (seq/cp tokens each), inside dp on the mesh
    # [pp, dp_replicate, dp_shard, cp, tp]; the batch divides over dp only
    cp: int = 1
    cp_mode: str = "ring"  # parallel.cp_mode: ring (k/v passed around) | alltoall (Ulysses)
    # parallel.ep: each MoE block's routed experts split over ep of the dp ranks (the innermost; E/ep
    # each), tokens sent to them and back by all-to-all (plan/experts.py); everything else as at ep = 1
    ep: int = 1
    # parallel.dualpipev_overlap: the ep all-to-alls beside the other side's compute
    dualpipev_overlap: bool = True

    @functools.cached_property
    def world(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @functools.cached_property
    def strategy_info(self) -> strategies.Strategy:
        return strategies.lookup(self.strategy)

    @functools.cached_property
    def split_backward(self) -> bool:
        """A pipeline schedule that runs B and W apart (zb, zbv, dualpipev): ddp and zero1 then
        replicate through FSDP2 (strategies.Strategy.uses_fsdp), as the run does."""
        return self.pp > 1 and self.schedule in SPLIT_BACKWARD_SCHEDULES

    @functools.cached_property
    def uses_fsdp(self) -> bool:
        """Whether the torch engine runs this layout on FSDP2 (the strategy's, TP's, EP's or the split
        backward's reason)."""
        return self.strategy_info.uses_fsdp(self.tp, self.ep, self.split_backward)

    @functools.cached_property
    def shard_size(self) -> int:
        """N of the formulas: ranks one shard of the model states is split over. The cp ranks of a
        dp index hold the same model: FSDP2 shards over dp_shard × cp, ZeRO-1 over dp × cp."""
        s = self.strategy_info
        n = s.shard_size(*s.dp_dims(self.dp, self.dp_shard))
        return n * self.cp if s.sharded else n

    @functools.cached_property
    def expert_shard_size(self) -> int:
        """N_e: ranks one shard of the routed experts' states is split over. The ep ranks split the
        experts; the strategy shards each rank's E/ep over the edp = dp/ep ranks holding the same ones
        (FSDP2 over dp_shard/ep, hsdp's shard group; ddp replicates them: 1)."""
        return self.shard_size // self.ep if self.strategy_info.sharded else 1

    @property
    def grad_sync_size(self) -> int:
        """Ranks whose gradients are averaged: every data-parallel rank of every context-parallel one."""
        return self.dp * self.cp

    @property
    def replicate_size(self) -> int:
        """Replica groups of a hybrid strategy (hsdp); 1 otherwise."""
        return self.dp // self.dp_shard if self.strategy_info.dp_mesh == "hybrid" else 1

    def fsdp_unit_params(self, shape: ModelShape, layers: int, first: bool = True,
                         last: bool = True, start: int = 0) -> list[int]:
        """Parameters of each FSDP2 unit of a stage holding `layers` blocks from block `start` (the
        embedding when first, norm + head when last), in forward order, as loom/parallel/fsdp.py groups
        them: the last unit is the one kept gathered after forward (the head's, or the root's). Under
        expert parallelism each MoE block's routed experts are a unit of their own, over the ranks
        holding the same experts (one per MoE block, plan/comm.py's _expert_sync): not among these."""
        if shape.moe:
            return list(stage_fsdp_units(shape, self.ep > 1, self.fsdp_unit_mb, layers, first, last, start))
        return list(stage_fsdp_units(shape, False, self.fsdp_unit_mb, layers, first, last, 0))

    @functools.cached_property
    def engine(self) -> str:
        """The parallel.engine that runs it, in the config's words (plan.json and the plan's text use
        them too): "deepspeed", or "torch" (see `implementation`)."""
        if self.framework == "deepspeed" or self.offload in ("optimizer", "optimizer-nvme", "nvme"):
            return "deepspeed"  # FSDP2 offloads all sharded states or none, and never to NVMe
        return "torch"

    @property
    def implementation(self) -> str:
        """What runs it on its engine, in words: the torch engine's DDP, DDP + ZeroRedundancyOptimizer or
        FSDP2 (ddp and zero1 under TP or EP replicate through FSDP2), or DeepSpeed's ZeRO stage."""
        s = self.strategy_info
        if self.engine == "deepspeed":
            return f"DeepSpeed ZeRO-{s.zero_stage}"
        replicas = "FSDP2" if self.uses_fsdp else "DDP"
        return f"{replicas} + ZeroRedundancyOptimizer" if s.shards_optimizer_only else replicas

    @functools.cached_property
    def runs_in_loom(self) -> bool:
        """loom's deepspeed engine runs data parallelism (ZeRO 0-3, offload), not TP, PP, CP or hsdp,
        and without loom's activation checkpointing (the torch engine's)."""
        if self.engine != "deepspeed":
            return True
        return self.tp == 1 and self.pp == 1 and self.cp == 1 and self.ep == 1 \
            and self.strategy_info.deepspeed_stage is not None and self.activation_checkpointing == "none"

    def label(self) -> str:
        hybrid = self.strategy_info.dp_mesh == "hybrid"
        parts = [f"{self.strategy}({self.replicate_size}×{self.dp_shard})" if hybrid else self.strategy]
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + ("+sp" if self.sequence_parallel else ""))
        if self.cp > 1:
            parts.append(f"cp{self.cp} {self.cp_mode}")
        if self.pp > 1:
            v = f"×v{self.virtual_stages}" if self.virtual_stages > 1 else ""
            parts.append(f"pp{self.pp}{v} {self.schedule}")
        if self.offload != "none":
            parts.append(f"offload {self.offload}")
        if self.activation_checkpointing != "none":
            ac = self.activation_checkpointing
            parts.append(f"ac {ac}" + (f"/{self.ac_every}" if ac == "selective" else ""))
        if self.framework == "deepspeed" and self.offload == "none":
            parts.append("on deepspeed")
        return " ".join(parts)

    @property
    def dimensions(self) -> int:
        """Parallel dimensions beyond data parallelism: what a person counts as complexity."""
        return (self.tp > 1) + (self.pp > 1) + (self.cp > 1) + (self.ep > 1)

    def local_seq(self, seq_len: int) -> int:
        """The tokens of each sequence a rank holds: every per-token term is priced for these."""
        return seq_len // self.cp


@functools.lru_cache(maxsize=4096)
def stage_fsdp_units(shape: ModelShape, experts_apart: bool, unit_mb: float, layers: int, first: bool,
                     last: bool, start: int) -> tuple[int, ...]:
    """Candidate.fsdp_unit_params, remembered (the search asks for the same stages again and again)."""
    return tuple(params for params, _ in stage_fsdp_unit_parts(shape, experts_apart, unit_mb, layers, first,
                                                                last, start))


@functools.lru_cache(maxsize=4096)
def stage_fsdp_unit_parts(shape: ModelShape, experts_apart: bool, unit_mb: float, layers: int, first: bool,
                          last: bool, start: int) -> tuple[tuple[int, int], ...]:
    """Each unit of stage_fsdp_units as (parameters, of them what TP keeps whole on each of its ranks:
    the norms' gains, and an MoE block's feed-forward but its routed experts when they are apart)."""
    tied, norms = shape.tie_embeddings, shape.layer_norm_params
    entries = [(shape.layer_params, norms)] * layers
    sizes = [shape.layer_params] * layers
    if shape.moe:  # grouped by their whole size (fsdp.py counts the experts' parameters too)
        sizes = [shape.block_params(i) for i in range(start, start + layers)]
        routed = shape.routed_params_per_block if experts_apart else 0
        whole = norms + shape.moe_ffn_params() - routed  # shapes.tp_replicated_params
        entries = [(n - routed, whole) if shape.is_moe(i) else (n, norms) for i, n in enumerate(sizes, start)]
    head = [(shape.embedding_params, 0)] if first and not tied else []
    tail = [(shape.head_params, shape.d_model)] if last and not tied else []  # the head and the final norm
    entries = head + entries + tail
    sizes = [n for n, _ in head] + sizes + [n for n, _ in tail]
    units = [(sum(n for n, _ in unit), sum(r for _, r in unit))
             for unit in strategies.fsdp_units(entries, sizes, unit_mb)]
    if not tied:
        return tuple(units)
    root = (shape.embedding_params + shape.head_params, shape.d_model)  # tied: the root holds both
    if len(units) == 1:
        return ((units[0][0] + root[0], units[0][1] + root[1]),)  # the root is the one unit
    return tuple(units + [root])
