"""torch.profiler over chosen steps: per-rank Chrome traces (gzip) in RUN_DIR/traces/, and on
GPUs a CUDA memory snapshot of the profiled steps (open it in pytorch.org/memory_viz).

The loop marks its phases with `record_function("loom/data" | "loom/forward" | "loom/backward" |
"loom/optimizer")`; `loom analyze` reads them back to split each step.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Self

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from loom.config import ProfileConfig
from loom.parallel.known_warnings import silence_profiler_cycles

# Kineto's bookkeeping lines ("USDT:2026-… SyncActivityProfilerHandler.cpp:52] profiler_start", "STAGE:…
# Completed Stage: …"), written to fd 2 where a trace starts and stops, into the progress line.
_KINETO_MARK = re.compile(rb"^(USDT|STAGE):\d{4}-\d\d-\d\d [^\]]*\] ")


@contextlib.contextmanager
def kineto_marks_dropped() -> Iterator[None]:
    """Run a block with fd 2 sent to a file, then write back all but Kineto's marks. No log level
    hides those without hiding Kineto's errors (its USDT level is above ERROR), so its errors and
    anything else said meanwhile still reach the terminal, just after the block."""
    sys.stderr.flush()
    terminal = os.dup(2)
    with tempfile.TemporaryFile() as said:
        os.dup2(said.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(terminal, 2)
            os.close(terminal)
            said.seek(0)
            kept = b"".join(line for line in said.read().splitlines(keepends=True)
                            if not _KINETO_MARK.match(line))
            if kept:
                os.write(2, kept)


def trace_path(run_dir: Path, rank: int) -> Path:
    return run_dir / "traces" / f"rank{rank}.json.gz"


def _all_threads(on: bool) -> dict:
    # The profiler records the thread that starts it (and autograd's own); a run that computes on a
    # helper thread of its own (DualPipeV's overlapped backward, loom/parallel/fb_overlap.py) asks for
    # every thread.
    if not on:
        return {}
    return {"experimental_config": torch._C._profiler._ExperimentalConfig(profile_all_threads=True)}


class StepProfiler:
    """Call `step()` after every optimizer step; traces are written when the active steps end."""

    def __init__(self, cfg: ProfileConfig, run_dir: Path, rank: int, device: torch.device,
                 all_threads: bool = False):
        self.cfg, self.rank, self.cuda = cfg, rank, device.type == "cuda"
        self.dir = run_dir / "traces"
        self.dir.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        silence_profiler_cycles()
        self.prof = profile(activities=activities,
                            schedule=schedule(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=1),
                            on_trace_ready=self._write, record_shapes=cfg.record_shapes,
                            with_stack=cfg.with_stack, **_all_threads(all_threads))
        self.steps_done = 0
        self.snapshot = self.cuda and cfg.memory_snapshot

    def __enter__(self) -> Self:
        with kineto_marks_dropped():
            self.prof.__enter__()
        self._maybe_record_memory()
        return self

    def __exit__(self, *exc) -> None:
        with kineto_marks_dropped():
            self.prof.__exit__(*exc)
        self._dump_memory()

    def step(self) -> None:
        self.steps_done += 1
        scheduled = self.steps_done <= self.cfg.wait + self.cfg.warmup + self.cfg.active
        with kineto_marks_dropped() if scheduled else contextlib.nullcontext():  # a trace starts or stops
            self.prof.step()
        self._maybe_record_memory()
        if self.steps_done == self.cfg.wait + self.cfg.warmup + self.cfg.active:
            self._dump_memory()

    def _write(self, prof) -> None:
        # Written aside, then renamed: a reader never sees half a trace.
        partial = self.dir / f".partial-rank{self.rank}"
        partial.mkdir(exist_ok=True)
        tmp = partial / f"rank{self.rank}.json.gz"
        prof.export_chrome_trace(str(tmp))  # gzip chosen by the .gz suffix
        os.replace(tmp, trace_path(self.dir.parent, self.rank))
        partial.rmdir()

    def _maybe_record_memory(self) -> None:
        # From the first warm-up step: the snapshot then covers every profiled step.
        if self.snapshot and self.steps_done == self.cfg.wait:
            torch.cuda.memory._record_memory_history(max_entries=200_000)

    def _dump_memory(self) -> None:
        if self.snapshot and self.steps_done >= self.cfg.wait:
            torch.cuda.memory._dump_snapshot(str(self.dir / f"rank{self.rank}_memory_snapshot.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
            self.snapshot = False
