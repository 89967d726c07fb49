"""An error raised inside the ranks reaches the user as one line through the real `loom` command
under torchrun: raised by one rank only (the others wait in a collective), or by every rank each on
its own (docs/bad-input.md `rank-error-one-line`) — never a traceback per rank and torchrun's report."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--nproc", "2", "--set", "model.preset=tiny", "--set", "data.seq_len=32", "--set", "train.steps=6",
        "--set", "train.batch_size=8", "--set", "data.num_workers=0", "--set", "parallel.strategy=ddp"]


def loom(*args: str, faults: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LOOM_FAULTS": faults}
    return subprocess.run([sys.executable, "-m", "loom.cli", *args], capture_output=True, text=True, env=env,
                          timeout=240)


def test_an_error_only_one_rank_raises_is_one_line(tmp_path):
    """Rank 1 hangs at step 3; rank 0's collective times out, a LoomError on rank 0 alone, while
    rank 1 is still alive: the launcher prints rank 0's line, and ends the group."""
    r = loom("train", *ARGS, "--out", str(tmp_path / "run"), "--set", "train.collective_timeout_s=4",
             faults="hang@3:1")
    errors = [line for line in r.stderr.splitlines() if line.startswith("loom: error: ")]
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "ChildFailedError" not in r.stderr, r.stderr[-3000:]
    assert len(errors) == 1 and "timed out after 4 s on rank 0: rank(s) 1" in errors[0], r.stderr[-3000:]
