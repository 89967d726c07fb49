"""Published training throughputs the planner's time model is calibrated against.

Each row is one run as its authors report it: the model, the GPUs, the layout and the figure
(tokens/s for the whole job, or a FLOP rate converted to tokens/s with the FLOPs-per-token
formula the source itself used, so that the conversion is exact). `planned()` prices the same run
with loom's planner. bench/calibration_table.py turns the rows into docs/calibration.md;
tests/unit/test_calibration.py holds every row to ±20%.

Model shapes: GPT-3-style models (Megatron's, MPT, BLOOM) have multi-head attention and a 4d GeLU
MLP; loom's block is a 3-matrix SwiGLU, so their MLP's 8d² weights are written as
ffn_hidden = round(8d/3): FLOPs match Megatron's count to < 0.1%. Learned position embeddings
(MPT's s·d) and biases are left out (< 0.4% of the parameters).
Layout fields the source does not state are marked "assumed" in the row's note.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from loom.plan.candidate import Candidate, Workload
from loom.plan.comm import comm_per_step
from loom.plan.efficiency import link_efficiency
from loom.plan.hardware import Cluster, lookup
from loom.plan.search import estimate
from loom.plan.shapes import ModelShape


@dataclass(frozen=True)
class Published:
    source: str  # short citation: paper or repository, table
    url: str
    shape: ModelShape
    seq_len: int
    global_batch: int  # sequences per optimizer step
    gpu: str  # hardware.CATALOG name
    nodes: int
    layout: Candidate
    recipe: str  # memory.RECIPES: "torch" fp32 weights (FSDP amp), "megatron" 16-bit weights + fp32
    # grads, "zero" 16-bit weights and grads; all with an fp32 optimizer
    tokens_per_s: float  # the published figure as tokens/s for the whole job
    figure: str  # what the source printed, and the conversion to tokens/s
    note: str = ""  # assumptions, caveats
    mfu: float | None = None  # the source's own model FLOPs utilization, where it states one
    cite: str = ""  # a short label for tables (default: source)
    gpus_per_node: int = 8
    gpu_overrides: dict = field(default_factory=dict)  # where the cluster differs from the catalog
    # False: the engine reduced the gradients after the whole backward (Megatron-LM 2021, DeepSpeed's
    # pipeline engine), where loom's planner assumes overlap; planned() adds that reduction back.
    dp_overlap: bool = True
    # True: the run overlapped tensor-parallel communication with its GEMMs (Megatron-LM's
    # --tp-comm-overlap), which the planner exposes; planned() takes that time back out.
    tp_overlap: bool = False

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    def workload(self) -> Workload:
        return Workload(self.shape, self.seq_len, self.global_batch, "bf16", self.recipe)

    def cluster(self) -> Cluster:
        gpu = dataclasses.replace(lookup(self.gpu), **self.gpu_overrides)
        return Cluster(gpu, self.gpus_per_node, self.nodes)

    def estimate(self) -> dict:
        assert self.layout.world == self.gpus, f"{self.source}: layout spans {self.layout.world} GPUs"
        return estimate(self.workload(), self.layout, self.cluster())

    def planned(self) -> float:
        """The planner's tokens/s for this run, adjusted where the run's engine overlaps
        differently from loom's (dp_overlap, tp_overlap)."""
        record = self.estimate()
        step = record["step_time_s"]
        t = record["step_time_breakdown_s"]
        if not self.dp_overlap:
            step += min(self._link_seconds("dp"), t["compute"] + t["recompute"])
        if self.tp_overlap:
            step -= self._link_seconds("tp")
        return self.workload().tokens_per_step / step

    def _link_seconds(self, group: str) -> float:
        """Seconds the planner gives a group's collectives per step, as plan/step.py prices them
        (dp: replicated gradients on their link; tp: within a node): bytes at the link's
        efficiency plus a latency each."""
        w, c, cluster = self.workload(), self.layout, self.cluster()
        comm, groups = comm_per_step(w, c, cluster.gpus_per_node)
        inter = group == "dp" and c.dp * c.tp > cluster.gpus_per_node
        gpu = cluster.gpu
        bandwidth = (gpu.inter_node_gbps if inter else gpu.intra_node_gbps) * 1e9 * link_efficiency(gpu)
        latency = gpu.inter_node_latency_s if inter else gpu.intra_node_latency_s
        return groups[group] / bandwidth + latency * comm.count_by_group.get(group, 0)


def gpt(name: str, d: int, layers: int, heads: int, vocab: int, tied: bool = True) -> ModelShape:
    """A GPT-3-style decoder (MHA, 4d GeLU MLP) in loom's shape terms."""
    return ModelShape(name, vocab_size=vocab, d_model=d, n_layers=layers, n_heads=heads, n_kv_heads=heads,
                      ffn_hidden=round(8 * d / 3), tie_embeddings=tied)


def llama(name: str, d: int, layers: int, heads: int, kv: int, ffn: int, vocab: int) -> ModelShape:
    return ModelShape(name, vocab_size=vocab, d_model=d, n_layers=layers, n_heads=heads, n_kv_heads=kv,
                      ffn_hidden=ffn)


def megatron_hw_flops(shape: ModelShape, seq: int) -> float:
    """The FLOPs per token behind Narayanan et al. 2021's Table 1, full recomputation counted (four
    passes over the blocks, three over the logit layer): 96·l·h²·(1 + s/6h + V/16lh)."""
    layers, h, v = shape.n_layers, shape.d_model, shape.vocab_size
    return 96 * layers * h * h * (1 + seq / (6 * h) + v / (16 * layers * h))


def megatron_model_flops(shape: ModelShape, seq: int) -> float:
    """Megatron-LM's num_floating_point_operations (training.py, July 2024) per token, for MHA and
    a 4h MLP: 12·l·h²·(2 + s/h + 4) + 6·V·h, no recomputation."""
    layers, h, v = shape.n_layers, shape.d_model, shape.vocab_size
    return 12 * layers * h * h * (6 + seq / h) + 6 * v * h


def _layout(strategy: str, dp: int, tp: int = 1, pp: int = 1, ac: str = "none", mb: int = 1, ga: int = 1,
            schedule: str | None = None, virtual: int = 1, sp: bool = False) -> Candidate:
    return Candidate(strategy, dp, tp, pp, schedule=schedule or ("1f1b" if pp > 1 else "none"),
                     virtual_stages=virtual, activation_checkpointing=ac, micro_batch=mb, grad_accum=ga,
                     sequence_parallel=sp)


# --- Narayanan et al. SC'21, Table 1 (Selene, DGX A100-80GB nodes of 8) ----------------------------------
MEGATRON_2021 = ("Narayanan et al. SC'21 'Efficient Large-Scale Language Model Training on GPU Clusters' "
                 "Table 1, as the NVIDIA/Megatron-LM README's images/cases_april2021.png "
                 "(2021-04 to 2024-07)")
MEGATRON_2021_URL = ("https://arxiv.org/abs/2104.04473, https://github.com/NVIDIA/Megatron-LM/blob/"
                     "50a4b5fa0280a160cc1b03a1c15faddbc1b1da9a/images/cases_april2021.png")
# (size, hidden, layers, heads, model-parallel size, GPUs, batch, achieved TFLOP/s per GPU)
_TABLE1 = [
    ("1.7B", 2304, 24, 24, 1, 32, 512, 137),
    ("3.6B", 3072, 30, 32, 2, 64, 512, 138),
    ("7.5B", 4096, 36, 32, 4, 128, 512, 142),
    ("18B", 6144, 40, 48, 8, 256, 1024, 135),
    ("39B", 8192, 48, 64, 16, 512, 1536, 138),
    ("76B", 10240, 60, 80, 32, 1024, 1792, 140),
    ("145B", 12288, 80, 96, 64, 1536, 2304, 148),
    ("310B", 16384, 96, 128, 128, 1920, 2160, 155),
    ("530B", 20480, 105, 128, 280, 2520, 2520, 163),
    ("1T", 25600, 128, 160, 512, 3072, 3072, 163),
]


def _megatron_2021(size, hidden, layers, heads, mp, gpus, batch, tflops) -> Published:
    shape = gpt(f"GPT {size}", hidden, layers, heads, 51200)
    tp = min(mp, 8)
    pp, dp = mp // tp, gpus // mp
    tokens = tflops * 1e12 * gpus / megatron_hw_flops(shape, 2048)
    return Published(
        MEGATRON_2021, MEGATRON_2021_URL, shape, 2048, batch, "A100-80GB", gpus // 8,
        _layout("ddp", dp, tp, pp, "full", 1, batch // dp), "zero", tokens,
        f"{tflops} TFLOP/s per GPU, recompute counted, ÷ 96·l·h²·(1+s/6h+V/16lh)",
        "full recomputation (the paper's FLOP count assumes it); fp16, micro-batch 1 and the 1F1B "
        "schedule assumed, as the repository's examples/pretrain_gpt3_175B.sh of April 2021; "
        "gradients all-reduced after backward (megatron/training.py train_step then); attention "
        "heads as in the paper's Table 1 (not in the image; they change neither FLOPs nor bytes)",
        dp_overlap=False, cite="Narayanan et al. 2021, Table 1")


# --- Megatron-LM README (July 2024), images/model_table.png (H100 nodes of 8) -------------------------------
MEGATRON_2024 = "NVIDIA/Megatron-LM README 'Training Speed and Scalability', images/model_table.png (2024-07)"
MEGATRON_2024_URL = ("https://github.com/NVIDIA/Megatron-LM/blob/f2e5db402c44ae309aa6448bcb4ae87e8ae0f5f4/"
                     "images/model_table.png")
# (size, heads, hidden, layers, TP, PP, DP, GPUs, batch, per-GPU TFLOP/s, MFU %)
_MODEL_TABLE = [
    ("1.7B", 16, 2048, 24, 1, 1, 48, 48, 192, 408.8, 41),
    ("7.1B", 32, 4096, 30, 2, 1, 48, 96, 192, 465.9, 47),
    ("16B", 48, 6144, 32, 4, 1, 48, 192, 192, 489.1, 49),
    ("32B", 56, 7168, 48, 8, 1, 48, 384, 192, 459.6, 46),
    ("70B", 64, 8192, 84, 8, 2, 48, 768, 384, 419.7, 42),
    ("119B", 80, 10240, 92, 8, 4, 48, 1536, 768, 420.5, 43),
    ("177B", 96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8, 44),
    ("314B", 128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4, 48),
    ("462B", 144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9, 47),
]


def _megatron_2024(size, heads, hidden, layers, tp, pp, dp, gpus, batch, tflops, mfu) -> Published:
    shape = gpt(f"GPT {size}", hidden, layers, heads, 131072)
    tokens = tflops * 1e12 * gpus / megatron_model_flops(shape, 4096)
    return Published(
        MEGATRON_2024, MEGATRON_2024_URL, shape, 4096, batch, "H100-SXM", gpus // 8,
        _layout("zero1", dp, tp, pp, "none", 1, batch // dp, sp=tp > 1), "megatron", tokens,
        f"{tflops} TFLOP/s per GPU (MFU {mfu}%, model FLOPs) ÷ Megatron's 12·l·h²·(6+s/h) + 6·V·h",
        "Megatron-Core r0.8; distributed optimizer (implied by --overlap-param-gather), sequence "
        "parallel with TP, TP communication overlapped (--tp-comm-overlap, as the README states); "
        "no recomputation, micro-batch 1 and the 1F1B schedule assumed", mfu=mfu / 100, tp_overlap=True,
        cite="Megatron-LM README 2024")


# --- llm-foundry scripts/train/benchmarking/README.md (MPT, Composer FSDP FULL_SHARD) ----------------------
FOUNDRY = "mosaicml/llm-foundry scripts/train/benchmarking/README.md"
FOUNDRY_URL = ("https://github.com/mosaicml/llm-foundry/blob/061f2c7ce64e655100286584a7629e2a09f827ba/"
               "scripts/train/benchmarking/README.md")
_MPT = {  # d_model, n_layers, n_heads (scripts/train/yamls/pretrain/mpt-*.yaml), vocab 50368, tied
    "1b": (2048, 24, 16), "7b": (4096, 32, 32), "13b": (5120, 40, 40), "30b": (7168, 48, 56),
    "70b": (8192, 80, 64)}


def _mpt(table: str, gpu: str, size: str, seq: int, gpus: int, mb: int, ga: int, batch: int, ac: bool,
         tokens: float, mfu: float) -> Published:
    shape = gpt(f"MPT-{size}", *_MPT[size], 50368)
    pure = gpu == "A100-40GB"  # that table ran precision bf16 with FSDP mixed precision PURE
    return Published(
        f"{FOUNDRY}, table '{table}'", FOUNDRY_URL, shape, seq, batch, gpu, gpus // 8,
        _layout("zero3", gpus, ac="full" if ac else "none", mb=mb, ga=ga), "zero" if pure else "torch",
        tokens, f"Throughput (T/s) column; MFU {mfu}%",
        "Composer FSDP FULL_SHARD, "
        + ("bf16 PURE: 16-bit weights gathered and gradients reduced (recipe 'zero')" if pure else
           "amp_bf16 (fp32 weights, bf16 compute)")
        + "; every layout field is in the table; "
        + ("network not stated (catalog)" if gpu == "H100-SXM" else "1600 Gb/s RoCE per node (= catalog)"),
        mfu / 100, cite=f"llm-foundry, {table}")


# --- torchtitan's performance page (FSDP2 on 64 A100-80GB), commit 3faaa1a0d (2024-08) -------------------
TITAN = "pytorch/torchtitan performance page (FSDP2 on 64 A100-80GB)"
TITAN_URL = "https://github.com/pytorch/torchtitan/blob/3faaa1a0dee68ce028400e3dafd1735d152cb4f8/docs/" \
    "performance" ".md"  # (split: a document outside this repository)


def _titan(model: ModelShape, seq: int, local_batch: int, ac: str, wps: float, mfu: float,
           what: str) -> Published:
    return Published(
        f"{TITAN}, {what}", TITAN_URL, model, seq, 64 * local_batch, "A100-80GB", 8,
        _layout("zero3", 64, ac=ac, mb=local_batch), "torch", wps * 64,
        f"WPS {wps} per GPU × 64 (MFU {mfu}%)",
        "FSDP2 full sharding, bf16 compute with fp32 reduction; the A100 cluster's network is not "
        "stated (catalog: one 200 Gb/s NIC per GPU)"
        + ("; 'selective layer' checkpoints every 2nd block (loom's selective, ac_every 2)"
           if ac == "selective" else ""), mfu / 100, cite=f"torchtitan, {what}")


LLAMA2_13B = llama("Llama 2 13B", 5120, 40, 40, 40, 13824, 32000)
LLAMA3_8B = llama("Llama 3 8B", 4096, 32, 32, 8, 14336, 128256)
LLAMA3_70B = llama("Llama 3 70B", 8192, 80, 64, 8, 28672, 128256)
LLAMA3_405B = llama("Llama 3 405B", 16384, 126, 128, 8, 53248, 128256)
BLOOM = gpt("BLOOM-176B", 14336, 70, 112, 250880)


def _llama3_405b(gpus: int, tflops: float, mfu: int) -> Published:
    dp = gpus // 128
    flops = LLAMA3_405B.flops_per_token(8192)
    return Published(
        "Llama Team 'The Llama 3 Herd of Models' (arXiv 2407.21783) Table 4", "https://arxiv.org/abs/2407.21783",
        LLAMA3_405B, 8192, 2048, "H100-SXM", gpus // 8,
        _layout("zero2", dp, 8, 16, "none", 1, 2048 // dp, "interleaved", 8, sp=True), "megatron",
        tflops * 1e12 * gpus / flops,
        f"{tflops} TFLOP/s per GPU (BF16 MFU {mfu}%) ÷ 6N + 12·l·h·s (PaLM); 16M tokens "
        "= 2048 × 8192 per batch",
        "FSDP-style sharding of grads and optimizer (zero2); no recomputation and micro-batch 1 assumed; "
        "interleaved schedule (the paper's) with v = 8 assumed: 128 layer slots over 16 stages, and the "
        "drop from 43% to 41% MFU when the micro-batches halve fits (p-1)/(v·m+p-1) with v near 8; "
        "the paper's exact FLOP count is not given", mfu / 100, cite="Llama 3 paper, Table 4")


ROWS: list[Published] = [
    *(_megatron_2021(*r) for r in _TABLE1),
    *(_megatron_2024(*r) for r in _MODEL_TABLE),
    _mpt("A100 80GB", "A100-80GB", "1b", 2048, 8, 14, 4, 448, False, 164109, 59.86),
    _mpt("A100 80GB", "A100-80GB", "7b", 2048, 8, 6, 2, 96, False, 37130, 64.23),
    _mpt("A100 80GB", "A100-80GB", "13b", 4096, 8, 10, 3, 240, True, 16482, 57.62),
    _mpt("A100 80GB", "A100-80GB", "30b", 2048, 8, 3, 21, 504, True, 7330, 55.3),
    _mpt("A100 40GB", "A100-40GB", "7b", 2048, 128, 18, 1, 2304, True, 463749, 50.14),
    _mpt("A100 40GB", "A100-40GB", "30b", 2048, 128, 6, 1, 768, True, 110803, 52.25),
    _mpt("H100 80GB BF16", "H100-SXM", "1b", 2048, 64, 20, 1, 1280, False, 2841754, 40.85),
    _mpt("H100 80GB BF16", "H100-SXM", "7b", 2048, 8, 6, 1, 48, False, 85144, 46.44),
    _mpt("H100 80GB BF16", "H100-SXM", "30b", 2048, 32, 14, 3, 1344, True, 73860, 43.92),
    _mpt("H100 80GB BF16", "H100-SXM", "70b", 2048, 64, 8, 4, 2048, True, 66523, 42.57),
    _titan(LLAMA2_13B, 4096, 2, "none", 2162, 61.1, "Llama 2 13B, no AC"),
    _titan(LLAMA3_8B, 8192, 1, "selective", 2904, 56.8, "Llama 3 8B, selective layer AC"),
    _titan(LLAMA3_70B, 8192, 1, "full", 331, 51.7, "Llama 3 70B, full AC"),
    Published(
        "BigScience BLOOM-176B training README (train/tr11-176B-ml), iteration 85376 log line",
        "https://github.com/bigscience-workshop/bigscience/blob/00327f8c3533c39b3cc17013f0d0d2b770eb2bb9/"
        "train/tr11-176B-ml/README.md",
        BLOOM, 2048, 2048, "A100-80GB", 48, _layout("zero1", 8, 4, 12, "full", 2, 128), "megatron",
        19.561 * 2048, "19.561 samples/s × 2048 tokens (149.77 TFLOP/s per GPU logged)",
        "Megatron-DeepSpeed, ZeRO-1 (BF16_Optimizer), DeepSpeed activation checkpointing; "
        "4 Omni-Path 100 Gb/s links per node (6.25 GB/s per GPU); the pipeline engine reduces "
        "gradients after the schedule", gpu_overrides={"inter_node_gbps": 6.25}, dp_overlap=False,
        cite="BLOOM-176B training log"),
    _llama3_405b(8192, 430, 43),
    _llama3_405b(16384, 400, 41),
]
