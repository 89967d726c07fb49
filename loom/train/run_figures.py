"""The end-of-run figures beyond loss and memory: MFU where a peak is known, a mixture of experts'
load, and the eval trend. Computed once into summary.json (`figures`) and printed from there.

MFU is the planner's: its FLOPs per token (loom/plan/step.py flops_per_token, recorded in
plan.json) × the measured tokens/s ÷ (ranks × the device's peak): the catalog's bf16 peak of a
recognised GPU, or the matmul rate `loom plan --calibrate` measured (plan.json's peak_tflops).
"""

from __future__ import annotations

import statistics


def measured_mfu(tokens_per_s: float, plan: dict | None) -> tuple[float, float] | None:
    """(MFU, the peak TFLOPS per device it is of), or None where plan.json knows no peak."""
    if not plan:
        return None
    peak, per_token, ranks = (plan.get(k) for k in ("peak_tflops", "flops_per_token", "gpus"))
    if not peak or not per_token or not ranks:
        return None
    return tokens_per_s * per_token / (ranks * peak * 1e12), peak


def figures(tokens_per_s: float, plan: dict | None, evals: dict[int, float], final_eval: float | None,
            steps: int, moe_rows: list[dict]) -> dict:
    """summary.json's `figures`: mfu and its peak (None: no peak known), the evals in step order
    (the final one last), and a MoE run's median load imbalance and dropped tokens in all."""
    mfu = measured_mfu(tokens_per_s, plan)
    trend = sorted(evals.items()) + ([(steps, final_eval)] if final_eval is not None else [])
    out = {"mfu": mfu[0] if mfu else None, "peak_tflops": mfu[1] if mfu else None,
           "device": (plan or {}).get("gpu"), "evals": [[s, v] for s, v in dict(trend).items()]}
    imbalance = [r["moe_load_imbalance"] for r in moe_rows if r.get("moe_load_imbalance") is not None]
    if imbalance:
        out["moe"] = {"load_imbalance": statistics.median(imbalance), "steps": len(imbalance),
                      "dropped": sum(r.get("moe_dropped") or 0 for r in moe_rows)}
    return out


def lines(f: dict) -> list[str]:
    """The summary's lines for `figures`."""
    if f.get("mfu") is not None:
        device = f" ({f['device']})" if f.get("device") else ""
        out = [f"MFU {f['mfu']:.1%} of a {f['peak_tflops']:.3g} TFLOPS peak per device{device}"]
    else:
        out = ["MFU n/a (no peak known for this device; `loom plan --calibrate` measures a CPU's)"]
    if f.get("moe"):
        m = f["moe"]
        out.append(f"MoE load: busiest expert {m['load_imbalance']:.2f}× the mean (median of {m['steps']} "
                   f"steps), {m['dropped']:,} tokens dropped in all")
    evals = f.get("evals") or []
    if len(evals) > 1:
        (s0, v0), (s1, v1) = evals[0], evals[-1]
        out.append(f"eval loss: {v0:.4f} (step {s0}) → {v1:.4f} (step {s1}), {len(evals)} evals")
    return out
