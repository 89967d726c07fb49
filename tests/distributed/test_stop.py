"""Stopping a run as a user or a scheduler does (issue 16): SIGTERM or Ctrl-C to `loom train`
checkpoints the step every rank agreed on, prints one line, exits 143 / 130, and `--resume auto`
continues to the same losses as a run never stopped; a signal to one rank alone stops every rank
at one step; SIGKILL of the launcher leaves no rank running."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm import job_with_free_port, srun_task, stub_scontrol

from loom.launch import free_port
from loom.train import checkpoint

ROOT = Path(__file__).resolve().parents[2]
STEPS = 300
ARGS = ["--nproc", "2", "--set", "model.preset=tiny", "--set", "data.seq_len=32",
        "--set", "train.batch_size=4", "--set", f"train.steps={STEPS}", "--set", "train.eval_batches=0",
        "--set", "data.num_workers=0",
        "--set", "parallel.strategy=zero3", "--set", "train.log_every=1000"]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _train(out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "loom.cli", "train", "--out", str(out), *ARGS, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())


def _losses(run: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def _started(run: Path, proc: subprocess.Popen, steps: int = 2) -> None:
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        metrics = run / "metrics.jsonl"
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= steps:
            return
        time.sleep(0.05)
    raise AssertionError(f"the run did not reach step {steps}: {proc.poll()}")


def _alive(run: Path) -> dict[int, str]:
    """The processes that still name the run directory: pid → command line."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(run) in cmd and int(pid) != os.getpid():
            found[int(pid)] = cmd
    return found


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    run = tmp_path_factory.mktemp("reference") / "run"
    proc = _train(run)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return _losses(run)


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)],
                         ids=["sigterm", "sigint"])
def test_signal_checkpoints_and_resume_continues_the_same_run(tmp_path, reference, signum, code):
    run = tmp_path / "run"
    proc = _train(run)
    _started(run, proc)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    line = err.strip().splitlines()[-1]
    match = re.fullmatch(rf"loom: interrupted \({signal.Signals(signum).name}\) at step (\d+); checkpoint "
                         rf"(\S+); continue with: (loom train --resume auto --out {re.escape(str(run))} "
                         rf"--nproc 2)", line)
    assert match, line
    step = int(match.group(1))
    assert 2 <= step < STEPS and Path(match.group(2)) == run / "checkpoints" / f"step_{step}"
    assert (run / "checkpoints" / f"step_{step}" / "meta.json").is_file()
    assert not list((run / "checkpoints").glob(".tmp-*"))
    assert not _alive(run)

    # the printed command as it is (the run's config.toml holds every --set of ARGS)
    resumed = subprocess.run([sys.executable, "-m", "loom.cli", *shlex.split(match.group(3))[1:]],
                             capture_output=True, text=True, env=_env(), timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    losses = _losses(run)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for s in range(1, STEPS + 1):
        assert losses[s] == pytest.approx(reference[s], rel=1e-6, abs=1e-7), s


def _rank_pid(run: Path, rank: int) -> int:
    """The process of rank `rank` (torchrun gives it RANK in its environment)."""
    for pid in _alive(run):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no process of rank {rank}: {_alive(run)}")


def test_a_signal_to_one_rank_stops_every_rank_at_one_step(tmp_path):
    """SIGTERM to rank 1 alone (a scheduler signalling one node's processes, a user's kill): the
    ranks agree on the stop, so both stop after the same step with one checkpoint of it. Ranks
    that stopped on their own would wait in different collectives (one saving, one training)
    until the 30 s collective timeout."""
    run = tmp_path / "run"
    proc = _train(run, "--set", "train.collective_timeout_s=30")
    try:
        _started(run, proc)
        os.kill(_rank_pid(run, 1), signal.SIGTERM)
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:  # hung: the ranks die with their launcher
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, err[-3000:]
    line = err.strip().splitlines()[-1]
    match = re.fullmatch(r"loom: interrupted \(SIGTERM\) at step (\d+); checkpoint (\S+); continue with: .*",
                         line)
    assert match, err[-3000:]
    step = int(match.group(1))
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == [f"step_{step}"]
    assert checkpoint.read_meta(run / "checkpoints" / f"step_{step}")["step"] == step
    assert sorted(_losses(run)) == list(range(1, step + 1))  # no step past the agreed one
    assert json.loads((run / "stopped.json").read_text())["step"] == step
    assert not _alive(run)


def test_killed_launcher_leaves_no_rank_running(tmp_path):
    run = tmp_path / "run"
    proc = _train(run)
    _started(run, proc)
    assert len(_alive(run)) >= 3  # the launcher, torchrun and two ranks
    proc.kill()
    proc.communicate(timeout=30)
    deadline = time.time() + 10
    while _alive(run) and time.time() < deadline:
        time.sleep(0.2)
    assert not _alive(run), _alive(run)


@pytest.mark.parametrize("minutes, saved", [(0.0001, [1, 2, 3, 4, 5, 6]), (0, [6])], ids=["timed", "off"])
def test_checkpoints_by_wall_clock_time(tmp_path, minutes, saved):
    """train.ckpt_every_min: a checkpoint whenever that much time has passed since the last, the
    ranks agreeing on it (two ranks here: a disagreement would hang in the save)."""
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "loom.cli", "train", "--out", str(run), *ARGS,
                           "--set", "train.steps=6", "--set", "train.keep_last=10",
                           "--set", f"train.ckpt_every_min={minutes}"],
                          capture_output=True, text=True, env=_env(), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = sorted(int(p.name.removeprefix("step_")) for p in (run / "checkpoints").glob("step_*"))
    assert steps == saved


@pytest.mark.parametrize("launch", ["srun-tasks", "torchrun-per-node"])
def test_slurm_early_warning_checkpoints_requeues_and_the_requeued_job_resumes(tmp_path, reference, launch):
    """sbatch --signal=USR1@T: Slurm signals every process of the job's step (here: the loom
    launchers and torchrun too, which must not die of it). The ranks stop at one step with a
    checkpoint, rank 0 calls `scontrol requeue JOB` (a stub), and the same job script run again
    continues to the losses of a run never stopped."""
    run, path, job = tmp_path / "run", stub_scontrol(tmp_path / "bin"), job_with_free_port()
    args = [a for a in ARGS if a not in ("--nproc", "2")]
    args += ["--set", "train.requeue=true", "--resume", "auto"]
    if launch == "torchrun-per-node":  # one task per node, each starting torchrun for its GPUs
        endpoint = f"127.0.0.1:{free_port()}"
        args += ["--nproc", "1", "--nnodes", "2", "--rdzv-endpoint", endpoint]

    def job_script() -> list[subprocess.Popen]:
        return [subprocess.Popen([sys.executable, "-m", "loom.cli", "train", "--out", str(run), *args],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env={**_env(), **path, **srun_task(r, 2, job)})
                for r in range(2)]

    tasks = job_script()
    _started(run, tasks[0])
    for pid in _alive(run):
        os.kill(pid, signal.SIGUSR1)
    errs = [t.communicate(timeout=120)[1] for t in tasks]
    for t, err in zip(tasks, errs):
        assert "Traceback" not in err, err[-3000:]
        assert t.returncode == 128 + signal.SIGUSR1, err[-3000:]
    lines = errs[0].strip().splitlines()
    assert re.fullmatch(r"loom: interrupted \(SIGUSR1\) at step \d+; checkpoint \S+; continue with: .*",
                        lines[-2])
    assert lines[-1] == f"loom: requeued Slurm job {job}: it continues from this checkpoint when it runs " \
                        f"again"
    assert f"requeue {job}" in (tmp_path / "bin" / "scontrol.log").read_text().splitlines()
    stopped = json.loads((run / "stopped.json").read_text())
    assert (run / "checkpoints" / f"step_{stopped['step']}" / "meta.json").is_file()
    assert not _alive(run)

    again = job_script()
    for t in again:
        _, err = t.communicate(timeout=600)
        assert t.returncode == 0, err[-3000:]
    losses = _losses(run)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for s in range(1, STEPS + 1):
        assert losses[s] == pytest.approx(reference[s], rel=1e-6, abs=1e-7), s


@pytest.mark.parametrize("nproc, signum, code", [(1, signal.SIGTERM, 143), (1, signal.SIGINT, 130),
                                                 (2, signal.SIGINT, 130)],
                         ids=["1-sigterm", "1-sigint", "2-sigint"])
def test_a_signal_to_the_process_group_under_timeout_saves(tmp_path, nproc, signum, code):
    """`timeout 120 loom train` with data-loader workers, its process group signalled (a terminal's
    Ctrl-C, systemd, `kill -- -PGID`): `timeout` passes the signal on, so loom gets it twice, and on
    --nproc 1 the workers get it too. The workers must not die of it (the trainer would crash,
    saving nothing) and the two copies of one Ctrl-C are not a second Ctrl-C (an abort). (torchrun
    and its ranks have a session of their own: on --nproc 2 only the launcher gets the signal.)"""
    run = tmp_path / "run"
    assert ARGS[:2] == ["--nproc", "2"]
    workers = [a if a != "data.num_workers=0" else "data.num_workers=2" for a in ARGS[2:]]
    args = ["--nproc", str(nproc), *workers]
    proc = subprocess.Popen(["timeout", "120", sys.executable, "-m", "loom.cli", "train", "--out", str(run),
                             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        _started(run, proc)
        os.killpg(proc.pid, signum)  # timeout leads its own process group
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == code, err[-3000:]
    assert "Traceback" not in err and "aborted" not in err, err[-3000:]
    match = re.fullmatch(rf"loom: interrupted \({signal.Signals(signum).name}\) at step (\d+); checkpoint "
                         rf"(\S+); continue with: .* --nproc {nproc}", err.strip().splitlines()[-1])
    assert match, err[-3000:]
    assert checkpoint.read_meta(Path(match.group(2)))["step"] == int(match.group(1)) >= 2
