"""Every way to run a workload on a cluster, priced, and the one to recommend.

Candidates: strategy (ddp, zero1, zero2, zero3, hsdp) × offload × tp × pp × cp (ring or alltoall) ×
ep (a mixture of experts only) × pipeline schedule × activation checkpointing × micro-batch, with
grad_accum (or the pipeline's micro-batches) making up the global batch (under LoRA on the torch
engine only: loom's deepspeed engine refuses it). Pure Python: thousands of candidates per second.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import multiprocessing
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from loom import strategies
from loom.config import SPLIT_BACKWARD_SCHEDULES as SPLIT_BACKWARD
from loom.config import V_SCHEDULES, stages_per_rank
from loom.errors import ConfigError
from loom.plan import context, experts, lora, muon
from loom.plan.candidate import Candidate, Workload, head_recomputed
from loom.plan.comm import comm_per_step, ep_payload_per_step
from loom.plan.efficiency import compute_fraction, link_efficiency
from loom.plan.hardware import Cluster
from loom.plan.memory import expert_state_bytes, gpu_memory
from loom.plan.shapes import with_stage_split, worthwhile_split
from loom.plan.step import bubble_fraction, flops_per_token, passes, step_time

GB = 1e9
MICRO_BATCHES = (1, 2, 4, 8, 16)
AC_MODES = ("none", "op", "selective", "full")  # activation checkpointing, from least recompute to most


def estimate(w: Workload, c: Candidate, cluster: Cluster, choose_loss: bool = False) -> dict:
    """One candidate, priced: the JSON record of `loom plan --format json`. `choose_loss` (the search):
    the stages' blocks (_split_of) and the loss (_loss_of) the candidate runs best; otherwise the
    workload's."""
    chunked = w.loss_chunk
    device = cluster.profile.device if cluster.profile is not None else "cuda"
    if choose_loss:
        w, mem = _split_of(w, c, cluster, device)
        w, mem = _loss_of(w, c, cluster, device, mem)
    else:
        mem = gpu_memory(w, c, cluster.fragmentation, device)
    comm, groups = comm_per_step(w, c, cluster.gpus_per_node)
    split = stage_split(w, c)
    record = {
        "label": record_label(c, w.loss_chunk != chunked, split), "full_logits": w.loss_chunk != chunked,
        "pp_stage_layers": list(split),
        "strategy": c.strategy, "engine": c.engine, "implementation": c.implementation,
        "runs_in_loom": c.runs_in_loom,
        "nodes": cluster.nodes, "gpus": c.world, "dp": c.dp, "dp_shard": c.shard_size, "tp": c.tp, "pp": c.pp,
        "cp": c.cp, "cp_mode": c.cp_mode,
        "pp_schedule": c.schedule, "pp_virtual_stages": c.virtual_stages,
        "sequence_parallel": c.sequence_parallel,
        "offload": c.offload, "recipe": w.recipe, "precision": w.precision,
        "activation_checkpointing": c.activation_checkpointing, "ac_every": c.ac_every,
        "micro_batch": c.micro_batch, "grad_accum": c.grad_accum,
        "memory_bytes": mem.to_dict(), "memory_stage": mem.stage,
        "host_memory_bytes": mem.host * cluster.gpus_per_node,  # per node
        "host_memory_bytes_per_gpu": mem.host, "nvme_bytes": mem.nvme * cluster.gpus_per_node,
        "comm_bytes_per_step": comm.total, "comm_bytes_by_link": {"intra_node": comm.intra_node,
                                                                  "inter_node": comm.inter_node},
        "comm_bytes_by_kind": comm.by_kind,
        "pipeline_bubble": bubble_fraction(c.pp, c.grad_accum, c.virtual_stages, c.schedule,
                                           passes(w.shape, w.seq_len, w.lora)) if c.pp > 1 else 0.0,
        "fits": None, "why_not": None, "step_time_s": None, "step_time_breakdown_s": None,
        "tokens_per_s": None, "mfu": None,
    }
    if w.shape.moe:  # an MoE model's: ep, the routed experts' states (memory_stage's, at rest, before any
        # offload) and expert parallelism's all_to_alls (also in comm_bytes_by_kind as ep_alltoall)
        held = expert_state_bytes(w, c, mem.stage)
        payload, calls = ep_payload_per_step(w, c)
        record.update(ep=c.ep, expert_state_bytes={"params": held.params, "grads": held.grads,
                                                   "optimizer": held.optimizer, "total": held.total},
                      ep_alltoall_payload_bytes_per_step=payload, ep_alltoall_calls_per_step=calls)
    if w.lora is not None:  # a rank's parameters before sharding (memory_stage's): frozen, trained
        rest, routed = lora.stage_params(w.shape, w.lora, mem.stage, c.pp, c.tp, c.ep)
        record["lora_params"] = {"base": rest.frozen + routed.frozen,
                                 "trainable": rest.trainable + routed.trainable}
    gpu = cluster.gpu
    if gpu is None:
        return record
    reasons = []
    if mem.total > gpu.memory_gb * GB:
        reasons.append(f"needs {mem.total / GB:.1f} GB per GPU > {gpu.memory_gb:g} GB")
    if record["host_memory_bytes"] > cluster.host_memory_gb * GB:
        reasons.append(f"needs {record['host_memory_bytes'] / GB:.0f} GB of host memory per node "
                       f"> {cluster.host_memory_gb:g} GB")
    if record["nvme_bytes"] > cluster.nvme_gb * GB:
        reasons.append(f"needs {record['nvme_bytes'] / GB:.0f} GB of NVMe per node > {cluster.nvme_gb:g} GB")
    t = step_time(w, c, cluster, comm, groups)
    flops = w.tokens_per_step * flops_per_token(w)  # under LoRA what it runs: no frozen weight's gradient
    record.update(fits=not reasons, why_not="; ".join(reasons) or None, step_time_s=t.total,
                  step_time_breakdown_s=t.to_dict(), tokens_per_s=w.tokens_per_step / t.total,
                  mfu=flops / (t.total * c.world * gpu.bf16_tflops * 1e12))
    return record


def enumerate_candidates(w: Workload, cluster: Cluster,
                         names: tuple[str, ...] = tuple(strategies.STRATEGIES)):
    shape, world, per_node = w.shape, cluster.world_size, cluster.gpus_per_node
    host_tier = cluster.profile is None or cluster.profile.device != "cpu"  # a CPU has no host to offload to
    tps = [t for t in (1, 2, 4, 8, 16) if t <= per_node and world % t == 0 and _tp_divides(shape, t)]
    grid = [(tp, pp, cp, mode) for tp in tps for pp in _pipeline_degrees(shape, world // tp)
            for cp, mode in _context_splits(w, world // (tp * pp), tp)]
    layouts = sorted(grid, key=lambda layout: layout[2] > 1)  # cp = 1 first (stable: the candidates' order)
    # "op" checkpointing of MoE blocks is priced only approximately (memory.py): not searched for them
    ac_modes = tuple(m for m in AC_MODES if m != "op" or not shape.moe) if shape.known else ("none",)
    for tp, pp, cp, mode in layouts:
        dp = world // (tp * pp * cp)
        if w.global_batch % dp:
            continue
        local_batch = w.global_batch // dp
        eps = [1] + (experts.splits(shape, dp) if cp == 1 else [])
        for strategy in names:
            for shard in _shards(strategy, dp, tp, per_node, cluster.nodes, cp):
                for offload, framework in _offloads(strategy, dp, tp, pp, host_tier, cp,
                                                    w.lora is not None or w.muon is not None):
                    if w.muon is not None and not muon.runs(strategies.lookup(strategy), tp, offload):
                        continue
                    for ep in eps:
                        if ep > 1 and not experts.valid(shape, Candidate(strategy, dp, tp, pp, shard, offload,
                                                                         framework=framework, ep=ep)):
                            continue
                        for schedule, virtual in _schedules(shape, pp):
                            for ac in ac_modes:
                                for mb in MICRO_BATCHES:
                                    if mb > local_batch or local_batch % mb:
                                        continue
                                    m = local_batch // mb
                                    if pp > 1 and (m < pp or not _worth_searching(shape.n_layers, pp, virtual,
                                                                                  schedule, m)):
                                        # 1F1B-style schedules need m ≥ p (GPipe too, to keep p busy)
                                        continue
                                    if ac == "op" and schedule in SPLIT_BACKWARD:
                                        continue  # torch's selective checkpoint allows one backward
                                    yield Candidate(strategy, dp, tp, pp, shard, offload, schedule, virtual,
                                                    ac, 2, mb, m, sequence_parallel=tp > 1,
                                                    framework=framework, cp=cp, cp_mode=mode, ep=ep)


def _context_splits(w: Workload, ranks: int, tp: int) -> list[tuple[int, str]]:
    """(cp, mode) pairs: cp = 1, and powers of two dividing the ranks left beside tp and pp for which
    loom splits the sequence (plan/context.py valid), in both modes."""
    splits = [(1, "ring")]
    cp = 2
    while cp <= ranks:
        if ranks % cp == 0:
            splits += [(cp, mode) for mode in context.MODES
                       if context.valid(w.shape, w.seq_len, cp, mode, tp, sequence_parallel=tp > 1)]
        cp *= 2
    return splits


def _tp_divides(shape, tp: int) -> bool:
    if tp == 1:
        return True
    if not shape.known:
        return False
    return not (shape.n_heads % tp or shape.n_kv_heads % tp or shape.ffn_hidden % tp or shape.vocab_size % tp)


def _pipeline_degrees(shape, ranks: int) -> list[int]:
    if not shape.known:
        return [1]
    return [p for p in (1, 2, 4, 8, 16, 32, 64) if p <= shape.n_layers and ranks % p == 0]


def _shards(strategy: str, dp: int, tp: int, per_node: int, nodes: int, cp: int = 1) -> list[int]:
    if strategies.lookup(strategy).dp_mesh != "hybrid":
        return [0]
    shard = per_node // (tp * cp)  # shard inside a node (over dp_shard × cp), replicate across nodes
    if nodes == 1 or shard < 1 or shard * cp < 2 or dp % shard or dp == shard:
        return []
    return [shard]


def _offloads(strategy: str, dp: int, tp: int, pp: int, host_tier: bool = True,
              cp: int = 1, lora: bool = False) -> list[tuple[str, str]]:
    """(offload, engine) pairs a strategy runs with. ZeRO-Offload takes stages 1-3 (the optimizer
    states); the parameters and NVMe need stage 3; hybrid sharding has FSDP2's CPUOffloadPolicy
    only. Sharding over one rank is no sharding: with dp = 1 only the simplest strategy that
    offers an offload tier is a candidate (zero3 tp8 is ddp tp8). loom's deepspeed engine runs
    ZeRO without TP or PP: those layouts are also priced on it. Nor does it split sequences: under
    cp > 1 only the torch engine's tiers; nor train LoRA adapters or step Muon (`lora`): the torch
    engine's alone."""
    s = strategies.lookup(strategy)
    if s.zero_stage == 0:
        tiers = ("none",)
    elif s.dp_mesh == "hybrid":
        tiers = ("none", "optimizer+params")
    elif s.zero_stage < 3:
        tiers = ("none", "optimizer")
    else:
        tiers = ("none", "optimizer", "optimizer+params", "optimizer-nvme", "nvme")
    if not host_tier:
        tiers = ("none",)
    if dp * cp == 1:  # the cp ranks share a shard too
        simpler = [name for name, other in strategies.STRATEGIES.items()
                   if other.zero_stage < s.zero_stage and other.dp_mesh != "hybrid"]
        taken = {tier for name in simpler for tier, _ in _offloads(name, 2, tp, pp, host_tier)}
        tiers = tuple(t for t in tiers if t not in taken)
    if cp > 1 or lora:
        return [(tier, "torch") for tier in tiers if tier in ("none", "optimizer+params")]
    pairs = [(tier, "torch") for tier in tiers]
    if s.deepspeed_stage and tp == pp == 1 and dp > 1 and s.dp_mesh != "hybrid":
        pairs.append(("none", "deepspeed"))
    return pairs


def _schedules(shape, pp: int) -> list[tuple[str, int]]:
    """(schedule, stages per rank) pairs searched; _worth_searching then checks the micro-batches.
    dualpipev only for a mixture of experts: its bubble and memory price above zbv's (no F&B overlap
    is credited), and the expert all-to-all it can hide is its reason to exist."""
    if pp == 1:
        return [("none", 1)]
    options = [("gpipe", 1), ("1f1b", 1), ("zb", 1)]
    if 2 * pp <= shape.n_layers:  # (layers that do not divide split as config.stage_sizes says)
        options += [("interleaved", 2), ("zb", 2), ("zbv", 2)] + ([("dualpipev", 2)] if shape.moe else [])
    return options


def _worth_searching(n_layers: int, pp: int, virtual: int, schedule: str, microbatches: int) -> bool:
    """The layout runs (schedule_runs), and is not one that prices worse on every count: zb over two
    stages per rank where zbv runs (the same sends, a larger bubble, no less memory)."""
    if not schedule_runs(n_layers, pp, virtual, schedule, microbatches):
        return False
    return not (schedule == "zb" and virtual > 1 and schedule_runs(n_layers, pp, 2, "zbv", microbatches))


def schedule_runs(n_layers: int, pp: int, virtual: int, schedule: str, microbatches: int) -> bool:
    """Whether loom/parallel/pipeline.validate_pipeline takes the layout (mirrored here: the planner
    imports no torch; tests/unit/test_plan_schedules.py checks the two agree)."""
    stages = pp * stages_per_rank(schedule, virtual)
    if stages > n_layers or (schedule in V_SCHEDULES and virtual > 2):
        return False
    if schedule == "interleaved" and virtual < 2:
        return False
    if schedule in ("gpipe", "1f1b") and virtual != 1:
        return False
    if schedule in ("1f1b", "interleaved", "zb") and microbatches < pp:
        return False
    if schedule in ("interleaved", "zb") and microbatches % (microbatches // pp):
        return False
    return schedule not in V_SCHEDULES or microbatches >= 2 * pp


NEAR_TIE = 0.05  # this close to the fastest, candidates are ranked by simplicity, not the model's last digits
TIGHT = 0.8  # of device memory: docs/planner.md's headroom rule; above it only when nothing fits under it
ROOM = 0.05  # of device memory: a near-tie saving this much wins on headroom; one saving less does not


@dataclass
class Plan:
    workload: Workload
    cluster: Cluster
    candidates: list[dict]
    recommended: int | None
    reason: str
    recommendable: list[int] = dataclasses.field(default_factory=list)  # near-ties, one per layout
    workload_origin: str = ""  # where the batch came from (the config's, or assumed)

    def to_dict(self) -> dict:
        shape = self.workload.shape
        model = {"name": shape.name, "num_params": shape.num_params, "known_shape": shape.known,
                 "seq_len": self.workload.seq_len, "global_batch": self.workload.global_batch,
                 "flops_per_token": shape.flops_per_token(self.workload.seq_len)}
        if shape.moe:
            model.update(active_params=shape.active_params, moe_experts=shape.moe_experts,
                         moe_top_k=shape.moe_top_k, moe_layers=shape.moe_layers,
                         moe_imbalance=self.workload.moe_imbalance)
        spec = self.workload.lora
        if spec is not None:
            model["lora"] = {"rank": spec.rank, "targets": list(spec.targets),
                             "expert_targets": list(spec.expert_targets),
                             "shared_targets": list(spec.shared_targets),
                             "train_embeddings": spec.train_embeddings, "train_norms": spec.train_norms,
                             "base_bytes": spec.base_bytes,
                             "adapter_params": lora.adapter_params(shape, spec),
                             "trainable_params": lora.trainable_params(shape, spec)}
        return {
            "model": model,
            "cluster": {**dataclasses.asdict(self.cluster), "world_size": self.cluster.world_size},
            "assumptions": assumptions(self.cluster, shape, any(r.get("cp", 1) > 1 for r in self.candidates),
                                       self.workload.moe_imbalance, self.workload.lora),
            "candidates": self.candidates, "recommended": self.recommended, "reason": self.reason,
            "recommendable": self.recommendable, "workload_origin": self.workload_origin,
        }


def assumptions(cluster: Cluster, shape=None, cp: bool = False, imbalance: float = 1.0,
                spec: lora.LoRA | None = None) -> list[str]:
    gpu = cluster.gpu
    moe = []
    lora_words = [] if spec is None else [
        f"LoRA {spec.describe()}: the base frozen in {spec.base_bytes} bytes per parameter, what trains in "
        f"fp32 with AdamW (16 bytes); no frozen weight's gradient (4 FLOPs per weight and token, not 6); the "
        f"torch engine only"]
    if shape is not None and shape.moe:
        moe = [f"mixture of experts: FLOPs of the active parameters (top {shape.moe_top_k} of "
               f"{shape.moe_experts} experts); the MoE blocks whole on each TP rank; expert parallelism's "
               f"all_to_alls exposed; the busiest rank's experts take {imbalance:g}× the mean tokens"
               + (" (ideal routing)" if imbalance == 1 else "")]
    if cluster.profile is not None:
        return [f"compute, elementwise work and collectives at the rates measured on this machine "
                f"({cluster.profile.describe()}; `loom plan --calibrate` remeasures)",
                "on a CPU nothing overlaps: the cores that compute also run the collectives",
                f"fragmentation margin {cluster.fragmentation:.0%} of allocated bytes; "
                "GB = 1e9 bytes"] + moe + lora_words
    fraction = cluster.achievable_fraction or compute_fraction(gpu, shape)
    efficiency = cluster.comm_efficiency or link_efficiency(gpu)
    return [
        (f"compute at {fraction:.0%} of the bf16 dense peak for this model (fitted to published runs, "
         f"docs/calibration.md; override: --hw achievable_fraction=), and no faster than "
         f"{gpu.kernel_launch_s * 1e6:g} µs per kernel launch"),
        (f"links at {efficiency:.0%} of their bandwidth; ring collectives; "
         f"{gpu.intra_node_latency_s * 1e6:g} µs "
         f"({gpu.inter_node_latency_s * 1e6:g} µs across nodes) per collective"),
        ("data-parallel collectives overlap with compute (only the excess is exposed); "
         "TP, PP and ZeRO-1's broadcast are exposed" + ("" if not cp else
                                                        "; CP's ring hides each hop behind its block's "
                                                        "attention, its all_to_alls are exposed")),
        f"fragmentation margin {cluster.fragmentation:.0%} of allocated bytes; GB = 1e9 bytes",
        "offload traffic and host Adam are not overlapped",
    ] + moe + lora_words


def search(w: Workload, cluster: Cluster, workers: int | None = None) -> Plan:
    """Price every candidate and recommend, among those loom runs that fit with headroom (under
    TIGHT of the device; any that fit when none has it), the simplest of the fastest. `workers`:
    processes to price with (price_all; by default one per core on a large search)."""
    if cluster.gpu is None:
        raise ConfigError("loom plan needs a GPU model to price step time; pass --gpu (e.g. --gpu H100-SXM)")
    records = price_all(w, cluster, list(enumerate_candidates(w, cluster)), workers)
    if not records:
        raise ConfigError(
            f"no layout of {cluster.world_size} GPUs divides the global batch of {w.global_batch} sequences "
            f"(dp must divide it); set train.batch_size to a multiple of {cluster.world_size}")
    fitting = [i for i, r in enumerate(records) if r["fits"]]
    if not fitting:
        closest = min(records, key=lambda r: r["memory_bytes"]["total"])
        raise ConfigError(f"nothing fits on {cluster.describe()} ({w.shape.name}; the leanest, "
                          f"{closest['label']}, {closest['why_not']}); "
                          + smallest_fitting_cluster(w, cluster))
    runnable = [i for i in fitting if records[i]["runs_in_loom"]]
    if not runnable:
        other = records[fitting[0]]
        raise ConfigError(f"only layouts loom does not run fit on {cluster.describe()} (e.g. "
                          f"{other['label']}: {unrunnable(other)}); "
                          + smallest_fitting_cluster(w, cluster, runnable=True))
    capacity = cluster.gpu.memory_gb * GB
    roomy = [i for i in runnable if records[i]["memory_bytes"]["total"] <= TIGHT * capacity]
    best, fastest, band = choose(records, roomy or runnable, capacity)
    preference = _simpler(records, best, fastest, band, capacity, _unit(cluster))
    headroom = (_set_aside(records, best, runnable, roomy, capacity, _unit(cluster)) if roomy else
                f"; nothing loom runs fits under {TIGHT:.0%} of the {_unit(cluster)}'s memory")
    why = _reason(records, best, cluster, roomy or runnable, preference + headroom, headroom=bool(roomy))
    if w.lora is not None:
        why += ". " + _lora_reason(w, cluster, records)
    return Plan(w, cluster, records, best, why, _one_per_layout(records, band, best))


PER_WORKER = 2000  # candidates: below this a worker process costs more than it saves


def price_all(w: Workload, cluster: Cluster, candidates: list[Candidate],
              workers: int | None = None) -> list[dict]:
    """Every candidate priced (estimate, choosing the loss), in their order. A large search is split
    into contiguous slices priced by forked worker processes, one per core (the records are plain
    dicts, cheap to send back): 113,278 candidates of 70B on 1024 GPUs take about 190 µs each."""
    if workers is None:
        workers = search_workers(len(candidates))
    elif "torch" in sys.modules:
        workers = 1  # (search_workers says why)
    if workers <= 1:
        return _price_slice(w, cluster, candidates)
    size = -(-len(candidates) // (4 * workers))  # a few slices per worker: the layouts' costs differ
    slices = [candidates[i:i + size] for i in range(0, len(candidates), size)]
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        priced = pool.starmap(_price_slice, [(w, cluster, part) for part in slices])
    return [record for part in priced for record in part]


def search_workers(candidates: int) -> int:
    """Processes to price `candidates` with: the cores this process may use, one per PER_WORKER
    candidates. Workers are forked, so only where forking is safe: on Linux (elsewhere fork is unsafe
    or absent, and a fresh interpreter per worker costs more than most searches), and in a process
    that has not imported torch (`loom plan` does not): a fork copies none of torch's threads, and a
    process group left for the collector then deadlocks the child that frees it."""
    if not sys.platform.startswith("linux") or "torch" in sys.modules:
        return 1
    cores = len(os.sched_getaffinity(0))
    return max(1, min(cores, candidates // PER_WORKER))


def _price_slice(w: Workload, cluster: Cluster, candidates: list[Candidate]) -> list[dict]:
    return [estimate(w, c, cluster, choose_loss=True) for c in candidates]


def record_label(c: Candidate, full_logits: bool, split: tuple[int, ...] = ()) -> str:
    """A record's label: the candidate's, the stages' blocks where they are not an even split, and the
    loss where the search unchunked it."""
    blocks = f" blocks {'/'.join(map(str, split))}" if split else ""
    return c.label() + blocks + (" full logits" if full_logits else "")


def record_workload(w: Workload, record: dict) -> Workload:
    """The workload as a record of the search prices it: its stages' blocks as it split them, its loss
    unchunked where it chose so."""
    if record.get("pp_stage_layers"):
        w = with_split(w, tuple(record["pp_stage_layers"]))
    return dataclasses.replace(w, loss_chunk=0) if record.get("full_logits") else w


def with_split(w: Workload, split: tuple[int, ...]) -> Workload:
    """The workload with its pipeline's stages holding `split`'s blocks (parallel.pp_stage_layers)."""
    if split == w.shape.stage_split:
        return w
    return dataclasses.replace(w, shape=with_stage_split(w.shape, split))


def stage_split(w: Workload, c: Candidate) -> tuple[int, ...]:
    """The blocks of each stage where the candidate's pipeline does not split them evenly; else ()."""
    split = w.shape.stage_split
    return split if c.pp > 1 and len(split) == c.pp * c.virtual_stages else ()


def _split_of(w: Workload, c: Candidate, cluster: Cluster, device: str):
    """(the workload with the stages' blocks balanced by FLOPs, its memory): shapes.balanced_split, fewer
    on the head's stage, where that lightens the busiest rank 5% or more (worthwhile_split), unless it
    then breaks the TIGHT headroom
    rule that the even split keeps (its extra blocks sit on earlier ranks, which hold more micro-batches
    in flight)."""
    split = worthwhile_split(w.shape, w.seq_len, c.pp, c.schedule, c.virtual_stages) if c.pp > 1 else ()
    balanced = with_split(w, split) if split else w
    mem = gpu_memory(balanced, c, cluster.fragmentation, device)
    if not split or cluster.gpu is None or mem.total <= TIGHT * cluster.gpu.memory_gb * GB:
        return balanced, mem
    even = with_split(w, ())
    even_mem = gpu_memory(even, c, cluster.fragmentation, device)
    return (even, even_mem) if even_mem.total <= TIGHT * cluster.gpu.memory_gb * GB else (balanced, mem)


def _loss_of(w: Workload, c: Candidate, cluster: Cluster, device: str, mem=None):
    """(the workload with the loss this candidate runs, its memory): the config's (train.loss_chunk),
    but the full logits where a chunk's head matmul would run again in backward (head_recomputed:
    GPipe, the split backwards) and the full logits still fit under the TIGHT headroom rule: memory
    spent for speed only where there is room for it. `mem`: the workload's memory, where known."""
    mem = mem or gpu_memory(w, c, cluster.fragmentation, device)
    room = TIGHT * cluster.gpu.memory_gb * GB if cluster.gpu is not None else 0.0
    if not head_recomputed(w, c) or mem.total > room:  # (the full logits hold more than the chunks)
        return w, mem
    full = dataclasses.replace(w, loss_chunk=0)
    full_mem = gpu_memory(full, c, cluster.fragmentation, device)
    if full_mem.total <= room:
        return full, full_mem
    return w, mem


def choose(records: list[dict], pool: list[int], capacity: float) -> tuple[int, int, list[int]]:
    """(recommended, fastest, near-ties): among the candidates the fastest is at most NEAR_TIE faster
    than, those of the simplest `kind`; of these, the fastest of those within ROOM of
    the device's memory of the leanest (a few hundred MB of headroom are not worth a near-tie's speed)."""
    fastest = max(pool, key=lambda i: (records[i]["tokens_per_s"], -records[i]["memory_bytes"]["total"]))
    floor = records[fastest]["tokens_per_s"] / (1 + NEAR_TIE)  # the fastest at most NEAR_TIE faster
    band = [i for i in pool if records[i]["tokens_per_s"] >= floor]
    simplest = min(kind(records[i], capacity) for i in band)
    alike = [i for i in band if kind(records[i], capacity) == simplest]
    leanest = min(records[i]["memory_bytes"]["total"] for i in alike)
    lean = [i for i in alike if records[i]["memory_bytes"]["total"] <= leanest + ROOM * capacity]
    best = max(lean, key=lambda i: (records[i]["tokens_per_s"], -records[i]["memory_bytes"]["total"]))
    return best, fastest, band


def kind(r: dict, capacity: float) -> tuple:
    """What a person prefers among near-equals, most important first: fewer parallel dimensions, the
    torch engine (its code is loom's own), no offload, no recomputation, room in memory (under TIGHT),
    the simpler strategy (ddp < zero1 < zero2 < zero3 < hsdp). `_kind_rule` says each in words."""
    tight = r["memory_bytes"]["total"] > TIGHT * capacity
    order = list(strategies.STRATEGIES).index(r["strategy"])
    return (dimensions(r), r["engine"] == "deepspeed", r["offload"] != "none",
            r["activation_checkpointing"] != "none", tight, order)


def simplicity(r: dict, capacity: float) -> tuple:
    """`kind`, then the most headroom, then the fastest."""
    return (*kind(r, capacity), r["memory_bytes"]["total"], -r["tokens_per_s"])


def dimensions(r: dict) -> int:
    """A record's parallel dimensions beyond data parallelism (Candidate.dimensions)."""
    return (r["tp"] > 1) + (r["pp"] > 1) + (r.get("cp", 1) > 1) + (r.get("ep", 1) > 1)


def _kind_rule(picked: dict, other: dict, capacity: float, unit: str) -> str | None:
    """The first rule of `kind` on which `picked` is the simpler, in words with the numbers it compares
    (None when the two are of one kind)."""
    mine, theirs = kind(picked, capacity), kind(other, capacity)
    if mine == theirs:
        return None
    rule = next(j for j, (a, b) in enumerate(zip(mine, theirs)) if a != b)
    mem = other["memory_bytes"]["total"]
    return (
        f"fewer parallel dimensions ({dimensions(picked)} vs {dimensions(other)})",
        "the torch engine (it runs on DeepSpeed)",
        f"no offload (it offloads the {other['offload']})",
        f"no recomputation (it checkpoints activations: {other['activation_checkpointing']})",
        f"memory headroom (it needs {size_text(mem)} per {unit}, {mem / capacity:.0%} of "
        f"{size_text(capacity)}, over the {TIGHT:.0%} headroom rule)",
        f"a simpler strategy ({picked['strategy']} before {other['strategy']})",
    )[rule]


def _simpler(records: list[dict], best: int, fastest: int, band: list[int], capacity: float,
             unit: str = "GPU") -> str:
    """Why the pick beat the fastest near-tie: what it was preferred to, how much faster that one is
    (both tokens/s), and the rule that decided ("" when the pick is the one fastest). A tie at the top
    is named, unless only micro-batch splits of the pick's own layout tie it; a faster such split (left
    out for its memory) is named with its micro-batch."""
    if fastest == best:
        ties = [i for i in band if i != best and records[i]["label"] != records[best]["label"]
                and records[i]["tokens_per_s"] >= records[best]["tokens_per_s"]]
        if not ties:
            return ""
        fastest = ties[0]
    picked, other = records[best], records[fastest]
    gap = other["tokens_per_s"] / picked["tokens_per_s"] - 1
    name = other["label"]
    if name == picked["label"]:  # a micro-batch split of the pick's own layout: say which
        name += f" at micro-batch {other['micro_batch']}×{other['grad_accum']}"
    rule = _kind_rule(picked, other, capacity, unit)
    mine, theirs = picked["memory_bytes"]["total"], other["memory_bytes"]["total"]
    if rule is None:  # one kind: the memory it saves (choose's ROOM), or on a tie the least memory
        a, b = sizes_apart(mine, theirs)
        rule = (f"{size_text(theirs - mine)} more memory headroom ({a} vs {b} per {unit}; a saving of "
                f"{ROOM:.0%} of the {unit}'s memory or more outweighs a near-tie's speed)"
                if gap > 0 and theirs - mine >= ROOM * capacity else f"less memory ({a} vs {b} per {unit})")
    if gap <= 0:
        speed = f"which ties it in predicted throughput ({picked['tokens_per_s']:,.0f} tokens/s)"
    else:
        fast, slow = numbers_apart(other["tokens_per_s"], picked["tokens_per_s"])
        speed = (f"which is predicted {percent(gap)} faster ({fast} vs {slow} tokens/s), within the "
                 f"{NEAR_TIE:.0%} the time model cannot tell apart")
    return f"preferred to {name} (#{fastest}), {speed}, for {rule}"


def _set_aside(records: list[dict], best: int, runnable: list[int], roomy: list[int], capacity: float,
               unit: str) -> str:
    """The layouts at least as fast as the pick that the headroom rule (TIGHT) left out whole (no
    micro-batch split of them under it), in words: how many, and the fastest with its memory ("" when
    there are none)."""
    kept = {records[i]["label"] for i in roomy}
    over = [i for i in runnable if records[i]["label"] not in kept
            and records[i]["tokens_per_s"] >= records[best]["tokens_per_s"]]
    if not over:
        return ""
    top = max(over, key=lambda i: records[i]["tokens_per_s"])
    r = records[top]
    mem = r["memory_bytes"]["total"]
    layouts = len({records[i]["label"] for i in over})  # micro-batch splits of a layout counted once
    count = (f"{layouts} layouts at least as fast that fit are" if layouts > 1 else
             "a layout at least as fast that fits is")
    return (f"; {count} set aside by the {TIGHT:.0%} memory headroom rule (at most "
            f"{size_text(TIGHT * capacity)} of {size_text(capacity)} per {unit}): the fastest, {r['label']} "
            f"(#{top}), {r['tokens_per_s']:,.0f} tokens/s, needs {size_text(mem)} ({mem / capacity:.0%})")


def percent(share: float) -> str:
    """A positive share as a percentage with the decimals that keep it from reading 0.0%."""
    for decimals in range(1, 5):
        text = f"{share * 100:.{decimals}f}"
        if float(text) > 0:
            return text + "%"
    return f"{share:.1e}"


def numbers_apart(a: float, b: float) -> tuple[str, str]:
    """Two numbers with thousands separators, with the decimals that tell them apart (none if equal)."""
    if a == b:
        return f"{a:,.0f}", f"{b:,.0f}"
    for decimals in range(4):
        x, y = f"{a:,.{decimals}f}", f"{b:,.{decimals}f}"
        if x != y:
            return x, y
    return f"{a:,.4f}", f"{b:,.4f}"


def sizes_apart(a: float, b: float) -> tuple[str, str]:
    """Two byte counts in size_text's unit, with the decimals that tell them apart: 49.87 GB vs 49.91 GB,
    not 49.9 GB vs 49.9 GB."""
    x, y = size_text(a), size_text(b)
    if x != y or a == b:
        return x, y
    scale, unit = (GB, "GB") if max(a, b) >= GB else (1e6, "MB")
    for decimals in range(1, 7):
        x, y = f"{a / scale:.{decimals}f} {unit}", f"{b / scale:.{decimals}f} {unit}"
        if x != y:
            return x, y
    return x, y


def _one_per_layout(records: list[dict], band: list[int], best: int) -> list[int]:
    """The recommendation, then the simplest candidate of each other layout in the band, then the
    best of the other engine (so --emit can write both). Context-parallel layouts only beside a
    context-parallel recommendation: when the sequence fits whole, splitting it adds a dimension for
    nothing (the time model prices it as a near-tie)."""
    chosen, layouts = [best], {_layout(records[best])}
    capacity = max(r["memory_bytes"]["total"] for r in records) * 2
    split = records[best].get("cp", 1) > 1
    for i in sorted(band, key=lambda i: simplicity(records[i], capacity)):
        if records[i].get("cp", 1) > 1 and not split:
            continue
        if _layout(records[i]) not in layouts:
            layouts.add(_layout(records[i]))
            chosen.append(i)
    engines = {records[i]["engine"] == "deepspeed" for i in chosen}
    others = [i for i, r in enumerate(records) if r["fits"] and r["runs_in_loom"]
              and (r["engine"] == "deepspeed") not in engines]
    if others and len(engines) == 1:
        chosen.append(max(others, key=lambda i: records[i]["tokens_per_s"]))
    return chosen


def _layout(r: dict) -> tuple:
    return (r["strategy"], r["tp"], r["pp"], r["pp_schedule"], r["offload"], r["engine"] == "deepspeed",
            r.get("cp", 1), r.get("cp_mode", "ring"), r.get("ep", 1))


def _lora_reason(w: Workload, cluster: Cluster, records: list[dict]) -> str:
    """What LoRA holds before sharding, and, when only offload makes it fit, that plainly, with the fewest
    GPUs on which it fits without."""
    spec, shape = w.lora, w.shape
    trained, adapters = lora.trainable_params(shape, spec), lora.adapter_params(shape, spec)
    frozen = shape.num_params - (trained - adapters)
    base = spec.base_bytes * frozen
    words = (f"LoRA ({spec.describe()}): the frozen base is {size_text(base)} ({spec.base_bytes} bytes × "
             f"{frozen / 1e9:.3g}B), what trains {size_text(16 * trained)} (16 bytes × {trained:,}), before "
             f"sharding")
    if any(r["fits"] and r["runs_in_loom"] and r["offload"] == "none" for r in records):
        return words
    share, memory, world = base / cluster.world_size, cluster.gpu.memory_gb * GB, cluster.world_size
    alone = f"the base alone is {size_text(share)} per {_unit(cluster)}" + (
        f" sharded over all {world}" if world > 1 else "")
    alone += (f", more than its {size_text(memory)}" if share > memory else
              f", and with any layout's activations and buffers more than its {size_text(memory)}")
    words += (f"; without offload it does not fit {cluster.describe()}: {alone}; it fits only with the "
              f"parameters on the host (parallel.offload=cpu)")
    smallest = _smallest_without_offload(w, cluster)
    return words + (f"; without offload the fewest that fit are {smallest}" if smallest else "")


def _smallest_without_offload(w: Workload, cluster: Cluster) -> str | None:
    """The smallest cluster (GPUs per node doubled up to 8, then nodes) where a layout loom runs fits
    without offload, in words with an example; None past 4096× this one."""
    per_node, nodes = cluster.gpus_per_node, cluster.nodes
    for _ in range(12):
        per_node, nodes = (per_node * 2, nodes) if per_node < 8 else (per_node, nodes * 2)
        bigger = dataclasses.replace(cluster, gpus_per_node=per_node, nodes=nodes)
        for c in enumerate_candidates(w, bigger):
            if c.offload == "none" and c.runs_in_loom and estimate(w, c, bigger)["fits"]:
                return f"{bigger.describe()} (e.g. {c.label()}: --gpus-per-node {per_node} --nodes {nodes})"
    return None


def unrunnable(record: dict) -> str:
    """Why loom does not run a (deepspeed-engine) record, in words: what it combines with DeepSpeed (the
    offload that needs it, or the engine alone), and what of it loom's deepspeed engine does not run."""
    what = [x for x, on in (("TP", record["tp"] > 1), ("PP", record["pp"] > 1),
                            ("CP", record.get("cp", 1) > 1), ("EP", record.get("ep", 1) > 1),
                            ("activation checkpointing", record["activation_checkpointing"] != "none"),
                            ("hybrid sharding", strategies.lookup(record["strategy"]).dp_mesh == "hybrid"))
            if on]
    engine = "DeepSpeed" if record["offload"] == "none" else f"DeepSpeed's offload of the {record['offload']}"
    what = ", ".join(what[:-1]) + " and " + what[-1] if len(what) > 1 else what[0]
    return f"{engine} with {what}, which loom's deepspeed engine does not run"


def smallest_fitting_cluster(w: Workload, cluster: Cluster, runnable: bool = False) -> str:
    """Where the workload fits: the fewest nodes (doubling) with a candidate that fits (`runnable`: one
    loom runs)."""
    nodes = cluster.nodes
    for _ in range(12):
        nodes *= 2
        bigger = dataclasses.replace(cluster, nodes=nodes)
        for c in enumerate_candidates(w, bigger):
            if (not runnable or c.runs_in_loom) and estimate(w, c, bigger)["fits"]:
                return (f"the smallest cluster that fits is {nodes} nodes × {cluster.gpus_per_node} "
                        f"(e.g. {c.label()}); add nodes (--nodes {nodes}) or a larger GPU")
    return "no cluster up to 4096× this size fits it either; check the model size and the batch"


def _unit(cluster: Cluster) -> str:
    """What the plan runs on, in words: a GPU, or this machine's CPU."""
    return "rank" if cluster.profile is not None and cluster.profile.device == "cpu" else "GPU"


def _reason(records: list[dict], best: int, cluster: Cluster, pool: list[int], preference: str = "",
            headroom: bool = True) -> str:
    r = records[best]
    t = r["step_time_breakdown_s"]
    share = {k: v / t["total"] for k, v in t.items() if k != "total"}
    largest = max((k for k in share if k != "compute"), key=share.get)
    mem = r["memory_bytes"]["total"]
    fit = f"that fit under the {TIGHT:.0%} memory headroom" if headroom else "that fit"
    tied = "which ties it" in preference
    rank = (f"the highest predicted throughput of those {fit}" if not preference.startswith("preferred") else
            f"the simplest of the fastest {fit}" if tied else
            f"the simplest of those within {NEAR_TIE:.0%} of the fastest {fit}")
    why = (f"{r['label']}: {rank} ({r['tokens_per_s']:,.0f} tokens/s, "
           f"MFU {r['mfu']:.0%}, {size_text(mem)} of {size_text(cluster.gpu.memory_gb * GB)} per "
           f"{_unit(cluster)}; "
           f"compute {share['compute']:.0%} of the step, then {largest.replace('_', ' ')} "
           f"{share[largest]:.0%})")
    if preference:
        why += f"; {preference.removeprefix('; ')}"
    big = cluster.nodes > 1 and cluster.world_size >= 512
    if r["engine"] == "deepspeed":
        engine = (f"engine: deepspeed ({r['implementation']}; parallel.engine = \"deepspeed\", loom runs "
                  "it): " + _why_deepspeed(records, best, pool, _unit(cluster), cluster.gpu.memory_gb * GB))
    elif big:
        engine = (f"engine: torch ({r['implementation']}; loom runs it); at {cluster.world_size} GPUs across "
                  "nodes DeepSpeed's mature large-scale and offload configs are the usual alternative")
    elif cluster.nodes == 1:
        engine = f"engine: torch ({r['implementation']}): one node, loom's own code, no DeepSpeed needed"
    else:
        engine = (f"engine: torch ({r['implementation']}): across nodes at moderate scale; torch-native "
                  "keeps the code minimal")
    return f"{why}. {engine}"


def _why_deepspeed(records: list[dict], best: int, pool: list[int], unit: str, capacity: float) -> str:
    """The true reason a DeepSpeed candidate won, though near-ties go to the torch engine: the same
    layout on the torch engine needs more memory, or the torch engine's fastest needs more parallel
    dimensions or is slower by more than NEAR_TIE, or no torch-engine layout fits."""
    r = records[best]
    offload = {"optimizer": "ZeRO-Offload of the optimizer to the host",
               "optimizer-nvme": "ZeRO-Infinity's optimizer on NVMe",
               "nvme": "ZeRO-Infinity's states on NVMe"}.get(r["offload"])
    how = f" with {offload}, which the torch engine does not run" if offload else ""
    shape_of = lambda x: (*_layout(x)[:4], *_layout(x)[6:], x["activation_checkpointing"])  # noqa: E731
    same = [x for x in records
            if x["engine"] != "deepspeed" and x["runs_in_loom"] and shape_of(x) == shape_of(r)]
    if same and not offload:
        twin = min(same, key=lambda x: x["memory_bytes"]["total"])
        if not twin["fits"] or twin["memory_bytes"]["total"] > TIGHT * capacity:
            verdict = f"more than a {unit} holds" if not twin["fits"] else f"over the {TIGHT:.0%} headroom"
            return (f"the same layout on the torch engine ({twin['label']}) needs "
                    f"{size_text(twin['memory_bytes']['total'])} per {unit}, {verdict}, against "
                    f"{size_text(r['memory_bytes']['total'])} on DeepSpeed")
    torch_ones = [i for i in pool if records[i]["engine"] != "deepspeed"]
    if not torch_ones:
        return f"it fits{how}, and no torch-engine layout fits with headroom"
    other = records[max(torch_ones, key=lambda i: records[i]["tokens_per_s"])]
    gap = r["tokens_per_s"] / other["tokens_per_s"] - 1
    more = dimensions(other) - dimensions(r)
    mine, theirs = numbers_apart(r["tokens_per_s"], other["tokens_per_s"])
    if gap <= NEAR_TIE and more > 0:
        return (f"it fits{how}; the torch engine's fastest ({other['label']}, {theirs} tokens/s against "
                f"{mine}) needs {more} more parallel dimension(s)")
    how = f", with {offload} (which the torch engine does not run)," if offload else ""
    return (f"predicted {percent(gap)} faster ({mine} vs {theirs} tokens/s){how} than the torch engine's "
            f"best ({other['label']})")


def size_text(nbytes: float) -> str:
    """Bytes for people: GB (MB under one), three significant figures, no exponent: 12.7 GB, 141 GB,
    99.3 MB."""
    value, unit = (nbytes / GB, "GB") if nbytes >= GB else (nbytes / 1e6, "MB")
    return f"{value:.0f} {unit}" if value >= 100 else f"{value:.3g} {unit}"


def emit_config(base, record: dict):
    """The loom Config that runs a candidate, from the user's config (model, data, batch kept)."""
    if not record["runs_in_loom"] and record.get("cp", 1) > 1:
        raise ConfigError(f"{record['label']} splits sequences (cp = {record['cp']}) on loom's deepspeed "
                          f"engine, which does not; pick a torch-engine candidate, or one with cp = 1")
    if not record["runs_in_loom"]:
        raise ConfigError(f"{record['label']} needs DeepSpeed's offload together with TP or PP, which loom's "
                          f"deepspeed engine does not run; pick a candidate with tp = pp = 1")
    cfg = dataclasses.replace(base, parallel=dataclasses.replace(base.parallel),
                              train=dataclasses.replace(base.train),
                              lora=dataclasses.replace(base.lora, targets=list(base.lora.targets)))
    p, t = cfg.parallel, cfg.train
    p.strategy, p.tp, p.pp = record["strategy"], record["tp"], record["pp"]
    p.sequence_parallel = record["sequence_parallel"]
    p.offload = "cpu" if record["offload"] == "optimizer+params" else "none"
    p.engine = "deepspeed" if record["engine"] == "deepspeed" else "torch"
    if p.engine == "deepspeed":  # ZeRO-Offload to the host, or ZeRO-Infinity to NVMe
        p.offload_optimizer = {"optimizer": "cpu", "optimizer-nvme": "nvme", "nvme": "nvme"}.get(
            record["offload"], "none")
        p.offload_params = "nvme" if record["offload"] == "nvme" else "none"
        if "nvme" in record["offload"]:
            p.nvme_path = p.nvme_path or "/local_nvme/loom"  # a directory on the node's NVMe disk
    p.activation_checkpointing, p.ac_every = record["activation_checkpointing"], record["ac_every"]
    if record.get("full_logits"):  # the loss unchunked: a chunk would recompute its logits (_loss_of)
        t.loss_chunk = 0
    cp = record.get("cp", 1)
    p.cp = cp
    if cp > 1:
        p.cp_mode = record["cp_mode"]
    p.ep = record.get("ep", 1)
    if strategies.lookup(record["strategy"]).dp_mesh == "hybrid":  # the record's N is dp_shard × cp
        p.dp_shard = record["dp_shard"] // cp
        p.dp_replicate = record["dp"] // p.dp_shard
    if record["pp"] > 1:
        p.pp_schedule, p.pp_virtual_stages = record["pp_schedule"], record["pp_virtual_stages"]
        p.pp_stage_layers = list(record.get("pp_stage_layers", []))
        p.microbatches, t.grad_accum = record["grad_accum"], 1
    else:
        t.grad_accum = record["grad_accum"]
    return cfg


def loss_chunk_of(cfg, model: str | None = None) -> int:
    """The loss chunk `loom train` runs the planned model with (train.loss_chunk): loom's GPT chunks
    its loss; a pretrained Hugging Face folder (model.init_from, or `loom plan --model` of a
    config.json beside its weights) returns full logits."""
    folder = Path(model).parent if model and model.endswith(".json") else None
    pretrained = cfg.model.init_from and model is None
    if pretrained or (folder is not None and any(folder.glob("*.safetensors"))):
        return 0
    return cfg.train.loss_chunk


def config_workload(cfg, shape, recipe: str = "torch", moe_imbalance: float = 1.0,
                    weight_pass_takes_functions: bool | None = None) -> Workload:
    """The workload a loom config trains (`moe_imbalance`: an MoE model's busiest expert's tokens over
    the mean, e.g. measured by a run; 1 is ideal routing), its LoRA (lora.*) included.
    `weight_pass_takes_functions` (Workload's field): a run's torch's own answer
    (loom/parallel/pipeline.py tries it; loom/train/record.py passes it); by default, as `loom plan`
    imports no torch, read off the installed version (installed_torch_takes_functions)."""
    if weight_pass_takes_functions is None:
        weight_pass_takes_functions = installed_torch_takes_functions()
    p = cfg.parallel
    split = tuple(p.pp_stage_layers) if p.pp > 1 else ()
    shape = with_stage_split(shape, split)
    return Workload(shape, cfg.data.seq_len, cfg.train.batch_size, cfg.train.precision, recipe,
                    loss_chunk_of(cfg), cfg.parallel.reduce_every_micro_step, moe_imbalance,
                    lora.from_config(cfg), muon.from_config(cfg), cfg.data.packing == "documents",
                    weight_pass_takes_functions)


def installed_torch_takes_functions() -> bool:
    """Whether the installed torch's split backward takes loom's autograd Functions, by its version
    (version_takes_functions); without torch, the pin's (it does)."""
    try:
        return version_takes_functions(importlib.metadata.version("torch"))
    except importlib.metadata.PackageNotFoundError:
        return True


def version_takes_functions(version: str) -> bool:
    """Whether torch `version` ("2.11.0+cu130") takes them: 2.13 and later do, 2.11 does not (2.12, not
    tried, is taken as 2.11: its plan prices the larger memory)."""
    numbers = re.match(r"(\d+)\.(\d+)", version)
    return numbers is None or (int(numbers[1]), int(numbers[2])) >= (2, 13)


def config_candidate(cfg, dp_replicate: int, dp_shard: int, tp: int, pp: int,
                     cp: int | None = None, ep: int | None = None) -> Candidate:
    """The candidate a resolved loom config runs (the inverse of emit_config); `cp` and `ep` the mesh's
    (by default the config's parallel.cp and parallel.ep)."""
    p, t = cfg.parallel, cfg.train
    cp = p.cp if cp is None else cp
    ep = getattr(p, "ep", 1) if ep is None else ep
    dp = dp_replicate * dp_shard
    pipelined = pp > 1
    micro = (p.microbatches or pp) if pipelined else t.grad_accum
    per_micro = t.batch_size // (dp * (t.grad_accum * micro if pipelined else micro))
    hybrid = strategies.lookup(p.strategy).dp_mesh == "hybrid"
    offload = "optimizer+params" if p.offload == "cpu" else "none"
    if p.engine == "deepspeed" and p.offload_params == "nvme":
        offload = "nvme"
    elif p.engine == "deepspeed" and p.offload_optimizer == "nvme" and p.offload_params == "none":
        offload = "optimizer-nvme"
    elif p.engine == "deepspeed" and p.offload_optimizer == "nvme":  # params on the host: the host tier
        offload = "optimizer+params"
    elif p.engine == "deepspeed" and p.offload_params != "none":
        offload = "optimizer+params"
    elif p.engine == "deepspeed" and p.offload_optimizer != "none":
        offload = "optimizer"
    return Candidate(p.strategy, dp, tp, pp, dp_shard if hybrid else 0, offload,
                     p.pp_schedule if pipelined else "none",
                     stages_per_rank(p.pp_schedule, p.pp_virtual_stages) if pipelined else 1,
                     p.activation_checkpointing, p.ac_every, per_micro, micro,
                     sequence_parallel=p.sequence_parallel and tp > 1, framework=p.engine,
                     fsdp_unit_mb=p.fsdp_unit_mb, cp=cp, cp_mode=p.cp_mode if cp > 1 else "ring", ep=ep,
                     dualpipev_overlap=p.dualpipev_overlap)
