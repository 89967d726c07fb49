"""A world of one trained in the test's own process (`loom train --nproc 1`, `train(cfg, ...)`)
sets RANK, MASTER_PORT, ... and a process group: train() ends both when it returns, but a test that
builds a world another way may leave them, and the next `loom train` would think it a torchrun rank.
`world_of_one()` runs the block without them (and without planted faults, LOOM_FAULTS) and undoes both
after it."""

from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def world_of_one():
    from loom.parallel.mesh import shutdown
    from loom.train import faults

    saved = dict(os.environ)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOOM_FAULTS"):
        os.environ.pop(key, None)
    faults.planted.cache_clear()
    try:
        yield
    finally:
        shutdown()
        os.environ.clear()
        os.environ.update(saved)
