"""A job as Slurm runs it, on this machine: srun's task variables, a stub `scontrol`, a job id
whose store port is free."""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path


def stub_scontrol(folder: Path) -> dict:
    """An `scontrol` on PATH that names localhost as the job's first node and logs its calls."""
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "scontrol.log"
    script = folder / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> {log}\n[ "$1" = show ] && echo localhost\nexit 0\n')
    script.chmod(0o755)
    return {"PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"}


def srun_task(rank: int, ntasks: int, job: str = "4242") -> dict:
    """The variables srun gives task `rank` of `ntasks` on one node (loom reads these alone)."""
    return {"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NTASKS": str(ntasks),
            "SLURM_JOB_ID": job, "SLURM_JOB_NODELIST": "node[1]", "OMP_NUM_THREADS": "1"}


def job_with_free_port() -> str:
    """A Slurm job id whose store port (15000 + id mod 20000, loom/launch.py) is free here."""
    for job in random.sample(range(20000), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 15000 + job))
            except OSError:
                continue
        return str(job)
    raise AssertionError("no free port in 15000..34999")


def stub_srun(folder: Path) -> None:
    """An `srun` (beside the stub scontrol) that runs its command once per node of the job, as
    `srun --ntasks-per-node=1` does, each with its task's variables."""
    script = folder / "srun"
    script.write_text('''#!/bin/bash
while [[ $1 == --* ]]; do shift; done
pids=()
for ((n = 0; n < SLURM_NNODES; n++)); do
    SLURM_NODEID=$n SLURM_PROCID=$n SLURM_LOCALID=0 SLURM_NTASKS=$SLURM_NNODES "$@" & pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
''')
    script.chmod(0o755)
