"""Predicted step time: compute, recompute, pipeline bubble, exposed communication, offload.

Assumptions (printed with every plan):
- compute runs at `achievable_fraction` of the bf16 dense peak (FLOPs from plan/shapes.py);
- recomputation repeats the forward (a third of 6N) of the checkpointed blocks;
- the bubble of a pipeline is (p−1)/(m+p−1) of its time ((p−1)/(v·m+p−1) interleaved);
- data-parallel collectives overlap with compute (DDP buckets, FSDP prefetch) and only the part
  longer than the compute is exposed; ZeRO-1's parameter broadcast follows the optimizer step,
  and TP and PP transfers sit on the critical path: those are exposed;
- links reach `comm_efficiency` of their bandwidth;
- offload moves gradients out and parameters in over the host link each step and runs Adam on
  the host CPUs (NVMe adds reading and writing the optimizer states), without overlap.
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.plan.comm import CommAccount
from loom.plan.shapes import checkpointed_layers


@dataclass(frozen=True)
class StepTime:
    compute: float
    recompute: float
    bubble: float
    comm_exposed: float
    offload: float

    @property
    def total(self) -> float:
        return self.compute + self.recompute + self.bubble + self.comm_exposed + self.offload

    def to_dict(self) -> dict:
        return {"compute": self.compute, "recompute": self.recompute, "bubble": self.bubble,
                "comm_exposed": self.comm_exposed, "offload": self.offload, "total": self.total}


def bubble_fraction(pp: int, microbatches: int, virtual: int = 1) -> float:
    if pp <= 1:
        return 0.0
    return (pp - 1) / (virtual * microbatches + pp - 1)


def step_time(w, c, cluster, comm: CommAccount, groups: dict[str, float]) -> StepTime:
    gpu = cluster.gpu
    flops = w.tokens_per_step * w.shape.flops_per_token(w.seq_len) / c.world
    rate = gpu.bf16_tflops * 1e12 * cluster.achievable_fraction
    compute = flops / rate
    recompute = 0.0
    if w.shape.known and c.activation_checkpointing != "none":
        layers = w.shape.n_layers
        share = checkpointed_layers(layers, c.activation_checkpointing, c.ac_every) / layers
        recompute = compute / 3 * share
    busy = compute + recompute
    bubble = 0.0
    if c.pp > 1:
        b = bubble_fraction(c.pp, c.grad_accum, c.virtual_stages if c.schedule == "interleaved" else 1)
        bubble = busy * b / (1 - b)

    def seconds(sent: float, inter: bool) -> float:
        bw = (gpu.inter_node_gbps if inter else gpu.intra_node_gbps) * 1e9 * cluster.comm_efficiency
        return sent / bw

    # Each group's bytes on its link; a ZeRO-1 broadcast and TP/PP transfers are exposed.
    dp_inter = c.dp * c.tp > cluster.gpus_per_node
    shard_inter = c.shard_size * c.tp > cluster.gpus_per_node
    broadcast = comm.by_kind.get("broadcast", 0.0) if w.recipe == "torch" else 0.0
    dp_bytes = groups["dp"] - broadcast
    hidden_dp = seconds(dp_bytes, shard_inter if c.strategy_info.shards_params else dp_inter)
    exposed = max(0.0, hidden_dp - busy) + seconds(broadcast, dp_inter)
    exposed += seconds(groups["tp"], False)
    exposed += seconds(groups["pp"], c.world > cluster.gpus_per_node and c.dp * c.tp >= cluster.gpus_per_node)

    offload = 0.0
    if c.offload != "none":
        local = w.shape.num_params / (c.tp * c.pp * c.shard_size)
        pcie = gpu.host_link_gbps * 1e9
        offload = (4 * local + 2 * local) / pcie  # fp32 gradients out, 16-bit parameters in
        offload += local / (cluster.cpu_adam_params_per_s / cluster.gpus_per_node)
        if c.offload in ("optimizer-nvme", "nvme"):
            offload += 2 * 12 * local / (cluster.nvme_gbps * 1e9 / cluster.gpus_per_node)
    return StepTime(compute, recompute, bubble, exposed, offload)
