"""Mixtures of experts on 2 CPU ranks: the small preset's shape (4 blocks, d 256) with its dense
SwiGLU (width 768) against MoE blocks of 8 experts of width 384, top 2 (the same active width, so
the dense model is the MoE's dense equivalent in FLOPs per token), dropless:

  dense          the small preset, zero3
  moe ep1        every rank holds (its shard of) all 8 experts, zero3
  moe ep2        each rank holds 4 experts, tokens sent to them and back (all-to-all), zero3
  moe ep1 zero2  the parameters replicated: ep splits what zero2 does not shard
  moe ep2 zero2

Each runs `loom profile` then `loom analyze` (gloo, fp32) and reads their records: tokens/s
(summary.json), model states per rank (measured; memory.json), the routed experts' states per rank
(their parameters this rank holds × the strategy's bytes: params 4, grads 4 and Adam 8 per
parameter, sharded as the strategy shards them), and from the profiler's ledger the exposed and
hidden all-to-all per step beside the step.

Goals (issue 28): ep2's expert states per rank ≤ 0.55 × ep1's; the exposed dispatch ≤ 25% of the MoE
blocks' time.

    python bench/moe.py [--seq 512] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
MIB = 2 ** 20
MOE = ("model.moe_experts=8", "model.moe_top_k=2", "model.moe_ffn_hidden=384")
CASES = {"dense": ("zero3", ()), "moe ep1": ("zero3", MOE), "moe ep2": ("zero3", (*MOE, "parallel.ep=2")),
         "moe ep1 zero2": ("zero2", MOE), "moe ep2 zero2": ("zero2", (*MOE, "parallel.ep=2"))}
EXPERT_PARAMS = 4 * 8 * 3 * 256 * 384  # 4 MoE blocks × 8 experts × (w1, w3, w2) of 256 × 384
MOE_OPS = ("_AllToAll", "_AllToAllBackward", "aten::bincount", "aten::argsort", "aten::index_add",
           "_SwiGLUDown", "_SwiGLUDownBackward")


def _profile(strategy: str, sets: tuple[str, ...], out: Path, seq: int) -> None:
    cmd = [sys.executable, "-m", "loom.cli", "profile", "--nproc", "2", "--out", str(out)]
    for s in ("model.preset=small", f"model.max_seq_len={seq}", f"data.seq_len={seq}", "train.batch_size=8",
              "train.steps=6", "profile.wait=1", "profile.warmup=1", "profile.active=3", "data.num_workers=0",
              "train.eval_batches=0", f"parallel.strategy={strategy}", "parallel.fsdp_unit_mb=0", *sets):
        cmd += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    for step in (cmd, [sys.executable, "-m", "loom.cli", "analyze", str(out)]):  # analyze: ledger.json
        done = subprocess.run(step, capture_output=True, text=True, env=env)
        if done.returncode:
            raise RuntimeError(f"{' '.join(step)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def expert_state_bytes(strategy: str, ep: int, dp: int = 2) -> float:
    """The routed experts' params + grads + Adam states one rank holds: its E/ep experts, sharded over
    the dp/ep ranks holding the same ones (zero3 all three, zero2 grads and Adam only)."""
    local, edp = EXPERT_PARAMS / ep, dp // ep
    params = 4 * local / (edp if strategy == "zero3" else 1)
    return params + 12 * local / edp


def run_case(name: str, seq: int, root: Path) -> dict:
    strategy, sets = CASES[name]
    out = root / name.replace(" ", "_")
    _profile(strategy, sets, out, seq)
    summary = json.loads((out / "summary.json").read_text())
    ledger = json.loads((out / "ledger.json").read_text())
    rank0 = ledger["ranks"]["0"]
    steps = rank0["steps"]
    ep = 2 if "parallel.ep=2" in sets else 1
    by_name = {o["name"]: o["total_ms"] for o in rank0.get("top_ops", [])}
    return {"case": name, "tokens_per_s": summary["tokens_per_s"],
            "model_states_mib": max(r["model_state_bytes"][0] for r in summary["measured_vs_planned"]) / MIB,
            "expert_states_mib": expert_state_bytes(strategy, ep) / MIB if sets else 0.0,
            "step_ms": sum(s["wall_ms"] for s in steps) / len(steps),
            "ep_exposed_ms": sum(s.get("ep_exposed_ms", 0.0) for s in steps) / len(steps),
            "ep_hidden_ms": sum(s.get("ep_hidden_ms", 0.0) for s in steps) / len(steps),
            "moe_ops_ms": sum(by_name.get(n, 0.0) for n in MOE_OPS) / len(steps)}


def print_table(rows: list[dict], seq: int) -> None:
    print(f"mixture of experts, small preset's shape, 8 × {seq} tokens per step, fp32, 2 gloo ranks (CPU)")
    print(f"{'case':14} {'tokens/s':>9} {'states MiB':>11} {'experts MiB':>12} {'step ms':>8} "
          f"{'a2a exposed':>12} {'hidden':>7} {'MoE ops ms':>11} {'exp/MoE':>8}")
    for r in rows:
        share = r["ep_exposed_ms"] / r["moe_ops_ms"] if r["moe_ops_ms"] else float("nan")
        print(f"{r['case']:14} {r['tokens_per_s']:9.0f} {r['model_states_mib']:11.2f} "
              f"{r['expert_states_mib']:12.2f} {r['step_ms']:8.0f} {r['ep_exposed_ms']:12.1f} "
              f"{r['ep_hidden_ms']:7.1f} {r['moe_ops_ms']:11.0f} {share:8.2f}")
    by = {r["case"]: r for r in rows}
    for strategy, suffix in (("zero3", ""), ("zero2", " zero2")):
        one, two = by[f"moe ep1{suffix}"], by[f"moe ep2{suffix}"]
        experts = two["expert_states_mib"] / one["expert_states_mib"]
        print(f"{strategy}: ep2 expert states ÷ ep1's = {experts:.2f}, "
              f"model states ÷ = {two['model_states_mib'] / one['model_states_mib']:.2f}")
    print("goals: ep2's expert states per rank ≤ 0.55 × ep1's; exposed dispatch ≤ 0.25 of the MoE blocks' "
          "time")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_case(name, args.seq, Path(tmp)) for name in CASES]
    print_table(rows, args.seq)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
