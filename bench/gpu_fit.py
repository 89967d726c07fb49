"""The planner's step-time terms fitted to loom's own GPU rows, with in-sample and held-out error.

The catalog plan of a GPU run prices its step as terms (plan/step.py StepTime): compute (+
recompute and the pipeline bubble, all at the family's calibrated matmul rate), optimizer (+
offload, at memory and host-link rates) and exposed communication. Measured on a GPU each term
runs at its own efficiency, and the step carries what the plan has no term for (launches, host
work the device waits on). So the measured step is fitted as

    step = k_compute·(compute + recompute + bubble) + k_memory·(optimizer + offload)
           + k_comm·comm_exposed + t_fixed

by least squares on relative error (each row weighted by 1/measured), with two rows or more per
unknown: k_compute, then t_fixed, k_memory and k_comm as the rows allow (an unknown not fitted
keeps the plan's own term). The published-run calibration (docs/calibration.md) is left as it
is: these factors are per machine, on top of it. Reported: each row's plan, fit and measurement;
the error of the plan as it is, of the fit on every row (in-sample), and of the fit leaving each
row out in turn (held-out: the honest figure for a row the fit has not seen); and what `k_compute`
means for `loom plan --hw achievable_fraction=`.

    python bench/gpu_fit.py [ROWS.json ...]   # default: bench/gpu_rows.json and bench/results.json's GPU rows

A row: {"case", "measured_step_s", "planned_breakdown": plan.json's step_time_breakdown_s,
"planned_fraction": the plan's compute fraction}. `loom bench --gpu` writes them (bench/gpu.py).
A recorded row (bench/gpu_rows.json: measurements only) gives its "gpu" and "sets" (the config
keys of its run on one GPU) instead, and is planned here by today's planner.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # this checkout's loom
TERMS = {  # fitted factor: the plan's terms it scales
    "k_compute": ("compute", "recompute", "bubble"),
    "k_memory": ("optimizer", "offload"),
    "k_comm": ("comm_exposed",),
}


def columns(row: dict) -> dict[str, float]:
    parts = row["planned_breakdown"]
    return {k: sum(parts.get(t) or 0.0 for t in terms) for k, terms in TERMS.items()}


UNKNOWNS = ("k_compute", "t_fixed", "k_memory", "k_comm")  # fitted in this order as rows allow


def fit(rows: list[dict]) -> dict[str, float | None]:
    """The factors (and t_fixed, seconds) that minimise the rows' squared relative error. At least two
    rows per unknown, taken in UNKNOWNS' order among the terms some row has; the rest are not fitted
    (None: the plan's own, a factor of 1, and no fixed time)."""
    cols = [columns(r) for r in rows]
    present = [k for k in UNKNOWNS if k == "t_fixed" or any(c[k] > 0 for c in cols)]
    names = present[: max(len(rows) // 2, 1)]
    y = np.array([r["measured_step_s"] for r in rows])
    a = np.array([[1.0 if k == "t_fixed" else c[k] for k in names] for c in cols])
    w = 1.0 / y
    solution, *_ = np.linalg.lstsq(a * w[:, None], y * w, rcond=None)
    out: dict[str, float | None] = {k: None for k in UNKNOWNS}
    out.update(zip(names, solution.tolist()))
    return out


def predict(factors: dict[str, float | None], row: dict) -> float:
    c = columns(row)
    scaled = sum((1.0 if factors[k] is None else factors[k]) * c[k] for k in TERMS)
    return (factors["t_fixed"] or 0.0) + scaled


def rms(errors: list[float]) -> float:
    return float(np.sqrt(np.mean(np.square(errors)))) if errors else float("nan")


def report(rows: list[dict]) -> dict:
    """Every row's plan, in-sample fit and held-out fit against its measurement, and the errors."""
    factors = fit(rows)
    table = []
    for i, row in enumerate(rows):
        measured = row["measured_step_s"]
        planned = row["planned_breakdown"]["total"]
        others = rows[:i] + rows[i + 1:]
        held = predict(fit(others), row) if len(others) >= 2 else None
        table.append({"case": row["case"], "measured_s": measured, "planned_s": planned,
                      "fit_s": predict(factors, row), "held_out_s": held})
    err = lambda key: [t[key] / t["measured_s"] - 1 for t in table if t[key] is not None]  # noqa: E731
    fraction = rows[0].get("planned_fraction")
    return {"factors": factors, "rows": table, "plan_error": rms(err("planned_s")),
            "in_sample_error": rms(err("fit_s")), "held_out_error": rms(err("held_out_s")),
            "achievable_fraction": fraction / factors["k_compute"]
            if fraction and factors.get("k_compute") else None}


def gpu_rows(paths: list[Path]) -> list[dict]:
    """Rows from recorded files (a list of rows) and from bench results (the gpu bench's rows that
    carry a step and its plan)."""
    rows = []
    for path in paths:
        data = json.loads(path.read_text())
        if isinstance(data, dict):  # bench/results.json
            data = data.get("benches", {}).get("gpu", {}).get("rows", [])
        rows += gpu_rows_of(data)
    return rows


def gpu_rows_of(rows: list[dict]) -> list[dict]:
    """The rows that carry a measured step and the plan's terms (a recorded row planned here)."""
    rows = [planned(r) if "sets" in r and "planned_breakdown" not in r else r for r in rows]
    return [r for r in rows if r.get("measured_step_s") and r.get("planned_breakdown")]


def planned(row: dict) -> dict:
    """A recorded row with the catalog plan of its run: its config keys on one of its GPU."""
    from loom.config import load_config
    from loom.plan.command import model_shape
    from loom.plan.efficiency import compute_fraction
    from loom.plan.hardware import Cluster, lookup
    from loom.plan.search import config_candidate, config_workload, estimate

    cfg = load_config(None, row["sets"])
    shape = model_shape(cfg, None, None)
    gpu = lookup(row["gpu"])
    record = estimate(config_workload(cfg, shape), config_candidate(cfg, 1, 1, 1, 1), Cluster(gpu, 1, 1))
    return {**row, "planned_breakdown": record["step_time_breakdown_s"],
            "planned_fraction": compute_fraction(gpu, shape)}


def render(result: dict, source: str) -> str:
    f = result["factors"]
    lines = [f"{'case':34s} {'measured':>9s} {'planned':>9s} {'fit':>9s} {'held out':>9s}"]
    for t in result["rows"]:
        held = f"{t['held_out_s']:9.3f}" if t["held_out_s"] is not None else f"{'–':>9s}"
        lines.append(f"{t['case'][:34]:34s} {t['measured_s']:9.3f} {t['planned_s']:9.3f} "
                     f"{t['fit_s']:9.3f} {held}")
    shown = ", ".join(f"{k} {v:.3g}" for k, v in f.items() if v is not None)
    lines += [f"fit ({source}): {shown}",
              f"error (rms of step ÷ measured − 1): plan {result['plan_error']:.1%}, fit in-sample "
              f"{result['in_sample_error']:.1%}, held out {result['held_out_error']:.1%}"]
    if result["achievable_fraction"]:
        lines.append(f"k_compute as the catalog's knob: loom plan --hw achievable_fraction="
                     f"{result['achievable_fraction']:.3f}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    recorded = (HERE / "gpu_rows.json", HERE / "results.json")
    paths = [Path(a) for a in argv] or [p for p in recorded if p.exists()]
    rows = gpu_rows(paths)
    if len(rows) < 2:
        print(f"gpu_fit: {len(rows)} GPU row(s) with a step and its plan in {', '.join(map(str, paths))}; "
              "a fit needs 2 or more (run `loom bench --gpu` on a GPU)")
        return 1
    print(render(report(rows), ", ".join(p.name for p in paths)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
