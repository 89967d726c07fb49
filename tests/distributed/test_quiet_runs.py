"""A run's stderr holds its progress, not third-party noise: TP's ranks log no DTensor
redistribution advice, a pipeline's DDP stages no find_unused_parameters warning per rank,
DeepSpeed's ZeRO-3 no FutureWarning per collective (42 in 10 steps before
loom/parallel/known_warnings.py) and no accelerator or build notes, a profile no Kineto marks;
the layout line names tp."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from optional import DEEPSPEED, require_module
from stray import stray_lines

ROOT = Path(__file__).resolve().parents[2]
TINY = ("--set", "model.preset=tiny", "--set", "train.batch_size=4", "--set", "data.seq_len=32",
        "--set", "data.num_workers=0", "--set", "train.eval_batches=1")


def _train(out: Path, *sets: str, command: str = "train") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("DS_ACCELERATOR", None)  # as a user's shell has it: DeepSpeed left to choose
    r = subprocess.run([sys.executable, "-m", "loom.cli", command, "--nproc", "2", "--out", str(out), *TINY,
                        *sets], capture_output=True, text=True, env=env, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _noise(stderr: str) -> list[str]:
    """stderr's lines other than the progress bar."""
    return stray_lines("", stderr)


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
    # nor its accelerator probe's warning, nor its CPU backend's "… built successfully" per rank
    assert _noise(r.stderr) == [] and "built successfully" not in r.stdout, r.stderr[-3000:] + r.stdout


def test_a_profile_under_context_parallelism_is_quiet(tmp_path):
    """Kineto's USDT profiler_start/stop marks (fd 2, inside the progress line), DeviceMesh's
    flattened-dim slicing warning (cp), and the ledger's "collectives have no recorded size" (the
    loop's 0-d all-reduce): none of them."""
    r = _train(tmp_path / "cp", "--set", "train.steps=6", "--set", "parallel.cp=2", "--set", "profile.wait=1",
               "--set", "profile.warmup=1", "--set", "profile.active=2", command="profile")
    assert _noise(r.stderr) == [], r.stderr[-3000:]
    assert "warning" not in r.stdout.lower() and (tmp_path / "cp" / "traces" / "rank1.json.gz").is_file(), \
        r.stdout[-3000:]
