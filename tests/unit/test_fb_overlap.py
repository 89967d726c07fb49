"""DualPipeV's overlapped forward and backward (loom/parallel/fb_overlap.py), its rules on threads
alone: with compute turns the two sides' compute segments alternate, the forward's first, never two at
once, and neither side waits forever whatever their counts of exchanges; the backward side exchanges
over its own group; nested exchanges are one. The gloo runs are tests/distributed/test_fb_overlap_ranks.py."""

from __future__ import annotations

import threading
import time

import pytest

from loom.parallel import fb_overlap
from loom.parallel.fb_overlap import BACKWARD, FORWARD, _ComputeTurns, _side, exchange_group, exchange_segment


def _run_sides(exchanges: dict[str, int], turns: _ComputeTurns | None, groups: dict | None = None):
    """Both sides at once, each `exchanges[side]` exchanges between computes; the segments' log."""
    log: list[tuple[str, str, float, float]] = []  # (side, kind, start, end)
    lock = threading.Lock()

    def work(side: str) -> None:
        def segment(kind: str) -> None:
            start = time.perf_counter()
            time.sleep(0.002)
            with lock:
                log.append((side, kind, start, time.perf_counter()))

        for _ in range(exchanges[side]):
            segment("compute")
            with exchange_segment():
                segment(f"exchange over {exchange_group('ep')}")
        segment("compute")

    helper = threading.Thread(target=_side, args=(BACKWARD, turns, groups or {}, lambda: work(BACKWARD)))
    helper.start()
    _side(FORWARD, turns, {}, lambda: work(FORWARD))
    helper.join(timeout=10)
    assert not helper.is_alive(), "the backward side never finished: a wait for a turn that never came"
    return log


@pytest.mark.parametrize("forward, backward", [(3, 3), (1, 4), (4, 1), (0, 2), (2, 0), (0, 0)])
def test_compute_turns_alternate_and_never_wait_forever(forward, backward):
    log = _run_sides({FORWARD: forward, BACKWARD: backward}, _ComputeTurns())
    computes = sorted((s for s in log if s[1] == "compute"), key=lambda s: s[2])
    assert len(computes) == forward + backward + 2
    for a, b in zip(computes, computes[1:]):
        assert a[3] <= b[2], f"{a[0]} and {b[0]} computed at once"
    # forward first, then in turns while both have some left
    order = [s[0] for s in computes]
    both = 2 * min(forward, backward) + 2
    assert order[:both] == [FORWARD, BACKWARD] * (both // 2)


def test_without_turns_the_sides_run_free():
    both_inside = threading.Barrier(2, timeout=10)  # each side's compute waits for the other's to begin

    def work() -> None:
        with exchange_segment():
            pass
        both_inside.wait()

    helper = threading.Thread(target=_side, args=(BACKWARD, None, {}, work))
    helper.start()
    _side(FORWARD, None, {}, work)  # a BrokenBarrierError here: the sides did not compute at once
    helper.join()


def test_the_backward_side_exchanges_over_its_own_group():
    log = _run_sides({FORWARD: 2, BACKWARD: 2}, None, {"ep": "ep-backward"})
    assert {s[1] for s in log if s[0] == FORWARD} == {"compute", "exchange over ep"}
    assert {s[1] for s in log if s[0] == BACKWARD} == {"compute", "exchange over ep-backward"}
    assert exchange_group("ep") == "ep"  # outside an overlapped action: the group itself


def test_nested_exchanges_are_one_segment():
    turns = _ComputeTurns()
    ends: list[str] = []
    turns.end = lambda side: ends.append(side)  # type: ignore[method-assign]
    turns.begin = lambda side: None  # type: ignore[method-assign]

    def work() -> None:
        with exchange_segment():
            with exchange_segment():  # the dispatch's rows inside its counts-and-rows exchange
                pass
        with exchange_segment():
            pass

    _side(FORWARD, turns, {}, work)
    assert ends == [FORWARD, FORWARD]


def test_overlap_is_for_dualpipev_under_ep():
    from loom.config import ParallelConfig

    assert fb_overlap.overlaps(ParallelConfig(pp=2, pp_schedule="dualpipev", ep=2))
    off = ParallelConfig(pp=2, pp_schedule="dualpipev", ep=2, dualpipev_overlap=False)
    assert not fb_overlap.overlaps(off)
    assert not fb_overlap.overlaps(ParallelConfig(pp=2, pp_schedule="dualpipev", ep=1))
    assert not fb_overlap.overlaps(ParallelConfig(pp=2, pp_schedule="zbv", ep=2))
