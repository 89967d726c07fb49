"""Planner accuracy on this machine: measured vs planned step time (and activation peak) of
`loom train` runs, each strategy priced on the device profile `loom plan --calibrate` measured.

    python bench/plan_time.py [--cases ddp zero3 ...] [--steps 12] [--preset small] [--calibrate]

Goal (issue 15): every ratio measured/planned within ±25%. `--calibrate` measures the profile
first (into bench/device_profile.json, which the runs then use); otherwise the default profile
(~/.cache/loom/device.json, or LOOM_DEVICE_PROFILE) is used.
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
sys.path.insert(0, str(HERE))
from provenance import describe, provenance  # noqa: E402

CASES = {
    "ddp": (2, ["parallel.strategy=ddp"]),
    "zero1": (2, ["parallel.strategy=zero1"]),
    "zero2": (2, ["parallel.strategy=zero2"]),
    "zero3": (2, ["parallel.strategy=zero3"]),
    "zero3-accum2": (2, ["parallel.strategy=zero3", "train.grad_accum=2"]),
    "hsdp": (4, ["parallel.strategy=hsdp", "parallel.dp_replicate=2", "parallel.dp_shard=2"]),
    "tp2": (2, ["parallel.strategy=zero3", "parallel.tp=2", "parallel.sequence_parallel=true"]),
    "pp2": (2, ["parallel.strategy=zero3", "parallel.pp=2", "parallel.pp_schedule=1f1b"]),
    "ddp-ac": (2, ["parallel.strategy=ddp", "parallel.activation_checkpointing=full"]),
}


def run_case(name: str, a, out: Path, env: dict) -> dict:
    nproc, sets = CASES[name]
    cmd = [sys.executable, "-m", "loom.cli", "train", "--nproc", str(nproc), "--out", str(out),
           "--set", f"model.preset={a.preset}", "--set", f"train.steps={a.steps}",
           "--set", "train.eval_batches=0", "--set", "data.num_workers=0"]
    for item in sets + a.set:
        cmd += ["--set", item]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"{name}: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    summary = json.loads((out / "summary.json").read_text())
    versus = summary["step_time_vs_planned"]
    (measured, planned), parts = versus["step_time_s"], versus["planned_breakdown_s"]
    act = summary["measured_vs_planned"][0]["activation_peak_bytes"]
    return {"case": name, "ranks": nproc, "measured_s": measured, "planned_s": planned,
            "ratio": measured / planned, "planned_breakdown_s": parts,
            "activation_ratio": act[0] / act[1] if act[0] and act[1] else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--set", action="append", default=[], help="more config overrides for every case")
    ap.add_argument("--calibrate", action="store_true")
    ap.add_argument("--out", type=Path, default=HERE / "plan_time_results.json")
    a = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    if a.calibrate:
        env["LOOM_DEVICE_PROFILE"] = str(HERE / "device_profile.json")
        subprocess.run([sys.executable, "-m", "loom.cli", "plan", "--calibrate"], check=True, env=env,
                       capture_output=True)
    rows = []
    print(f"{'case':<14} {'ranks':>5} {'measured s':>11} {'planned s':>10} {'ratio':>6}  planned parts")
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.cases:
            try:
                row = run_case(name, a, Path(tmp) / name, env)
            except RuntimeError as e:
                print(f"{name:<14} failed: {e}")
                continue
            rows.append(row)
            parts = ", ".join(f"{k} {v:.3f}" for k, v in row["planned_breakdown_s"].items()
                              if k != "total" and v)
            print(f"{name:<14} {row['ranks']:>5} {row['measured_s']:11.3f} {row['planned_s']:10.3f} "
                  f"{row['ratio']:6.2f}  {parts}", flush=True)
    missed = [r["case"] for r in rows if not 0.75 <= r["ratio"] <= 1.25]
    print(f"within ±25%: {len(rows) - len(missed)}/{len(rows)}"
          + (f"; missed: {', '.join(missed)}" if missed else ""))
    prov = provenance()
    record = {"provenance": prov, "preset": a.preset, "steps": a.steps, "rows": rows}
    a.out.write_text(json.dumps(record, indent=1))
    print(describe(prov))


if __name__ == "__main__":
    main()
