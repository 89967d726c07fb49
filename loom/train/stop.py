"""A graceful stop: SIGINT, SIGTERM or train.preempt_signal (SIGUSR1: Slurm's early warning) to a
rank, or the launcher's stop file (written when the `loom` launcher itself gets one of those), asks
the run to stop. Every rank finishes its optimizer step; the ranks agree (one all-reduce of a
small CPU tensor per step, on a gloo group, so it never waits for the GPU) to stop at the same
step, save a checkpoint, and leave with the signal's conventional code. A second Ctrl-C aborts at
once (one delivered twice within launch.SAME_CTRL_C_S is one). On the early warning under
train.requeue, rank 0 then requeues the Slurm job, whose script continues with --resume auto.

Ranks also die with their launcher (loom/launch.py `die_with_parent`): no rank keeps training,
or writing into the run, as an orphan.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from loom.errors import LoomError
from loom.launch import STOP_FILE_ENV, aborts, exit_code


class Stopped(LoomError):
    """The run stopped on request at `step`, after saving `checkpoint` (None: no run directory)."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None, note: str | None = None) -> None:
        self.signum, self.step, self.checkpoint, self.note = signum, step, checkpoint, note
        self.code = exit_code(signum)
        where = f"; checkpoint {checkpoint}" if checkpoint is not None else ""
        super().__init__(f"interrupted ({signal.Signals(signum).name}) at step {step}{where}")


def preempt_signal(cfg) -> int:
    """train.preempt_signal's number: the scheduler's warning ahead of preemption or the time limit."""
    return signal.Signals[f"SIG{cfg.train.preempt_signal}"]


def slurm_requeue() -> str:
    """Put this Slurm job back in the queue (`scontrol requeue`); its script runs again and continues
    with --resume auto. One line saying what happened."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return "train.requeue: not in a Slurm job (no SLURM_JOB_ID), so nothing was requeued"
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"scontrol requeue {job} failed ({e}); submit the job again: it continues with --resume auto"
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        return f"scontrol requeue {job} failed ({why}); submit the job again: it continues with --resume auto"
    return f"requeued Slurm job {job}: it continues from this checkpoint when it runs again"


_received = 0  # the first stop signal this process got (0: none)
_received_at = 0.0  # when (time.monotonic)


def _record(signum, frame) -> None:
    global _received, _received_at
    if not _received:
        _received, _received_at = signum, time.monotonic()
    elif aborts(signum, _received_at, time.monotonic()):  # a second Ctrl-C: abort now
        os._exit(130)


def listen(preempt: int = signal.SIGUSR1) -> dict:
    """Keep SIGINT, SIGTERM and the preemption signal as a stop request from now on (a rank calls
    it at its start: a signal during setup is honoured at step 1, not fatal). The handlers it
    replaced; none off the main thread, where Python cannot run them."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, _record) for sig in (signal.SIGINT, signal.SIGTERM, preempt)}


class StopRequest:
    """The stop asked of this rank (a signal, or the launcher's file), agreed across ranks."""

    current: StopRequest | None = None  # the run's, closed by train() whatever ends it

    def __init__(self, world_size: int, preempt: int = signal.SIGUSR1) -> None:
        StopRequest.current = self
        self.stop_file = os.environ.get(STOP_FILE_ENV)
        self.group = dist.new_group(backend="gloo") if world_size > 1 else None
        self.previous = listen(preempt)

    def _asked(self) -> int:
        if _received:
            return _received
        if self.stop_file:
            try:
                return int(Path(self.stop_file).read_text() or signal.SIGTERM)
            except (FileNotFoundError, ValueError):
                return 0
        return 0

    def agreed(self, checkpoint_due: bool = False, write_failed: bool = False) -> tuple[int, bool, bool]:
        """(the signal to stop on at this step, 0: go on; whether any rank's clock says a timed
        checkpoint is due; whether any rank's background checkpoint write failed): the same on
        every rank."""
        flags = torch.tensor([self._asked(), int(checkpoint_due), int(write_failed)], dtype=torch.int64)
        if self.group is not None:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return int(flags[0]), bool(flags[1]), bool(flags[2])

    def close(self) -> None:
        self._restore()
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None

    def _restore(self) -> None:
        global _received
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous, _received = {}, 0
        StopRequest.current = None

    @classmethod
    def close_current(cls) -> None:
        """Restore the signal handlers after a run that ended in an error."""
        if cls.current is not None:
            cls.current._restore()
