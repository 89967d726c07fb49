"""A loaded machine: the time other processes hold this process's cores is measured
(loom/observe/core_wait), taken out of the calibration's timings so that a profile measured beside
another job describes the machine, and named beside a run's step time."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from loom.observe import core_wait
from loom.observe.calibrate import _in_passes
from loom.train.record import print_step_time, step_time_vs_planned

# The waits measured are the competitors' this test starts, not another test's (tests/conftest.py).
pytestmark = pytest.mark.alone

linux_schedstat = pytest.mark.skipif(not Path("/proc/self/schedstat").exists(),
                                     reason="needs Linux's /proc/<pid>/schedstat (run-queue waits)")


@contextlib.contextmanager
def one_core(competitors: int):
    """This thread on one core, and `competitors` busy processes on the same core beside it."""
    core = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    procs = []
    try:
        for _ in range(competitors):
            procs.append(subprocess.Popen([sys.executable, "-c", "import os, sys\n"
                                           f"os.sched_setaffinity(0, {{{core}}}); print('on', flush=True)\n"
                                           "while True: pass"], stdout=subprocess.PIPE, text=True))
            assert procs[-1].stdout.readline().strip() == "on"
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        os.sched_setaffinity(0, before)


def spin(seconds: float) -> None:
    """Busy for `seconds` of this thread's own CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@linux_schedstat
def test_the_wait_is_the_time_another_process_held_the_core():
    with one_core(competitors=2):
        waits, start, cpu = core_wait.snapshot(), time.perf_counter(), time.thread_time()
        spin(0.3)
        wall, ran = time.perf_counter() - start, time.thread_time() - cpu
        waited = core_wait.waited_s(waits)
    assert waited > 0.4 * wall  # three busy processes on one core: about a third each
    assert abs(wall - waited - ran) < 0.1 * wall


@linux_schedstat
def test_a_calibration_beside_another_job_measures_the_machine_not_the_load():
    """A probe timed with a busy process on its core reads as fast as on its own (within 25%),
    where the plain wall clock reads it about twice as slow."""
    cpu = torch.device("cpu")
    with one_core(competitors=0):
        (alone,) = _in_passes([lambda: spin(0.01)], 0.15, cpu)
    with one_core(competitors=1):
        (loaded,) = _in_passes([lambda: spin(0.01)], 0.15, cpu)
    assert 0.8 < loaded / alone < 1.25


def test_a_runs_step_time_names_the_load(capsys):
    plan = {"step_time_s": 0.3, "step_time_breakdown_s": {"compute": 0.3, "total": 0.3}}
    print_step_time(step_time_vs_planned(0.6, plan, core_wait_share=0.5), "cpu")
    line = capsys.readouterr().out
    assert "= 2.00" in line and "the ranks waited for one 50% of the time" in line
    assert "≈ 0.300 s" in line
    print_step_time(step_time_vs_planned(0.31, plan, core_wait_share=0.01), "cpu")
    assert "other processes" not in capsys.readouterr().out
