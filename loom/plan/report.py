"""`loom plan`'s output: the table of the best candidates, each strategy's best, the two-level
(GPU | host) account of model states, the assumptions and the recommendation."""

from __future__ import annotations

from loom.plan.candidate import Candidate, Workload
from loom.plan.memory import gpu_memory
from loom.plan.search import GB, Plan
from loom.strategies import STRATEGIES


def model_state_account(w: Workload, cluster) -> list[dict]:
    """Each strategy's model states per GPU and on the host, on the whole cluster without TP/PP:
    the seeds' walk from DDP's full replica to ZeRO-3 with offload."""
    world = cluster.world_size
    rows = []
    unsharded_dp = [(name, "none") for name, s in STRATEGIES.items() if s.dp_mesh != "hybrid"]
    for strategy, offload in unsharded_dp + [("zero3", "optimizer"), ("zero3", "optimizer+params")]:
        c = Candidate(strategy, world, offload=offload)
        m = gpu_memory(w, c, 0.0)
        rows.append({"label": c.label(), "gpu_bytes": m.model_states, "host_bytes_per_gpu": m.host,
                     "params": m.params, "grads": m.grads, "optimizer": m.optimizer,
                     "fits": m.model_states <= cluster.gpu.memory_gb * GB and
                     m.host * cluster.gpus_per_node <= cluster.host_memory_gb * GB})
    return rows


def params_text(count: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g}{unit}"
    return f"{count:.0f}"


def render_table(plan: Plan, top: int = 5) -> str:
    w, cluster, records = plan.workload, plan.cluster, plan.candidates
    shape = w.shape
    device = (f"({cluster.gpu.memory_gb:g} GB, {cluster.gpu.bf16_tflops:g} bf16 TFLOPs each)"
              if cluster.profile is None else
              f"({cluster.gpu.memory_gb:.3g} GB of memory each; {cluster.profile.describe()})")
    out = [(f"loom plan: {shape.name} ({params_text(shape.num_params)} params) on {cluster.describe()} "
            f"{device}, recipe {w.recipe}, {w.precision}, "
            f"global batch {w.global_batch} × {w.seq_len} tokens, {len(records)} candidates")]
    if plan.workload_origin:
        out.append(f"  {plan.workload_origin}")
    if not shape.known:
        out.append("  (parameter count only: activations, TP/PP and attention FLOPs are not modeled; "
                   "give a preset or config.json for those)")
    out.append("")
    out.append(f"model states per GPU on {cluster.world_size} GPUs (GPU | host), GB:")
    for row in model_state_account(w, cluster):
        mark = "fits" if row["fits"] else "does not fit"
        out.append(f"  {row['label']:<28} GPU {row['gpu_bytes'] / GB:9.1f}   "
                   f"host {row['host_bytes_per_gpu'] / GB:8.1f}"
                   f"   (params {row['params'] / GB:.1f} + grads {row['grads'] / GB:.1f} + optimizer "
                   f"{row['optimizer'] / GB:.1f})  {mark}")
    out.append("")
    fitting = sorted((i for i, r in enumerate(records) if r["fits"]),
                     key=lambda i: -records[i]["tokens_per_s"])
    shown = fitting[:top]
    for strategy in STRATEGIES:  # each strategy's best, fitting or (if none fits) the smallest
        mine = [i for i, r in enumerate(records) if r["strategy"] == strategy]
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
    header = (f"{'#':>5} {'candidate':<44} {'mb×acc':>7} {'GPU GB':>7} {'act GB':>7} {'host GB/node':>12} "
              f"{'comm GB':>8} {'inter%':>6} {'step s':>8} {'tok/s':>11} {'MFU':>5}  fits")
    out += [header, "-" * len(header)]
    for i in shown:
        r = records[i]
        m = r["memory_bytes"]
        comm = r["comm_bytes_per_step"]
        inter = r["comm_bytes_by_link"]["inter_node"] / comm if comm else 0.0
        fits = "yes" if r["fits"] else f"no: {r['why_not']}"
        star = "*" if i == plan.recommended else " "
        out.append(f"{star}{i:>4} {r['label']:<44} {r['micro_batch']:>3}×{r['grad_accum']:<3} "
                   f"{m['total'] / GB:7.1f} {m['activations'] / GB:7.1f} {r['host_memory_bytes'] / GB:12.0f} "
                   f"{comm / GB:8.2f} {inter:6.0%} "
                   f"{r['step_time_s']:8.3f} {r['tokens_per_s']:11,.0f} {r['mfu']:5.0%}  {fits}")
    best = records[plan.recommended]
    t = best["step_time_breakdown_s"]
    out += ["", "step time of the recommendation: " + ", ".join(
        f"{k.replace('_', ' ')} {v:.3f} s" for k, v in t.items() if k != "total") + f" = {t['total']:.3f} s",
        "assumptions: " + "; ".join(plan.to_dict()["assumptions"]), "",
        f"recommended (*): {plan.reason}"]
    return "\n".join(out)
