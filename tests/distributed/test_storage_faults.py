"""A full disk under a two-rank run (issue 16): a real small tmpfs (where this machine lets a test
mount one) and a planted ENOSPC in the middle of DCP's write, synchronous and in the background.
Each stops the run with one line, exit code 1 and no traceback; the previous checkpoint is intact
and resumes to the losses of a run that never failed."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from optional import require

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8
ARGS = ["--nproc", "2", "--set", "model.preset=tiny", "--set", "data.seq_len=32",
        "--set", "train.batch_size=4", "--set", f"train.steps={STEPS}", "--set", "train.eval_batches=0",
        "--set", "data.num_workers=0",
        "--set", "parallel.strategy=zero3", "--set", "train.ckpt_every=2", "--set", "train.keep_last=3"]
ONE_LINE = re.compile(r"loom: error: checkpoint step_(\d+) could not be written to (\S+): no space left on "
                      r"the device \(ENOSPC\); it needs [\d.]+ \w+, the file system has [\d.]+ \w+ free; "
                      r"nothing of it is left, and the previous checkpoint step_(\d+) is intact; .*")


def _loom(out: Path, *extra: str, faults: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LOOM_FAULTS": faults}
    return subprocess.run([sys.executable, "-m", "loom.cli", "train", "--out", str(out), *ARGS, *extra],
                          capture_output=True, text=True, env=env, timeout=300)


def _losses(run: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    run = tmp_path_factory.mktemp("reference") / "run"
    done = _loom(run)
    assert done.returncode == 0, done.stderr[-3000:]
    return _losses(run)


def _stopped_at(done: subprocess.CompletedProcess, run: Path, step: int, previous: int,
                trained: tuple[int, ...]) -> None:
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    line = done.stderr.strip().splitlines()[-1]
    m = ONE_LINE.fullmatch(line)
    assert m, line
    assert (int(m.group(1)), m.group(2), int(m.group(3))) == (step, str(run / "checkpoints"), previous)
    saved = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert saved == ["latest"] + [f"step_{s}" for s in range(2, previous + 1, 2)], saved  # no .tmp- left
    assert max(_losses(run)) in trained  # it did not train on


def _resumes_to_reference(run: Path, reference: dict[int, float]) -> None:
    done = _loom(run, "--resume", "auto")
    assert done.returncode == 0, done.stderr[-3000:]
    losses = _losses(run)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for s in losses:
        assert losses[s] == pytest.approx(reference[s], rel=1e-6, abs=1e-7), s


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_enospc_while_writing(tmp_path, reference, async_save):
    """Rank 1's write of step 4 fails after writing part of its files. In the background, the
    ranks learn of it at the next step's agreement (or, if the write is still going on then, at
    the next save, which waits for it)."""
    run = tmp_path / "run"
    done = _loom(run, "--set", f"train.ckpt_async={str(async_save).lower()}", faults="enospc@4:1")
    _stopped_at(done, run, 4, 2, (5, 6) if async_save else (4,))
    _resumes_to_reference(run, reference)


def test_a_full_tmpfs(tmp_path, reference):
    """A 4 MB tmpfs holds two of this model's checkpoints (1.6 MB each): the third does not fit."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)],
                             capture_output=True)
    why = mounted.stderr.decode().strip()
    require("tmpfs", mounted.returncode == 0, f"mounting a tmpfs needs root, which this user lacks ({why})")
    try:
        run = disk / "run"
        _stopped_at(_loom(run), run, 6, 4, (6,))
        shutil.copytree(run, tmp_path / "moved")  # the user frees space: here, by moving the run
    finally:
        subprocess.run(["umount", str(disk)], check=True)
    _resumes_to_reference(tmp_path / "moved", reference)
