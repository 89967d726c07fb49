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
    chunk_logits_bytes,
    head_backward_bytes,
    head_saved_bytes,
    head_transient_bytes,
    layers_of_stage,
    llama_like,
    op_saved_bytes_per_layer,
    op_shared_bytes_per_layer,
    residual_bytes,
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


def gpu_memory(w, c, fragmentation: float = 0.10, device: str = "cuda") -> MemoryAccount:
    """Per-GPU memory of candidate `c` on workload `w` (see plan/candidate.py), worst stage."""
    stages = {0, c.pp - 1}
    accounts = [stage_memory(w, c, s, fragmentation, device) for s in sorted(stages)]
    return max(accounts, key=lambda a: a.total)


def stage_memory(w, c, stage: int, fragmentation: float = 0.10, device: str = "cuda",
                 moments: list | None = None) -> MemoryAccount:
    """Per-GPU memory of a rank holding pipeline stage `stage` (0 without a pipeline), at the
    step's peak. `device` "cpu": a loom train run on gloo ranks, whose collectives and optimizer
    allocate differently (see _step_peak). `moments`: a list that receives every moment compared,
    as (name, activations, buffers); the account is the largest."""
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

    activations = 0.0
    if shape.known:
        activations, inflight = _step_peak(w, c, stage, layers, stage_params, replicated, grads,
                                           optimizer, device, moments)
        buffers += inflight
    else:
        buffers += DEEPSPEED_BUCKETS if deepspeed else 0.0
        if c.offload != "none":  # what stays on the GPU: a layer's parameters staged in, and the next
            buffers += 2 * w.act_bytes * llama_like(shape.num_params).layer_params / c.tp
    allocated = params + grads + optimizer + activations + buffers
    return MemoryAccount(params, grads, optimizer, activations, buffers, fragmentation * allocated,
                         host, nvme, stage)


def ddp_accumulates_apart(w, c) -> bool:
    """Whether the step holds a second copy of the gradients: DDP's micro-steps under no_sync
    accumulate into gradients of their own, beside its buckets (the states' gradients), until the
    last micro-step's backward copies them in (measured: +4Ψ)."""
    return (w.recipe == "torch" and c.engine != "deepspeed" and not c.strategy_info.uses_fsdp(c.tp)
            and c.grad_accum > 1)


def _step_peak(w, c, stage: int, layers: int, stage_params: int, replicated: int, grads: float,
               optimizer: float, device: str, named: list | None = None) -> tuple[float, float]:
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
      head backward       the head's weight gradient (head_backward_bytes), the loss's tensors gone
      head reduce-scatter an untied head's own unit reduce-scatters at once, resharded first
      recompute           the topmost checkpointed block rebuilt, the blocks above it done; its
                          unit gathered again (zero3), the tied root still gathered with its gradient
      pipeline            a micro-batch's backward done, the others in flight: the schedule keeps
                          every unit gathered until the step's last backward
      reduce-scatter      the end of backward: the last unit's (_reduce_scatter), every other
                          sharded gradient rebuilt
      tied embedding      its backward adds its gradient to the head's (below)
      optimizer           on CPU, foreach AdamW (loom's choice there) makes sqrt(v), one more
                          v-sized tensor: half the optimizer states; GPUs step fused, in place
      at rest             between steps the states alone: the peak is never below them
    `device` "cpu": loom train on gloo ranks, whose reduce-scatter is an all-reduce of a copy of
    its input, and whose AdamW is foreach.
    """
    shape, tp, e = w.shape, c.tp, w.act_bytes
    last, pipelined = stage == c.pp - 1, c.pp > 1
    chunk = w.loss_chunk if tp == 1 and not pipelined else 0  # TP and PP keep the full logits
    deepspeed = c.engine == "deepspeed"
    strategy = c.strategy_info
    fsdp = not deepspeed and strategy.uses_fsdp(tp) and w.recipe == "torch"
    # ddp and zero1 (without TP) reach 16-bit through torch.autocast; FSDP2 and DeepSpeed cast weights
    autocast = not deepspeed and not strategy.uses_fsdp(tp) and e < 4
    sp = c.sequence_parallel and tp > 1
    seq, mb = w.seq_len, c.micro_batch
    local = lambda n: (n - shape.layer_norm_params) / tp + shape.layer_norm_params  # noqa: E731

    # Activations of one micro-batch, kept from its forward to its backward.
    per_layer = activation_bytes_per_layer(shape, seq, mb, e, tp, sp, autocast)
    residual = residual_bytes(shape, seq, mb, e, autocast)
    ckpt = checkpointed_layers(layers, c.activation_checkpointing, c.ac_every)
    op = c.activation_checkpointing == "op"  # a checkpointed block also keeps its matmuls' outputs
    per_ckpt = residual / (tp if sp else 1)
    if op:
        per_ckpt = op_saved_bytes_per_layer(shape, seq, mb, e, tp, sp, autocast)
    one_micro = (layers - ckpt) * per_layer + ckpt * per_ckpt
    if last:
        one_micro += head_saved_bytes(shape, seq, mb, e, tp, pipelined, sp, autocast, chunk)
    elif pipelined:
        one_micro += residual  # the stage's output, kept by the schedule for its backward
    saved = _micro_batches_in_flight(c, stage) * one_micro
    # the fp32 log-softmax, or chunked each token's fp32 logsumexp
    loss_saved = 4 * seq * mb * (1 if chunk else shape.vocab_size / tp) if last else 0.0

    # Buffers held through backward.
    held = 0.0
    if deepspeed:
        held += DEEPSPEED_BUCKETS
    if fsdp and c.grad_accum > 1:
        # Micro-steps without gradient sync accumulate the unsharded gradients (FSDP2 no_sync;
        # pipelining does the same between micro-batches): the stage's whole gradient.
        held += GRAD_COMM_BYTES[w.recipe] * (stage_params - replicated) / tp + replicated * 4
    if ddp_accumulates_apart(w, c):
        held += grads
    if c.offload != "none":
        held += 2 * e * local(shape.layer_params)  # parameters staged in from the host
    if autocast:
        # autocast caches each weight's 16-bit copy until the context exits, after backward: every
        # matmul weight (the tied embedding through the head; an untied one is only looked up).
        cast = layers * (shape.layer_params - shape.layer_norm_params)
        cast += shape.vocab_size * shape.d_model if last else 0
        held += e * cast
    units = [local(u) for u in c.fsdp_unit_params(shape, layers, stage == 0, last)] if fsdp else []
    kept = 0.0
    if fsdp:
        # The unit gathered at backward's start: zero3 keeps the last one gathered since forward (the
        # head's, or the root's with the tied embedding); zero2 (and ddp/zero1 under TP, FSDP2
        # over a (dp, 1) mesh) keep every unit gathered from forward to backward.
        kept = e * (units[-1] if strategy.reshard_after_forward else sum(units))
        held -= grads  # the sharded gradients, not yet rebuilt

    if deepspeed:  # DeepSpeed's engine: its buckets, activations and the larger transient
        transient = head_transient_bytes(shape, seq, mb, tp, chunk, e) if last else 0.0
        return saved + max(per_layer if ckpt else 0.0, transient), held

    vh = shape.vocab_size * shape.d_model / tp  # the head's (or the embedding's) weight, local
    tied_root = fsdp and shape.tie_embeddings  # the root unit holds the embedding = the head
    own_head = fsdp and last and not shape.tie_embeddings and len(units) > 1  # head + norm: one unit
    others = saved - one_micro  # other micro-batches in flight (pipeline)
    moments = [] if named is None else named  # (name, activations, buffers)
    if last:
        head = head_saved_bytes(shape, seq, mb, e, tp, pipelined, sp, autocast, chunk)
        # Forward's end, in the loss: the logits (and their fp32 copy under 16-bit) beside the
        # log-softmax; FSDP2 frees the latest all-gather's flat buffer only after the root's forward
        # (the last block's unit, or the head's; with one unit, a second copy of the model).
        logits = seq * mb * shape.vocab_size / tp * (e + (4 if e < 4 else 0))
        if chunk:  # one chunk's
            logits = chunk_logits_bytes(shape, seq, mb, e, chunk)
        latest = 0.0
        if fsdp and c.shard_size > 1:
            latest = e * (units[-2] if tied_root and len(units) > 1 else units[-1])
        moments.append(("forward's end", saved + logits, kept + latest + held))
        moments.append(("loss", saved + head_transient_bytes(shape, seq, mb, tp, chunk, e), kept + held))
        logits_grad, weight_grad = head_backward_bytes(shape, seq, mb, e, tp, autocast, chunk)
        moments.append(("head backward", saved - loss_saved + logits_grad, kept + weight_grad + held))
        if own_head:  # its gradient reduce-scattered at once, the unit resharded first
            gloo = device == "cpu" and c.shard_size > 1
            moments.append(("head reduce-scatter", saved - head, _reduce_scatter(units[-1], e, gloo) + held))
    else:
        head = 0.0
        moments.append(("backward's start", saved, kept + held))
    if ckpt:
        # The topmost checkpointed block is rebuilt first, once the head and the blocks above it
        # (not checkpointed under selective) have run backward: its unit is gathered again, the
        # tied root stays gathered with the head weight's gradient.
        selective = c.activation_checkpointing == "selective"
        top = (layers - 1) // c.ac_every * c.ac_every if selective else layers - 1
        rebuilt = one_micro - head - (layers - 1 - top) * per_layer + per_layer
        if op:  # the rebuilt block's kept outputs are among its activations: counted once
            rebuilt -= op_shared_bytes_per_layer(shape, seq, mb, e, tp)
        # its backward then begins with the SwiGLU's two hidden-sized gradients (gate and up) beside
        # the rebuilt activations (measured on the small preset: the 1.23 of the plan without them)
        rebuilt += 2 * seq * mb * shape.ffn_hidden / tp * e
        gathered = e * (units[-1] + vh) if tied_root else 0.0
        gathered += e * local(shape.layer_params) if len(units) > 1 else 0.0
        if not strategy.reshard_after_forward:
            gathered = kept
        moments.append(("recompute", others + rebuilt, gathered + held))
    if fsdp and pipelined:
        # A micro-batch's backward done, the others in flight: the schedule keeps every unit gathered
        # until the step's last backward, the first unit's gradient being accumulated.
        moments.append(("pipeline", others, e * sum(units) + e * units[0] + held))
    if fsdp and stage == 0:
        # The end of backward: the unit reduced last is the root when it holds the tied embedding
        # (complete only after the embedding's backward), else the first unit; every other sharded
        # gradient is rebuilt. An untied embedding's gradient stays referenced by autograd through
        # its unit's reduce-scatter (issued by FSDP2's end-of-backward callback).
        last_reduced = units[-1] if tied_root else units[0]
        gloo = device == "cpu" and c.shard_size > 1  # one rank per shard: a copy, no collective
        held_grad = 0.0 if tied_root else e * vh
        moments.append(("reduce-scatter", 0.0, _reduce_scatter(last_reduced, e, gloo, held_grad)))
    if shape.tie_embeddings and stage == 0 and not deepspeed:
        # The embedding's backward adds its gradient to the head's: both and their sum (autograd
        # accumulates out of place) in the parameter's dtype (FSDP2: the gathered 16-bit one; DDP:
        # fp32, the bucket taking it only once both uses are done). FSDP2 also holds the root
        # gathered with its other unsharded gradients (with one unit: the whole model's), and
        # the previous unit's reduce-scatter input (kept until the next); the root's own sharded
        # gradient is not rebuilt yet.
        if fsdp:
            root = units[-1]
            previous = 4 * units[0] if len(units) > 1 else 0.0
            extra = e * root + e * (root - vh) + previous - 4 * root / c.shard_size
            moments.append(("tied embedding", 0.0, 3 * e * vh + extra + held + grads))
        else:
            moments.append(("tied embedding", 0.0, 3 * 4 * vh + held))
    if device == "cpu":
        moments.append(("optimizer", 0.0, optimizer / 2))
    moments.append(("at rest", 0.0, 0.0))  # between steps: the states alone (gradients included)
    _, activations, buffers = max(moments, key=lambda m: m[1] + m[2])
    return activations, buffers


def _reduce_scatter(unit: float, elem: int, gloo: bool, held: float = 0.0) -> float:
    """Peak bytes of one FSDP2 unit's gradient reduce-scatter beyond the sharded gradient it
    writes: the unsharded gradient (compute dtype) and the fp32 reduce-scatter input it is copied
    into; gloo then all-reduces a copy of that input, the unsharded gradient released unless
    something else holds it (`held`)."""
    return max(elem * unit + 4 * unit, held + 8 * unit if gloo else 0.0)


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
