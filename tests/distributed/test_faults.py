"""Faults through the real `loom` command under torchrun: a rank killed mid-step and restarted,
a kill while a checkpoint is being written, and a hung rank that a collective timeout names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--nproc", "2", "--set", "model.preset=tiny", "--set", "data.seq_len=32", "--set", "train.steps=6",
        "--set", "train.batch_size=8", "--set", "data.num_workers=0", "--set", "parallel.strategy=zero2",
        "--set", "train.ckpt_every=2"]


def loom(*args: str, faults: str = "", timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LOOM_FAULTS": faults}
    return subprocess.run([sys.executable, "-m", "loom.cli", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def losses(run: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records]
    assert steps == sorted(set(steps)), steps  # every step once, in order
    return {r["step"]: r["loss"] for r in records}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    run = tmp_path_factory.mktemp("reference") / "run"
    r = loom("train", *ARGS, "--out", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    return losses(run)


def test_killed_rank_restarts_and_resumes_from_the_latest_checkpoint(tmp_path, reference):
    run = tmp_path / "run"
    r = loom("train", *ARGS, "--out", str(run), "--max-restarts", "1", faults="kill@5:1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout and "step_4 (step 4" in r.stdout  # rank 1 died in step 5
    assert losses(run) == reference  # steps 1–6, each once, equal to the run that never failed
    # one line for the restart, not torchrun's log and the surviving rank's traceback; they are kept
    line = (f"loom: rank 1 died (signal 9, SIGKILL); restarting from step_4, restart 1 of 1 "
            f"(details: {run}/logs)")
    assert line in r.stderr.splitlines(), r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "exitcode" not in r.stderr and "SIGTERM" not in r.stderr, r.stderr
    agent = (run / "logs" / "torchrun.log").read_text()
    assert "failed (exitcode" in agent and f"{line}; every rank's exit code" in agent and "1: -9" in agent
    for rank_log in (run / "logs").glob("rank*.attempt0.log"):  # a survivor's broken collective
        assert rank_log.read_text().startswith("Traceback"), rank_log


def test_kill_while_writing_a_checkpoint_leaves_the_previous_one(tmp_path, reference):
    run = tmp_path / "run"
    r = loom("train", *ARGS, "--out", str(run), faults="kill_in_checkpoint@4")
    assert r.returncode != 0
    root = run / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_2"
    assert not (root / "step_4").exists()  # written but never published
    assert (root / ".tmp-step_4").is_dir()

    r = loom("train", *ARGS, "--out", str(run), "--resume", "auto")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step_2 (step 2" in r.stdout
    assert not (root / ".tmp-step_4").exists()  # the unfinished write was cleared away
    assert losses(run) == reference


def test_hung_rank_ends_in_an_error_naming_the_collective_and_the_rank(tmp_path):
    run = tmp_path / "run"
    start = time.monotonic()
    r = loom("train", *ARGS, "--out", str(run), "--set", "train.collective_timeout_s=4", faults="hang@3:1",
             timeout=120)
    elapsed = time.monotonic() - start
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if line.startswith("loom: error: collective")]
    assert errors, r.stderr[-3000:]
    assert "timed out after 4 s on rank 0: rank(s) 1 (at #" in errors[0] and "did not arrive" in errors[0]
    assert "gloo:" in errors[0]  # the stuck collective, by name
    assert {p.name for p in (run / "flight_recorder").iterdir()} >= {"rank0.json", "rank1.json"}
    assert elapsed < 60  # start-up + the 4 s timeout + the dumps, never the hang's hour


def test_an_error_every_rank_raises_is_one_line_from_the_launcher(tmp_path):
    """train.on_nonfinite = stop: both ranks stop at the NaN step with the same error, which the
    launcher prints once; no rank's traceback, no torchrun failure report."""
    run = tmp_path / "run"
    r = loom("train", *ARGS, "--out", str(run), "--set", "train.on_nonfinite=stop", faults="nan@3")
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "ChildFailedError" not in r.stderr, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("loom: error:")]
    assert len(errors) == 1 and errors[0].startswith("loom: error: step 3: loss nan"), r.stderr[-3000:]
    assert "the last checkpoint is" in errors[0] and "step_2" in errors[0]
