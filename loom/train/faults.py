"""Planted faults for testing recovery, from the LOOM_FAULTS environment variable.

LOOM_FAULTS is a comma-separated list of KIND@STEP or KIND@STEP:RANK (rank 0 if omitted):
  kill@5:1                 rank 1 kills itself (SIGKILL) in the middle of step 5
  kill_in_checkpoint@4     rank 0 is killed after step 4's checkpoint files are written,
                           before the checkpoint is made visible
  hang@3:1                 rank 1 stops responding at the start of step 3
  nan@3                    rank 0's loss at step 3 becomes NaN
  enospc@4:1               rank 1's writes of step 4's checkpoint fail, part written, as on a full disk
Kills fire only in the first attempt (TORCHELASTIC_RESTART_COUNT 0), so a restarted group can
recover. Unset, every hook is a no-op.
"""

from __future__ import annotations

import errno
import functools
import os
import signal
import time
from pathlib import Path

import torch

from loom.errors import LoomError

KINDS = ("kill", "kill_in_checkpoint", "hang", "nan", "enospc")


@functools.cache
def planted() -> dict[tuple[str, int, int], bool]:
    spec = os.environ.get("LOOM_FAULTS", "").strip()
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        kind, _, where = item.partition("@")
        step, _, rank = where.partition(":")
        if kind not in KINDS or not step.isdigit() or (rank and not rank.isdigit()):
            raise LoomError(f"LOOM_FAULTS item '{item}' must be KIND@STEP or KIND@STEP:RANK with KIND one of "
                            f"{', '.join(KINDS)}, e.g. kill@5:1")
        out[(kind, int(step), int(rank or 0))] = True
    return out


def _fires(kind: str, step: int, rank: int) -> bool:
    if not planted().get((kind, step, rank)):
        return False
    first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
    return first_attempt or kind in ("hang", "nan")


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def at_step_start(step: int, rank: int) -> None:
    if _fires("hang", step, rank):
        time.sleep(3600)


def after_forward(step: int, rank: int, loss: torch.Tensor) -> torch.Tensor:
    if _fires("kill", step, rank):
        _kill()
    if _fires("nan", step, rank):
        return loss * float("nan")
    return loss


def maybe_kill_in_checkpoint(step: int, rank: int) -> None:
    if _fires("kill_in_checkpoint", step, rank):
        _kill()


def checkpoint_writer(step: int, rank: int, path: Path):
    """DCP's file writer for checkpoint `step`; under enospc@STEP, one that writes this rank's
    files and then fails as a full disk does."""
    from torch.distributed.checkpoint import FileSystemWriter

    if not _fires("enospc", step, rank):
        return FileSystemWriter(path)

    class FullDisk(FileSystemWriter):
        def write_data(self, plan, planner):
            super().write_data(plan, planner).wait()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    return FullDisk(path)
