"""Per-rank model-state bytes of each data-parallel strategy (the formulas measurements check).

Ψ = parameter count, N = ranks that share one shard. The `torch` recipe is torch-native mixed
precision: fp32 parameters and gradients, Adam m and v in fp32 -> 4Ψ + 4Ψ + 8Ψ = 16Ψ unsharded.
"""

from __future__ import annotations

from dataclasses import dataclass

from loom import strategies
from loom.plan.shapes import (
    activation_bytes_per_layer,
    checkpointed_layers,
    head_saved_bytes,
    head_transient_bytes,
    layers_of_stage,
)

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


def gpu_memory(w, c, fragmentation: float = 0.10) -> MemoryAccount:
    """Per-GPU memory of candidate `c` on workload `w` (see plan/candidate.py), worst stage."""
    stages = {0, c.pp - 1}
    accounts = [stage_memory(w, c, s, fragmentation) for s in sorted(stages)]
    return max(accounts, key=lambda a: a.total)


def stage_memory(w, c, stage: int, fragmentation: float = 0.10) -> MemoryAccount:
    """Per-GPU memory of a rank holding pipeline stage `stage` (0 without a pipeline)."""
    shape, last = w.shape, stage == c.pp - 1
    stage_params = shape.stage_params(stage, c.pp)
    layers = layers_of_stage(shape.n_layers, stage, c.pp) if shape.known else 0
    replicated = shape.tp_replicated_params(layers, last) if (c.tp > 1 and shape.known) else 0
    recipe = engine_recipe(w, c)
    deepspeed = c.engine == "deepspeed"
    states = model_state_bytes(c.strategy, stage_params, c.shard_size, recipe,
                               paper_stages=recipe == "zero" or deepspeed, tp=c.tp, tp_replicated=replicated)
    params, grads, optimizer = states.params, states.grads, states.optimizer
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

    if shape.known:
        local_layer = (shape.layer_params - shape.layer_norm_params) / c.tp + shape.layer_norm_params
        gathered = w.act_bytes * local_layer  # one layer's parameters, unsharded in the compute dtype
        fsdp = c.strategy_info.engine == "fsdp2" and w.recipe == "torch"
        if fsdp and not c.strategy_info.reshard_after_forward:
            buffers += layers * gathered  # SHARD_GRAD_OP: every layer unsharded from forward to backward
        elif fsdp:  # at the peak (backward's start) a unit is being prefetched: a block, or a group
            units = c.fsdp_unit_params(shape, layers, stage == 0, last)
            largest = units[0] if len(units) == 1 else max(units[:-1])  # one unit: the whole stage
            buffers += max(gathered, w.act_bytes * largest / c.tp)
        if fsdp and c.grad_accum > 1:
            # Micro-steps without gradient sync accumulate the unsharded gradients (FSDP2 no_sync;
            # pipelining does the same between micro-batches): the stage's whole gradient.
            buffers += GRAD_COMM_BYTES[w.recipe] * (stage_params - replicated) / c.tp + replicated * 4
        if c.offload != "none":
            buffers += 2 * gathered  # parameters staged in from the host
    if deepspeed:
        buffers += DEEPSPEED_BUCKETS

    activations = 0.0
    if shape.known:
        sp, pipelined = c.sequence_parallel, c.pp > 1
        per_layer = activation_bytes_per_layer(shape, w.seq_len, c.micro_batch, w.act_bytes, c.tp, sp)
        residual = w.seq_len * c.micro_batch * shape.d_model * w.act_bytes  # one [s, b, h] tensor
        kept_input = residual / (c.tp if sp else 1)
        ckpt = checkpointed_layers(layers, c.activation_checkpointing, c.ac_every)
        one_micro = (layers - ckpt) * per_layer + ckpt * kept_input
        if last:
            one_micro += head_saved_bytes(shape, w.seq_len, c.micro_batch, w.act_bytes, c.tp, pipelined)
        elif pipelined:
            one_micro += residual  # the stage's output, kept by the schedule for its backward
        # On top, the larger of: the loss's gradients at the start of backward (last stage), or
        # one checkpointed layer rebuilt later in backward (by then the loss's tensors are gone).
        recompute = per_layer if ckpt else 0.0
        transient = head_transient_bytes(shape, w.seq_len, c.micro_batch, c.tp) if last else 0.0
        activations = _micro_batches_in_flight(c, stage) * one_micro + max(recompute, transient)
    allocated = params + grads + optimizer + activations + buffers
    return MemoryAccount(params, grads, optimizer, activations, buffers, fragmentation * allocated,
                         host, nvme, stage)


def _micro_batches_in_flight(c, stage: int) -> float:
    """Micro-batches whose activations a stage holds at once: 1 without a pipeline; GPipe all m;
    1F1B p − stage (p on the first); interleaved 1F1B p·(1 + (p−1)/(p·v)) on the first."""
    if c.pp == 1:
        return 1
    m = c.grad_accum
    if c.schedule == "gpipe":
        return m
    if c.schedule == "interleaved" and stage == 0:
        return min(m * c.virtual_stages, c.pp * (1 + (c.pp - 1) / (c.pp * c.virtual_stages)))
    return min(m, c.pp - stage)
