"""`loom plan`'s output: the table of the best candidates, each strategy's best, the two-level
(GPU | host) account of model states, the assumptions and the recommendation."""

from __future__ import annotations

import dataclasses

from loom.plan import lora, muon
from loom.plan.candidate import Candidate, Workload
from loom.plan.memory import gpu_memory
from loom.plan.search import GB, Plan, estimate, record_workload, size_text, unrunnable
from loom.strategies import STRATEGIES


def model_state_account(w: Workload, cluster) -> list[dict]:
    """Each strategy's model states per GPU and on the host, on the whole cluster without TP/PP:
    the seeds' walk from DDP's full replica to ZeRO-3 with offload (under LoRA without ZeRO-Offload of the
    optimizer alone, DeepSpeed's, which does not train adapters here)."""
    world = cluster.world_size
    rows = []
    unsharded_dp = [(name, "none") for name, s in STRATEGIES.items() if s.dp_mesh != "hybrid"]
    on_cpu = cluster.profile is not None and cluster.profile.device == "cpu"  # no host to offload to
    offloaded = [] if on_cpu else [("zero3", "optimizer"), ("zero3", "optimizer+params")]
    if w.lora is not None:
        offloaded = [(strategy, tier) for strategy, tier in offloaded if tier == "optimizer+params"]
    if w.muon is not None:  # Muon's exchange runs on the device: loom refuses offload with it
        offloaded = []
    for strategy, offload in unsharded_dp + offloaded:
        c = Candidate(strategy, world, offload=offload)
        m = gpu_memory(w, c, 0.0)
        rows.append({"label": c.label(), "gpu_bytes": m.model_states, "host_bytes_per_gpu": m.host,
                     "params": m.params, "grads": m.grads, "optimizer": m.optimizer,
                     "fits": m.model_states <= cluster.gpu.memory_gb * GB and
                     m.host * cluster.gpus_per_node <= cluster.host_memory_gb * GB})
    return rows


def lora_line(w: Workload) -> str:
    """LoRA in one line: what it adapts, what trains, and the bytes before sharding."""
    spec, shape = w.lora, w.shape
    trained, adapters = lora.trainable_params(shape, spec), lora.adapter_params(shape, spec)
    frozen = shape.num_params - (trained - adapters)
    stand_in = "" if shape.known else " (adapters counted on a Llama-style shape of that size)"
    share = trained / shape.num_params
    return (f"LoRA {spec.describe()}: {params_text(trained)} trainable parameters ({share:.2%} of "
            f"{params_text(shape.num_params)}){stand_in}; the frozen base "
            f"{size_text(spec.base_bytes * frozen)} ({spec.base_bytes} bytes each), what trains "
            f"{size_text(16 * trained)} (16 bytes each), before sharding")


def muon_line(w: Workload, world: int) -> str:
    """What Muon changes (plan/muon.py): its share of the parameters, their optimizer bytes, and a
    zero3 rank's Newton-Schulz FLOPs and exchange per step."""
    shape = w.shape
    mats = muon.stage_matrices(shape, 0, 1, w.lora)
    cost = muon.rank_cost(shape, Candidate("zero3", world), w.muon, 0, w.lora)
    what = "LoRA's adapters" if w.lora is not None else "the blocks' matrices"
    trained = lora.trainable_params(shape, w.lora) if w.lora is not None else shape.num_params
    return (f"muon: {what} ({params_text(mats.params)} of {params_text(trained)} trained params) keep one "
            f"momentum, 4 bytes where AdamW keeps 8; per step a zero3 rank on {world} runs "
            f"{flops_text(cost.flops)} of Newton-Schulz ({w.muon.ns_steps} iterations) and sends "
            f"{size_text(cost.payload)} in {cost.count} all-to-alls")


def muon_versus_adamw(plan: Plan) -> str:
    """The recommendation priced again with AdamW for every parameter: Muon's memory drop and the
    time its Newton-Schulz iterations and exchange add."""
    from loom.plan.explain import candidate_of  # (explain imports search, as this module does)
    best = plan.candidates[plan.recommended]
    adamw = estimate(dataclasses.replace(record_workload(plan.workload, best), muon=None), candidate_of(best),
                     plan.cluster)
    m, a = best["memory_bytes"], adamw["memory_bytes"]
    unit = "rank" if plan.cluster.profile is not None and plan.cluster.profile.device == "cpu" else "GPU"
    step, base = best["step_time_s"], adamw["step_time_s"]
    return (f"muon vs AdamW on the recommendation: optimizer states {size_text(m['optimizer'])} vs "
            f"{size_text(a['optimizer'])} per {unit} ({size_text(a['optimizer'] - m['optimizer'])} less), "
            f"step {step:.3f} s vs {base:.3f} s ({(step / base - 1):+.1%}: Newton-Schulz and its exchange "
            f"in the optimizer's {best['step_time_breakdown_s']['optimizer']:.3f} s)")


def flops_text(flops: float) -> str:
    """FLOPs for people: 83.2 TFLOP, 58.3 MFLOP."""
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if flops >= scale:
            return f"{flops / scale:.3g} {unit}FLOP"
    return f"{flops:.3g} FLOP"


def params_text(count: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g}{unit}"
    return f"{count:.0f}"


def byte_unit(largest: float) -> tuple[str, float]:
    """The unit a column of byte counts reads best in: GB, or MB when all are under a GB."""
    return ("GB", GB) if largest >= GB else ("MB", 1e6)


def render_table(plan: Plan, top: int = 5) -> str:
    w, cluster, records = plan.workload, plan.cluster, plan.candidates
    shape = w.shape
    on_cpu = cluster.profile is not None and cluster.profile.device == "cpu"
    unit, units = ("rank", "ranks") if on_cpu else ("GPU", "GPUs")
    device = (f"({cluster.gpu.memory_gb:g} GB, {cluster.gpu.bf16_tflops:g} bf16 TFLOPs each)"
              if cluster.profile is None else
              f"({size_text(cluster.gpu.memory_gb * GB)} of memory each; {cluster.profile.describe()})")
    params = params_text(shape.num_params)
    if shape.moe:
        params += f", {params_text(shape.active_params)} active"
    out = [(f"loom plan: {shape.name} ({params} params) on {cluster.describe()} "
            f"{device}, recipe {w.recipe}, {w.precision}, "
            f"global batch {w.global_batch} × {w.seq_len} tokens, {len(records)} candidates")]
    if plan.workload_origin:
        out.append(f"  {plan.workload_origin}")
    if not shape.known:
        out.append("  (parameter count only: activations, TP/PP and attention FLOPs are not modeled; "
                   "give a preset or config.json for those)")
    if w.lora is not None:
        out.append(f"  {lora_line(w)}")
    if w.muon is not None and shape.known:
        out.append(f"  {muon_line(w, cluster.world_size)}")
    out.append("")
    account = model_state_account(w, cluster)
    name, scale = byte_unit(max(row["gpu_bytes"] + row["host_bytes_per_gpu"] for row in account))
    where = "" if on_cpu else " (GPU | host)"
    out.append(f"model states per {unit} on {cluster.world_size} {units}{where}, {name}:")
    for row in account:
        mark = "fits" if row["fits"] else "does not fit"
        host = "" if on_cpu else f"   host {row['host_bytes_per_gpu'] / scale:8.1f}"
        out.append(f"  {row['label']:<30} {unit} {row['gpu_bytes'] / scale:9.1f}{host}"
                   f"   (params {row['params'] / scale:.1f} + grads {row['grads'] / scale:.1f} + optimizer "
                   f"{row['optimizer'] / scale:.1f})  {mark}")
    out.append("")
    # ranked: only what loom runs; what fits but loom does not run is listed apart, below
    fitting = sorted((i for i, r in enumerate(records) if r["fits"] and r["runs_in_loom"]),
                     key=lambda i: -records[i]["tokens_per_s"])
    shown = []
    for i in fitting:  # the fastest of each label: micro-batch splits that tie would fill the table
        if len(shown) < top and all(records[j]["label"] != records[i]["label"] for j in shown):
            shown.append(i)
    for strategy in STRATEGIES:  # each strategy's best, fitting or (if none fits) the smallest
        mine = [i for i, r in enumerate(records) if r["strategy"] == strategy and r["runs_in_loom"]]
        if not mine:
            continue
        fit = [i for i in mine if records[i]["fits"]]
        best = max(fit, key=lambda i: records[i]["tokens_per_s"]) if fit else \
            min(mine, key=lambda i: records[i]["memory_bytes"]["total"])
        if best not in shown:
            shown.append(best)
    for i in plan.recommendable:  # the near-ties a person would weigh, after the fastest
        if i not in shown:
            shown.append(i)
    name, scale = byte_unit(max(records[i]["memory_bytes"]["total"] for i in shown))
    comm_name, comm_scale = byte_unit(max(records[i]["comm_bytes_per_step"] for i in shown))
    host = "" if on_cpu else f" {'host GB/node':>12}"
    header = (f"{'#':>5} {'candidate':<44} {'mb×acc':>7} {f'{unit} {name}':>8} {f'act {name}':>7}{host} "
              f"{f'comm {comm_name}':>8} {'inter%':>6} {'step s':>8} {'tok/s':>11} {'MFU':>5}  fits")
    out += [header, "-" * len(header)]
    for i in shown:
        r = records[i]
        m = r["memory_bytes"]
        comm = r["comm_bytes_per_step"]
        inter = r["comm_bytes_by_link"]["inter_node"] / comm if comm else 0.0
        fits = "yes" if r["fits"] else f"no: {r['why_not']}"
        star = "*" if i == plan.recommended else " "
        host = "" if on_cpu else f" {r['host_memory_bytes'] / GB:12.0f}"
        out.append(f"{star}{i:>4} {r['label']:<44} {r['micro_batch']:>3}×{r['grad_accum']:<3} "
                   f"{m['total'] / scale:8.1f} {m['activations'] / scale:7.1f}{host} "
                   f"{comm / comm_scale:8.2f} {inter:6.0%} "
                   f"{r['step_time_s']:8.3f} {r['tokens_per_s']:11,.0f} {r['mfu']:5.0%}  {fits}")
    apart = sorted((i for i, r in enumerate(records) if r["fits"] and not r["runs_in_loom"]),
                   key=lambda i: -records[i]["tokens_per_s"])
    if apart:
        fastest = [i for n, i in enumerate(apart)  # the fastest micro-batch split of each layout
                   if all(records[j]["label"] != records[i]["label"] for j in apart[:n])]
        out += ["", f"fit, but not ranked: loom does not run them: {len(fastest)} layouts "
                    f"({len(apart)} candidates), the fastest:"]
        out += [f"  {i:>4} {records[i]['label']:<44} {records[i]['tokens_per_s']:11,.0f} tokens/s  "
                f"({unrunnable(records[i])})" for i in fastest[:3]]
    best = records[plan.recommended]
    t = best["step_time_breakdown_s"]
    out += ["", "step time of the recommendation: " + ", ".join(
        f"{k.replace('_', ' ')} {v:.3f} s" for k, v in t.items() if k != "total") + f" = {t['total']:.3f} s"]
    if w.muon is not None and shape.known:
        out.append(muon_versus_adamw(plan))
    out += [
        "assumptions: " + "; ".join(plan.to_dict()["assumptions"]), "",
        f"recommended (*): {plan.reason}"]
    return "\n".join(out)
