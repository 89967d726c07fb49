"""A graceful stop: SIGINT, SIGTERM or SIGUSR1 (Slurm's early warning) to a rank, or the launcher's
stop file (written when the `loom` launcher itself gets one of those), asks the run to stop. Every
rank finishes its optimizer step; the ranks agree (one all-reduce of a small CPU tensor per step,
on a gloo group, so it never waits for the GPU) to stop at the same step, save a checkpoint, and
leave with the signal's conventional code. A second Ctrl-C aborts at once.

Ranks also die with their launcher (loom/launch.py `die_with_parent`): no rank keeps training,
or writing into the run, as an orphan.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from loom.errors import LoomError
from loom.launch import STOP_FILE_ENV, exit_code


class Stopped(LoomError):
    """The run stopped on request at `step`, after saving `checkpoint` (None: no run directory)."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        self.code = exit_code(signum)
        where = f"; checkpoint {checkpoint}" if checkpoint is not None else ""
        super().__init__(f"interrupted ({signal.Signals(signum).name}) at step {step}{where}")


class StopRequest:
    """The stop asked of this rank (a signal, or the launcher's file), agreed across ranks."""

    current: StopRequest | None = None  # the run's, closed by train() whatever ends it

    def __init__(self, world_size: int) -> None:
        StopRequest.current = self
        self.signum = 0
        self.stop_file = os.environ.get(STOP_FILE_ENV)
        self.group = dist.new_group(backend="gloo") if world_size > 1 else None
        self.previous = {}
        if threading.current_thread() is threading.main_thread():  # where Python runs handlers
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
                self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.signum and signum == signal.SIGINT:  # a second Ctrl-C: abort now
            os._exit(130)
        self.signum = self.signum or signum

    def _asked(self) -> int:
        if self.signum:
            return self.signum
        if self.stop_file:
            try:
                return int(Path(self.stop_file).read_text() or signal.SIGTERM)
            except (FileNotFoundError, ValueError):
                return 0
        return 0

    def agreed(self, checkpoint_due: bool = False) -> tuple[int, bool]:
        """(the signal to stop on at this step, 0: go on; whether any rank's clock says a timed
        checkpoint is due): the same on every rank."""
        flags = torch.tensor([self._asked(), int(checkpoint_due)], dtype=torch.int64)
        if self.group is not None:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return int(flags[0]), bool(flags[1])

    def close(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
        StopRequest.current = None

    @classmethod
    def close_current(cls) -> None:
        """Restore the signal handlers after a run that ended in an error."""
        if cls.current is not None:
            for sig, handler in cls.current.previous.items():
                signal.signal(sig, handler)
            cls.current.previous, cls.current = {}, None
