"""Predicted step time: compute, recompute, pipeline bubble, exposed communication, optimizer,
offload.

Two ways to price compute and collectives:
- on a catalog GPU, compute runs at the family's calibrated fraction of the bf16 dense peak
  (plan/efficiency.py, fitted to published runs: docs/calibration.md), but no layer runs faster
  than its kernels can be launched (a per-kernel floor); collectives cost a latency α each plus
  their bytes at the link's calibrated efficiency;
- on a measured device (`loom plan --calibrate`: plan/device.py), each linear layer and attention
  runs at the rate measured for its shape, elementwise work (norms, RoPE, SwiGLU, residuals, the
  loss, as counted on loom's block) at the measured memory bandwidth plus a fixed cost per op,
  and every collective at its measured α + bytes/β.
Then, for both:
- recomputation repeats the forward (a third of the work) of the checkpointed blocks;
- the bubble of a pipeline is (p−1)/(m+p−1) of its time ((p−1)/(v·m+p−1) interleaved);
- on GPUs data-parallel collectives overlap with compute (DDP buckets, FSDP prefetch) and only the
  part longer than the compute is exposed; ZeRO-1's parameter broadcast follows the optimizer
  step, and TP and PP transfers sit on the critical path: those are exposed. On a CPU the cores
  that compute also move the bytes: nothing overlaps;
- the optimizer step streams params, grads and Adam's m and v (28 bytes per fp32 parameter) and
  the gradient clip reads and scales the grads (12 more) at memory bandwidth;
- offload moves gradients out and parameters in over the host link each step and runs Adam on
  the host CPUs (NVMe adds reading and writing the optimizer states), without overlap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from loom.plan.comm import DDP_BUCKET, CommAccount
from loom.plan.efficiency import compute_fraction, link_efficiency
from loom.plan.shapes import checkpointed_layers, layers_of_stage

# Elementwise traffic of one decoder block's forward + backward per token (bytes, fp32), counted
# on loom's block with a TorchDispatchMode over every non-matmul aten op (inputs + outputs):
# 93·d + 16·f + 18·kv_dim elements (tests/unit/test_plan_truth.py recounts it), in 86 ops (the lean
# block: k, v stay kv_dim wide, SwiGLU recomputes silu); the loss adds about six passes over the
# fp32 logits.
BLOCK_ELEMENTWISE = (93, 16, 18)
LOSS_PASSES = 6
KERNELS_PER_LAYER = 3 * 40  # GPU kernels of a block's forward + backward (a fused-free eager run)
ADAM_BYTES, CLIP_BYTES = 28, 12  # per fp32 parameter: read p, g, m, v and write p, m, v; clip


@dataclass(frozen=True)
class StepTime:
    compute: float
    recompute: float
    bubble: float
    comm_exposed: float
    optimizer: float
    offload: float

    @property
    def total(self) -> float:
        return self.compute + self.recompute + self.bubble + self.comm_exposed + self.optimizer + self.offload

    def to_dict(self) -> dict:
        return {"compute": self.compute, "recompute": self.recompute, "bubble": self.bubble,
                "comm_exposed": self.comm_exposed, "optimizer": self.optimizer, "offload": self.offload,
                "total": self.total}


def bubble_fraction(pp: int, microbatches: int, virtual: int = 1) -> float:
    if pp <= 1:
        return 0.0
    return (pp - 1) / (virtual * microbatches + pp - 1)


def micro_steps(c) -> int:
    """Forward + backward passes a rank runs per optimizer step (a pipeline stage runs all m)."""
    return c.grad_accum


def local_params(w, c) -> float:
    """Parameters a rank steps the optimizer over: its stage's, split by TP and the shard."""
    stage = max(w.shape.stage_params(s, c.pp) for s in {0, c.pp - 1})
    return stage / c.tp / c.shard_size


def step_time(w, c, cluster, comm: CommAccount, groups: dict[str, float]) -> StepTime:
    if cluster.profile is not None:
        return measured_step_time(w, c, cluster, comm)
    return catalog_step_time(w, c, cluster, comm, groups)


def catalog_step_time(w, c, cluster, comm: CommAccount, groups: dict[str, float]) -> StepTime:
    gpu = cluster.gpu
    flops = w.tokens_per_step * w.shape.flops_per_token(w.seq_len) / c.world
    fraction = cluster.achievable_fraction or compute_fraction(gpu, w.shape, c.tp)
    compute = flops / (gpu.bf16_tflops * 1e12 * fraction)
    if w.shape.known:  # no layer runs faster than its kernels launch
        layers = math.ceil(w.shape.n_layers / c.pp)
        compute = max(compute, micro_steps(c) * layers * KERNELS_PER_LAYER * gpu.kernel_launch_s)
    recompute = _recompute(w, c, compute, gpu)
    busy = compute + recompute
    bubble = _bubble(c, busy)
    efficiency = cluster.comm_efficiency or link_efficiency(gpu)

    def seconds(sent: float, inter: bool, group: str) -> float:
        bw = (gpu.inter_node_gbps if inter else gpu.intra_node_gbps) * 1e9 * efficiency
        latency = gpu.inter_node_latency_s if inter else gpu.intra_node_latency_s
        count = comm.count_by_group.get(group, 0) if group != "broadcast" else 0
        return sent / bw + latency * count

    # Each group's bytes on its link; a ZeRO-1 broadcast and TP/PP transfers are exposed.
    dp_inter = c.dp * c.tp > cluster.gpus_per_node
    shard_inter = c.shard_size * c.tp > cluster.gpus_per_node
    broadcast = comm.by_kind.get("broadcast", 0.0) if w.recipe == "torch" else 0.0
    dp_bytes = groups["dp"] - broadcast
    hidden_dp = seconds(dp_bytes, shard_inter if c.strategy_info.shards_params else dp_inter, "dp")
    exposed = max(0.0, hidden_dp - busy) + seconds(broadcast, dp_inter, "broadcast")
    exposed += seconds(groups["tp"], False, "tp")
    pp_inter = c.world > cluster.gpus_per_node and c.dp * c.tp >= cluster.gpus_per_node
    exposed += seconds(groups["pp"], pp_inter, "pp")
    optimizer = (ADAM_BYTES + CLIP_BYTES) * local_params(w, c) / (gpu.hbm_tbps * 1e12) \
        if c.offload == "none" else 0.0
    return StepTime(compute, recompute, bubble, exposed, optimizer, _offload(w, c, cluster))


def measured_step_time(w, c, cluster, comm: CommAccount) -> StepTime:
    """Compute and collectives at the rates `loom plan --calibrate` measured on this device."""
    profile, ranks, shape = cluster.profile, cluster.gpus_per_node, w.shape
    tokens = w.seq_len * c.micro_batch
    bandwidth = profile.elementwise_bytes(ranks, tokens * max(shape.d_model, 1) * 4)
    overhead = profile.op_overhead(ranks)
    if shape.known:
        d, tp = shape.d_model, c.tp
        layer = block_seconds(profile, ranks, shape, w.seq_len, tokens, tp)
        layer *= profile.block_in_situ(ranks, tokens * d * 4)
        layers = layers_of_stage(shape.n_layers, 0, c.pp)
        vocab = shape.vocab_size / tp
        head = 6 * tokens * d * vocab / profile.linear_flops(ranks, tokens, d, vocab)
        head += LOSS_PASSES * 4 * tokens * vocab / bandwidth
        embedding = 2 * 4 * shape.vocab_size * d / tp / bandwidth  # backward: a dense [V, d] gradient
        heaviest = max(layers * layer + (embedding if c.pp > 1 else 0.0),
                       layers_of_stage(shape.n_layers, c.pp - 1, c.pp) * layer + head
                       + (embedding if c.pp == 1 else 0.0))
        compute = micro_steps(c) * heaviest
        ckpt = checkpointed_layers(layers, c.activation_checkpointing, c.ac_every)
        recompute = micro_steps(c) * ckpt * layer / 3
        if c.activation_checkpointing == "op":  # the matmuls and attention are kept, not rerun
            elementwise = block_elementwise_seconds(profile, ranks, shape, tokens, tp)
            recompute = micro_steps(c) * ckpt * elementwise * profile.block_in_situ(ranks, tokens * d * 4) / 3
    else:
        compute = w.tokens_per_step * shape.flops_per_token(w.seq_len) / c.world / profile.peak_flops(ranks)
        recompute = 0.0
    busy = compute + recompute
    bubble = _bubble(c, busy)
    # Collectives at their measured cost, and the copies in and out of their buffers.
    exposed = 0.0
    for kind, payload in comm.payload_by_kind.items():
        kind = "send" if kind == "recv" else kind
        count = _count(comm, kind, payload)
        exposed += profile.collective_seconds(ranks, kind, payload, count)
        exposed += 2 * payload / profile.elementwise_bytes(ranks, payload / max(count, 1))  # staging copies
    if c.world > 1:  # the loop's few-byte all-reduces: mean loss and gradient norm
        exposed += profile.collective_seconds(ranks, "all_reduce", 8, 2)
    if not c.strategy_info.shards_params and c.dp > 1:  # gradients into DDP's buckets and back
        grads = 4 * local_params(w, c) * c.shard_size
        exposed += 4 * grads / profile.elementwise_bytes(ranks, min(grads, DDP_BUCKET))
    optimizer = profile.optimizer_seconds(ranks, local_params(w, c))
    if optimizer is None:  # a profile from before the optimizer was measured: its bytes and ops
        big = profile.elementwise_bytes(ranks, 4 * local_params(w, c))
        optimizer = (ADAM_BYTES + CLIP_BYTES) * local_params(w, c) / big
        optimizer += 2 * overhead * (2 * (shape.n_layers if shape.known else 1) * 9 // max(c.pp, 1))
    return StepTime(compute, recompute, bubble, exposed, optimizer, _offload(w, c, cluster))


def block_seconds(profile, ranks: int, shape, seq: int, tokens: int, tp: int) -> float:
    """One decoder block's forward + backward over `tokens` tokens at the rates `profile` measured
    for its parts alone: the linears, attention and the elementwise work. How much slower the block
    runs as a whole is the profile's block_in_situ factor, applied by the caller."""
    d, kv, f = shape.d_model, shape.kv_dim, shape.ffn_hidden
    linears = [(d, d / tp), (d, kv / tp), (d, kv / tp), (d / tp, d),  # q, k, v, o
               (d, f / tp), (d, f / tp), (f / tp, d)]  # gate, up, down
    layer = sum(6 * tokens * k * n / profile.linear_flops(ranks, tokens, k, n) for k, n in linears)
    attention = 12 * (shape.n_heads / tp) * shape.head_dim * seq * tokens
    layer += attention / profile.attention_flops(ranks, seq, shape.head_dim)
    return layer + block_elementwise_seconds(profile, ranks, shape, tokens, tp)


def block_elementwise_bytes(shape, tokens: int, tp: int) -> float:
    """The elementwise traffic of one block's forward + backward (BLOCK_ELEMENTWISE), fp32 bytes."""
    a, b, e = BLOCK_ELEMENTWISE
    return 4 * tokens * (a * shape.d_model + b * shape.ffn_hidden / tp + e * shape.kv_dim / tp)


def block_elementwise_seconds(profile, ranks: int, shape, tokens: int, tp: int) -> float:
    """block_seconds' elementwise part: what "op" checkpointing recomputes (a third of it, forward's)."""
    block_bandwidth = profile.block_elementwise_bytes(ranks, tokens * shape.d_model * 4)
    return block_elementwise_bytes(shape, tokens, tp) / block_bandwidth


def _count(comm: CommAccount, kind: str, payload: float) -> int:
    """How many collectives of `kind` a step issues (DDP's buckets where the plan leaves it open)."""
    known = comm.count_by_kind.get(kind)
    return known if known else max(1, math.ceil(payload / DDP_BUCKET))


def _recompute(w, c, compute: float, gpu=None) -> float:
    if not w.shape.known or c.activation_checkpointing == "none":
        return 0.0
    layers = w.shape.n_layers
    if c.activation_checkpointing == "op" and gpu is not None:
        # only the elementwise work of a forward is rerun, at memory bandwidth (or kernel launches)
        stage = math.ceil(layers / c.pp)
        tokens = w.seq_len * c.micro_batch
        per_layer = max(block_elementwise_bytes(w.shape, tokens, c.tp) / 3 / (gpu.hbm_tbps * 1e12),
                        KERNELS_PER_LAYER / 3 * gpu.kernel_launch_s)
        return micro_steps(c) * stage * per_layer
    return compute / 3 * checkpointed_layers(layers, c.activation_checkpointing, c.ac_every) / layers


def _bubble(c, busy: float) -> float:
    if c.pp <= 1:
        return 0.0
    b = bubble_fraction(c.pp, c.grad_accum, c.virtual_stages if c.schedule == "interleaved" else 1)
    return busy * b / (1 - b)


def _offload(w, c, cluster) -> float:
    if c.offload == "none":
        return 0.0
    gpu = cluster.gpu
    local = w.shape.num_params / (c.tp * c.pp * c.shard_size)
    offload = (4 * local + 2 * local) / (gpu.host_link_gbps * 1e9)  # fp32 gradients out, 16-bit params in
    offload += local / (cluster.cpu_adam_params_per_s / cluster.gpus_per_node)
    if c.offload in ("optimizer-nvme", "nvme"):
        offload += 2 * 12 * local / (cluster.nvme_gbps * 1e9 / cluster.gpus_per_node)
    return offload
