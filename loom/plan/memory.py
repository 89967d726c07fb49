"""Per-rank model-state bytes of each data-parallel strategy (the formulas measurements check).

Ψ = parameter count, N = ranks that share one shard. The `torch` recipe is torch-native mixed
precision: fp32 parameters and gradients, Adam m and v in fp32 -> 4Ψ + 4Ψ + 8Ψ = 16Ψ unsharded.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from loom import strategies
from loom.config import rank_stages, stages_per_rank
from loom.plan import context, experts, in_flight, lora, muon
from loom.plan.candidate import head_recomputed, loss_chunk, plain_ops, stage_fsdp_unit_parts
from loom.plan.shapes import (
    activation_bytes_per_layer,
    attention_kv_width,
    checkpointed_layers,
    chunk_logits_bytes,
    dense_mlp_saved_bytes,
    grouped_experts,
    head_backward_bytes,
    head_saved_bytes,
    head_transient_bytes,
    llama_like,
    mlp_saved_widths,
    moe_ffn_saved_bytes,
    op_saved_bytes_per_layer,
    op_shared_bytes_per_layer,
    plain_ops_bytes_per_layer,
    residual_bytes,
)
from loom.plan.terms import NO_TERMS, Terms, gb, num

# bytes per parameter: (params, grads, optimizer states)
RECIPES = {
    "torch": (4, 4, 8),  # fp32 params + fp32 grads + Adam m, v
    "zero": (2, 2, 12),  # ZeRO paper: fp16 params + fp16 grads + fp32 master, m, v
    "megatron": (2, 4, 12),  # Megatron/DeepSpeed keep fp32 main grads: 18 bytes/param
    # DeepSpeed's ZeRO over fp32 model weights (loom's CPU runs): its optimizer steps an fp32 master
    # copy of them, so the optimizer states are master + m + v.
    "deepspeed_fp32": (4, 4, 12),
}
# DeepSpeed's reduce and all-gather buckets, as loom sizes them (parallel.ddp_bucket_mb, 25 MB).
DEEPSPEED_BUCKETS = 2 * 25 * 2**20


def deepspeed_states(strategy: str, num_params: int, shard_size: int, act_bytes: int) -> tuple[float, str]:
    """What a rank of loom's deepspeed engine holds at rest (after a step, whose gradients DeepSpeed
    has freed): the model's weights and the optimizer's states — ZeRO 1-3 step an fp32 master copy
    (master, m, v: e.g. 4Ψ + 12Ψ/N for ZeRO-2 over fp32 weights), ZeRO-0 the weights themselves
    (m, v: 12Ψ). Bytes and formula."""
    stage = strategies.lookup(strategy).zero_stage
    recipe = "torch" if stage == 0 else "zero" if act_bytes == 2 else "deepspeed_fp32"
    states = model_state_bytes(strategy, num_params, shard_size, recipe, paper_stages=True)
    p, _, o = RECIPES[recipe]
    params, optimizer = (f"{p}Ψ/N" if stage == 3 else f"{p}Ψ"), (f"{o}Ψ/N" if stage else f"{o}Ψ")
    text = f"{p + o}Ψ/N" if stage == 3 else f"{p + o}Ψ" if stage == 0 else f"{params} + {optimizer}"
    return states.params + states.optimizer, text


def engine_recipe(w, c) -> str:
    """The bytes per parameter a candidate's engine keeps: the workload's recipe on the torch engine;
    DeepSpeed's ZeRO (stages 1-3) keeps 16-bit weights and grads plus fp32 master, m and v (the ZeRO
    paper's recipe), or fp32 weights and grads plus those states when the model runs in fp32."""
    if c.engine != "deepspeed" or c.strategy_info.zero_stage == 0:
        return w.recipe
    return "zero" if w.act_bytes == 2 else "deepspeed_fp32"


@dataclass(frozen=True)
class ModelStateBytes:
    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def model_state_bytes(strategy: str, num_params: int, shard_size: int, recipe: str = "torch",
                      paper_stages: bool = False, tp: int = 1, tp_replicated: int = 0) -> ModelStateBytes:
    """Bytes of params, grads and optimizer state held by one rank at rest.

    `shard_size` is N, the number of ranks one shard is split over (the whole data-parallel
    group for ZeRO, dp_shard for HSDP). `paper_stages` follows the ZeRO paper's stage 2
    (unsharded fp16 params) instead of FSDP2's SHARD_GRAD_OP (params sharded at rest).
    """
    p, g, o = RECIPES[recipe]
    # With tensor parallelism each TP rank holds 1/tp of every split parameter and all of the
    # `tp_replicated` ones (the norms' gains).
    num_params = (num_params - tp_replicated) / tp + tp_replicated
    s = strategies.lookup(strategy)
    sp, sg, so = (kind in s.sharded for kind in (strategies.PARAMS, strategies.GRADS, strategies.OPTIMIZER))
    if paper_stages and s.zero_stage == 2:
        sp = False  # the ZeRO paper's stage 2 keeps its (fp16) parameters whole
    n = float(shard_size)
    return ModelStateBytes(
        params=p * num_params / (n if sp else 1),
        grads=g * num_params / (n if sg else 1),
        optimizer=o * num_params / (n if so else 1),
    )


def lora_state_bytes(strategy: str, base_params: float, trainable_params: float, shard_size: int,
                     base_bytes: int) -> ModelStateBytes:
    """Bytes of params, grads and optimizer state one rank holds at rest under LoRA (plan/lora.py): the
    frozen base's `base_params` at `base_bytes` each (no gradient, no optimizer state) and the
    `trainable_params` (adapters; trained embeddings and norms) at the torch recipe's fp32 4 + 4 + 8,
    each state divided by `shard_size` = N where the strategy shards it (FSDP2: frozen and trainable
    alike, 2Ψ_base/N + 16Ψ_lora/N in bf16; ddp: 2Ψ_base + 16Ψ_lora; zero1: only the optimizer's, 8Ψ_lora/N).
    The counts are one rank's before data-parallel sharding, after the TP, EP and pipeline splits
    (lora.stage_params gives the planner's; an MoE model's routed experts apart, over N_e)."""
    p, g, o = RECIPES["torch"]
    s = strategies.lookup(strategy)
    sp, sg, so = (shard_size if kind in s.sharded else 1
                  for kind in (strategies.PARAMS, strategies.GRADS, strategies.OPTIMIZER))
    return ModelStateBytes(params=(base_bytes * base_params + p * trainable_params) / sp,
                           grads=g * trainable_params / sg, optimizer=o * trainable_params / so)


def rank_stages_of(c, rank: int) -> tuple[tuple[int, ...], int]:
    """(the stages pipeline rank `rank` runs, the pipeline's stage count): one stage a rank, or v of
    them round-robin (interleaved, zb), or two in a V (zbv, dualpipev: rank 0 runs the first and the
    last), as loom.config.rank_stages places them."""
    if c.pp == 1:
        return (0,), 1
    return pipeline_rank_stages(rank, c.pp, c.schedule, c.virtual_stages)


@functools.lru_cache(maxsize=1024)
def pipeline_rank_stages(rank: int, pp: int, schedule: str, virtual: int) -> tuple[tuple[int, ...], int]:
    """rank_stages_of, remembered (the search asks for each rank's stages several times a candidate)."""
    per = stages_per_rank(schedule, virtual)
    return tuple(rank_stages(rank, pp, per, schedule)), pp * per


@functools.lru_cache(maxsize=4096)
def rank_blocks(shape, pp: int, schedule: str, virtual: int) -> tuple[int, ...]:
    """The blocks each pipeline rank runs over its stages, split as the run splits them (remembered:
    the search asks for every candidate)."""
    if pp == 1:
        return (shape.n_layers,)
    sizes = shape.stage_sizes(pipeline_rank_stages(0, pp, schedule, virtual)[1])
    return tuple(sum(sizes[s] for s in pipeline_rank_stages(r, pp, schedule, virtual)[0]) for r in range(pp))


@functools.lru_cache(maxsize=4096)
def _fullest_rank(shape, pp: int, schedule: str, virtual: int) -> int:
    """The pipeline rank whose stages hold the most parameters, the earliest of equals (an earlier rank
    holds more micro-batches in flight)."""
    def params(r: int) -> int:
        stages, total = pipeline_rank_stages(r, pp, schedule, virtual)
        return sum(shape.stage_params(s, total) for s in stages)
    return max(range(pp), key=lambda r: (params(r), -r))


def holds_last_stage(c, rank: int) -> bool:
    """Whether pipeline rank `rank` runs the last stage (the norm, head and loss): rank p − 1, but rank
    0 under a V."""
    stages, total = rank_stages_of(c, rank)
    return stages[-1] == total - 1


def rank_sum(c, rank: int, of_stage, zero=0):
    """`of_stage(stage, stages)` (a ModelShape.stage_* method) summed over the stages `rank` runs."""
    if c.pp == 1 or stages_per_rank(c.schedule, c.virtual_stages) == 1:
        return of_stage(rank, c.pp)
    stages, total = rank_stages_of(c, rank)
    return sum((of_stage(s, total) for s in stages), zero)


def priced_ranks(shape, c) -> list[int]:
    """The pipeline ranks the planner prices: with one stage a rank, ModelShape.priced_stages (the
    embedding's, the head's, the fullest); with several, ranks 0 and p − 1 (a V puts both
    ends on rank 0, and its turn on rank p − 1, which sends nothing between its two stages: under a V
    rank 1 too), and the rank whose stages hold the most parameters (an uneven split's extra blocks
    fall on middle stages), of an MoE model also the one holding the most MoE blocks (those fall
    where the placement puts them)."""
    if c.pp == 1 or stages_per_rank(c.schedule, c.virtual_stages) == 1:
        return shape.priced_stages(c.pp)
    ends = {0, c.pp - 1} | ({1} if c.schedule in ("zbv", "dualpipev") else set())
    if not shape.known:
        return sorted(ends)
    fullest = _fullest_rank(shape, c.pp, c.schedule, c.virtual_stages)
    if not shape.moe:
        return sorted(ends | {fullest})
    most_moe = max(range(c.pp), key=lambda r: (rank_sum(c, r, shape.stage_moe_layers), -r))
    return sorted(ends | {fullest, most_moe})


def heaviest_rank(shape, c) -> int:
    """The pipeline rank holding the most parameters over its stages (0 without a pipeline): the one
    whose gradients, optimizer step and data-parallel traffic the planner prices."""
    return max(priced_ranks(shape, c), key=lambda r: rank_sum(c, r, shape.stage_params))


def rank_lora_params(w, c, rank: int) -> tuple[lora.Params, lora.Params]:
    """lora.stage_params summed over the stages pipeline rank `rank` runs: (the rest, the routed
    experts), a rank's after TP and EP."""
    stages, total = rank_stages_of(c, rank)
    parts = [lora.stage_params(w.shape, w.lora, s, total, c.tp, c.ep) for s in stages]
    return sum((r for r, _ in parts), lora.Params()), sum((e for _, e in parts), lora.Params())


def lora_states(w, c, stage: int = 0) -> tuple[ModelStateBytes, ModelStateBytes | None]:
    """A LoRA workload's model states on a rank of pipeline stage `stage`: (the stage but its routed
    experts over N, the routed experts over N_e, or None for a dense model)."""
    rest, routed = rank_lora_params(w, c, stage)
    b = w.lora.base_bytes
    held = lora_state_bytes(c.strategy, routed.frozen, routed.trainable, c.expert_shard_size, b)
    return (lora_state_bytes(c.strategy, rest.frozen, rest.trainable, c.shard_size, b),
            held if routed.total else None)


def expert_state_bytes(w, c, stage: int = 0) -> ModelStateBytes:
    """The routed experts' model states one rank of pipeline stage `stage` holds at rest (the rest of
    the model's states: model_state_bytes as for a dense model, less these). The stage's routed
    parameters P_e are split over the ep ranks and the strategy shards a rank's P_e/ep over the
    N_e = N/ep ranks holding the same experts (ddp: none), whatever tp: params, grads, optimizer =
    (p, g, o)·P_e/ep, each /N_e where the strategy shards it. Under zero3 that is 16·P_e/dp, as at
    ep = 1; under ddp 16·P_e/ep. Under LoRA their frozen weights and adapters (lora_states)."""
    if w.lora is not None:
        return lora_states(w, c, stage)[1] or ModelStateBytes(0.0, 0.0, 0.0)
    routed = rank_sum(c, stage, w.shape.stage_routed_params)
    recipe = engine_recipe(w, c)
    return model_state_bytes(c.strategy, routed / c.ep, c.expert_shard_size, recipe,
                             paper_stages=recipe == "zero" or c.engine == "deepspeed")


# Bytes per parameter of the gradient collectives (FSDP2 reduces in fp32 under the torch recipe;
# the ZeRO paper reduces fp16 gradients; Megatron/DeepSpeed keep fp32 main gradients).
GRAD_COMM_BYTES = {"torch": 4, "zero": 2, "megatron": 4}


@dataclass(frozen=True)
class MemoryAccount:
    """One GPU's bytes (its worst pipeline stage) and what offload puts on the host and disk."""
    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float  # unsharded parameters and gradients in flight, communication buffers
    fragmentation: float
    host: float  # per GPU; a node needs gpus_per_node times this
    nvme: float  # per GPU
    stage: int  # the pipeline stage these bytes are for

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.model_states + self.activations + self.buffers + self.fragmentation

    def to_dict(self) -> dict:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "buffers": self.buffers,
                "fragmentation": self.fragmentation, "model_states": self.model_states, "total": self.total,
                "host": self.host, "nvme": self.nvme}


def gpu_memory(w, c, fragmentation: float = 0.10, device: str = "cuda",
               terms: Terms = NO_TERMS) -> MemoryAccount:
    """Per-GPU memory of candidate `c` on workload `w` (see plan/candidate.py), worst stage; the
    worst stage's account recorded in `terms`."""
    stages = priced_ranks(w.shape, c)
    accounts = [stage_memory(w, c, s, fragmentation, device) for s in stages]
    worst = max(accounts, key=lambda a: a.total)
    if terms:
        terms.section(f"memory per {'rank' if device == 'cpu' else 'GPU'} (GB = 1e9 bytes)"
                      f"{'' if c.pp == 1 else f', pipeline stage {worst.stage}'}")
        if c.pp > 1 and stages_per_rank(c.schedule, c.virtual_stages) > 1:
            terms.note("pipeline ranks priced, each over its stages: "
                       + ", ".join(f"rank {a.stage} {gb(a.total)}" for a in accounts)
                       + f"; the largest, rank {worst.stage}, is the GPU's")
        elif c.pp > 1 and len(stages) > 2:
            terms.note(f"stages 0, p−1 (the embedding, the head) and {stages[1]} (the most parameters: its "
                       "MoE blocks) priced: " + ", ".join(f"stage {a.stage} {gb(a.total)}" for a in accounts)
                       + f"; the largest, stage {worst.stage}, is the GPU's")
        elif c.pp > 1:
            terms.note("stages 0 and p−1 priced (the embedding, the head): "
                       + ", ".join(f"stage {a.stage} {gb(a.total)}" for a in accounts)
                       + f"; the larger, stage {worst.stage}, is the GPU's")
        worst = stage_memory(w, c, worst.stage, fragmentation, device, terms=terms)
    return worst


def stage_memory(w, c, stage: int, fragmentation: float = 0.10, device: str = "cuda",
                 moments: list | None = None, terms: Terms = NO_TERMS) -> MemoryAccount:
    """Per-GPU memory of a rank holding pipeline stage `stage` (0 without a pipeline), at the
    step's peak. `device` "cpu": a loom train run on gloo ranks, whose collectives and optimizer
    allocate differently (see _step_peak). `moments`: a list that receives every moment compared,
    as (name, activations, buffers); the account is the largest. Each quantity is recorded in
    `terms` (plan/terms.py)."""
    shape, last = w.shape, holds_last_stage(c, stage)
    # a rank's stages summed: under a V rank 0 holds the embedding and the head
    stage_params = rank_sum(c, stage, shape.stage_params)
    layers = rank_sum(c, stage, shape.stage_blocks) if shape.known else 0
    moe_layers = rank_sum(c, stage, shape.stage_moe_layers)
    replicated = shape.tp_replicated_params(layers, last, moe_layers) if (c.tp > 1 and shape.known) else 0
    recipe = engine_recipe(w, c)
    deepspeed = c.engine == "deepspeed"
    # The routed experts apart (expert_state_bytes): split over ep, sharded over N_e, never over tp
    routed = rank_sum(c, stage, shape.stage_routed_params)
    if w.lora is not None:  # the base frozen, the adapters trained (the deepspeed engine refuses LoRA)
        states, expert = lora_states(w, c, stage)
    else:
        states = model_state_bytes(c.strategy, stage_params - routed, c.shard_size, recipe,
                                   paper_stages=recipe == "zero" or deepspeed, tp=c.tp,
                                   tp_replicated=replicated - routed if replicated else 0)
        expert = expert_state_bytes(w, c, stage) if routed else None
    adamw = states, expert
    if w.muon is not None:
        states, expert = _muon_states(w, c, stage, states, expert, NO_TERMS)
    params, grads, optimizer = states.params, states.grads, states.optimizer
    if expert is not None:
        params, grads, optimizer = params + expert.params, grads + expert.grads, optimizer + expert.optimizer
    buffers = 0.0
    if deepspeed and c.offload == "none":  # DeepSpeed frees its gradient partitions after each step:
        buffers, grads = grads, 0.0  # held during the step, not at rest (as its engine measures)
    host = nvme = 0.0
    if c.offload == "optimizer":  # ZeRO-Offload: gradients and optimizer states on the host
        host, grads, optimizer = grads + optimizer, 0.0, 0.0
    elif c.offload == "optimizer+params":
        host, params, grads, optimizer = params + grads + optimizer, 0.0, 0.0, 0.0
    elif c.offload == "optimizer-nvme":  # optimizer states on NVMe, and the gradients swapped with them
        nvme, grads, optimizer = grads + optimizer, 0.0, 0.0
    elif c.offload == "nvme":  # ZeRO-Infinity: every state on NVMe, staged through host buffers
        nvme, params, grads, optimizer = params + grads + optimizer, 0.0, 0.0, 0.0

    if terms and w.lora is not None:
        _record_lora_states(terms, w, c, stage, stage_params, adamw[0], (params, grads, optimizer),
                            host + nvme, adamw[1])
    elif terms:
        _record_states(terms, w, c, stage, stage_params, replicated, adamw[0], (params, grads, optimizer),
                       host + nvme, moved=buffers, expert=adamw[1])
        if deepspeed:
            terms.note(f"DeepSpeed buckets: its reduce and all-gather buckets, 2 × 25 MiB = "
                       f"{gb(DEEPSPEED_BUCKETS)}, held through the step")
    parts = [("DeepSpeed's gradient partitions", buffers)] if buffers else []  # the buffers, named
    activations = 0.0
    if shape.known:
        named = [] if moments is None and terms else moments
        activations, inflight = _step_peak(w, c, stage, layers, stage_params, replicated, grads,
                                           optimizer, device, named, terms, routed)
        buffers += inflight
        parts.insert(0, ("the peak's buffers", inflight))
        if terms:
            _record_moments(terms, named or [("DeepSpeed's step", activations, inflight)])
            if ddp_accumulates_apart(w, c):
                terms.note(f"  buffers include DDP's gradients of the no_sync micro-steps, beside its "
                           f"buckets: grads = {gb(grads)}")
    else:
        if terms:
            terms.note("activations: not modelled (parameter count only)")
        if deepspeed:
            buffers += DEEPSPEED_BUCKETS
            parts.insert(0, ("DeepSpeed buckets", DEEPSPEED_BUCKETS))
        if c.offload != "none":  # what stays on the GPU: a layer's parameters staged in, and the next
            layer = llama_like(shape.num_params).layer_params
            buffers += 2 * w.act_bytes * layer / c.tp
            parts.append(("2 staged layers", 2 * w.act_bytes * layer / c.tp))
            if terms:
                terms.note(f"offload: a layer's parameters staged in from the host, and the next: "
                           f"2·e·layer/tp, "
                           f"a Llama-style layer of Ψ having {num(layer)} parameters")
    allocated = params + grads + optimizer + activations + buffers
    if terms and len(parts) > 1:
        terms.item("buffers", " + ".join(n for n, _ in parts), " + ".join(gb(v) for _, v in parts),
                   gb(buffers))
    elif terms and parts and not shape.known:
        terms.item("buffers", parts[0][0], None, gb(buffers))
    if terms:
        terms.item("fragmentation", f"{fragmentation:g} × allocated (states + activations + buffers)",
                   f"{fragmentation:g} × {gb(allocated)}", gb(fragmentation * allocated))
    return MemoryAccount(params, grads, optimizer, activations, buffers, fragmentation * allocated,
                         host, nvme, stage)


def _muon_states(w, c, stage: int, states: ModelStateBytes, expert: ModelStateBytes | None,
                 terms: Terms) -> tuple[ModelStateBytes, ModelStateBytes | None]:
    """Muon's states (plan/muon.py): each of its matrices keeps one fp32 momentum where AdamW keeps m
    and v, 4 bytes fewer per parameter (torch's recipe: 4Ψ_muon + 8Ψ_adamw), divided as the strategy
    divides the optimizer's states: the rest over N, the routed experts over N_e. Its matrices: the
    blocks' (a rank's after TP's split, E/ep of the experts), under LoRA the adapters (trained
    embeddings and norms stay on AdamW); of a bare parameter count, its Llama-style stand-in's."""
    shape = w.shape if w.shape.known else llama_like(w.shape.num_params)
    dense, routed = muon.rank_state_params(shape, c, stage, w.lora)
    sharded = strategies.OPTIMIZER in c.strategy_info.sharded
    n, ne = (c.shard_size, c.expert_shard_size) if sharded else (1, 1)
    saved = 4 * dense / n
    rest = dataclasses.replace(states, optimizer=states.optimizer - saved)
    held = None if expert is None else \
        dataclasses.replace(expert, optimizer=expert.optimizer - 4 * routed / ne)
    if terms:
        what = "Ψ_m: the adapters A, B on a rank" if w.lora is not None else \
            "Ψ_m: the blocks' matrices on a rank (attention, MLP; after TP)"
        terms.item(what, "wq, wk, wv, wo, w1, w3, w2 (not the embedding, head, norms, router)"
                   if w.lora is None else "A [r, in], B [out, r] of each adapted linear", None, num(dense))
        terms.item("muon optimizer", f"AdamW's − 4·Ψ_m{'/N' if n > 1 else ''} (one fp32 momentum, not m and "
                   f"v: 4·Ψ_m + 8·Ψ_adamw in torch's recipe)",
                   f"{gb(states.optimizer)} − 4 × {num(dense)}{f' / {n}' if n > 1 else ''}",
                   gb(rest.optimizer))
        if held is not None:
            over = f" / {ne}" if ne > 1 else ""
            terms.item("muon expert optimizer", f"AdamW's − 4·P_e/ep{'/N_e' if ne > 1 else ''} (each "
                       "expert's matrices)", f"{gb(expert.optimizer)} − 4 × {num(routed)}{over}",
                       gb(held.optimizer))
    return rest, held


# What each moment _step_peak compares holds beyond the model states at rest (its names).
MOMENTS = {
    "forward's end": "in the loss: saved, the logits and their fp32 copy | the latest all-gather as well",
    "loss": "backward's start: saved + the loss's gradients of the logits",
    "backward's start": "saved | what backward holds from its start",
    "head backward": "the loss's tensors gone: the logits' and the head weight's gradients",
    "final norm backward": "the head done: the final norm's backward temporaries beside the head's gradient",
    "head reduce-scatter": "the head's own unit reduce-scatters its gradient, resharded first",
    "block backward": "the topmost block's unit all-gathered again for its backward, the next prefetched",
    "recompute": "the topmost checkpointed block rebuilt, with its backward's first gradients (SwiGLU "
                 "gate and up); its unit gathered again",
    "pipeline steady": "as many micro-batches as at the peak, under FSDP2 every unit gathered (zero3 "
                       "under 1F1B: only the last, a forward resharded the rest), the sends and input "
                       "gradients torch holds to the step's end",
    "pipeline input backward": "a split schedule's input pass (B), the graph retained: its bottom "
                               "attention norm's backward temporaries beside every saved tensor",
    "pipeline top block backward": "a stage's whole backward in its top block: the SwiGLU's gradients, "
                                   "then (FSDP2, 16-bit) the block's weight gradients beside its ffn norm's",
    "pipeline embedding grad": "the first stage's last backward op: the embedding's new gradient beside "
                                   "the one accumulated, every unit gathered",
    "pipeline backward's end": "zero3 under 1F1B, or GPipe: a backward's micro-batch consumed, every unit "
                               "gathered (again), each unsharded gradient held",
    "reduce-scatter": "the end of backward: the last unit's reduce-scatter",
    "gpipe second, pipeline backward's end": "GPipe's second backward in its bottom block: every gradient "
                                             "made, m - 2 micro-batches besides",
    "gpipe head backward": "GPipe's last micro-batch: every unit gathered since the first backward (whose "
                           "moments hold no accumulated gradient yet)",
    "pipeline reduce-scatter": "after the last backward: the stage's units reduced one by one, those after "
                               "the one reduced still gathered with their gradients",
    "tied embedding": "the embedding's gradient added to the head's",
    "embedding gradient": "TP, untied: the embedding's gradient whole over the vocabulary, sliced to its "
                          "shard",
    "optimizer": "foreach AdamW's sqrt(v) on CPU: half the optimizer states",
    "ring forward": "the last block's ring attention: its k/v blocks in flight and fp32 accumulators",
    "ring backward": "the topmost (or rebuilt) block's ring backward: k/v in flight, fp32 dk, dv, dq",
    "at rest": "between steps: the states alone (and a pipeline's receive buffers)",
}


def _record_moments(terms: Terms, moments: list) -> None:
    """Each moment compared, activations | buffers beyond the states at rest, the peak marked (the
    first largest, as _step_peak takes it)."""
    peak = max(moments, key=lambda x: x[1] + x[2])
    terms.note("moments of the step (memory.stage_memory's), activations | buffers beyond the states at "
               "rest; the peak is the largest sum:")
    for moment in moments:
        name, act, buf = moment
        about = f"   ({MOMENTS[name]})" if name in MOMENTS else ""
        if name.startswith(SECOND) and name not in MOMENTS:
            about = f"   (GPipe's second backward, one micro-batch fewer, every gradient made: " \
                    f"{MOMENTS.get(name.removeprefix(SECOND), '')})"
        mark = "  ← peak" if moment is peak else ""
        terms.lines.append(f"  {name + ':':<24} {gb(act)} | {gb(buf)} = {gb(act + buf)}{about}{mark}")
    if any(buf < 0 for _, _, buf in moments):
        terms.note("  (buffers below 0: FSDP2's sharded gradients, counted in the states at rest, are freed "
                   "at the step's start and not rebuilt yet)")


OFFLOADED = {"optimizer": "grads and optimizer states to the host (ZeRO-Offload)",
             "optimizer+params": "params, grads and optimizer states to the host",
             "optimizer-nvme": "grads and optimizer states to NVMe (ZeRO-Infinity)",
             "nvme": "params, grads and optimizer states to NVMe (ZeRO-Infinity)"}
RECIPE_WORDS = {"torch": "torch: fp32 params 4 + fp32 grads 4 + Adam m, v 8 bytes per parameter",
                "zero": "ZeRO paper: 16-bit params 2 + 16-bit grads 2 + fp32 master, m, v 12",
                "megatron": "Megatron: 16-bit params 2 + fp32 main grads 4 + fp32 master, m, v 12",
                "deepspeed_fp32": "DeepSpeed over fp32 weights: params 4 + grads 4 + master, m, v 12"}


def _record_params(terms: Terms, shape, c, stage: int, total: int) -> None:
    """Ψ of one pipeline rank's stages (shape.stage_params), in symbols and numbers."""
    pp = c.pp
    if not shape.known:
        if pp == 1:
            terms.item("Ψ parameters", "--params", None, num(total))
        else:
            terms.item("Ψ stage parameters", "Ψ/p", f"{num(shape.num_params)} / {pp}", num(total))
        return
    d, kv, f = shape.d_model, shape.kv_dim, shape.ffn_hidden
    terms.item("P_layer per block" if not shape.moe else "P_layer per dense block", "2h² + 2h·kv + 3h·f + 2h",
               f"2·{d}² + 2·{d}·{kv} + 3·{d}·{f} + 2·{d}", num(shape.layer_params))
    stages, count = rank_stages_of(c, stage)
    layers = sum(shape.stage_blocks(s, count) for s in stages)
    first, last = stages[0] == 0, holds_last_stage(c, stage)
    sym, vals = [f"{'L' if pp == 1 else 'L_s'}·P_layer"], [f"{layers}·{num(shape.layer_params)}"]
    if shape.moe:
        moe = rank_sum(c, stage, shape.stage_moe_layers)
        e, he, sh = shape.moe_experts, shape.moe_hidden, shape.moe_shared_hidden
        gate = " + h" if shape.moe_shared_gate else ""
        terms.item("P_moe per MoE block", f"2h² + 2h·kv + 2h + h·E + 3h·h_e·E + 3h·h_s{gate} (router, E "
                   "routed experts, the shared ones h_s wide)",
                   f"2·{d}² + 2·{d}·{kv} + 2·{d} + {d}·{e} + 3·{d}·{he}·{e} + 3·{d}·{sh}{gate and f' + {d}'}",
                   num(shape.moe_layer_params))
        sym, vals = ["L_d·P_layer + L_m·P_moe"], [f"{layers - moe}·{num(shape.layer_params)} + "
                                                  f"{moe}·{num(shape.moe_layer_params)}"]
    if first:
        sym.append("V·h")
        vals.append(f"{shape.vocab_size}·{d}")
    if last:
        if shape.tie_embeddings:
            sym.append("h" if pp == 1 else "h + V·h")
            vals.append(f"{d}" if pp == 1 else f"{d} + {shape.vocab_size}·{d}")
        else:
            sym.append("(V·h + h)")
            vals.append(f"({shape.vocab_size}·{d} + {d})")
    what = "Ψ parameters" if pp == 1 else f"Ψ of stage {stage}" if len(stages) == 1 else f"Ψ of rank {stage}"
    terms.item(what, " + ".join(sym), " + ".join(vals), num(total))
    if pp > 1:
        held = f"stage {stage} of {pp}" if len(stages) == 1 else \
            f"rank {stage} of {pp}, stages {', '.join(map(str, stages))} of {count}"
        terms.note(f"  ({held}: L_s = {layers} blocks{'; the embedding' if first else ''}"
                   f"{'; the final norm and head' if last else ''}"
                   f"{' (tied: its own copy of the embedding)' if last and shape.tie_embeddings else ''})")


def _state_formula(p: int, g: int, o: int, sp: bool, sg: bool, so: bool) -> tuple[str, str]:
    """('4Ψ/N + 4Ψ/N + 8Ψ/N', '16Ψ/N'): the per-state sum and its collapsed form."""
    parts = [(p, sp), (g, sg), (o, so)]
    full = " + ".join(f"{b}Ψ{'/N' if s else ''}" for b, s in parts)
    whole = sum(b for b, s in parts if not s)
    split = sum(b for b, s in parts if s)
    short = " + ".join(t for t in ((f"{whole}Ψ" if whole else ""), (f"{split}Ψ/N" if split else "")) if t)
    return full, short


def _record_states(terms: Terms, w, c, stage: int, stage_params: int, replicated: int,
                   states: ModelStateBytes,
                   on_gpu: tuple[float, float, float], offloaded: float, moved: float,
                   expert: ModelStateBytes | None = None) -> None:
    """The stage's parameters, the recipe's and strategy's model states, and where the account
    keeps them (GPU, host, NVMe; DeepSpeed's gradient partitions, `moved`, as a buffer); an MoE
    model's routed experts (`expert`, expert_state_bytes) apart."""
    _record_params(terms, w.shape, c, stage, stage_params)
    psi = stage_params
    routed = rank_sum(c, stage, w.shape.stage_routed_params) if expert is not None else 0
    if routed:
        psi = stage_params - routed
        terms.item("P_e routed experts", "L_m·3h·h_e·E (the stage's; below apart: split over ep, never "
                   "over tp)", f"{rank_sum(c, stage, w.shape.stage_moe_layers)}·3·{w.shape.d_model}·"
                   f"{w.shape.moe_hidden}·{w.shape.moe_experts}", num(routed))
        terms.item("Ψ the rest", "Ψ − P_e", f"{num(stage_params)} − {num(routed)}", num(psi))
    if c.tp > 1 and routed:
        rest = replicated - routed
        psi = (stage_params - routed - rest) / c.tp + rest
        terms.item("Ψ_tp on a TP rank", "(Ψ − P_e − R)/tp + R, R = norm gains (2h per block + h) and the MoE "
                   "blocks' router and shared experts",
                   f"({num(stage_params - routed)} − {num(rest)})/{c.tp} + {num(rest)}", num(psi))
    elif c.tp > 1:
        psi = (stage_params - replicated) / c.tp + replicated
        terms.item("Ψ_tp on a TP rank", "(Ψ − R)/tp + R, R = norm gains (2h per block + h)",
                   f"({num(stage_params)} − {num(replicated)})/{c.tp} + {num(replicated)}", num(psi))
    recipe = engine_recipe(w, c)
    paper = recipe == "zero" or c.engine == "deepspeed"
    s = c.strategy_info
    sp, sg, so = (kind in s.sharded for kind in (strategies.PARAMS, strategies.GRADS, strategies.OPTIMIZER))
    if paper and s.zero_stage == 2:
        sp = False
    p, g, o = RECIPES[recipe]
    full, short = _state_formula(p, g, o, sp, sg, so)
    why = f" (the {c.engine} engine's)" if recipe != w.recipe else ""
    shards = ", ".join(k for k, f in (("params", sp), ("grads", sg), ("optimizer", so)) if f) or "nothing"
    cp_sharded = c.cp > 1 and s.sharded
    over = f" = {c.shard_size // c.cp} × cp {c.cp} (the cp ranks hold one model)" if cp_sharded else ""
    terms.note(f"model states, recipe {recipe}{why}: {RECIPE_WORDS[recipe]}; {c.strategy} shards {shards} "
               f"over N = {c.shard_size}{over}")
    if recipe == "torch":
        seeds = f"the seeds' {c.strategy}: {s.formula}"
    else:
        stage_name = ("DDP", "P_os", "P_os+g", "P_os+g+p")[s.zero_stage]
        whole = ", params whole at rest" if paper and s.zero_stage == 2 else ""
        seeds = f"the ZeRO paper's {stage_name}, K = {o}{whole}"
    terms.note(f"  {full} = {short}   ({seeds})")
    n, psi_sym = c.shard_size, "Ψ_tp" if c.tp > 1 else "Ψ"
    for name, b, sharded, value in (("params", p, sp, states.params), ("grads", g, sg, states.grads),
                                    ("optimizer", o, so, states.optimizer)):
        terms.item(name, f"{b}·{psi_sym}{'/N' if sharded else ''}",
                   f"{b} × {num(psi)}{f' / {n}' if sharded else ''}",
                   gb(value))
    if routed:
        ep, ne = c.ep, c.expert_shard_size
        edp = f"N_e = N/ep = {n}/{ep}" if s.sharded else "ddp: replicated over the edp = dp/ep ranks, N_e = 1"
        terms.note(f"routed experts: E/ep = {w.shape.moe_experts}/{ep} per rank (ep = {ep}), sharded over "
                   f"the ranks holding the same ones, {edp} = {ne}")
        for name, b, sharded, value in (("expert params", p, sp, expert.params),
                                        ("expert grads", g, sg, expert.grads),
                                        ("expert optimizer", o, so, expert.optimizer)):
            terms.item(name, f"{b}·P_e/ep{'/N_e' if sharded else ''}",
                       f"{b} × {num(routed)}/{ep}{f' / {ne}' if sharded else ''}", gb(value))
    if moved:
        terms.note(f"  DeepSpeed frees its gradient partitions after each step: grads {gb(moved)} counted "
                   f"as a buffer (held during the step), 0 at rest")
    if w.muon is not None:
        _muon_states(w, c, stage, states, expert, terms)
    if c.offload != "none":
        terms.note(f"  offload {c.offload}: {OFFLOADED[c.offload]}: {gb(offloaded)} per GPU leave the GPU")
    params, grads, optimizer = on_gpu
    terms.item("model states on GPU", "params + grads + optimizer",
               f"{gb(params)} + {gb(grads)} + {gb(optimizer)}", gb(params + grads + optimizer))


# Each role's linear (in, out) in symbols, as explanations write the adapters' r·(in + out)
_SYMBOLS = {"q": ("h", "h"), "k": ("h", "kv"), "v": ("h", "kv"), "o": ("h", "h"), "gate": ("h", "f"),
            "up": ("h", "f"), "down": ("f", "h")}


def _record_lora_states(terms: Terms, w, c, stage: int, stage_params: int, states: ModelStateBytes,
                        on_gpu: tuple[float, float, float], offloaded: float,
                        expert: ModelStateBytes | None) -> None:
    """LoRA's model states (lora_states): the model's parameters, its adapters and what else trains, a
    rank's share of each before sharding, and the strategy's bytes: b·Ψ_base + 16·Ψ_lora, sharded."""
    shape, spec = w.shape, w.lora
    _record_params(terms, shape, c, stage, stage_params)
    counted = lora.counted_shape(shape)
    r = spec.rank
    shaped = lora.linears(counted)
    per_block = " + ".join(f"({_SYMBOLS[x][0]} + {_SYMBOLS[x][1]})" for x in spec.targets) or "0"
    numbers = " + ".join(f"({shaped[x][0]} + {shaped[x][1]})" for x in spec.targets) or "0"
    adapters = lora.adapter_params(shape, spec)
    stand_in = "" if shape.known else f", counted on a {counted.name}"
    if shape.moe:
        dense, _ = lora.block_adapters(shape, spec, False)
        rest, routed = lora.block_adapters(shape, spec, True)
        terms.item("Ψ_lora adapters", f"L_d·A_dense + L_m·(A_attention+shared + A_experts), A_dense = "
                   f"r·({per_block}) (r = {r}: A [r, in], B [out, r] per adapted linear; the E routed "
                   f"experts' {', '.join(spec.expert_targets) or 'none'} each)",
                   f"{shape.n_layers - shape.moe_layers}·{num(dense)} + {shape.moe_layers}·({num(rest)} + "
                   f"{num(routed)})", num(adapters))
    else:
        terms.item("Ψ_lora adapters", f"L·r·({per_block}) (r = {r}: A [r, in], B [out, r] per adapted "
                   f"linear{stand_in})", f"{counted.n_layers}·{r}·({numbers})", num(adapters))
    trained = lora.trainable_params(shape, spec) - adapters
    if trained:
        what = [x for x, on in (("V·h embedding" + ("" if shape.tie_embeddings else " + V·h head"),
                                 spec.train_embeddings), ("2h·L + h norms", spec.train_norms)) if on]
        terms.item("Ψ trained beside", " + ".join(what) + " (lora.train_embeddings / train_norms)", None,
                   num(trained))
    rest, held = lora.stage_params(shape, spec, stage, c.pp, c.tp, c.ep)
    split = " (TP: A whole and B split for q k v gate up, the other way for o and down)" if c.tp > 1 else ""
    terms.item("Ψ_base on a rank", "the frozen parameters a rank holds, before sharding" +
               (", the routed experts apart" if held.total else ""), None, num(rest.frozen))
    terms.item("Ψ_lora on a rank", f"what trains on a rank, before sharding{split}", None,
               num(rest.trainable))
    b, s = spec.base_bytes, c.strategy_info
    sp, sg, so = (kind in s.sharded for kind in (strategies.PARAMS, strategies.GRADS, strategies.OPTIMIZER))
    over = lambda sharded: "/N" if sharded else ""  # noqa: E731
    shards = ", ".join(k for k, f in (("params", sp), ("grads", sg), ("optimizer", so)) if f) or "nothing"
    terms.note(f"model states, LoRA: the base frozen in {b} bytes per parameter (no gradient, no optimizer "
               f"state); what trains in fp32: params 4 + grads 4 + Adam m, v 8 = 16 bytes; {c.strategy} "
               f"shards {shards} over N = {c.shard_size}")
    whole = 4 * (not sp) + 4 * (not sg) + 8 * (not so)
    lora_sym = " + ".join(t for t in (f"{whole}Ψ_lora" if whole else "", f"{16 - whole}Ψ_lora/N"
                                      if whole < 16 else "") if t)
    terms.note(f"  {b}Ψ_base{over(sp)} + {lora_sym}   (base {b}Ψ{over(sp)}, adapters "
               f"16Ψ_lora{over(so)})")
    n = c.shard_size
    for name, formula, numbers, value in (
            ("params", f"{b}·Ψ_base{over(sp)} + 4·Ψ_lora{over(sp)}",
             f"({b} × {num(rest.frozen)} + 4 × {num(rest.trainable)}){f' / {n}' if sp else ''}",
             states.params),
            ("grads", f"4·Ψ_lora{over(sg)}", f"4 × {num(rest.trainable)}{f' / {n}' if sg else ''}",
             states.grads),
            ("optimizer", f"8·Ψ_lora{over(so)}", f"8 × {num(rest.trainable)}{f' / {n}' if so else ''}",
             states.optimizer)):
        terms.item(name, formula, numbers, gb(value))
    if expert is not None:
        ep, ne = c.ep, c.expert_shard_size
        terms.note(f"routed experts: E/ep = {shape.moe_experts}/{ep} per rank, their frozen weights and "
                   f"adapters sharded over the ranks holding the same ones, N_e = {ne}")
        by = lambda sharded: ("/N_e", f" / {ne}") if sharded else ("", "")  # noqa: E731
        for name, formula, numbers, sharded, value in (
                ("expert params", "b·P_e/ep + 4·A_e/ep",
                 f"{b} × {num(held.frozen)} + 4 × {num(held.trainable)}", sp, expert.params),
                ("expert grads", "4·A_e/ep", f"4 × {num(held.trainable)}", sg, expert.grads),
                ("expert optimizer", "8·A_e/ep", f"8 × {num(held.trainable)}", so, expert.optimizer)):
            sym, div = by(sharded)
            terms.item(name, f"({formula}){sym}" if sym else formula, f"({numbers}){div}" if div else numbers,
                       gb(value))
    if w.muon is not None:
        _muon_states(w, c, stage, states, expert, terms)
    if c.offload != "none":
        terms.note(f"  offload {c.offload}: {OFFLOADED[c.offload]}: {gb(offloaded)} per GPU leave the GPU")
    params, grads, optimizer = on_gpu
    terms.item("model states on GPU", "params + grads + optimizer",
               f"{gb(params)} + {gb(grads)} + {gb(optimizer)}", gb(params + grads + optimizer))


def ddp_accumulates_apart(w, c) -> bool:
    """Whether the step holds a second copy of the gradients: DDP's micro-steps under no_sync
    accumulate into gradients of their own, beside its buckets (the states' gradients), until the
    last micro-step's backward copies them in (measured: +4Ψ)."""
    return (w.recipe == "torch" and c.engine != "deepspeed"
            and not c.uses_fsdp and not no_ddp(w, c)
            and c.grad_accum > 1)


def no_ddp(w, c) -> bool:
    """ddp and zero1 with one replica (dp × cp = 1) run without DDP (loom/parallel/ddp.py): no
    buckets; the gradients exist from backward to the optimizer's zero_grad only."""
    return w.recipe == "torch" and c.engine != "deepspeed" and not c.uses_fsdp and c.dp * c.cp == 1


def _step_peak(w, c, stage: int, layers: int, stage_params: int, replicated: int, grads: float,
               optimizer: float, device: str, named: list | None = None,
               terms: Terms = NO_TERMS, routed: int = 0) -> tuple[float, float]:
    """(activations, buffers) of a stage at the step's peak: the largest, over the moments of the
    step below, of what the rank holds beyond its model states at rest (what `loom train` measures:
    the step's live-tensor peak minus the states). Activations: saved tensors and the loss's and
    logits' transients. Buffers: bytes in flight then (parameters gathered or autocast's copies,
    unsharded gradients, collective buffers, optimizer temporaries) less the gradients the step
    has not rebuilt yet: zero_grad(set_to_none) frees FSDP2's sharded gradients at the step's
    start and each unit's reappears when its reduce-scatter ends, so at backward's start none is
    held (for zero3 4Ψ/N below the states at rest, which can make buffers negative; DDP's
    buckets stay allocated).

    Moments, as named in `stage_memory(..., moments=)` (e = the compute dtype's bytes; FSDP2
    reduces in fp32, 4 bytes):
      forward's end       in the loss: every saved tensor, the logits and their fp32 copy, the
                          unit kept gathered, and the latest all-gather's flat buffer, which FSDP2
                          frees only after the root's forward
      loss                backward's start: the loss's gradients of the logits
                          (head_transient_bytes); "backward's start" on a stage without the loss
      head backward       the head's weight gradient (head_backward_bytes), the loss's tensors gone;
                          under GPipe the last micro-batch's too, every unit gathered since the first
                          backward (no forward in between reshards one)
      head reduce-scatter an untied head's own unit reduce-scatters at once, resharded first
      recompute           the topmost checkpointed block rebuilt, the blocks above it done; its
                          unit gathered again (zero3), the tied root still gathered with its gradient
      pipeline            a micro-batch's backward done, the others in flight: the schedule keeps
                          every unit gathered until the step's last backward
      reduce-scatter      the end of backward: the last unit's (_reduce_scatter), every other
                          sharded gradient rebuilt
      pipeline top block  a whole backward in its top block's SwiGLU (the last stage's after its final
                          norm's; a split schedule's first stage's W)
      gpipe second, ... GPipe's first backward holds every micro-batch and no accumulated gradient:
                          each of its moments has a twin in the second, one micro-batch fewer beside them
      pipeline reduce-scatter  a pipeline reduces a stage's gradients after its last backward, unit
                          by unit (_pipeline_reduce); it reduces none in backward (no head
                          reduce-scatter there)
      tied embedding      its backward adds its gradient to the head's (below)
      optimizer           on CPU, foreach AdamW (loom's choice there) makes sqrt(v), one more
                          v-sized tensor: half the optimizer states; GPUs step fused, in place
      at rest             between steps the states alone: the peak is never below them
    `device` "cpu": loom train on gloo ranks, whose reduce-scatter is an all-reduce of a copy of
    its input, and whose AdamW is foreach.

    An MoE model's stage (`routed`: its routed experts' parameters) mixes dense and MoE blocks: an MoE
    block keeps moe_ffn_saved_bytes in place of the dense SwiGLU's (under "op" likewise, an
    approximation), its FSDP2 unit gathers the routed experts a rank holds (P_e/ep per block, beside
    the rest whole over tp), and under torch.autocast the experts' 16-bit copies (w1, w3: stacked
    weights' views, which autocast does not cache) are kept by their matmuls until backward.

    Under LoRA (w.lora) a block also keeps its adapters' tensors (lora.saved_bytes); the units gather the
    frozen base with the adapters (lora.fsdp_units), but only what trains has a gradient: no head weight
    gradient, no embedding's unless lora.train_embeddings, each unit's reduce-scatter of its trainable
    part. A 16-bit base makes the whole model 16-bit under autocast too (its embedding output, hence the
    residual stream): priced as FSDP2's, autocast caching only the fp32 trainables' copies.
    """
    shape, tp, e = w.shape, c.tp, w.act_bytes
    last, pipelined = holds_last_stage(c, stage), c.pp > 1
    # every layout chunks (TP: each rank's vocabulary shard; PP: the last stage), but under plain_ops
    chunk = loss_chunk(w, c)
    plain = plain_ops(w, c)
    deepspeed = c.engine == "deepspeed"
    strategy = c.strategy_info
    fsdp = not deepspeed and c.uses_fsdp and w.recipe == "torch"
    # ddp and zero1 (without TP) reach 16-bit through torch.autocast; FSDP2 and DeepSpeed cast weights
    autocast = not deepspeed and not c.uses_fsdp and e < 4
    casts_trainables = autocast  # under LoRA: autocast's copies of what trains
    spec = w.lora
    trains_embeddings = spec is None or spec.train_embeddings  # else no embedding or head weight gradient
    if spec is not None:
        lora_rest, lora_routed = lora.stage_params(shape, spec, stage, c.pp, tp, c.ep)
        autocast = autocast and spec.base_bytes > e  # a 16-bit base needs no cast: every tensor 16-bit
    sp = c.sequence_parallel and tp > 1
    seq, mb = c.local_seq(w.seq_len), c.micro_batch  # context parallel: each rank's s/cp tokens
    local = lambda n: (n - shape.layer_norm_params) / tp + shape.layer_norm_params  # noqa: E731

    # Activations of one micro-batch, kept from its forward to its backward.
    sb, h = seq * mb, shape.d_model
    if terms:
        how = ("torch.autocast (fp32 residual stream and norms, each matmul casts its input)" if autocast
               else "16-bit weights (FSDP2 MixedPrecisionPolicy / DeepSpeed)" if e < 4 else "fp32")
        terms.note(f"activations of one micro-batch (Korthikanti et al. 2022's sbh(34 + 5as/h), adapted to "
                   f"RMSNorm, RoPE, SwiGLU, GQA and flash attention), {how}: s·b = {sb}"
                   + (f" (s = {w.seq_len}/{c.cp}: a rank's share of each sequence under cp = {c.cp})"
                      if c.cp > 1 else ""))
    ring = c.cp > 1 and c.cp_mode == "ring"  # its pieces keep k and v grouped on every device
    kv_width = shape.kv_dim if ring else attention_kv_width(shape, e, device, w.documents)
    # a document mask's bias: the whole sequence's, T² a sequence (all-to-all gathers it: cp·T per local
    # token); not the ring's pieces (context_parallel.py builds theirs as they run)
    keys = 0 if ring or not w.documents else w.seq_len * c.cp
    per_layer = activation_bytes_per_layer(shape, seq, mb, e, tp, sp, autocast, terms, kv_width, keys)
    if c.cp > 1:  # the split attention's output comes back head-major: wo keeps a sequence-major copy
        copy = sb * shape.d_model / tp * e  # (measured on gloo, cp2 small at 4,096 tokens: 1.12 of the plan)
        if terms:
            terms.item("cp: wo's input", "s·b·h/tp·e (the attention's output, head-major, copied for wo)",
                       f"{sb}·{shape.d_model}/{tp}·{e}", gb(copy))
            terms.item("per block under cp", "block + wo's input", f"{gb(per_layer)} + {gb(copy)}",
                       gb(per_layer + copy))
        per_layer += copy
    plain_norms, plain_ffn = plain_ops_bytes_per_layer(shape, seq, mb, e, tp, sp) if plain \
        else (0.0, 0.0)
    if plain:
        if terms:
            terms.note(f"plain ops: under {c.schedule}, this torch's weight pass takes no autograd Function "
                       "(loom/parallel/pipeline.py weight_pass_takes_functions): each norm keeps its fp32 "
                       "input and normalized tensor, the SwiGLU silu(gate) and the product; the full logits")
            terms.item("plain ops per block", "2·4·s·b·h" + ("/tp" if sp else "") + " (norms)"
                       + (" + 2·s·b·f·e (SwiGLU)" if plain_ffn else ""),
                       None, gb(plain_norms + plain_ffn))
        per_layer += plain_norms + plain_ffn
    residual = residual_bytes(shape, seq, mb, e, autocast)
    ckpt = checkpointed_layers(layers, c.activation_checkpointing, c.ac_every)
    start = shape.stage_layers(stage, c.pp)[0] if shape.moe else 0
    moe = shape.moe_layers_in(start, layers)  # MoE blocks of the stage
    imbalance = experts.imbalance(w, c)
    if moe:
        moe_ffn = moe_ffn_saved_bytes(shape, seq, mb, e, imbalance, terms,
                                      grouped_experts(shape, w.precision, device, c.ep,
                                                      spec.rank if spec and spec.expert_targets else 0),
                                      plain)
        dense_ffn = dense_mlp_saved_bytes(shape, seq, mb, e, tp)
        per_moe = per_layer - dense_ffn - plain_ffn + moe_ffn
        if terms:
            terms.item("per MoE block", "block − dense SwiGLU + MoE feed-forward",
                       f"{gb(per_layer)} − {gb(dense_ffn)} + {gb(moe_ffn)}", gb(per_moe))
    if spec is not None:  # the adapters' own tensors, less the norm outputs no adapter reads
        extra = lora.saved_bytes(shape, spec, sb, e, tp)
        if terms:
            terms.item("LoRA per block", "adapted linears × s·b·r·e (A·x)" + (" + s·b·in·(e + 1) (dropout's "
                       "input and mask)" if spec.dropout else "") + (" + s·b·f·e (down's input, the product)"
                       if "down" in spec.targets and tp == 1 else "") + " − the norm outputs no adapter "
                       "reads (lora.saved_bytes)", None, gb(extra))
            terms.item("block with LoRA", "block + LoRA per block", f"{gb(per_layer)} + {gb(extra)}",
                       gb(per_layer + extra))
        per_layer += extra
        if moe:
            moe_extra = lora.saved_bytes(shape, spec, sb, e, tp, True, imbalance)
            if terms:
                terms.item("MoE block with LoRA", "MoE block + its adapters' (experts: imbalance·k rows)",
                           f"{gb(per_moe)} + {gb(moe_extra)}", gb(per_moe + moe_extra))
            per_moe += moe_extra
    op = c.activation_checkpointing == "op"  # a checkpointed block also keeps its matmuls' outputs
    per_ckpt = residual / (tp if sp else 1)
    (over, by), ne = ("/tp", f"/{tp}") if sp else ("", ""), 4 if autocast else e
    if ckpt and terms:
        rule = ("all L_s blocks" if c.activation_checkpointing != "selective"
                else f"⌈L_s/{c.ac_every}⌉ = ⌈{layers}/{c.ac_every}⌉")
        terms.item("checkpointed blocks c", rule, None, str(ckpt))
        terms.item("kept input", f"s·b·h·{'4' if autocast else 'e'}{over}", f"{sb}·{h}·{ne}{by}",
                   gb(per_ckpt))
    if op and ckpt:
        per_ckpt = op_saved_bytes_per_layer(shape, seq, mb, e, tp, sp, autocast, terms)
    if moe:
        mode = c.activation_checkpointing
        ckpt_moe = experts.checkpointed_moe_layers(shape, start, layers, mode, c.ac_every)
        # "op" keeps an MoE block's matmul outputs in place of the dense ones: taken as what it keeps
        # unchecked (an approximation)
        per_ckpt_moe = per_ckpt - dense_ffn * 2 / mlp_saved_widths(tp) + moe_ffn if op else per_ckpt
        dense, ckpt_dense = layers - moe, ckpt - ckpt_moe
        blocks = (dense - ckpt_dense) * per_layer + ckpt_dense * per_ckpt + (moe - ckpt_moe) * per_moe \
            + ckpt_moe * per_ckpt_moe
        if terms:
            terms.item("blocks", "(L_d − c_d)·block + c_d·kept + (L_m − c_m)·MoE block + c_m·kept "
                       "(L_m MoE blocks, c_m of them checkpointed)",
                       f"({dense} − {ckpt_dense})·{gb(per_layer)} + {ckpt_dense}·{gb(per_ckpt)} + "
                       f"({moe} − {ckpt_moe})·{gb(per_moe)} + {ckpt_moe}·{gb(per_ckpt_moe)}", gb(blocks))
    else:
        blocks = (layers - ckpt) * per_layer + ckpt * per_ckpt
    if terms and ckpt and not moe:
        terms.item("blocks", "(L_s − c)·block + c·kept input",
                   f"({layers} − {ckpt})·{gb(per_layer)} + {ckpt}·{gb(per_ckpt)}", gb(blocks))
    elif terms and not moe:
        terms.item("blocks", "L_s·block", f"{layers}·{gb(per_layer)}", gb(blocks))
    # the chunked loss's gradients made in its forward (not under GPipe or a split backward: step.py)
    in_forward = bool(chunk) and not head_recomputed(w, c)
    head = head_saved_bytes(shape, seq, mb, e, tp, pipelined, sp, autocast, chunk, terms,
                            grad_in_forward=in_forward) if last else 0.0
    head += plain_norms / 2 if last else 0.0  # the final norm's plain ops: as a block's one norm
    if pipelined and terms:
        terms.item("stage output", f"s·b·h·{'4' if autocast else 'e'} (kept for its backward; each stage "
                   "but the last)", f"{sb}·{h}·{ne}", gb(residual))
    # zb, zbv, dualpipev: each deferred W keeps its linears' output gradients beside its saved tensors
    per_w = deferred_weight_bytes_per_layer(shape, seq, mb, e, tp) if c.split_backward else 0.0
    # ... and each norm's output gradient, which W takes to its weight's gradient (lean_ops' Function, whose
    # backward W runs again, or plain ops' product with the weight) (measured on gloo, zb pp 2: the last
    # stage 1.07 of the plan without them)
    per_w += 2 * sb * h * e / (tp if sp else 1) if c.split_backward else 0.0
    boundary = residual / (tp if sp else 1)  # what crosses between stages: sequence parallel's split
    # FSDP2 in 16-bit under zb and zbv: a stage's W writes its unsharded gradients in the compute dtype, and
    # only its next B's post-backward adds them to the fp32 ones (torch's first stage runs its whole
    # backward in W, adding them at once; the last stage's W runs the chunked loss's backward again,
    # which adds all but the head's; zb's last stage peaks in a W, its earlier ones added by the B's
    # between: the head's, as it writes first; DualPipeV's steady phase runs whole backwards). Measured
    # on gloo, pp 2 in bf16: the stages' 1.06-1.10 of the plan without them. (With a unit per block the
    # stage in its B has added its upper units' by its bottom norm: 0.95 of the plan there, an upper bound.)
    held_grads = {}
    if fsdp and e < 4 and spec is None and c.schedule in ("zb", "zbv"):
        stages, total = rank_stages_of(c, stage)
        for s in stages:
            if s == total - 1 and (chunk or c.schedule == "zb"):
                held_grads[s] = e * shape.vocab_size * h / tp
            elif s > 0:
                routed_s = shape.stage_routed_params(s, total)
                held_grads[s] = e * ((shape.stage_params(s, total) - routed_s) / tp + routed_s / c.ep)
    peak = _held_micro_batches(c, stage, shape, layers, blocks, head, residual, boundary, per_w,
                               held_grads, terms)
    saved, one_micro = peak.saved, peak.one_micro
    transient = head_transient_bytes(shape, seq, mb, tp, chunk, e, terms) if last else 0.0
    # the fp32 log-softmax, or chunked each token's fp32 logsumexp (none: the gradients from forward)
    loss_saved = 4 * seq * mb * (1 if chunk else shape.vocab_size / tp) if last and not in_forward else 0.0

    # Buffers held through backward.
    held = 0.0
    if deepspeed:
        held += DEEPSPEED_BUCKETS
    accumulated = 0.0  # the unsharded gradients accumulated over micro-steps
    if fsdp and c.grad_accum > 1 and (pipelined or not w.reduce_every_micro_step):
        # Micro-steps without gradient sync accumulate the unsharded gradients (FSDP2 no_sync, under
        # parallel.reduce_every_micro_step = false; pipelining does the same between micro-batches):
        # the stage's whole gradient.
        rest = replicated - routed if replicated else 0  # the routed experts: P_e/ep whole on a rank
        if spec is not None:  # only what trains has a gradient
            accumulated = 4 * (lora_rest.trainable + lora_routed.trainable)
        else:
            accumulated = GRAD_COMM_BYTES[w.recipe] * (stage_params - routed - rest) / tp + rest * 4 \
                + 4 * routed / c.ep
        held += accumulated
    # what GPipe's first backward, after every forward, has not made yet: the gradients it accumulates (and
    # one replica's, None from zero_grad to its backward)
    unmade = accumulated + (grads if ddp_accumulates_apart(w, c) or (pipelined and no_ddp(w, c)) else 0.0)
    if ddp_accumulates_apart(w, c):
        held += grads
    block_local = local(shape.layer_params)  # a block's parameters on a rank, gathered
    moe_local = _moe_block_local(shape, tp, c.ep) if moe else 0.0
    if spec is not None:  # with their adapters
        block_local = lora.block_params(shape, spec, False, tp, c.ep)[0].total
        moe_local = sum(lora.block_params(shape, spec, True, tp, c.ep), lora.Params()).total if moe else 0.0
    if c.offload != "none":
        held += 2 * e * max(block_local, moe_local)  # parameters staged in from the host
    if autocast:
        # autocast caches each weight's 16-bit copy until the context exits, after backward: every
        # matmul weight but w2 (swiglu_down casts its own), the tied embedding through the head (an
        # untied one is only looked up).
        cast = layers * shape.autocast_cached_params
        if moe:  # an MoE block's: attention's, the router's, the shared SwiGLU's w1, w3 and gate
            d = shape.d_model
            moe_cast = 2 * d * d + 2 * d * shape.kv_dim + d * shape.moe_experts \
                + 2 * d * shape.moe_shared_hidden + (d if shape.moe_shared_gate else 0)
            cast = (layers - moe) * shape.autocast_cached_params + moe * moe_cast
            # and the routed experts' w1, w3 (views of the stacked weights, cast at each use, not
            # cached) kept by their matmuls for backward, in each micro-batch in flight
            held += e * moe * 2 * d * shape.moe_hidden * shape.moe_experts / c.ep * peak.in_flight
        cast += shape.vocab_size * shape.d_model if last else 0
        held += e * cast
    if casts_trainables and spec is not None:  # autocast caches the fp32 trainables' 16-bit copies
        held += e * (lora_rest.trainable + lora_routed.trainable)
    if fsdp and spec is not None:  # the base and adapters gathered; only what trains reduce-scattered
        lora_units = lora.fsdp_units(shape, spec, layers, stage == 0, last, start, c.fsdp_unit_mb, tp, c.ep)
        units, grad_units = [u.total for u in lora_units], [u.trainable for u in lora_units]
    elif fsdp and moe:
        units = _moe_units(shape, c, start, layers, stage == 0, last)
    else:
        units = _tp_local_units(shape, shape.moe and c.ep > 1, c.fsdp_unit_mb, layers, stage == 0, last,
                                tp) if fsdp else ()
    if spec is None:
        grad_units = units  # every parameter has a gradient
    kept = 0.0
    # A schedule that defers weight gradients keeps every unit gathered to the step's end, zero3's too
    # (loom/parallel/fsdp.py: reshard_after_forward).
    reshards = strategy.reshard_after_forward and not c.split_backward
    if fsdp:
        # The unit gathered at backward's start: zero3 keeps the last one gathered since forward (the
        # head's, or the root's with the tied embedding); zero2 (and ddp/zero1 under TP, FSDP2
        # over a (dp, 1) mesh) keep every unit gathered from forward to backward.
        kept = e * (units[-1] if reshards else sum(units))
        if c.grad_accum == 1 or pipelined or not w.reduce_every_micro_step:
            held -= grads  # the sharded gradients, not yet rebuilt (a later micro-step holds them)
    elif no_ddp(w, c) and c.grad_accum == 1 and not pipelined:
        held -= grads  # one replica runs no DDP: its gradients are None until backward makes them

    if deepspeed:  # DeepSpeed's engine: its buckets, activations and the larger transient
        rebuilt = (max(per_layer, per_moe) if moe else per_layer) if ckpt else 0.0
        activations = saved + max(rebuilt, transient)
        if terms:
            terms.item("activations", "saved + max(recomputed block, loss gradients) (DeepSpeed's engine)",
                       f"{gb(saved)} + max({gb(rebuilt)}, {gb(transient)})", gb(activations))
        return activations, held
    if terms:  # the activations of the moment that holds exactly them, below
        name, what = ("loss", "saved + loss gradients") if last else ("backward's start", "saved")
        terms.note(f"  {what} = {gb(saved + transient)}: the activations of the moment {name!r} below")

    vh = shape.vocab_size * shape.d_model / tp  # the head's (or the embedding's) weight, local
    vh_grad = vh if trains_embeddings else 0.0  # its gradient
    tied_root = fsdp and shape.tie_embeddings  # the root unit holds the embedding = the head
    own_head = fsdp and last and not shape.tie_embeddings and len(units) > 1  # head + norm: one unit
    others = saved - one_micro  # other micro-batches in flight (pipeline)
    # what a pipeline holds besides from its steady phase on: the unsharded gradients (held), the split
    # schedules' input gradients, the sends torch holds, zb's and zbv's 16-bit gradients
    pending = held + peak.input_grads + peak.sent + peak.held_grads
    moments = [] if named is None else named  # (name, activations, buffers)

    def ffn_width(moe_block: bool) -> float:
        """A block's SwiGLU width per token on this rank (an MoE block: the busiest rank's experts)."""
        return imbalance * shape.moe_top_k * shape.moe_hidden if moe_block else shape.ffn_hidden / tp

    # an RMSNorm's backward (lean_ops._RMSNorm, or its plain ops alike): its input's gradient in the compute
    # dtype and four fp32 [s·b, h] temporaries (normalized input, gradient, weighted gradient, correction)
    norm_backward = sb * h / (tp if sp else 1) * (16 + e)
    top_block = 0.0  # a stage's whole backward in its top block, beyond its saved tensors
    # (under a split schedule torch's first stage runs no B: its W runs the whole backward)
    whole = not c.split_backward or stage == 0
    if pipelined and whole and not ckpt and not (moe and shape.is_moe(start + layers - 1)):
        # A stage's whole backward reaches its top block's SwiGLU (swiglu_down): two f-wide gradients
        # beside w2's; then, FSDP2 in 16-bit keeping the block's weight gradients in the compute dtype
        # to its unit's post-backward, its ffn norm's (as the final norm's), gate and up released.
        # Measured on gloo, 1F1B pp 2, small at 4 layers: 1.12 (fp32) and 1.16 (bf16) without it, and
        # on the last stage, after its final norm's backward, 1.06 (fp32); zb's first stage in its W 1.04.
        wide, weights = sb * shape.ffn_hidden / tp, h * shape.ffn_hidden / tp
        swiglu = e * (2 * wide + weights) if fsdp else 2 * wide * e + 4 * weights
        norm = 3 * e * weights + norm_backward - 2 * wide * e if fsdp and e < 4 else 0.0
        top_block = max(swiglu, norm)  # (its moment below, beside what the pipeline holds then)
    if last:
        # Forward's end, in the loss: the logits (and their fp32 copy under 16-bit) beside the
        # log-softmax; FSDP2 frees the latest all-gather's flat buffer only after the root's forward
        # (the last block's unit, or the head's; with one unit, a second copy of the model).
        logits = seq * mb * shape.vocab_size / tp * (e + (4 if e < 4 else 0))
        if chunk:  # one chunk's
            logits = chunk_logits_bytes(shape, seq, mb, e, chunk, tp)
        latest = 0.0
        if fsdp and c.shard_size > 1:
            latest = e * (units[-2] if tied_root and len(units) > 1 else units[-1])
        sends = peak.sent  # (the sends torch holds then: 1F1B's last input gradient, the runtime's all)
        moments.append(("forward's end", saved + logits, kept + latest + held + sends))
        moments.append(("loss", saved + transient, kept + held + sends))
        logits_grad, weight_grad = head_backward_bytes(shape, seq, mb, e, tp, autocast, chunk)
        weight_grad = weight_grad if trains_embeddings else 0.0
        moments.append(("head backward", saved - loss_saved + logits_grad, kept + weight_grad + held + sends))
        if fsdp and pipelined and reshards and c.schedule == "gpipe" and c.grad_accum > 1:
            # GPipe runs every forward first, so after the first micro-batch's backward no forward
            # reshards a unit again: the last micro-batch's head backward has every unit gathered, beside
            # the gradients accumulated so far (measured on gloo: 1.15 of the plan without this moment)
            moments.append(("gpipe head backward", one_micro - loss_saved + logits_grad,
                            e * sum(units) + weight_grad + held))
        # then the final norm's backward, the head's weight gradient still held
        moments.append(("final norm backward", saved - loss_saved + norm_backward,
                        kept + weight_grad + held + sends))
        if top_block and not c.split_backward:  # then the top block's, its gradient from the final norm
            # arriving, the stage's output held by the schedule to the backward's end
            arriving = sb * h / (tp if sp else 1) * e
            moments.append(("pipeline top block backward", saved - head + arriving + residual + top_block,
                            (kept if reshards else e * sum(units)) + weight_grad + pending))
        if own_head and not pipelined:  # its gradient reduce-scattered at once, the unit resharded first
            # (zero2: the others stay gathered); the head's weight is the unit's last parameter, its gradient
            # held through it, and the head's sharded gradient, written there, is among those `held` lacks
            # (a pipeline reduces after its last backward: "pipeline reduce-scatter")
            gloo = device == "cpu" and c.shard_size > 1
            others_gathered = kept - e * units[-1] if not reshards else 0.0
            held_head = e * vh_grad if c.shard_size > 1 else 0.0
            # (a later micro-step's output is added to the shard the earlier ones left: beside it till then)
            rebuilt_head = 4 * grad_units[-1] / c.shard_size
            moments.append(("head reduce-scatter", saved - head,
                            _reduce_scatter(grad_units[-1], e, gloo, held_head, rebuilt_head)
                            + others_gathered + held))
        if fsdp and reshards and len(units) > 2 and c.shard_size > 1:
            # The topmost block's unit gathered again for its backward, the loss and head done: the
            # all-gather's output and the unsharded copy of it, and the next unit's prefetched
            # output (gloo: one more, its copy of the output; measured 4 units on CPU).
            copies = 4 if device == "cpu" else 3
            root = e * units[-1] if tied_root else 0.0
            moments.append(("block backward", saved - head, root + copies * e * units[-2] + held))
    else:
        head = 0.0
        moments.append(("backward's start", saved, kept + held))
    if ckpt:
        # The topmost checkpointed block is rebuilt first, once the head and the blocks above it
        # (not checkpointed under selective) have run backward: its unit is gathered again, the
        # tied root stays gathered with the head weight's gradient.
        selective = c.activation_checkpointing == "selective"
        top = (layers - 1) // c.ac_every * c.ac_every if selective else layers - 1
        if moe:  # the blocks above the top one, and the top one, each of its kind
            kinds = [shape.is_moe(start + j) for j in range(top, layers)]
            above = sum(per_moe if k else per_layer for k in kinds[1:])
            rebuilt = one_micro - head - above + (per_moe if kinds[0] else per_layer)
            if op:
                shared = op_shared_bytes_per_layer(shape, seq, mb, e, tp)
                rebuilt -= shared - dense_ffn * 2 / mlp_saved_widths(tp) + moe_ffn if kinds[0] else shared
            # the MoE's backward begins with its experts' gate and up gradients (the busiest rank's)
            rebuilt += 2 * seq * mb * ffn_width(kinds[0]) * e
            top_local = moe_local if kinds[0] else block_local
        else:
            rebuilt = one_micro - head - (layers - 1 - top) * per_layer + per_layer
            if op:  # the rebuilt block's kept outputs are among its activations: counted once
                rebuilt -= op_shared_bytes_per_layer(shape, seq, mb, e, tp)
            # its backward then begins with the SwiGLU's two hidden-sized gradients (gate and up) beside
            # the rebuilt activations (measured on the small preset: the 1.23 of the plan without them)
            rebuilt += 2 * seq * mb * ffn_width(False) * e
            top_local = block_local
        gathered = e * (units[-1] + vh_grad) if tied_root else 0.0
        gathered += e * top_local if len(units) > 1 else 0.0
        if not reshards:
            gathered = kept
        moments.append(("recompute", others + rebuilt, gathered + held))
    if pipelined:
        # The steady phase, as many micro-batches held as at the peak: FSDP2 keeps every unit gathered
        # from the first backward to the step's last, and each unit's unsharded gradient (held); the
        # split schedules' input gradients and the sends torch's runtime holds, to the step's end.
        gathered = e * sum(units) if fsdp else 0.0
        if top_block and (not last or c.split_backward):  # (GPipe's first backward's: resharded units)
            moments.append(("pipeline top block backward", saved + top_block,
                            (kept if reshards else gathered) + pending))
        # A backward's end, in its bottom block's SwiGLU backward: that block's activations, the gradient
        # arriving at it, its product's and the gate's and up's gradients, beside the other micro-batches,
        # every unit gathered again (measured on gloo, 1F1B: 1.02 of this at pp 2 and 4)
        bottom_moe = moe and shape.is_moe(start)
        bottom = (per_moe if bottom_moe else per_layer) + sb * e * (h + 3 * ffn_width(bottom_moe))
        if c.schedule == "gpipe":
            # GPipe's first backward (below) by its bottom block: every unit gathered and every gradient
            # made but that block's (and the embedding's), beside the other m - 1; the second's: every
            # gradient beside m - 2, and FSDP2 in 16-bit its unit's in the compute dtype, not added yet
            embedding = shape.vocab_size * h if stage == 0 else 0
            head_params = shape.vocab_size * h + h if last else 0
            below = (stage_params - embedding - head_params) / layers + embedding
            moments.append(("pipeline backward's end", others + bottom,
                            gathered + pending - unmade * below / stage_params))
            if c.grad_accum > 1:
                sixteen = e * units[0] if fsdp and e < 4 else 0.0
                moments.append((SECOND + "pipeline backward's end", others - one_micro + bottom,
                                gathered + pending + sixteen))
        elif reshards:
            # 1F1B runs a forward between two backwards of a stage, and under zero3 that forward
            # reshards each unit again: a backward begins with its units sharded and gathers them as it
            # consumes its micro-batch (measured on gloo, pp 2 with a unit per block: 0.84 of the plan
            # that held both at once) and ends as above; its start is "backward's start" (or the loss)
            # unless torch holds sends or input gradients as well.
            if peak.input_grads + peak.sent > 0:
                moments.append(("pipeline steady", saved, kept + pending))
            moments.append(("pipeline backward's end", others + bottom, gathered + pending))
        else:
            moments.append(("pipeline steady", saved, gathered + pending))
        if c.split_backward:
            # torch's input pass (B) retains the graph: it frees none of the micro-batch's saved tensors as
            # it goes, and ends in the stage's bottom attention norm, whose backward holds its input's
            # gradient and four fp32 [s·b, h] temporaries beside them, as the final norm's (lean or plain
            # alike; measured on gloo, zbv pp 2 in bf16: 1.05-1.10 of the plan without this moment)
            moments.append(("pipeline input backward", saved + norm_backward, gathered + pending))
        if fsdp and stage == 0 and trains_embeddings:
            # the embedding's backward, the stage's last: its new gradient, as large as its weight, beside
            # the one accumulated over the earlier micro-batches (measured on gloo, zero3 pp 2 on one rank
            # with an 8,192-row vocabulary: 1.37 of the plan without it)
            moments.append(("pipeline embedding grad", others, gathered + pending + e * vh_grad))
    if fsdp and pipelined:
        last_params = _units_last_params(shape, grad_units, tp, stage == 0, last, tied_root, own_head,
                                         vh_grad)
        moments.append(("pipeline reduce-scatter", 0.0,
                        _pipeline_reduce(units, grad_units, last_params, e, c.shard_size, device, tied_root,
                                         held - accumulated, accumulated, grads)))
    elif fsdp and stage == 0:
        # The end of backward: the unit reduced last is the root when it holds the tied embedding
        # (complete only after the embedding's backward), else the first unit; every other sharded
        # gradient is rebuilt. An untied embedding's gradient, its unit's last, is held through the
        # reduce-scatter (_reduce_scatter).
        last_reduced = grad_units[-1] if tied_root else grad_units[0]
        gloo = device == "cpu" and c.shard_size > 1  # one rank per shard: a copy, no collective
        held_grad = 0.0 if tied_root else e * vh_grad
        moments.append(("reduce-scatter", 0.0, _reduce_scatter(last_reduced, e, gloo, held_grad)))
        if tp > 1 and trains_embeddings and not tied_root:
            # Under TP DTensor's backward makes the embedding's weight gradient whole over the vocabulary
            # (Replicate), which FSDP2 slices to its shard (a copy) as it takes it, at the end of backward:
            # beside its unit, still gathered, and the first block's reduce-scatter input (kept until the
            # next); its own sharded gradient not rebuilt yet (measured on gloo: 1.26 of the plan)
            previous = 4 * grad_units[1] if len(grad_units) > 1 else 0.0
            moments.append(("embedding gradient", 0.0, e * vh_grad * (tp + 1) + e * units[0] + previous
                            - 4 * grad_units[0] / c.shard_size))
    if shape.tie_embeddings and stage == 0 and not deepspeed and trains_embeddings:
        # The embedding's backward adds its gradient to the head's: both and their sum (autograd
        # accumulates out of place) in the parameter's dtype (FSDP2: the gathered 16-bit one; DDP:
        # fp32, the bucket taking it only once both uses are done). FSDP2 also holds the root
        # gathered with its other unsharded gradients (with one unit: the whole model's), and
        # the previous unit's reduce-scatter input (kept until the next); the root's own sharded
        # gradient is not rebuilt yet. Under TP the embedding's gradient comes whole over the
        # vocabulary (DTensor's Replicate) and is sliced to the head's shard (a copy) to be added
        # (measured on gloo: 1.35 of the plan without them).
        if fsdp:
            root = units[-1]
            previous = 4 * units[0] if len(units) > 1 else 0.0
            extra = e * root + e * (root - vh) + previous - 4 * root / c.shard_size
            whole = e * vh * (tp + 1) if tp > 1 else e * vh  # the embedding's gradient (and its slice)
            moments.append(("tied embedding", 0.0, 2 * e * vh + whole + extra + held + grads))
        else:
            moments.append(("tied embedding", 0.0, 3 * 4 * vh + held))
    if c.cp > 1 and c.cp_mode == "ring":
        # Ring attention's blocks in flight and its fp32 accumulators, beside the saved tensors: the
        # last block's forward (all but the head saved), the topmost block's backward (a rebuilt
        # one's, under checkpointing).
        forward, backward = context.ring_transients(shape, seq, mb, e, tp)
        body = others + one_micro - head
        moments.append(("ring forward", body + forward, kept + held))
        rebuilt = [m for m in moments if m[0] == "recompute"]
        top = max([body] + [m[1] for m in rebuilt])
        moments.append(("ring backward", top + backward, kept + held))
        if terms:
            b_kv = f"{sb}·{shape.kv_dim}/{tp}·{e}"
            terms.item("ring forward", "2·2·B_kv + b·s·(h + a)/tp·4 (k/v blocks in flight, fp32 out + lse)",
                       f"4·{b_kv} + {sb}·({h} + {shape.n_heads})/{tp}·4", gb(forward))
            terms.item("ring backward",
                       "2·2·B_kv + 6·b·s·kv/tp·4 + b·s·h/tp·(4 + 1.5e) + B_kv (k/v in flight, fp32 dk/dv "
                       "out, held and in, fp32 dq, the output gradient, one piece's gradients)",
                       f"4·{b_kv} + 6·{sb}·{shape.kv_dim}/{tp}·4 + {sb}·{h}/{tp}·(4 + 1.5·{e}) + {b_kv}",
                       gb(backward))
    elif c.cp > 1 and terms:
        terms.note("  alltoall: each all_to_all's output replaces its input (q, k, v and the output "
                   "re-laid out between sequence and heads): no transient beyond a block's tensors modelled")
    if device == "cpu":
        moments.append(("optimizer", 0.0, optimizer / 2))
    moments.append(("at rest", 0.0, 0.0))  # between steps: the states alone (gradients included)
    if pipelined and c.schedule == "gpipe":
        # GPipe's backwards follow every forward: the first holds all m micro-batches but none of the
        # gradients the backwards accumulate; the second one micro-batch fewer and all of them, the larger
        # where the gradients outweigh a micro-batch (16-bit) (measured on gloo, pp 2 with one replica,
        # zero3 and ddp: 0.83-0.92 of the plan that held both at once, 1.05-1.08 in bf16 without the second)
        first = [(name, a, b) for name, a, b in moments if name in _GPIPE_FIRST_BACKWARD]
        moments[:] = [(name, a, b - unmade if name in _GPIPE_FIRST_BACKWARD else b) for name, a, b in moments]
        if c.grad_accum > 1:
            moments.extend((SECOND + name, a - one_micro, b) for name, a, b in first
                           if name != "forward's end")
    # A pipeline's receive buffers are made at the first step and kept: in every moment
    moments[:] = [(name, a, b + peak.receive) for name, a, b in moments]
    _, activations, buffers = max(moments, key=lambda m: m[1] + m[2])
    return activations, buffers


# The schedules torch runs through its _PipelineScheduleRuntime, one stage a rank or several: their sends
# are waited on at the step's end (measured on gloo, zb pp 2: its first stage 1.07 of the plan without its
# outputs)
RUNTIME_SCHEDULES = frozenset({"interleaved", "zb", "zbv", "dualpipev"})

# The moments of a stage's first backward (its forward's end too): under GPipe, with every micro-batch held;
# each has a twin in the second backward (SECOND + its name)
SECOND = "gpipe second, "
_GPIPE_FIRST_BACKWARD = frozenset({"forward's end", "loss", "head backward", "final norm backward",
                                   "block backward", "recompute", "backward's start",
                                   "pipeline top block backward"})


@dataclass(frozen=True)
class HeldMicroBatches:
    """What a pipeline rank keeps of its micro-batches at its peak (_held_micro_batches)."""
    saved: float  # the live micro-batches' saved tensors, and the deferred W's output gradients
    one_micro: float  # one micro-batch of the stage whose backward comes next (the last's, if held)
    in_flight: float  # micro-batches of all the rank's blocks that those live ones add up to
    receive: float  # the receive buffers: a micro-batch's input and output gradient, per stage
    input_grads: float  # split schedules: each micro-batch's input gradient, left on its receive buffer
    sent: float  # the sends torch's runtime holds (RUNTIME_SCHEDULES), each tensor held to the step's end
    held_grads: float = 0.0  # zb, zbv: the stages' 16-bit gradients from their W to their next B (steady)


@functools.lru_cache(maxsize=4096)
def _tp_local_units(shape, experts_apart: bool, unit_mb: float, layers: int, first: bool, last: bool,
                    tp: int) -> tuple[float, ...]:
    """A stage's FSDP2 units (Candidate.fsdp_unit_params) as one TP rank holds them: each split over tp
    but its norms' gains, which every TP rank holds whole. Remembered: the search asks again for every
    micro-batch and checkpointing mode."""
    parts = stage_fsdp_unit_parts(shape, experts_apart, unit_mb, layers, first, last, 0)
    return tuple((n - norms) / tp + norms for n, norms in parts)


def _held_micro_batches(c, rank: int, shape, layers: int, blocks: float, head: float,
                        residual: float, boundary: float, per_w: float, held_grads: dict | None = None,
                        terms: Terms = NO_TERMS) -> HeldMicroBatches:
    """Pipeline rank `rank`, whose stages hold `layers` blocks keeping `blocks` of one micro-batch (split
    by their layers), the last stage also `head`, every other its output (`residual`), at the largest
    of the moments loom/plan/in_flight.py gives; per_w: what a deferred W keeps of one block beside its
    saved tensors; `boundary`: one micro-batch's tensor between stages, as received and sent;
    `held_grads`: a zb or zbv stage's gradients in the compute dtype, held from its W to its next B, so in
    its steady phase (the first moment, once a W has run) and not in its cool-down (B after B). Without a
    pipeline: one micro-batch, nothing received."""
    if c.pp == 1:
        if terms:
            terms.item("micro-batches in flight", "1 (no pipeline)", None, "1")
            terms.item("saved", "in flight × (blocks + head)", f"1 × {gb(blocks + head)}", gb(blocks + head))
        return HeldMicroBatches(blocks + head, blocks + head, 1.0, 0.0, 0.0, 0.0)
    stages, total = rank_stages_of(c, rank)
    m = c.grad_accum
    stage_layers = {s: shape.stage_blocks(s, total) for s in stages}
    # a stage's output, kept for its backward; under the schedules torch's runtime runs one sent to another
    # rank is among the sends held below
    sends_held = c.schedule in RUNTIME_SCHEDULES
    output = {s: head if s == total - 1 else 0.0 if sends_held and s + 1 not in stages else residual
              for s in stages}
    # a stage's first block keeps its input for backward, and after the first stage that is the receive
    # buffer (or, a V's turn on one rank, the stage's output before it): counted there, not again here
    # (measured on gloo, GPipe pp 2: the last stage's micro-batch one s·b·h·e below the plan's)
    micro = {s: blocks * stage_layers[s] / layers + output[s] - (boundary if s > 0 else 0.0) for s in stages}
    best, at, held = -1.0, (), 0.0
    for i, moment in enumerate(in_flight.rank_moments(c.schedule, c.pp, c.virtual_stages, m, rank)):
        # (torch's first stage runs no B: its W runs the whole backward, keeping no output gradients before)
        saved = sum(ch.live * micro[ch.stage] + ch.deferred * stage_layers[ch.stage] * per_w * (ch.stage > 0)
                    for ch in moment)
        grads = sum((held_grads or {}).get(ch.stage, 0.0) for ch in moment if i == 0 and ch.live < m)
        if saved + grads > best + held:
            best, at, held = saved, moment, grads
    live = sum(ch.live * stage_layers[ch.stage] / layers for ch in at)
    # torch allocates each stage's receive buffers at the first step and keeps them
    receive = sum(m * boundary * ((s > 0) + (s < total - 1)) for s in stages)
    # The schedules torch's runtime runs (RUNTIME_SCHEDULES) wait on their sends only at the step's end,
    # each send holding its tensor: a stage's outputs to another rank, and its input gradients
    forward, backward = in_flight.cross_rank_sends(stages, total)
    # Under the split schedules torch's B leaves each input gradient on the stage's receive buffer (its
    # .grad), and a send to another rank holds it to the step's end: m per such stage by then, fewer
    # before (an upper bound); a V's turn passes its own on (measured on gloo, zbv pp 2)
    input_grads = m * boundary * backward if c.split_backward else 0.0
    sent = m * boundary * (forward + (0 if c.split_backward else backward)) if sends_held else 0.0
    if c.schedule == "1f1b":  # a backward's input gradient waits in its send for the next forward's receive
        sent = boundary * backward  # (measured on gloo, pp 2 in bf16: the last stage at 1.08 without it)
    one_micro = micro[total - 1] if total - 1 in micro else max(micro.values())
    if terms:
        terms.item("micro-batches in flight", in_flight.rule(c.schedule),
                   ", ".join(f"stage {ch.stage}: {ch.live}" + (f" ({ch.deferred} W deferred)" if ch.deferred
                                                               else "") for ch in at),
                   str(sum(ch.live for ch in at)))
        sums = [f"{ch.live} × {gb(micro[ch.stage])}"
                + (f" + {ch.deferred}·{stage_layers[ch.stage]} × {gb(per_w)}" if ch.deferred else "")
                for ch in at]
        terms.item("saved", "Σ over its stages: live × (its blocks + its head, or its output where no send "
                   "holds it) + deferred × its blocks × kept for W", " + ".join(sums), gb(best))
        terms.item("receive buffers", "m·s·b·h·e per stage's input (all but the first) and per stage's "
                   "output gradient (all but the last), made at the first step and kept", None, gb(receive))
        if input_grads:
            terms.item("input gradients", "m·s·b·h·e per stage whose input comes from another rank (split "
                       "schedules: left on the receive buffers, their sends pending to the step's end; at "
                       "most that many by the last forward)", None, gb(input_grads))
        if sent and c.schedule == "1f1b":
            terms.item("sends held", "s·b·h·e: a backward's input gradient, in its send until the next "
                       "forward's receive", None, gb(sent))
        elif sent:
            back = "" if c.split_backward else " and per input gradient sent back"
            terms.item("sends held", f"m·s·b·h·e per output sent to another rank{back} (waited on at the "
                       "step's end; at most that many by the last forward)", None, gb(sent))
    if terms and held:
        terms.item("16-bit gradients held", "e·P_s per stage but the first (the last: its head's, under the "
                   "chunked loss or zb), from its W to its next B (FSDP2 adds them to the fp32 ones there)",
                   None, gb(held))
    return HeldMicroBatches(best, one_micro, live, receive, input_grads, sent, held)


def _moe_block_local(shape, tp: int, ep: int) -> float:
    """An MoE block's parameters a rank holds gathered: attention split over tp, the norms and the MoE
    feed-forward whole (TP does not split it), of its routed experts the rank's E/ep."""
    d, routed = shape.d_model, shape.routed_params_per_block
    return (2 * d * d + 2 * d * shape.kv_dim) / tp + 2 * d + shape.moe_ffn_params() - routed + routed / ep


def _moe_units(shape, c, start: int, layers: int, first: bool, last: bool) -> list:
    """Candidate.fsdp_unit_params of an MoE model's stage as a rank holds each unit gathered: a dense
    block whole but for TP's split (its norms whole), an MoE block _moe_block_local (its experts' own
    unit under ep gathered with it), the embedding and head as for a dense model; grouped by their
    whole sizes as fsdp.py groups them."""
    return list(_moe_units_of(shape, c.tp, c.ep, c.fsdp_unit_mb, start, layers, first, last))


@functools.lru_cache(maxsize=4096)
def _moe_units_of(shape, tp: int, ep: int, unit_mb: float, start: int, layers: int, first: bool,
                  last: bool) -> tuple:
    local = lambda n: (n - shape.layer_norm_params) / tp + shape.layer_norm_params  # noqa: E731
    moe_local = _moe_block_local(shape, tp, ep)
    tied = shape.tie_embeddings
    blocks = range(start, start + layers)
    entries = [moe_local if shape.is_moe(i) else local(shape.layer_params) for i in blocks]
    sizes = [shape.block_params(i) for i in blocks]
    if first and not tied:
        entries, sizes = [local(shape.embedding_params)] + entries, [shape.embedding_params] + sizes
    if last and not tied:
        entries, sizes = entries + [local(shape.head_params)], sizes + [shape.head_params]
    units = [sum(unit) for unit in strategies.fsdp_units(entries, sizes, unit_mb)]
    root = local(shape.embedding_params + shape.head_params) if tied else 0.0
    if len(units) == 1:
        return (units[0] + root,)
    return tuple(units + ([root] if root else []))


def _units_last_params(shape, grad_units, tp: int, first: bool, last: bool, tied_root: bool, own_head: bool,
                       head: float) -> list[float]:
    """Each unit's last parameter with a gradient (grad_units' order), whose gradient FSDP2's reduce
    keeps to its end (_reduce_scatter): an untied head's weight (`head`: its gradient's elements; the head
    and the final norm end the last unit), the embedding where it is a unit alone, else a block's w2
    (an MoE block's priced so too) or, for the tied root, its final norm's gain (taken as nothing)."""
    block_w2 = shape.d_model * shape.ffn_hidden / tp
    out = [block_w2] * len(grad_units)
    if first and not tied_root and grad_units[0] == head:
        out[0] = head
    if own_head:
        out[-1] = head
    if tied_root:
        out[-1] = 0.0
    return out


def _pipeline_reduce(units, grad_units, last_params, elem: int, shard: int, device: str, tied_root: bool,
                     held: float, accumulated: float, grads: float) -> float:
    """Buffers at the peak of a pipeline stage's gradient reduction, which torch's pipeline runs after the
    stage's last backward (REDUCE_GRAD): every unit in module order (the root first, with a tied
    embedding), each resharded, then reduce-scattered (_reduce_scatter); the units after it still
    gathered with their unsharded gradients (`accumulated` in all, or one step's in the compute dtype),
    the sharded gradients of those before it rebuilt (`grads`: all of them, at rest). `held`: the
    stage's other buffers, less `grads`. Measured on gloo, zero3 pp 2 × dp 2, a unit per module:
    stage 0 peaks at its embedding's reduce-scatter, the blocks gathered with their gradients."""
    order = list(range(len(units)))
    if tied_root and len(units) > 1:  # the root's state is the stage module's: first in module order
        order = order[-1:] + order[:-1]
    total = sum(grad_units) or 1.0
    per_grad = accumulated / total if accumulated else elem
    gloo = device == "cpu" and shard > 1
    peak, done = float("-inf"), 0.0
    gathered, unreduced = sum(units), sum(grad_units)  # of the units after the one reduced
    for k in order:
        gathered, unreduced = gathered - units[k], unreduced - grad_units[k]
        moment = held + elem * gathered + per_grad * unreduced + grads * done / total \
            + _reduce_scatter(grad_units[k], elem, gloo, per_grad * last_params[k] if shard > 1 else 0.0,
                              4 * grad_units[k] / shard)
        peak = max(peak, moment)
        done += grad_units[k]
    return peak


def _reduce_scatter(unit: float, elem: int, gloo: bool, held: float = 0.0, output: float = 0.0) -> float:
    """Peak bytes of one FSDP2 unit's gradient reduce-scatter: first the unsharded gradients (compute
    dtype) and the fp32 reduce-scatter input they are copied into; then, the gradients released, the
    input with the collective's output (`output`: the sharded gradient it writes, where the caller's
    moment does not hold it already) and gloo's copy of the input, which it all-reduces. FSDP2's
    foreach_reduce keeps its loop's last gradient (the unit's last parameter's, over a shard group
    of two or more) to the end of the call: `held` (measured: the head's weight gradient beside its
    unit's reduce-scatter on gloo)."""
    return max(elem * unit + 4 * unit, 4 * unit + (4 * unit if gloo else 0.0) + held + output)


def deferred_weight_bytes_per_layer(shape, seq: int, micro_batch: int, elem: int, tp: int = 1) -> float:
    """What one micro-batch's deferred W keeps of a block beside its saved tensors (torch's B retains the
    graph, so those stay too): each linear's output gradient, which W multiplies by the linear's input
    (q h/tp, k and v kv/tp each, wo and w2 h, w1 and w3 f/tp each): s·b·e·(2h + (h + 2kv + 2f)/tp). An MoE
    block is priced as a dense one of its ffn_hidden (an approximation)."""
    h, kv, f = shape.d_model, shape.kv_dim, shape.ffn_hidden
    return seq * micro_batch * elem * (2 * h + (h + 2 * kv + 2 * f) / tp)
