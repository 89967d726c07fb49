"""Context parallelism on CPU ranks: long sequences of the small preset (4 blocks, d 256, 8 heads),
one global batch of one sequence, three ways:

  no cp          one rank holds the whole sequence
  cp2 ring       two ranks, each a front chunk and its mirror; k/v passed around (isend/irecv)
  cp2 alltoall   two ranks, Ulysses: sequence <-> heads around attention

Each runs `loom profile` then `loom analyze` (gloo, fp32, zero3 with a unit per block) and reads
their records: tokens/s (summary.json), the activation peak per rank measured and planned
(summary.json), and from the profiler's ledger the exposed and
hidden exchange per step beside the attention's own time (the ring's, or SDPA's under all-to-all:
its autograd Functions' total, waits included, which is what the block spends in attention).

Goals (issue 27): cp2's activation peak ≤ 0.55 × no cp's; the ring's exposed exchange ≤ 20% of its
attention time.

    python bench/context_parallel.py [--seq 4096] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from provenance import provenance  # bench/provenance.py (run from bench/, its folder)

HERE = Path(__file__).resolve().parent
MIB = 2 ** 20
CASES = {"no cp": (1, ()), "cp2 ring": (2, ("parallel.cp=2", "parallel.cp_mode=ring")),
         "cp2 alltoall": (2, ("parallel.cp=2", "parallel.cp_mode=alltoall"))}
ATTENTION_OPS = ("_RingAttention", "_RingAttentionBackward",
                 "aten::_scaled_dot_product_flash_attention_for_cpu",
                 "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


def _profile(ranks: int, sets: tuple[str, ...], out: Path, seq: int) -> None:
    profile_run(ranks, ("model.preset=small", f"model.max_seq_len={seq}", f"data.seq_len={seq}",
                        "train.batch_size=1", "parallel.strategy=zero3", *sets), out)


def profile_run(ranks: int, sets: tuple[str, ...], out: Path) -> None:
    """`loom profile` (6 steps, 3 of them profiled, a unit per block) then `loom analyze` into `out`,
    with `sets` over those; bench/moe.py runs its cases through it too."""
    cmd = [sys.executable, "-m", "loom.cli", "profile", "--nproc", str(ranks), "--out", str(out)]
    for s in ("train.steps=6", "profile.wait=1", "profile.warmup=1", "profile.active=3", "data.num_workers=0",
              "train.eval_batches=0", "parallel.fsdp_unit_mb=0", *sets):
        cmd += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    for step in (cmd, [sys.executable, "-m", "loom.cli", "analyze", str(out)]):  # analyze: ledger.json
        done = subprocess.run(step, capture_output=True, text=True, env=env)
        if done.returncode:
            raise RuntimeError(f"{' '.join(step)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def _attention_ms(ops: list[dict], steps: int) -> float:
    """Attention's time per step: the ring's Functions (which hold SDPA's CPU kernels), else the kernels."""
    by_name = {o["name"]: o["total_ms"] for o in ops}
    ring = by_name.get("_RingAttention", 0.0) + by_name.get("_RingAttentionBackward", 0.0)
    kernels = sum(by_name.get(n, 0.0) for n in ATTENTION_OPS[2:])
    return (ring or kernels) / steps


PEAK_GOAL, EXPOSED_GOAL = 0.55, 0.20


def run_case(name: str, seq: int, root: Path) -> dict:
    ranks, sets = CASES[name]
    out = root / name.replace(" ", "_")
    _profile(ranks, sets, out, seq)
    summary = json.loads((out / "summary.json").read_text())
    ledger = json.loads((out / "ledger.json").read_text())
    peaks = [row["activation_peak_bytes"] for row in summary["measured_vs_planned"]]
    rank0 = ledger["ranks"]["0"]
    steps = rank0["steps"]
    exposed = sum(s.get("cp_exposed_ms", 0.0) for s in steps) / len(steps)
    hidden = sum(s.get("cp_hidden_ms", 0.0) for s in steps) / len(steps)
    return {"case": name, "ranks": ranks, "tokens_per_s": summary["tokens_per_s"],
            "activation_peak_mib": max(m for m, _ in peaks) / MIB,
            "activation_planned_mib": max(p for _, p in peaks) / MIB,
            "step_ms": sum(s["wall_ms"] for s in steps) / len(steps),
            "cp_exposed_ms": exposed, "cp_hidden_ms": hidden,
            "attention_ms": _attention_ms(rank0["top_ops"], len(steps))}


def print_table(rows: list[dict], seq: int) -> None:
    base = rows[0]
    print(f"context parallelism, small preset, 1 × {seq} tokens, fp32, gloo (CPU)")
    print(f"{'case':14} {'ranks':>5} {'tokens/s':>9} {'act peak MiB':>13} {'planned':>8} {'÷ no cp':>8} "
          f"{'step ms':>8} {'attn ms':>8} {'exposed':>8} {'hidden':>7} {'exp/attn':>8}")
    for r in rows:
        split = r["ranks"] > 1 and r["attention_ms"]
        share = r["cp_exposed_ms"] / r["attention_ms"] if split else float("nan")
        ratio = r["activation_peak_mib"] / base["activation_peak_mib"]
        print(f"{r['case']:14} {r['ranks']:5d} {r['tokens_per_s']:9.0f} {r['activation_peak_mib']:13.1f} "
              f"{r['activation_planned_mib']:8.1f} {ratio:8.3f} {r['step_ms']:8.0f} {r['attention_ms']:8.0f} "
              f"{r['cp_exposed_ms']:8.1f} {r['cp_hidden_ms']:7.1f} {share:8.2f}")
    print("goals: cp2 activation peak ≤ 0.55 × no cp's; ring exposed exchange ≤ 0.20 of its attention time")
    for r in rows[1:]:  # each goal, met or missed, said: a figure beside its goal is no verdict
        ratio = r["activation_peak_mib"] / base["activation_peak_mib"]
        share = r["cp_exposed_ms"] / r["attention_ms"] if r["attention_ms"] else float("nan")
        print(f"  {r['case']}: activation peak {ratio:.3f} × no cp's, {_verdict(ratio <= PEAK_GOAL)}; "
              f"exposed exchange {share:.2f} of attention, {_verdict(share <= EXPOSED_GOAL)}")


def _verdict(met: bool) -> str:
    return "met" if met else "MISSED"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=4096)
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
