"""`loom plan --explain N`: one candidate's memory and time arithmetic, line by line.

Every line names a quantity, its formula in symbols, the same formula with this candidate's
numbers, and the result, so a person can redo it by hand against the seeds' formulas. The lines
are the planner's own: memory.gpu_memory, comm.comm_per_step and step.step_time record each term
as they compute it (plan/terms.py), and this module prices the candidate once more with a
recording Terms and prints the record, computing nothing itself. Each section ends with a check
line: its recorded parts add up to the candidate's record in the plan (a ✗ there means a term was
priced but not recorded, or the record came from another planner: the tests fail on it).
"""

from __future__ import annotations

from loom import strategies
from loom.config import stage_sizes
from loom.errors import ConfigError
from loom.plan import lora
from loom.plan import step as steps
from loom.plan.candidate import Candidate
from loom.plan.comm import comm_per_step
from loom.plan.memory import gpu_memory
from loom.plan.search import TIGHT, estimate, record_label, record_workload, size_text, stage_split
from loom.plan.terms import GB, Terms, gb, num, sec


def candidate_of(record: dict) -> Candidate:
    """The Candidate a record of `loom plan --format json` prices (the inverse of search.estimate)."""
    hybrid = strategies.lookup(record["strategy"]).dp_mesh == "hybrid"
    deepspeed = record["engine"] == "deepspeed" and record["offload"] == "none"
    cp = record.get("cp", 1)  # the record's dp_shard is N, dp_shard × cp
    return Candidate(record["strategy"], record["dp"], record["tp"], record["pp"],
                     record["dp_shard"] // cp if hybrid else 0, record["offload"], record["pp_schedule"],
                     record["pp_virtual_stages"], record["activation_checkpointing"], record["ac_every"],
                     record["micro_batch"], record["grad_accum"], record["sequence_parallel"],
                     "deepspeed" if deepspeed else "torch", cp=cp, cp_mode=record.get("cp_mode", "ring"),
                     ep=record.get("ep", 1))


def explain(plan, index: int) -> str:
    count = len(plan.candidates)
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
        raise ConfigError(f"candidate {index} does not exist; the plan has {count} (0–{count - 1})")
    record = plan.candidates[index]
    w, cluster = plan.workload, plan.cluster
    w = record_workload(w, record)  # the loss the record runs (search._loss_of)
    c = candidate_of(record)
    out = Terms()
    _header(out, index, record, w, c, cluster)
    _memory(out, record, w, c, cluster)
    comm, groups = _comm(out, record, w, c, cluster)
    if cluster.gpu is not None and record["step_time_s"] is not None:
        _time(out, record, w, c, cluster, comm, groups)
        _throughput(out, record, w, c, cluster)
    return "\n".join(out.lines)


# ---------------------------------------------------------------------------------------------
# header


def _header(out: Terms, index: int, record: dict, w, c: Candidate, cluster) -> None:
    shape = w.shape
    out.lines.append(f"candidate {index}: {record['label']} — engine {record['engine']} ({c.implementation})"
                     f"{'' if record['runs_in_loom'] else ' (loom does not run it)'}")
    active = f" ({num(shape.active_params)} active)" if shape.moe else ""
    out.note(f"{shape.name}: {num(shape.num_params)} parameters{active}; {cluster.describe()}; "
             f"recipe {w.recipe}; {w.precision} compute (e = {w.act_bytes} bytes per activation element)")
    s = c.strategy_info
    shard = (f"N = {c.shard_size} (dp_shard; {c.replicate_size} replica groups)" if s.dp_mesh == "hybrid"
             else f"N = {c.shard_size}")
    cp = f" × cp {c.cp}" if c.cp > 1 else ""
    out.note(f"layout: dp {c.dp}{cp} × tp {c.tp} × pp {c.pp} = {c.world} ranks; {shard} ranks share one "
             f"shard of the model states")
    if c.ep > 1:
        out.note(f"expert parallel: ep = {c.ep} of the dp ranks split each MoE block's {shape.moe_experts} "
                 f"routed experts ({shape.moe_experts // c.ep} each); the strategy shards them over N_e = "
                 f"{c.expert_shard_size} ranks holding the same experts")
    if c.cp > 1:
        out.note(f"context parallel: cp = {c.cp} ({c.cp_mode}); each rank holds s/cp = {w.seq_len}/{c.cp} = "
                 f"{c.local_seq(w.seq_len)} tokens of each sequence (chunk i and its mirror 2cp−1−i); "
                 f"the batch divides over dp only")
    accum = "pipeline micro-batches m" if c.pp > 1 else "gradient-accumulation micro-steps"
    out.note(f"batch: global {w.global_batch} sequences × T = s = {w.seq_len} tokens = "
             f"{num(w.tokens_per_step)} tokens per step; per rank micro-batch b = {c.micro_batch} × "
             f"{c.grad_accum} {accum} (dp {c.dp} × {c.micro_batch} × {c.grad_accum} = "
             f"{c.dp * c.micro_batch * c.grad_accum})")
    if shape.known:
        out.note(f"shape: L = {shape.n_layers} layers, h = {shape.d_model}, a = H = {shape.n_heads} heads "
                 f"(Q = {shape.head_dim} per head, {shape.n_kv_heads} kv heads: kv = {shape.kv_dim}), "
                 f"f = {shape.ffn_hidden}, V = {shape.vocab_size}"
                 f"{', tied embeddings' if shape.tie_embeddings else ''}")
        if shape.moe:
            shared = f", shared experts h_s = {shape.moe_shared_hidden}" if shape.moe_shared_hidden else ""
            gate = " (gated)" if shape.moe_shared_gate else ""
            out.note(f"mixture of experts: L_m = {shape.moe_layers} MoE blocks (from block "
                     f"{shape.moe_dense_first}, every {shape.moe_every}), E = {shape.moe_experts} routed "
                     f"experts of h_e = {shape.moe_hidden}, top k = {shape.moe_top_k}{shared}{gate}; load "
                     f"imbalance {w.moe_imbalance:g}")
    else:
        out.note("shape: parameter count only (activations, TP/PP and attention FLOPs are not modelled)")
    if w.lora is not None:
        out.note(f"LoRA {w.lora.describe()}: the base frozen in {w.lora.base_bytes} bytes per parameter, "
                 f"{num(lora.adapter_params(shape, w.lora))} adapter parameters train in fp32 (lora.*)")
    if c.activation_checkpointing != "none":
        every = f" of every {c.ac_every} blocks" if c.activation_checkpointing == "selective" else ""
        out.note(f"activation checkpointing: {c.activation_checkpointing}{every}")
    split = stage_split(w, c)
    label = record_label(c, record.get("full_logits", False), split)
    if split:
        even = ", ".join(map(str, stage_sizes(shape.n_layers, len(split))))
        out.note(f"stages: {', '.join(map(str, split))} blocks (parallel.pp_stage_layers; evenly: {even})")
    if record.get("full_logits"):
        out.note(f"loss: the full logits, not chunks of train.loss_chunk: under {c.schedule} a chunk's "
                 f"logits are computed again in backward, and the full ones fit under the {TIGHT:.0%} "
                 "headroom rule")
    if label != record["label"]:
        out.note(f"✗ the candidate rebuilt from the record is {label!r}, not {record['label']!r}")
    again = estimate(w, c, cluster)
    same = again["memory_bytes"] == record["memory_bytes"] and again["step_time_s"] == record["step_time_s"]
    if not same:
        out.note("✗ the candidate rebuilt from the record prices differently from the record")


# ---------------------------------------------------------------------------------------------
# memory


def memory_device(cluster) -> str:
    """The device the planner prices memory for (search.estimate): gloo ranks on a measured CPU
    allocate differently from GPUs."""
    profile = cluster.profile
    return "cpu" if profile is not None and profile.device == "cpu" else "cuda"


def _unit(cluster) -> str:
    """What one rank runs on, in the section titles: a GPU, or (planning a CPU) a rank."""
    return "rank" if memory_device(cluster) == "cpu" else "GPU"


def _memory(out: Terms, record: dict, w, c: Candidate, cluster) -> None:
    """The planner's own account as memory.gpu_memory recorded it, and its parts against the record."""
    mem = gpu_memory(w, c, cluster.fragmentation, memory_device(cluster), out)
    m = record["memory_bytes"]
    parts = [("params", mem.params), ("grads", mem.grads), ("optimizer", mem.optimizer),
             ("activations", mem.activations), ("buffers", mem.buffers), ("fragmentation", mem.fragmentation)]
    out.check(parts, mem.total, m["total"], gb)
    gpu = cluster.gpu
    if gpu is not None:
        verdict = "fits" if record["fits"] else f"does not fit: {record['why_not']}"
        out.note(f"{gb(m['total'])} of {size_text(gpu.memory_gb * GB)} per {_unit(cluster)}; {verdict}")
    if mem.host or mem.nvme:
        where, value, key = (("host", mem.host, "host_memory_bytes") if mem.host
                             else ("NVMe", mem.nvme, "nvme_bytes"))
        out.item(f"{where} per node", f"{where} per GPU × GPUs per node",
                 f"{gb(value)} × {cluster.gpus_per_node}",
                 gb(record[key]))


# ---------------------------------------------------------------------------------------------
# communication


def _comm(out: Terms, record: dict, w, c: Candidate, cluster):
    out.section(f"communication per {_unit(cluster)} per step (ring: all-reduce 2(N−1)/N·Φ, all-gather and "
                "reduce-scatter (N−1)/N·Φ each, broadcast (N−1)/N·Φ; Φ = the whole tensor)")
    comm, groups = comm_per_step(w, c, cluster.gpus_per_node, out)
    parts = [("dp", groups["dp"])]
    parts += [(g, groups[g]) for g, degree in (("tp", c.tp), ("pp", c.pp), ("cp", c.cp), ("ep", c.ep))
              if degree > 1 and w.shape.known]
    if groups.get("muon"):
        parts.append(("muon", groups["muon"]))
    out.check(parts, sum(v for _, v in parts), record["comm_bytes_per_step"], gb)
    return comm, groups


# ---------------------------------------------------------------------------------------------
# step time


def _time(out: Terms, record: dict, w, c: Candidate, cluster, comm, groups) -> None:
    """The step time as step.step_time recorded it, and its parts against the record."""
    gpu, profile = cluster.gpu, cluster.profile
    if profile is None:
        out.section(f"step time on {gpu.name} (catalog: {num(gpu.bf16_tflops)} bf16 TFLOP/s dense, "
                    f"HBM {num(gpu.hbm_tbps)} TB/s, links {num(gpu.intra_node_gbps)} GB/s intra / "
                    f"{num(gpu.inter_node_gbps)} GB/s inter-node)")
    else:
        out.section(f"step time on the measured device ({profile.describe()}; rates for "
                    f"{cluster.gpus_per_node} rank(s) at once)")
    t = steps.step_time(w, c, cluster, comm, groups, out)
    parts = [("compute", t.compute), ("recompute", t.recompute), ("bubble", t.bubble),
             ("comm exposed", t.comm_exposed), ("optimizer", t.optimizer), ("offload", t.offload)]
    out.check(parts, t.total, record["step_time_s"], sec)


def _throughput(out: Terms, record: dict, w, c: Candidate, cluster) -> None:
    t = record["step_time_s"]
    out.item("tokens/s", "tokens per step / step time", f"{num(w.tokens_per_step)} / {sec(t)}",
             num(round(record["tokens_per_s"])))
    flops = w.tokens_per_step * steps.flops_per_token(w)  # under LoRA the FLOPs it runs
    peak = cluster.gpu.bf16_tflops
    out.item("MFU", "FLOPs per step / (step time × GPUs × peak)",
             f"{num(flops)} / ({sec(t)} × {c.world} × {num(peak)}e12)", f"{record['mfu']:.1%}")
