"""Muon against AdamW on 2 CPU ranks (gloo, zero3): the small preset (d 256, 4 blocks, 8 heads,
SwiGLU width 768, byte vocabulary: 3.3M parameters, 3.1M of them in the blocks' matrices) trained
to the same tokens (--steps × 16 × 128) on the stdlib corpus, once with AdamW and once with
train.optimizer = "muon" (Muon for the blocks' matrices, AdamW for the embedding, head and norms;
muon.lr unset: train.lr under the match_rms_adamw scale, as Moonlight and Kimi run it). The same
seed, data order, LR schedule (warmup, cosine), clipping and weight decay.

From each run's records:

  loss curve      metrics.jsonl: each step's training loss, printed side by side every --every steps;
                  smoothed over 10 steps for the crossing below
  to AdamW's end  the first step at which Muon's smoothed loss reaches AdamW's final smoothed loss:
                  Muon's steps ÷ AdamW's (published runs at scale: about 0.5-0.7)
  eval            summary.json: the held-out loss at the end
  optimizer ms    metrics.jsonl: the always-on ledger's optimizer phase per step (median of the
                  steady steps), Muon ÷ AdamW
  optim MiB       memory.json: the optimizer states each rank holds, measured, Muon ÷ AdamW, beside
                  plan.json's planned optimizer bytes

Goals (issue 42): optimizer states per rank ≤ 0.55 × AdamW's; optimizer time per step ≤ 1.5 ×
AdamW's under zero3 on 2 ranks.

    python bench/muon.py [--steps 300] [--every 25] [--json PATH (bench/muon_results.json)]
                         [--table PATH] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from harness import Context, Progress
from provenance import describe, provenance

HERE = Path(__file__).resolve().parent
MIB = 2**20
SEQ, BATCH, STEPS, WINDOW = 128, 16, 300, 10
WORKLOAD = ("model.preset=small", f"data.seq_len={SEQ}", f"train.batch_size={BATCH}", "data.num_workers=0",
            "parallel.strategy=zero3", "train.warmup_steps=20", "train.log_every=50", "train.eval_batches=8")
OPTIMIZERS = {"adamw": (), "muon": ("train.optimizer=muon",)}
STATES_GOAL, TIME_GOAL = 0.55, 1.5


def _smoothed(losses: list[float]) -> list[float]:
    return [statistics.mean(losses[max(0, i - WINDOW + 1):i + 1]) for i in range(len(losses))]


def _measures(run) -> dict:
    ranks = list(run.memory["ranks"].values())
    steady = run.metrics[2:] or run.metrics
    memory, times = run.plan.get("memory_bytes", {}), run.plan.get("step_time_breakdown_s", {})
    return {"losses": [m["loss"] for m in run.metrics], "eval_loss": run.summary.get("eval_loss"),
            "tokens_per_s": run.tokens_per_s,
            "optimizer_ms": 1e3 * statistics.median(m["optimizer_s"] for m in steady),
            "planned_optimizer_ms": 1e3 * times["optimizer"] if "optimizer" in times else None,
            "step_ms": 1e3 * statistics.median(m["step_time_s"] for m in steady),
            "optimizer_mib": [r["optimizer_bytes"] / MIB for r in ranks],
            "planned_optimizer_mib": memory["optimizer"] / MIB if "optimizer" in memory else None,
            "model_states_mib": [r["model_state_bytes"] / MIB for r in ranks],
            "busy": min(sum(r.get("core_wait_share") or 0.0 for r in ranks), 0.9),
            "command": run.command}


def crossing(muon: list[float], adamw: list[float]) -> int | None:
    """The first step (1-based) at which Muon's smoothed loss reaches AdamW's final smoothed loss."""
    target = _smoothed(adamw)[-1]
    return next((i + 1 for i, x in enumerate(_smoothed(muon)) if x <= target), None)


def print_table(result: dict, every: int) -> None:
    runs = result["runs"]
    a, m = runs["adamw"], runs["muon"]
    print(f"Muon vs AdamW, small preset (3.3M params), {BATCH} × {SEQ} tokens per step, zero3 on 2 CPU ranks "
          f"(gloo), fp32; {describe(result['provenance'])}")
    print(f"{'step':>5} {'adamw loss':>11} {'muon loss':>10}")
    sa, sm = _smoothed(a["losses"]), _smoothed(m["losses"])
    for i in range(every - 1, len(sa), every):
        print(f"{i + 1:5d} {sa[i]:11.4f} {sm[i]:10.4f}")
    print(f"(losses smoothed over {WINDOW} steps)")
    cross = result["muon_steps_to_adamw_final"]
    where = f"step {cross} of {len(sa)} = {cross / len(sa):.2f}×" if cross else "not within the run"
    print(f"Muon reaches AdamW's final loss ({sa[-1]:.4f}) at {where}; eval: adamw {a['eval_loss']:.4f}, "
          f"muon {m['eval_loss']:.4f}")
    print(f"{'':7} {'tokens/s':>9} {'step ms':>8} {'opt ms':>7} {'planned':>8} {'optim MiB (rank 0, 1)':>22} "
          f"{'planned':>8} {'busy':>5}")
    for name, r in runs.items():
        mib = ", ".join(f"{x:.2f}" for x in r["optimizer_mib"])
        ms, planned_mib = (f"{r[k]:.2f}" if r.get(k) else "–"
                           for k in ("planned_optimizer_ms", "planned_optimizer_mib"))
        print(f"{name:7} {r['tokens_per_s']:9.0f} {r['step_ms']:8.0f} {r['optimizer_ms']:7.1f} {ms:>8} "
              f"{mib:>22} {planned_mib:>8} {r['busy']:5.2f}")
    print(f"Muon ÷ AdamW: optimizer states {result['states_ratio']:.3f} (goal ≤ {STATES_GOAL}: "
          f"{'met' if result['states_met'] else 'MISSED'}); optimizer time {result['time_ratio']:.2f}× "
          f"(goal ≤ {TIME_GOAL}: {'met' if result['time_met'] else 'MISSED'})")
    for name, r in runs.items():
        print(f"  {name}: {r['command']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=STEPS, help=f"steps per run ({STEPS})")
    ap.add_argument("--every", type=int, default=25, help="print the curves every this many steps (25)")
    ap.add_argument("--json", type=Path, default=HERE / "muon_results.json")
    ap.add_argument("--table", type=Path, help="only print the table of a results file")
    ap.add_argument("--keep", type=Path, help="keep the run directories here")
    a = ap.parse_args()
    if a.table:
        print_table(json.loads(a.table.read_text()), a.every)
        return
    with tempfile.TemporaryDirectory(prefix="loom-muon-") as tmp:
        work = a.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        ctx = Context(False, work, {"benches": {}}, Progress(len(OPTIMIZERS)), work)
        ctx.bench = "muon"
        runs = {name: _measures(ctx.train([*WORKLOAD, f"train.steps={a.steps}", *extra], label=name))
                for name, extra in OPTIMIZERS.items()}
    adamw, muon = runs["adamw"], runs["muon"]
    states = max(m / w for m, w in zip(muon["optimizer_mib"], adamw["optimizer_mib"]))
    time_ratio = muon["optimizer_ms"] / adamw["optimizer_ms"]
    result = {"provenance": provenance(), "steps": a.steps, "workload": list(WORKLOAD), "runs": runs,
              "muon_steps_to_adamw_final": crossing(muon["losses"], adamw["losses"]),
              "states_ratio": states, "states_met": states <= STATES_GOAL,
              "time_ratio": time_ratio, "time_met": time_ratio <= TIME_GOAL}
    print_table(result, a.every)
    a.json.write_text(json.dumps(result, indent=1))
    print(f"results: {a.json}")


if __name__ == "__main__":
    main()
