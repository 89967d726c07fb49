"""Each diagnosis finding from a crafted ledger: the category, the exact config key it names and
the value it suggests, at the threshold and not below it; a healthy ledger gives none."""

from __future__ import annotations

import pytest

from loom.observe.diagnose import SHARE, diagnose


def step(compute: float = 85.0, comm: float = 5.0, io: float = 5.0, idle: float = 5.0, wall: float = 100.0,
         **extra) -> dict:
    """One ledger step whose shares (percent of `wall` ms) are given."""
    shares = {"compute": compute, "comm_exposed": comm, "io": io, "idle": idle}
    assert sum(shares.values()) == pytest.approx(100)
    row = {"wall_ms": wall, "shares": shares, "forward_ms": 0.3 * wall, "backward_ms": 0.5 * wall,
           "optimizer_ms": 0.05 * wall, "data_ms": io * wall / 100, "overlap_pct": 50.0, "host_syncs": 0}
    return row | extra


def ledger(*steps: dict, ranks: int = 2, collectives: list | None = None, stragglers: list | None = None,
           ) -> dict:
    return {"ranks": {str(r): {"steps": list(steps), "collectives": collectives or []} for r in range(ranks)},
            "stragglers": stragglers or []}


def found(analysis: dict, config: dict | None = None) -> dict[str, dict]:
    findings = diagnose(analysis, config)
    by_category = {f["category"]: f for f in findings}
    assert len(by_category) == len(findings), findings  # one finding per category
    return by_category


def test_a_healthy_ledger_has_no_finding():
    assert diagnose(ledger(step(), step())) == []
    assert diagnose({"ranks": {}}) == []


def test_io():
    f = found(ledger(step(compute=60, io=20, idle=15)), {"data": {"num_workers": 2}})["io"]
    assert f["knob"] == "data.num_workers" and f["value"].startswith("4 (now 2)")
    assert "IO 20% of a 100.0 ms step" in f["evidence"]
    assert "io" in found(ledger(step(compute=70, io=SHARE, idle=10)))  # at the threshold
    assert "io" not in found(ledger(step(compute=71, io=SHARE - 1, idle=10)))


@pytest.mark.parametrize("kinds, knob, value", [
    ({"all_gather": 30.0, "reduce_scatter": 20.0, "all_reduce": 10.0}, "parallel.fsdp_prefetch", "2 (gather"),
    ({"all_reduce": 40.0, "broadcast": 1.0}, "parallel.ddp_bucket_mb", "12.5 (now 25)"),
])
def test_exposed_communication_names_the_engines_knob(kinds, knob, value):
    """Sharded strategies (all-gathers and reduce-scatters) wait on FSDP's prefetch, replicated
    ones (all-reduce) on DDP's buckets."""
    collectives = [{"kind": k, "duration_ms": ms} for k, ms in kinds.items()]
    f = found(ledger(step(compute=55, comm=35, io=5, idle=5), collectives=collectives),
              {"parallel": {"fsdp_prefetch": 1, "ddp_bucket_mb": 25.0}})["comm"]
    assert f["knob"] == knob and f["value"].startswith(value), f
    assert "exposed 35%" in f["evidence"]


def test_idle():
    f = found(ledger(step(compute=50, comm=5, io=5, idle=40)))["idle"]
    assert f["knob"] == "train.compile" and f["value"].startswith("true")
    assert f["title"] == "The step is 40% idle"
    assert "idle" in found(ledger(step(compute=70, comm=5, io=10, idle=SHARE)))  # at the threshold
    assert "idle" not in found(ledger(step(compute=71, comm=5, io=10, idle=SHARE - 1)))


def test_optimizer():
    heavy = step(optimizer_ms=40.0)
    f = found(ledger(heavy))["optimizer"]
    assert f["knob"] == "train.optimizer_impl" and f["value"].startswith("fused")
    assert f["title"] == "The optimizer step takes 40% of the step"
    assert "optimizer 40.0 ms per step" in f["evidence"]
    assert "optimizer" in found(ledger(step(optimizer_ms=30.0)))  # at the threshold
    assert "optimizer" not in found(ledger(step(optimizer_ms=29.0)))


def test_host_syncs_and_tiny_kernels():
    f = found(ledger(step(host_syncs=3)))
    assert f["sync"]["knob"] == "code: the training step" and f["sync"]["title"].startswith("3 host")
    kernels = found(ledger(step(kernels=2000, mean_kernel_us=5.0, occupancy_pct=10.0)))["kernels"]
    assert kernels["knob"] == "train.compile" and kernels["value"] == "true"
    assert "kernels" not in found(ledger(step(kernels=2000, mean_kernel_us=25.0)))


def test_straggler_names_the_late_rank_and_what_to_fix():
    late = {"rank": 1, "evidence": "rank 1 arrives last at 9 of 9 collectives", "late_ms_mean": 140.0}
    slow, waiting = step(compute=50, comm=5, io=5, idle=40), step(compute=40, comm=55, io=3, idle=2)
    analysis = {"ranks": {"0": {"steps": [waiting]}, "1": {"steps": [slow]}}, "stragglers": [late]}
    f = found(analysis)
    assert f["straggler"]["knob"] == "the host of rank 1" and "about 140.0 ms less" in \
        f["straggler"]["expected_effect"]
    assert "comm" not in f and "idle" not in f  # explained by the straggler
    loading = step(compute=40, comm=5, io=40, idle=15)
    analysis["ranks"]["1"]["steps"] = [loading]
    assert found(analysis)["straggler"]["knob"] == "data.num_workers"


def _arrivals(late_ms: float) -> dict:
    """Two ranks, two steps of 100 ms, one all-reduce each: rank 0 arrives at its start, rank 1
    `late_ms` later; both finish 10 ms after rank 1 arrives."""
    ranks = {}
    for rank, delay in (("0", 0.0), ("1", late_ms)):
        collectives = []
        for n in (1, 2):
            t0 = n * 100_000.0  # µs
            arrive = t0 + 1000 * delay
            collectives.append({"step": n, "kind": "all_reduce", "bytes": 4000, "group_size": 2,
                                "group": None, "seq": None, "enqueue_us": arrive, "start_us": arrive,
                                "end_us": t0 + 1000 * (late_ms + 10)})
        ranks[rank] = {"steps": [step(), step()], "collectives": collectives}
    return ranks


def test_stragglers_from_crafted_arrivals():
    """Rank 1 is 50 ms late at every collective of 100 ms steps: rank 0 waits 50 ms and moves bytes
    for 10; rank 1 is the straggler, 50 ms late per step. 2 ms of jitter is no straggler."""
    from loom.observe.stragglers import find_stragglers, match_collectives

    ranks = _arrivals(50.0)
    matched = match_collectives(ranks)
    assert [m["last_rank"] for m in matched] == [1, 1]
    assert matched[0]["per_rank"] == {"0": {"wait_ms": 50.0, "transfer_ms": 10.0},
                                      "1": {"wait_ms": 0.0, "transfer_ms": 10.0}}
    (late,) = find_stragglers(matched, ranks)
    assert (late["rank"], late["late_ms_mean"], late["last_share"]) == (1, 50.0, 1.0)
    jitter = _arrivals(2.0)
    assert find_stragglers(match_collectives(jitter), jitter) == []
