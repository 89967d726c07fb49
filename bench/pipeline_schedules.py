"""The pipeline schedules side by side on CPU ranks: pp 4, 16 micro-batches, the small preset's
shape at 8 layers (a V needs two per rank), one sequence of 128 tokens per micro-batch, fp32, gloo:

  gpipe, 1f1b          one stage per rank
  interleaved, zb      two stages per rank, round-robin (pp_virtual_stages = 2)
  zbv, dualpipev       two stages per rank in a V

Each runs `loom profile` then `loom analyze` (bench/context_parallel.py's profile_run) and reads
their records: tokens/s (summary.json), each rank's bubble share of its step from the trace ledger
(ledger.json) beside the plan's bubble (plan.json), and each rank's activation peak measured and
planned (summary.json).

Then 1f1b and zbv at pp 2, a core per rank (pp 4 puts 4 ranks on this machine's 2 cores, and a rank
waiting for a descheduled neighbour reads as bubble). Then an MoE at pp 2 × ep 2 (4 ranks, 8 layers,
16 micro-batches): 1f1b, dualpipev with its overlap off (parallel.dualpipev_overlap = false: torch runs
each paired forward and backward one after the other) and dualpipev (loom/parallel/fb_overlap.py runs
them at once): tokens/s and the expert all-to-all exposed and hidden per step (the ledger's
`ep_alltoall`).

Goals (issue 41): zbv's bubble share ≤ 0.5 × 1f1b's, its memory per rank within ±10% of the plan;
dualpipev hides at least half of the all-to-all that 1f1b exposes.

    python bench/pipeline_schedules.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from context_parallel import profile_run  # bench/context_parallel.py (run from bench/, its folder)
from provenance import provenance

MIB = 2 ** 20
PP, MICROBATCHES = 4, 16
SCHEDULES = {"gpipe": (), "1f1b": (), "interleaved": ("parallel.pp_virtual_stages=2",),
             "zb": ("parallel.pp_virtual_stages=2",), "zbv": (), "dualpipev": ()}
SHAPE = ("model.preset=small", "model.n_layers=8", "data.seq_len=128", "parallel.strategy=zero3")
MOE = ("model.preset=tiny-moe", "model.n_layers=8", "model.moe_aux_loss_coef=0.01", "data.seq_len=128",
       "parallel.strategy=zero3", "parallel.pp=2", "parallel.ep=2", f"parallel.microbatches={MICROBATCHES}",
       f"train.batch_size={2 * MICROBATCHES}")
BUBBLE_GOAL, MEMORY_GOAL, HIDDEN_GOAL = 0.5, 0.10, 0.5


def _per_step(steps: list[dict], key: str) -> float:
    return sum(s.get(key, 0.0) for s in steps) / len(steps)


def run_schedule(schedule: str, root: Path, pp: int = PP) -> dict:
    out = root / f"{schedule}_pp{pp}"
    profile_run(pp, (*SHAPE, f"parallel.pp={pp}", f"parallel.microbatches={MICROBATCHES}",
                     f"train.batch_size={MICROBATCHES}", f"parallel.pp_schedule={schedule}",
                     *SCHEDULES[schedule]), out)
    summary = json.loads((out / "summary.json").read_text())
    plan = json.loads((out / "plan.json").read_text())
    ranks = json.loads((out / "ledger.json").read_text())["ranks"]
    bubble = [_per_step(r["steps"], "bubble_ms") / _per_step(r["steps"], "wall_ms") for r in ranks.values()]
    idle = [_per_step(r["steps"], "idle_ms") / _per_step(r["steps"], "wall_ms") for r in ranks.values()]
    peaks = [row["activation_peak_bytes"] for row in summary["measured_vs_planned"]]
    return {"schedule": schedule, "pp": pp, "tokens_per_s": summary["tokens_per_s"],
            "bubble_share": sum(bubble) / len(bubble), "bubble_share_by_rank": bubble,
            "idle_share": sum(idle) / len(idle), "planned_bubble": plan["pipeline_bubble"],
            "activation_peak_mib": [m / MIB for m, _ in peaks],
            "activation_planned_mib": [p / MIB for _, p in peaks]}


def run_moe(schedule: str, root: Path, overlap: bool = True) -> dict:
    name = schedule if overlap or schedule != "dualpipev" else "dualpipev, no overlap"
    out = root / f"moe_{schedule}_{overlap}"
    keys = (f"parallel.pp_schedule={schedule}", f"parallel.dualpipev_overlap={str(overlap).lower()}")
    profile_run(4, (*MOE, *keys), out)
    summary = json.loads((out / "summary.json").read_text())
    steps = [s for r in json.loads((out / "ledger.json").read_text())["ranks"].values() for s in r["steps"]]
    return {"schedule": name, "tokens_per_s": summary["tokens_per_s"], "wall_ms": _per_step(steps, "wall_ms"),
            "ep_exposed_ms": _per_step(steps, "ep_exposed_ms"),
            "ep_hidden_ms": _per_step(steps, "ep_hidden_ms")}


def print_table(rows: list[dict], own_cores: list[dict], moe: list[dict]) -> None:
    print(f"pipeline schedules, {MICROBATCHES} micro-batches of 1 × 128 tokens, small preset at 8 layers, "
          f"zero3, fp32, gloo (CPU, 2 cores)")
    print(f"{'schedule':12} {'pp':>3} {'tokens/s':>9} {'bubble':>7} {'planned':>8} {'idle':>6} "
          f"{'act peak MiB (max rank)':>24} {'planned':>8} {'÷ plan':>7}")
    for r in rows + own_cores:
        peak, planned = max(r["activation_peak_mib"]), max(r["activation_planned_mib"])
        print(f"{r['schedule']:12} {r['pp']:3d} {r['tokens_per_s']:9.0f} {r['bubble_share']:7.3f} "
              f"{r['planned_bubble']:8.3f} {r['idle_share']:6.3f} {peak:24.1f} {planned:8.1f} "
              f"{peak / planned:7.2f}")
    for group in (rows, own_cores):
        by = {r["schedule"]: r for r in group}
        ratio = by["zbv"]["bubble_share"] / by["1f1b"]["bubble_share"]
        worst = max((m / p - 1 for m, p in zip(by["zbv"]["activation_peak_mib"],
                                               by["zbv"]["activation_planned_mib"])), key=abs)
        print(f"goals at pp {group[0]['pp']}: zbv's bubble ≤ {BUBBLE_GOAL} × 1f1b's: {ratio:.2f}, "
              f"{_verdict(ratio <= BUBBLE_GOAL)}; zbv's activation peak within ±{MEMORY_GOAL:.0%} of the "
              f"plan on every rank: worst {worst:+.0%}, {_verdict(abs(worst) <= MEMORY_GOAL)}")
    print(f"MoE, pp 2 × ep 2 (tiny-moe at 8 layers, {MICROBATCHES} micro-batches), "
          "the expert all-to-all per step:")
    for r in moe:
        print(f"  {r['schedule']:22} {r['tokens_per_s']:7.0f} tokens/s, step {r['wall_ms']:7.1f} ms, "
              f"all-to-all exposed {r['ep_exposed_ms']:7.1f} ms, hidden {r['ep_hidden_ms']:7.1f} ms")
    m = {r["schedule"]: r for r in moe}
    base = m["1f1b"]["ep_exposed_ms"]
    hidden = (base - m["dualpipev"]["ep_exposed_ms"]) / base if base else float("nan")
    print(f"goal: dualpipev hides ≥ {HIDDEN_GOAL:.0%} of what 1f1b exposes: {hidden:.0%}, "
          f"{_verdict(hidden >= HIDDEN_GOAL)}")


def _verdict(met: bool) -> str:
    return "met" if met else "MISSED"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_schedule(s, Path(tmp)) for s in SCHEDULES]
        own_cores = [run_schedule(s, Path(tmp), pp=2) for s in ("1f1b", "zbv")]  # a core per rank
        moe = [run_moe("1f1b", Path(tmp)), run_moe("dualpipev", Path(tmp), overlap=False),
               run_moe("dualpipev", Path(tmp))]
    print_table(rows, own_cores, moe)
    if args.json:  # the record the docs quote (tests/unit/test_readme_figures.py checks them against it)
        command = "python " + " ".join([f"bench/{Path(__file__).name}", *sys.argv[1:]])
        args.json.write_text(json.dumps({"provenance": provenance(), "command": command, "rows": rows,
                                         "own_cores": own_cores, "moe": moe}, indent=1))


if __name__ == "__main__":
    main()
