"""Mixtures of experts on 2 CPU ranks: the small preset's shape (4 blocks, d 256) with its dense
SwiGLU (width 768) against MoE blocks of 8 experts of width 384, top 2 (the same active width, so
the dense model is the MoE's dense equivalent in FLOPs per token), dropless:

  dense          the small preset, zero3
  moe ep1        every rank holds (its shard of) all 8 experts, zero3
  moe ep2        each rank holds 4 experts, tokens sent to them and back (all-to-all), zero3
  moe ep1 ddp    the model states replicated: ep splits what ddp does not shard
  moe ep2 ddp

Each runs `loom profile` then `loom analyze` (gloo, fp32) and reads their records: tokens/s
(summary.json), model states per rank (measured; memory.json), the routed experts' share of them
(measured model states less the dense part's 16Ψ/N, beside the planner's expert_state_bytes), and
from the profiler's ledger the exposed and hidden all-to-all per step beside the MoE blocks' own
operations (the all-to-all, routing, and the experts' fused SwiGLU).

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
         "moe ep1 ddp": ("ddp", MOE), "moe ep2 ddp": ("ddp", (*MOE, "parallel.ep=2"))}
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


def _planned_states(strategy: str, sets: tuple[str, ...], seq: int) -> tuple[float, float]:
    """(the dense part's model states, the routed experts') per rank, by the planner."""
    sys.path.insert(0, str(HERE.parent))
    from loom.config import load_config
    from loom.plan.memory import expert_state_bytes, model_state_bytes
    from loom.plan.search import config_candidate, config_workload
    from loom.plan.shapes import from_preset

    cfg = load_config(None, [f"data.seq_len={seq}", "train.batch_size=8", f"parallel.strategy={strategy}",
                             *sets])
    shape = from_preset("small", **{s.split("=")[0].removeprefix("model."): int(s.split("=")[1])
                                    for s in sets if s.startswith("model.")})
    w = config_workload(cfg, shape)
    c = config_candidate(cfg, 2 if strategy == "ddp" else 1, 1 if strategy == "ddp" else 2, 1, 1)
    routed = shape.stage_routed_params(0, 1)
    return model_state_bytes(strategy, shape.num_params - routed, c.shard_size).total, \
        expert_state_bytes(w, c).total


def run_case(name: str, seq: int, root: Path) -> dict:
    strategy, sets = CASES[name]
    out = root / name.replace(" ", "_")
    _profile(strategy, sets, out, seq)
    summary = json.loads((out / "summary.json").read_text())
    ledger = json.loads((out / "ledger.json").read_text())
    rank0 = ledger["ranks"]["0"]
    steps = rank0["steps"]
    by_name = {o["name"]: o["total_ms"] for o in rank0.get("top_ops", [])}
    states = max(r["model_state_bytes"][0] for r in summary["measured_vs_planned"])
    dense, experts = _planned_states(strategy, sets, seq)
    return {"case": name, "tokens_per_s": summary["tokens_per_s"], "model_states_mib": states / MIB,
            "expert_states_mib": (states - dense) / MIB if sets else 0.0,
            "expert_planned_mib": experts / MIB if sets else 0.0,
            "step_ms": sum(s["wall_ms"] for s in steps) / len(steps),
            "ep_exposed_ms": sum(s.get("ep_exposed_ms", 0.0) for s in steps) / len(steps),
            "ep_hidden_ms": sum(s.get("ep_hidden_ms", 0.0) for s in steps) / len(steps),
            "moe_ops_ms": sum(by_name.get(n, 0.0) for n in MOE_OPS) / len(steps)}


def print_table(rows: list[dict], seq: int) -> None:
    print(f"mixture of experts, small preset's shape, 8 × {seq} tokens per step, fp32, 2 gloo ranks (CPU)")
    print(f"{'case':14} {'tokens/s':>9} {'states MiB':>11} {'experts MiB':>12} {'planned':>8} {'step ms':>8} "
          f"{'a2a exposed':>12} {'hidden':>7} {'MoE ops ms':>11} {'exp/MoE':>8}")
    for r in rows:
        share = r["ep_exposed_ms"] / r["moe_ops_ms"] if r["moe_ops_ms"] else float("nan")
        print(f"{r['case']:14} {r['tokens_per_s']:9.0f} {r['model_states_mib']:11.2f} "
              f"{r['expert_states_mib']:12.2f} {r['expert_planned_mib']:8.2f} {r['step_ms']:8.0f} "
              f"{r['ep_exposed_ms']:12.1f} {r['ep_hidden_ms']:7.1f} {r['moe_ops_ms']:11.0f} {share:8.2f}")
    by = {r["case"]: r for r in rows}
    for strategy, suffix in (("zero3", ""), ("ddp", " ddp")):
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
