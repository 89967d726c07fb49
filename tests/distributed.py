"""Run a function on N gloo ranks in processes of their own (free port, timeout, errors surfaced).

The ranks are forked from a forkserver that has imported torch and loom once: a spawned rank spent
most of a small test importing them again (about 5 s of a tiny model's 8 on 2 cores). Each rank gets
the caller's environment and working directory as a spawned one would, and unpickles the function and
its arguments only then (a module it imports reads that environment)."""

from __future__ import annotations

import os
import pickle
import queue
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from loom.launch import free_port

# What the forkserver imports once (loom.train.driver imports most of loom).
PRELOAD = ["torch", "torch.distributed", "loom.train.driver"]


def _worker(call: bytes, env: dict, cwd: str, rank: int, world: int, port: int, results) -> None:
    os.environ.clear()
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    os.chdir(cwd)
    import numpy as np
    import torch

    # numpy's global stream its own, as a spawned process's (a fork's is the server's; Python's random
    # reseeds at a fork itself, and torch's generator starts at its default seed either way)
    np.random.seed()
    torch.set_num_threads(1)  # N ranks share the machine's few cores
    try:
        fn, args = pickle.loads(call)
        # Plain pickle copies tensors; torch's queue pickler would share memory that dies with us.
        results.put((rank, "ok", pickle.dumps(fn(*args))))
    except BaseException:  # noqa: BLE001 - report anything to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable, world: int, *args: Any, timeout: float = 240.0) -> list[Any]:
    """fn(*args) on every rank; returns the results ordered by rank. `fn` must be importable."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # (read when the server starts: the first call)
    results = ctx.Queue()
    port = free_port()
    call, env = pickle.dumps((fn, args)), dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(call, env, os.getcwd(), r, world, port, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    try:
        while len(out) < world:
            try:
                rank, status, value = results.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"{world - len(out)} rank(s) did not finish in {timeout}s") from None
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world)]
