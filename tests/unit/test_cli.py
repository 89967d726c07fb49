"""The `loom` command: bad input caught before any rank starts (a real torchrun launch:
tests/distributed/test_cli_torchrun.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def loom(*args: str, cwd: Path | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "loom.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def small_text(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "small.txt"
    path.write_text("tiny corpus " * 20)  # 240 bytes: fewer windows than one batch
    return path


BAD_INPUT = {
    "unknown strategy": (["--set", "parallel.strategy=zero4"], "parallel.strategy"),
    "unknown key": (["--set", "train.stepz=3"], "did you mean 'train.steps'"),
    "wrong type": (["--set", "train.steps=abc"], "train.steps must be int"),
    "hsdp product": (["--nproc", "4", "--set", "parallel.strategy=hsdp", "--set", "parallel.dp_replicate=3",
                      "--set", "parallel.dp_shard=2"], "1 × 3 × 2 × 1 × 1 = 6 ≠ 4"),
    "offload with ddp": (["--set", "parallel.strategy=ddp", "--set", "parallel.offload=cpu"],
                         "parallel.offload"),
    "offload on a CPU-only host": (["--set", "parallel.offload=cpu"], "needs an accelerator"),
    "grad_accum < 1": (["--set", "train.grad_accum=0"], "train.grad_accum"),
    "missing data path": (["--set", "data.source=/no/such/corpus.txt"], "/no/such/corpus.txt"),
    "nproc too large": (["--nproc", "1000"], "--nproc 1000"),
    "batch not divisible": (["--nproc", "2", "--set", "train.batch_size=5"], "multiple of 2"),
    "tp not dividing the heads": (["--set", "model.preset=tiny", "--set", "model.n_kv_heads=1",
                                   "--set", "parallel.tp=2"], "model.n_kv_heads = 1"),
    "pp more than layers": (["--nproc", "4", "--set", "model.preset=tiny", "--set", "parallel.pp=4"],
                            "parallel.pp = 4 is more than the model's 2 layers"),
    "1f1b with too few microbatches": (["--set", "model.preset=tiny", "--set", "parallel.pp=2",
                                       "--set", "parallel.microbatches=1"], "microbatches ≥ 2"),
    "interleaved stages more than layers": (["--set", "model.preset=tiny", "--set", "model.n_layers=3",
                                             "--set", "parallel.pp=2",
                                             "--set", "parallel.pp_schedule=interleaved",
                                             "--set", "parallel.pp_virtual_stages=2"],
                                            "4 pipeline stages (pp 2 × virtual 2) do not fit"),
    "degrees not the world size": (["--nproc", "4", "--set", "parallel.pp=3"],
                                   "pp × cp × tp = 3 × 1 × 1 = 3 does not divide the world size 4"),
    "bad --set syntax": (["--set", "train.steps"], "section.key=value"),
}


@pytest.mark.parametrize("args,needle", BAD_INPUT.values(), ids=list(BAD_INPUT))
def test_bad_input_is_one_line_before_ranks_start(tmp_path, args, needle):
    out = tmp_path / "run"
    r = loom("train", "--out", str(out), *args, timeout=60)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("loom: error: "), r.stderr
    assert needle in lines[0]
    assert not out.exists()  # nothing started, nothing written


def test_corpus_smaller_than_one_batch(tmp_path, small_text):
    r = loom("train", "--out", str(tmp_path / "run"), "--set", f'data.source="{small_text}"',
             "--set", "data.seq_len=16", timeout=60)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert "batch" in r.stderr


def test_invalid_toml_file(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[train\nsteps = 3\n")
    r = loom("train", str(cfg), timeout=60)
    assert r.returncode != 0 and "not valid TOML" in r.stderr and "Traceback" not in r.stderr


def test_a_closed_pipe_is_no_traceback():
    """`loom … | head`: the reader closes the pipe early; loom stops quietly (141, as a shell reports
    SIGPIPE), without a BrokenPipeError traceback."""
    buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # as in a terminal's shell
    proc = subprocess.Popen([sys.executable, "-m", "loom.cli", "presets"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=buffered)
    proc.stdout.close()  # before loom writes a byte
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err
