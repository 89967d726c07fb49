"""Published runs that state their measured memory per GPU, against the planner's per-GPU memory.

torchtitan's H100 benchmarks (its benchmarks folder, llama3_h100_202412, 2024-12) give the peak
memory of each run (the maximum over the GPUs of the allocator's reserved bytes, in GiB) beside
its layout. The rows here are the ones whose every setting loom's planner models: FSDP2 in bf16
with fp32 master weights, Llama 3.1 at 8192 tokens, torchtitan's default selective checkpointing
(op-level: matmul outputs saved). Runs with Float8 or torch.compile are left out (neither is
priced). bench/calibration_table.py writes them into docs/calibration.md; tests/unit/
test_calibration.py holds the planner's figure to MEMORY_TOLERANCE of each.
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.config import TrainConfig
from loom.plan.candidate import Candidate, Workload
from loom.plan.hardware import Cluster, lookup
from loom.plan.published import LLAMA3_8B
from loom.plan.search import estimate
from loom.plan.shapes import ModelShape

GIB = 2**30
MEMORY_TOLERANCE = 0.15
TITAN_H100 = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan" ".md"  # (split: not in this repo)
TITAN_H100_URL = ("https://github.com/pytorch/torchtitan/blob/31a17bfdb70bab6f62a13d21816a5339b911d6e3/"
                  "benchmarks/llama3_h100_202412_torchtitan" ".md")


@dataclass(frozen=True)
class PublishedMemory:
    cite: str
    shape: ModelShape
    seq_len: int
    local_batch: int  # sequences per GPU per step
    gpus: int
    activation_checkpointing: str
    memory_gib: float  # the published peak per GPU
    note: str = ""
    gpu: str = "H100-SXM"  # torchtitan's are 96 GB HBM2e H100s: capacity does not enter the figure

    def planned_bytes(self, as_loom_runs_it: bool = False) -> float:
        """The planner's peak per GPU for this run as torchtitan ran it: the full logits (no chunked
        loss) and its op policy, which keeps every other matmul's output (see titan_recomputed_bytes).
        `as_loom_runs_it`: the same layout as `loom train` runs it (loss chunked by train.loss_chunk's
        default, every matmul's output kept)."""
        nodes = max(1, self.gpus // 8)
        cluster = Cluster(lookup(self.gpu), min(8, self.gpus), nodes)
        layout = Candidate("zero3", self.gpus, 1, 1, activation_checkpointing=self.activation_checkpointing,
                           micro_batch=self.local_batch, grad_accum=1)
        chunk = TrainConfig().loss_chunk if as_loom_runs_it else 0
        workload = Workload(self.shape, self.seq_len, self.local_batch * self.gpus, "bf16", "torch", chunk)
        planned = estimate(workload, layout, cluster)["memory_bytes"]["total"]
        if as_loom_runs_it or self.activation_checkpointing != "op":
            return planned
        return planned - (1 + cluster.fragmentation) * self.titan_recomputed_bytes()

    def titan_recomputed_bytes(self) -> float:
        """What torchtitan's op-level policy does not keep of what loom's does: it saves the outputs
        of every other aten.mm of a block (wq, wv, w1, w2 kept; wk, wo, w3 recomputed), loom's all
        seven. Per block s·b·(kv + h + f)·2 bytes in bf16, over all L blocks (one micro-batch)."""
        shape = self.shape
        tokens = self.seq_len * self.local_batch
        return shape.n_layers * tokens * (shape.kv_dim + shape.d_model + shape.ffn_hidden) * 2

    def ratio(self) -> float:
        return self.planned_bytes() / (self.memory_gib * GIB)


MEMORY_ROWS = [
    PublishedMemory("torchtitan H100, Table 1: FSDP", LLAMA3_8B, 8192, 2, 8, "op", 82.4,
                    "8 GPUs, local batch 2, selective (op) AC, no compile, no Float8"),
    PublishedMemory("torchtitan H100, Table 3: FSDP", LLAMA3_8B, 8192, 2, 128, "op", 67.0,
                    "128 GPUs (16 nodes), local batch 2, selective (op) AC, no compile, no Float8"),
]
