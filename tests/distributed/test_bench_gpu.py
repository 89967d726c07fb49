"""`loom bench --gpu`'s benchmark, run small on a CPU: its runs (eager, compiled, checkpointed
activations, profiled, an async checkpoint resumed) and the rows it writes. This machine has no GPU,
so what this proves is the benchmark's own code, ready for a GPU; CUDA itself is not exercised."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import benchmarks  # noqa: E402
import suite  # noqa: E402

SMALL = {"model.preset": "tiny", "train.device": "cpu", "data.seq_len": "64", "train.batch_size": "4",
         "data.num_workers": "0"}


def test_the_gpu_benchmark_runs_its_cases_and_writes_its_rows(tmp_path, monkeypatch):
    workload = [f"{k}={SMALL.get(k, v)}" for k, v in (s.split("=", 1) for s in benchmarks.GPU_WORKLOAD)]
    assert sum(s.startswith(tuple(SMALL)) for s in workload) == len(SMALL)  # every one replaced
    monkeypatch.setattr(benchmarks, "GPU_WORKLOAD", workload)
    bench = {"rows": [], "notes": [], "missed": [], "plots": []}
    ctx = suite.Context(True, tmp_path, {"benches": {"gpu": bench}}, suite.Progress(8), tmp_path)
    ctx.bench = "gpu"
    benchmarks.gpu(ctx)

    rows = {r["setting"]: r for r in bench["rows"]}
    assert list(rows) == ["eager", "compile", "AC full", "async checkpoint from CUDA memory, resumed"]
    for setting in ("eager", "compile", "AC full"):
        row = rows[setting]
        assert row["tokens_per_s"] > 0 and row["peak_gib"] > 0 and row["step_s"] > 0
        assert 0.5 < row["activation_vs_planned"] < 2.0, row
        assert "train.precision=bf16" in row["command"] and "train.optimizer_impl=fused" in row["command"]
    # full AC frees activations: its peak is below eager's
    assert rows["AC full"]["peak_gib"] < rows["eager"]["peak_gib"]
    assert "compute" in bench["notes"][0]  # the profiled step's `loom analyze` table
    saved = Path(rows["async checkpoint from CUDA memory, resumed"]["command"].split("--out ")[1].split()[0])
    assert saved.name == "RUN"  # the command is reproducible in any fresh folder
    resumed = sorted(tmp_path.glob("*-async-checkpoint"))[-1]
    steps = [json.loads(line)["step"] for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 12 and rows["async checkpoint from CUDA memory, resumed"]["resumed_steps"] >= 12
