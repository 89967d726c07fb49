"""Planted bugs in how the suite runs: a test that times the machine sharing the cores with another
test under pytest-xdist (tests/conftest.py)."""

from __future__ import annotations

from planted import Bug

BUGS = [
    Bug("alone-shares-the-cores", "a test marked `alone` takes the workers' lock shared, as every other "
        "test does: it runs beside them, and its wall-clock bound reads their load",
        "tests/conftest.py", "fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)",
        "fcntl.flock(lock, fcntl.LOCK_SH)",
        ("tests/unit/test_alone_marker.py::test_an_alone_test_runs_while_no_other_test_does",)),
]
