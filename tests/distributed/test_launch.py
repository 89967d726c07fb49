"""Launching as a cluster does (issue 16): two "nodes" on localhost meeting at a c10d or a static
rendezvous, and srun-style tasks (SLURM_* variables, no torchrun) form the same group of two
ranks as `--nproc 2` on one node, and train to the same losses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from slurm import job_with_free_port, srun_task, stub_scontrol, stub_srun

from loom.launch import free_port

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6
ARGS = ["--set", "model.preset=tiny", "--set", "data.seq_len=32", "--set", "train.batch_size=4",
        "--set", f"train.steps={STEPS}", "--set", "train.eval_batches=0", "--set", "data.num_workers=0",
        "--set", "parallel.strategy=zero3"]

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _loom(out: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    base = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES and not k.startswith("SLURM_")}
    return subprocess.Popen([sys.executable, "-m", "loom.cli", "train", "--out", str(out), *ARGS, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**base, "PYTHONPATH": str(ROOT), **(env or {})})


def _finish(*procs: subprocess.Popen) -> list[str]:
    """Each process's stdout, once all exited 0."""
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        outs.append(out)
    return outs


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_node(tmp_path_factory) -> list[float]:
    run = tmp_path_factory.mktemp("one-node") / "run"
    _finish(_loom(run, "--nproc", "2"))
    return _losses(run)


@pytest.mark.parametrize("rendezvous", ["c10d", "static"])
def test_two_nodes_on_localhost_train_as_one_node(tmp_path, one_node, rendezvous):
    run, endpoint = tmp_path / "run", f"127.0.0.1:{free_port()}"
    nodes = [_loom(run, "--nproc", "1", "--nnodes", "2", "--rdzv-endpoint", endpoint,
                   *(["--node-rank", str(n)] if rendezvous == "static" else []))
             for n in range(2)]
    _finish(*nodes)
    assert len(one_node) == STEPS
    assert _losses(run) == pytest.approx(one_node, rel=1e-6)


def test_srun_tasks_start_a_correct_group(tmp_path, one_node):
    """No MASTER_ADDR: the first host of SLURM_JOB_NODELIST (from scontrol) hosts the store; the
    port comes from the job id. The command printed to continue starts the same tasks again."""
    run, path, job = tmp_path / "run", stub_scontrol(tmp_path / "bin"), job_with_free_port()
    tasks = [_loom(run, env={**path, **srun_task(r, 2, job)}) for r in range(2)]
    first, _ = _finish(*tasks)
    assert _losses(run) == pytest.approx(one_node, rel=1e-6)
    assert "show hostnames node[1]" in (tmp_path / "bin" / "scontrol.log").read_text()
    assert f"(continue: srun --nodes 1 --ntasks 2 loom train --resume auto --out {run} " \
           f"--set train.steps={2 * STEPS}; weights:" in first


def test_the_sbatch_example_runs_two_nodes(tmp_path, one_node):
    """examples/slurm/train.sbatch as Slurm would run it (a stub srun and scontrol, two "nodes" of
    one rank each on this machine): the same losses as one node with two ranks."""
    path = stub_scontrol(tmp_path / "bin")
    stub_srun(tmp_path / "bin")
    run = tmp_path / "run"
    env = {**{k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES},
           "PATH": f"{path['PATH']}{os.pathsep}{Path(sys.executable).parent}", "PYTHONPATH": str(ROOT),
           "SLURM_JOB_ID": job_with_free_port(), "SLURM_JOB_NAME": "loom", "SLURM_JOB_NODELIST": "node[1-2]",
           "SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "1", "RUN": str(run)}
    done = subprocess.run(["bash", str(ROOT / "examples" / "slurm" / "train.sbatch"), *ARGS], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _losses(run) == pytest.approx(one_node, rel=1e-6)
