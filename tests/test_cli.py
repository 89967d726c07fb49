"""The `loom` command end to end: a real torchrun launch, and bad input caught before ranks start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def loom(*args: str, cwd: Path | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "loom.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def small_text(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "small.txt"
    path.write_text("tiny corpus " * 20)  # 240 bytes: fewer windows than one batch
    return path


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


BAD_INPUT = {
    "unknown strategy": (["--set", "parallel.strategy=zero4"], "parallel.strategy"),
    "unknown key": (["--set", "train.stepz=3"], "did you mean 'train.steps'"),
    "wrong type": (["--set", "train.steps=abc"], "train.steps must be int"),
    "hsdp product": (["--nproc", "4", "--set", "parallel.strategy=hsdp", "--set", "parallel.dp_replicate=3",
                      "--set", "parallel.dp_shard=2"], "1 × 3 × 2 × 1 = 6 ≠ 4"),
    "offload with ddp": (["--set", "parallel.strategy=ddp", "--set", "parallel.offload=cpu"], "parallel.offload"),
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
    "interleaved layers not divisible": (["--set", "model.preset=tiny", "--set", "model.n_layers=3",
                                          "--set", "parallel.pp=2", "--set", "parallel.pp_schedule=interleaved",
                                          "--set", "parallel.pp_virtual_stages=2"], "not divisible by"),
    "degrees not the world size": (["--nproc", "4", "--set", "parallel.pp=3"],
                                   "pp × tp = 3 × 1 = 3 does not divide the world size 4"),
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
