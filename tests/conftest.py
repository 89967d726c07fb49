"""Shared fixtures (a small real text corpus, so no test needs a download) and the `distributed`
marker: every test under tests/distributed/ spawns ranks, so `-m "not distributed"` is the fast
inner loop (tests/unit/); and the `alone` marker, for a test that times the machine, under
pytest-xdist (`-n auto`, as CI runs the suite)."""

from __future__ import annotations

import contextlib
import fcntl
import inspect
import json
import os
import sys
import tempfile
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """A few stdlib modules' source as one text file."""
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(inspect.getsource(json) + inspect.getsource(inspect)[:60_000])
    return path


# A device profile measured once on a 2-core CPU (`loom plan --calibrate`), so that `loom plan`
# (which plans for this machine by default) and the plan.json of test runs never calibrate on
# their own; tests that measure this machine point LOOM_DEVICE_PROFILE elsewhere.
os.environ.setdefault("LOOM_DEVICE_PROFILE", str(Path(__file__).parent / "data" / "device_cpu.json"))


def smoke_set() -> list[str]:
    """tests/smoke.txt's node ids (a file's path stands for all of its tests)."""
    lines = (Path(__file__).parent / "smoke.txt").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def extended_set() -> list[str]:
    """tests/extended.txt's node ids: more cases of a capability another test already runs."""
    lines = (Path(__file__).parent / "extended.txt").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _listed(nodeid: str, entries: set[str]) -> bool:
    return nodeid in entries or nodeid.split("::")[0] in entries or nodeid.split("[")[0] in entries


def pytest_collection_modifyitems(config, items) -> None:
    here = Path(__file__).parent / "distributed"
    smoke, extended = set(smoke_set()), set(extended_set())
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.distributed)
        if _listed(item.nodeid, smoke):
            item.add_marker(pytest.mark.smoke)
        if _listed(item.nodeid, extended):
            item.add_marker(pytest.mark.extended)


@contextlib.contextmanager
def _turn(alone: bool):
    """Under pytest-xdist, a test marked `alone` runs while no other worker runs one: a test that
    reads the wall clock against a bound fails when another test shares the cores (a calibrated step
    time, 2.2x its plan so). A readers-writer lock over the run's workers: every test holds the lock
    shared, an `alone` one exclusive; the gate keeps new tests from starting while it waits."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:  # one process: every test runs alone
        yield
        return
    base = Path(tempfile.gettempdir()) / f"loom-tests-{run}"
    with open(f"{base}.gate", "a") as gate, open(f"{base}.lock", "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Setup, call and teardown under one turn: a module fixture that measures runs in the setup."""
    with _turn(item.get_closest_marker("alone") is not None):
        yield


@pytest.fixture(autouse=True)
def _own_environment():
    """A world of one trained in this process sets RANK, MASTER_PORT, ... and keeps a process
    group; left behind, the next `loom train` would think it is a torchrun rank. Undo both."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        if "torch.distributed" in sys.modules:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture
def world_of_one():
    """A world of one trained in this process (`loom train --nproc 1`): its process group and the
    environment it sets (RANK, MASTER_PORT, ...) undone after (tests/in_process.py)."""
    from in_process import world_of_one as undone_after

    with undone_after():
        yield


@pytest.fixture
def gloo_world_of_one():
    """A single-process gloo process group (rank 0 of 1) for unit tests of collectives, meshes and
    what a rank does; yields the rank's view (rank, world_size, is_main). The group, and any RANK or
    MASTER_PORT it leaves, are undone after (tests/in_process.py)."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from in_process import world_of_one as one_process

    from loom.launch import free_port

    with one_process():
        store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        yield SimpleNamespace(rank=0, world_size=1, is_main=True)
