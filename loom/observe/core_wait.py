"""Time this process spent ready to run but waiting for a core, which other processes took.

A loaded machine stretches every timing: a calibration taken while something else runs would make
the planner think the cores slow, and a run beside other jobs looks slower than its plan. Linux
counts, per thread, the nanoseconds it sat runnable in a run queue (/proc/self/task/*/schedstat,
second field). A timing minus the longest such wait of this process's threads is what the work
took on its own cores: exact for one thread; for several, their waits overlap and OpenMP's spinning
threads keep some of the loss, so it is a lower bound on the slowdown. Where the file is missing
(not Linux, or schedstats off) the wait reads 0 and timings are taken as they are.
"""

from __future__ import annotations

import glob

Snapshot = dict  # thread id -> run-queue wait in ns


def snapshot() -> Snapshot:
    waits = {}
    for path in glob.glob("/proc/self/task/*/schedstat"):
        try:
            with open(path) as f:
                fields = f.read().split()
            waits[path] = int(fields[1])
        except (OSError, IndexError, ValueError):  # a thread that just ended, or no schedstats
            continue
    return waits


def waited_s(before: Snapshot, after: Snapshot | None = None, chained: bool = False) -> float:
    """Seconds of waiting for a core between the snapshots: the longest of any thread alive at both
    (threads computing side by side wait side by side), or chained: their sum (a collective's message
    passes from thread to thread, and each one's wait delays it)."""
    after = snapshot() if after is None else after
    waits = [after[t] - before[t] for t in after.keys() & before.keys()]
    return (sum(waits) if chained else max(waits, default=0)) / 1e9
