"""Who ends the process group train() starts: run alone (a world of one), train() itself, at once;
ranks of a launcher keep it for their script's next train() and end it at exit. Ending it there
after each call made the next call's group race the old one on the same port: every spawned
two-call test (a run, then its resume) hung at a barrier for 600 s."""

from __future__ import annotations

import atexit
import os

import torch.distributed as dist

from loom.launch import free_port
from loom.parallel.mesh import group_of_this_call, shutdown


def _start_group() -> None:
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)


def test_alone_the_group_ends_with_the_call(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with group_of_this_call():
        _start_group()
    assert not dist.is_initialized()


def test_a_launchers_rank_keeps_it_for_the_next_call_and_ends_it_at_exit(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    registered = []
    monkeypatch.setattr(atexit, "register", registered.append)
    try:
        with group_of_this_call():
            _start_group()
        assert dist.is_initialized() and registered == [shutdown]
        with group_of_this_call():  # the script's second train(): the same group, nothing more registered
            pass
        assert dist.is_initialized() and registered == [shutdown]
    finally:
        shutdown()
    assert os.environ["RANK"] == "0"
