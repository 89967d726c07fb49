"""loom's overhead: the same model, data and strategy run by `loom train` and by a plain loop.

Runs alternate (loom, plain, loom, plain, ...) so drift of the machine hits both alike, and the
median tokens/s ratio is printed per case. Target: loom within 3% of the plain loop.

    python bench/overhead.py [--cases ddp zero3 tp2 pp2] [--rounds 3] [--steps 30]

Cases: ddp and zero3 over 2 data-parallel ranks; tp2 (zero3 × tensor parallel 2) and pp2
(zero3 × pipeline 2, 1F1B, 2 micro-batches) on 2 ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from provenance import describe, provenance  # noqa: E402

CASES = {"ddp": ("ddp", 1, 1), "zero3": ("zero3", 1, 1), "tp2": ("zero3", 2, 1), "pp2": ("zero3", 1, 2)}


def run_loom(case: str, a, out: Path) -> float:
    strategy, tp, pp = CASES[case]
    cmd = [sys.executable, "-m", "loom.cli", "train", "--nproc", "2", "--out", str(out),
           "--set", f"parallel.strategy={strategy}", "--set", f"parallel.tp={tp}",
           "--set", f"parallel.pp={pp}",
           "--set", f"model.preset={a.preset}",
           "--set", f"train.steps={a.steps}", "--set", f"train.batch_size={a.batch_size}",
           "--set", f"data.seq_len={a.seq_len}", "--set", "data.num_workers=1",
           "--set", "data.eval_fraction=0.02", "--set", "train.eval_batches=0"]
    subprocess.run(cmd, check=True, capture_output=True, env=_env())
    return json.loads((out / "summary.json").read_text())["tokens_per_s"]


def run_plain(case: str, a, out: Path) -> float:
    strategy, tp, pp = CASES[case]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(HERE / "plain_loop.py"), "--strategy", strategy, "--tp", str(tp), "--pp", str(pp),
           "--preset", a.preset,
           "--steps", str(a.steps), "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len),
           "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, env=_env())
    return json.loads(out.read_text())["tokens_per_s"]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in a.cases:
            loom_tps, plain_tps = [], []
            for i in range(a.rounds):
                loom_tps.append(run_loom(case, a, Path(tmp) / f"loom-{case}-{i}"))
                plain_tps.append(run_plain(case, a, Path(tmp) / f"plain-{case}-{i}.json"))
                print(f"{case} round {i + 1}: loom {loom_tps[-1]:,.0f} tok/s, "
                      f"plain {plain_tps[-1]:,.0f} tok/s",
                      flush=True)
            # Each round's ratio compares a loom run with the plain run right after it; the median of
            # those ratios is the figure, which need not equal the quotient of the two medians.
            ratios = [x / y for x, y in zip(loom_tps, plain_tps)]
            results[case] = {"loom_tokens_per_s": statistics.median(loom_tps),
                             "plain_tokens_per_s": statistics.median(plain_tps),
                             "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
                             "ratio_max": max(ratios), "ratios": ratios, "loom_rounds": loom_tps,
                             "plain_rounds": plain_tps}
    where = provenance()
    print(f"\n{describe(where)}; {a.rounds} alternating rounds of {a.steps} steps, {a.preset} preset")
    print(f"{'case':<10}{'loom tok/s':>12}{'plain tok/s':>13}{'loom/plain':>12}{'rounds min–max':>17}")
    for case, r in results.items():
        print(f"{case:<10}{r['loom_tokens_per_s']:>12,.0f}{r['plain_tokens_per_s']:>13,.0f}"
              f"{r['ratio_median']:>12.3f}{r['ratio_min']:>10.3f}–{r['ratio_max']:.3f}")
    if a.json:
        a.json.write_text(json.dumps({"provenance": where, "rounds": a.rounds, "steps": a.steps,
                                      "preset": a.preset, "cases": results}, indent=2))


if __name__ == "__main__":
    main()
