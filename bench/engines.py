"""loom's two engines side by side: the same model, data, batch and seed run by the torch engine
(FSDP2) and by the deepspeed engine, for ZeRO-2 and ZeRO-3, and DeepSpeed's offload modes against
none. Runs alternate so drift of the machine hits every case alike; medians are printed.

    python bench/engines.py [--rounds 5] [--steps 20] [--json bench/engines_results.json]

"vs torch" is the median over rounds of the ratio to the torch engine's run of the same round.
Each run is `loom train --nproc 2` (2 CPU ranks, gloo) on the small preset, batch 16 × 128.
NVMe offload writes under --nvme-path (a folder on a local disk). The "a unit per block" rows run
the torch engine as before parallel.fsdp_unit_mb grouped small blocks: the cost of one all-gather
and one reduce-scatter per block.

Memory: the small preset's optimizer states (20 MB a rank) are within the noise of a process's
resident memory, so the NVMe rows' memory effect is shown on a 41M-parameter model (the RSS
rows: 3 steps, resident memory after step 2, without and with the optimizer on NVMe).
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


def cases(nvme: Path) -> dict[str, list[str]]:
    ds = ["parallel.engine=deepspeed"]
    return {
        "torch zero2": ["parallel.strategy=zero2"],
        "torch zero2, a unit per block": ["parallel.strategy=zero2", "parallel.fsdp_unit_mb=0"],
        "deepspeed zero2": [*ds, "parallel.strategy=zero2"],
        "torch zero3": ["parallel.strategy=zero3"],
        "torch zero3, a unit per block": ["parallel.strategy=zero3", "parallel.fsdp_unit_mb=0"],
        "deepspeed zero3": [*ds, "parallel.strategy=zero3"],
        "deepspeed zero3 offload optimizer cpu": [*ds, "parallel.strategy=zero3",
                                                  "parallel.offload_optimizer=cpu"],
        "deepspeed zero3 offload optimizer nvme": [*ds, "parallel.strategy=zero3",
                                                   "parallel.offload_optimizer=nvme",
                                                   f'parallel.nvme_path="{nvme}"'],
        "deepspeed zero3 offload params cpu": [*ds, "parallel.strategy=zero3", "parallel.offload_params=cpu"],
    }


# 41M parameters: the optimizer's fp32 master + Adam states are 245 MB a rank on 2 ranks
RSS_MODEL = ["model.preset=tiny", "model.d_model=768", "model.n_heads=8", "model.n_kv_heads=4",
             "model.ffn_hidden=2304", "model.n_layers=4", "model.vocab_size=8192", "data.seq_len=32",
             "train.batch_size=4", "train.steps=3", "parallel.engine=deepspeed", "parallel.strategy=zero3"]


def rss_cases(nvme: Path) -> dict[str, list[str]]:
    return {"RSS: deepspeed zero3, 41M": RSS_MODEL,
            "RSS: deepspeed zero3, 41M, optimizer to NVMe": [*RSS_MODEL, "parallel.offload_optimizer=nvme",
                                                            f'parallel.nvme_path="{nvme}"']}


def run(overrides: list[str], a, out: Path) -> dict:
    workload = [f"model.preset={a.preset}", f"train.steps={a.steps}", f"train.batch_size={a.batch_size}",
                f"data.seq_len={a.seq_len}"]
    cmd = [sys.executable, "-m", "loom.cli", "train", "--nproc", "2", "--out", str(out),
           *[x for o in [*workload, "train.eval_batches=0", *overrides] for x in ("--set", o)]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    subprocess.run(cmd, check=True, capture_output=True, env=env)
    summary = json.loads((out / "summary.json").read_text())
    memory = json.loads((out / "memory.json").read_text())["ranks"]["0"]
    return {"tokens_per_s": summary["tokens_per_s"], "resident_bytes": memory.get("resident_bytes"),
            "nvme_bytes": memory.get("nvme_bytes")}


def pairwise_ratio(runs: dict[str, list[dict]], name: str, base: str) -> float:
    """The median over rounds of this case's tokens/s over its torch-engine twin's in the same round
    (drift of the machine between rounds cancels)."""
    return statistics.median(r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(runs[name], runs[base]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--nvme-path", type=Path, default=None, help="default: a temporary folder")
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        nvme = a.nvme_path or Path(tmp) / "nvme"
        nvme.mkdir(parents=True, exist_ok=True)
        every = {**cases(nvme), **rss_cases(nvme)}
        runs: dict[str, list[dict]] = {name: [] for name in every}
        for i in range(a.rounds):
            for name, overrides in every.items():
                runs[name].append(run(overrides, a, Path(tmp) / f"{name.replace(' ', '-')}-{i}"))
                print(f"round {i + 1} {name}: {runs[name][-1]['tokens_per_s']:,.0f} tokens/s", flush=True)
    med = {name: {k: statistics.median(r[k] for r in rs) if rs[0][k] is not None else None for k in rs[0]}
           for name, rs in runs.items()}
    where = provenance()
    print(f"\n{describe(where)}; {a.rounds} rounds of {a.steps} steps, {a.preset} preset, 2 CPU ranks")
    print(f"{'case':<48}{'tokens/s':>10}{'vs torch':>10}{'RSS MiB':>9}{'NVMe MiB':>10}")
    for name, m in med.items():
        stage = "zero2" if "zero2" in name else "zero3"
        ratio = pairwise_ratio(runs, name, f"torch {stage}") if name in cases(nvme) else float("nan")
        nvme_mib = f"{m['nvme_bytes'] / 2**20:10.1f}" if m["nvme_bytes"] else f"{'':>10}"
        rss = m["resident_bytes"] / 2**20
        print(f"{name:<48}{m['tokens_per_s']:>10,.0f}{ratio:>10.2f}{rss:>9.0f}{nvme_mib}")
    if a.json:
        ratios = {name: pairwise_ratio(runs, name, "torch zero2" if "zero2" in name else "torch zero3")
                  for name in cases(nvme)}
        a.json.write_text(json.dumps({"provenance": where, "rounds": a.rounds, "steps": a.steps,
                                      "medians": med, "ratio_vs_torch": ratios, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
