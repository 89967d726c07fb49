"""`loom train --nproc 2`: a real torchrun launch writes the whole run directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def loom(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "loom.cli", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def test_train_under_torchrun_writes_the_run_directory(tmp_path):
    out = tmp_path / "run"
    r = loom("train", "--nproc", "2", "--out", str(out), "--set", "model.preset=tiny",
             "--set", "train.steps=4", "--set", "train.batch_size=4", "--set", "train.grad_accum=2",
             "--set", "data.seq_len=32", "--set", "parallel.strategy=zero2", "--set", "data.num_workers=0")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "micro-batch 1 × grad_accum 2 × dp 2" in r.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [rec["step"] for rec in records] == [1, 2, 3, 4]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "data_wait_s"):
        assert all(isinstance(rec[key], float) for rec in records), key
    assert records[-1]["loss"] < records[0]["loss"]
    memory = json.loads((out / "memory.json").read_text())
    assert set(memory["ranks"]) == {"0", "1"}
    for m in memory["ranks"].values():
        assert abs(m["model_state_bytes"] / memory["expected_model_state_bytes"] - 1) < 0.01
        assert m["peak_bytes"] > m["model_state_bytes"]
    assert 'strategy = "zero2"' in (out / "config.toml").read_text()
