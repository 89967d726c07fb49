"""A run's stderr holds its progress, not third-party noise: TP's ranks log no DTensor
redistribution advice, a pipeline's DDP stages no find_unused_parameters warning per rank, and
DeepSpeed's ZeRO-3 no FutureWarning per collective (42 in 10 steps before
loom/parallel/known_warnings.py); the layout line names tp."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from optional import DEEPSPEED, require_module

ROOT = Path(__file__).resolve().parents[2]
TINY = ("--set", "model.preset=tiny", "--set", "train.batch_size=4", "--set", "data.seq_len=32",
        "--set", "data.num_workers=0", "--set", "train.eval_batches=1")


def _train(out: Path, *sets: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "loom.cli", "train", "--nproc", "2", "--out", str(out), *TINY,
                        *sets], capture_output=True, text=True, env=env, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _noise(stderr: str) -> list[str]:
    """stderr's lines other than the progress bar."""
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith("step ")]


def test_tensor_parallel_run_is_quiet_and_its_layout_names_tp(tmp_path):
    r = _train(tmp_path / "tp", "--set", "train.steps=3", "--set", "parallel.tp=2")
    assert "redistributing" not in r.stderr and _noise(r.stderr) == [], r.stderr[-3000:]
    assert "dp=1 [replicate 1 × shard 1] × tp=2," in r.stdout


def test_pipeline_over_ddp_is_quiet(tmp_path):
    r = _train(tmp_path / "pp", "--set", "train.steps=3", "--set", "parallel.pp=2",
               "--set", "parallel.strategy=ddp")
    assert "find_unused_parameters" not in r.stderr and _noise(r.stderr) == [], r.stderr[-3000:]


def test_deepspeed_zero3_run_prints_no_future_warnings(tmp_path):
    require_module("deepspeed", DEEPSPEED)
    r = _train(tmp_path / "ds", "--set", "train.steps=4", "--set", "parallel.engine=deepspeed",
               "--set", "parallel.strategy=zero3")
    assert r.stderr.count("FutureWarning") == 0, r.stderr[-3000:]
    assert "is deprecated" not in r.stderr
