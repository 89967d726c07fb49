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
blocks' time (measured on the forward, the part of the block a profiler range delimits; gloo's
all-to-all blocks the CPU, so all of it is exposed there).

    python bench/moe.py [--seq 512] [--json PATH]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
from pathlib import Path

from context_parallel import profile_run  # bench/context_parallel.py (run from bench/, its folder)
from provenance import provenance

HERE = Path(__file__).resolve().parent
MIB = 2 ** 20
MOE = ("model.moe_experts=8", "model.moe_top_k=2", "model.moe_ffn_hidden=384")
CASES = {"dense": ("zero3", ()), "moe ep1": ("zero3", MOE), "moe ep2": ("zero3", (*MOE, "parallel.ep=2")),
         "moe ep1 ddp": ("ddp", MOE), "moe ep2 ddp": ("ddp", (*MOE, "parallel.ep=2"))}


def _profile(strategy: str, sets: tuple[str, ...], out: Path, seq: int) -> None:
    profile_run(2, ("model.preset=small", f"model.max_seq_len={seq}", f"data.seq_len={seq}",
                    "train.batch_size=8", f"parallel.strategy={strategy}", *sets), out)


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


def moe_forward_ms(trace: Path, steps: int) -> tuple[float, float]:
    """(the MoE blocks' forward time, the all-to-all time inside it) per profiled step, from a rank's
    Chrome trace: its `moe` ranges and the `ep_alltoall` ranges they hold. Forward only: backward's
    autograd ops carry no block range."""
    events = [e for e in json.load(gzip.open(trace))["traceEvents"] if e.get("ph") == "X"]
    blocks = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == "moe"]
    inside = sum(e["dur"] for e in events if e["name"] == "ep_alltoall"
                 and any(a <= e["ts"] and e["ts"] + e["dur"] <= b for a, b in blocks))
    return sum(b - a for a, b in blocks) / 1e3 / steps, inside / 1e3 / steps


def run_case(name: str, seq: int, root: Path) -> dict:
    strategy, sets = CASES[name]
    out = root / name.replace(" ", "_")
    _profile(strategy, sets, out, seq)
    summary = json.loads((out / "summary.json").read_text())
    ledger = json.loads((out / "ledger.json").read_text())
    rank0 = ledger["ranks"]["0"]
    steps = rank0["steps"]
    moe_ms, a2a_ms = moe_forward_ms(out / "traces" / "rank0.json.gz", len(steps))
    states = max(r["model_state_bytes"][0] for r in summary["measured_vs_planned"])
    dense, experts = _planned_states(strategy, sets, seq)
    return {"case": name, "tokens_per_s": summary["tokens_per_s"], "model_states_mib": states / MIB,
            "expert_states_mib": (states - dense) / MIB if sets else 0.0,
            "expert_planned_mib": experts / MIB if sets else 0.0,
            "step_ms": sum(s["wall_ms"] for s in steps) / len(steps),
            "ep_exposed_ms": sum(s.get("ep_exposed_ms", 0.0) for s in steps) / len(steps),
            "ep_hidden_ms": sum(s.get("ep_hidden_ms", 0.0) for s in steps) / len(steps),
            "moe_forward_ms": moe_ms, "a2a_in_forward_ms": a2a_ms}


def print_table(rows: list[dict], seq: int) -> None:
    print(f"mixture of experts, small preset's shape, 8 × {seq} tokens per step, fp32, 2 gloo ranks (CPU)")
    print(f"{'case':14} {'tokens/s':>9} {'states MiB':>11} {'experts MiB':>12} {'planned':>8} {'step ms':>8} "
          f"{'a2a exposed':>12} {'hidden':>7} {'MoE fwd ms':>11} {'a2a in it':>10} {'share':>6}")
    for r in rows:
        share = r["a2a_in_forward_ms"] / r["moe_forward_ms"] if r["moe_forward_ms"] else float("nan")
        print(f"{r['case']:14} {r['tokens_per_s']:9.0f} {r['model_states_mib']:11.2f} "
              f"{r['expert_states_mib']:12.2f} {r['expert_planned_mib']:8.2f} {r['step_ms']:8.0f} "
              f"{r['ep_exposed_ms']:12.1f} {r['ep_hidden_ms']:7.1f} {r['moe_forward_ms']:11.1f} "
              f"{r['a2a_in_forward_ms']:10.1f} {share:6.2f}")
    by = {r["case"]: r for r in rows}
    for strategy, suffix in (("zero3", ""), ("ddp", " ddp")):
        one, two = by[f"moe ep1{suffix}"], by[f"moe ep2{suffix}"]
        experts = two["expert_states_mib"] / one["expert_states_mib"]
        print(f"{strategy}: ep2 expert states ÷ ep1's = {experts:.2f}, "
              f"model states ÷ = {two['model_states_mib'] / one['model_states_mib']:.2f}")
    print("goals: ep2's expert states per rank ≤ 0.55 × ep1's; exposed dispatch ≤ 0.25 of the MoE blocks' "
          "time (here: the all-to-all's share of the blocks' forward, where the trace delimits them)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_case(name, args.seq, Path(tmp)) for name in CASES]
    print_table(rows, args.seq)
    if args.json:  # the record the docs quote (tests/unit/test_readme_figures.py checks them against it)
        command = "python " + " ".join([f"bench/{Path(__file__).name}", *sys.argv[1:]])
        args.json.write_text(json.dumps({"provenance": provenance(), "command": command, "rows": rows},
                                        indent=1))


if __name__ == "__main__":
    main()
