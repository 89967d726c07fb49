"""CollectiveCounter sees what each engine really issues: counts and payload bytes (observed),
with the ring model's wire bytes beside them (modelled).

Every expected number is worked out by hand from the tensors handed to the collectives, never by
planner code: the payloads must hold even with the ring model replaced by nonsense.
One run of 4 gloo ranks covers every case (spawning ranks costs more than the cases): N = 4
makes the ring factors distinct (all-reduce 3/2, the others 3/4), subgroups give N = 2 and 1.
"""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks
from torch import nn

from loom.observe.collectives import CollectiveCounter

WORLD = 4


def _rows(comm: CollectiveCounter) -> list[tuple[str, int, int, int]]:
    return [(r["kind"], r["group_size"], r["payload_bytes"], r["modelled_wire_bytes"]) for r in comm.records]


def _rank_cases() -> dict:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    pair, _ = dist.new_subgroups(2)  # {0, 1}, {2, 3}
    alone, _ = dist.new_subgroups(1)
    out = {}

    x = torch.ones(1000)  # fp32: 4000 bytes
    half = torch.ones(1000, dtype=torch.float16)  # 2000 bytes
    with CollectiveCounter() as comm:
        dist.all_reduce(x)
        dist.all_gather_into_tensor(torch.empty(2, 1000), x.view(1, 1000), group=pair)  # out [2, 1000]
        dist.all_gather([torch.empty(1000) for _ in range(WORLD)], x)  # output 4 × [1000]
        dist.reduce_scatter_tensor(torch.empty(1, 1000), torch.ones(2, 1000), group=pair)  # in [2, 1000]
        dist.broadcast(half, src=0)
        funcol.all_reduce(x, "sum", pair).wait()
    out["known"] = _rows(comm), comm.summary(), [r["dtype"] for r in comm.records]
    # The planner's ring formula replaced by nonsense: the observed quantities must not move.
    import loom.observe.collectives as comms

    real, comms.ring = comms.ring, lambda kind, n, size: -1.0
    try:
        with CollectiveCounter() as comm:
            dist.all_reduce(x)
            dist.all_gather_into_tensor(torch.empty(2, 1000), x.view(1, 1000), group=pair)
        out["no_model"] = comm.summary()
    finally:
        comms.ring = real

    t = torch.ones(6)  # 24 bytes
    h = torch.ones(5, dtype=torch.bfloat16)  # 10 bytes, a pipeline activation
    with CollectiveCounter() as comm:
        dist.all_reduce(t)
        dist.all_gather_into_tensor(torch.empty(WORLD * 6), t)
        dist.reduce_scatter_tensor(torch.empty(6), torch.ones(WORLD * 6))
        dist.broadcast(t, src=0)
        dist.all_reduce(t, group=pair)
        dist.all_reduce(t, group=alone)
        funcol.all_gather_tensor(t, 0, pair).wait()  # functional: the group comes by name
        ring = [dist.P2POp(dist.isend, h, (rank + 1) % WORLD),
                dist.P2POp(dist.irecv, torch.empty_like(h), (rank - 1) % WORLD)]
        for work in dist.batch_isend_irecv(ring):
            work.wait()
        if rank == 0:
            dist.send(t, 1)
        elif rank == 1:
            dist.recv(t, 0)
    out["plain"] = _rows(comm), comm.summary()

    ddp = DistributedDataParallel(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)), bucket_cap_mb=100)
    with CollectiveCounter() as comm:
        ddp(torch.randn(2, 4)).sum().backward()
    out["ddp"] = _rows(comm)

    linear = nn.Linear(4, 3)
    zero = ZeroRedundancyOptimizer(linear.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    linear(torch.randn(2, 4)).sum().backward()
    with CollectiveCounter() as comm:
        zero.step()
    out["zero1"] = _rows(comm)

    fsdp = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 5), nn.Linear(5, 2))
    fully_shard(fsdp[0])
    fully_shard(fsdp[1])
    fully_shard(fsdp)  # the root unit holds the last Linear
    with CollectiveCounter() as comm:
        fsdp(torch.randn(2, 4)).sum().backward()
    out["fsdp2"] = _rows(comm)

    mesh = init_device_mesh("cpu", (WORLD,))
    x = distribute_tensor(torch.randn(8, 3), mesh, [Shard(0)])
    w = distribute_tensor(torch.randn(3, 2), mesh, [Shard(0)])
    with CollectiveCounter() as comm:
        x.redistribute(mesh, [Replicate()]).to_local()
    out["redistribute"] = _rows(comm)
    with CollectiveCounter() as comm:
        y = x @ w  # DTensor's sharding propagation gathers w inside the op
    out["matmul"] = _rows(comm), str(y.placements)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(_rank_cases, WORLD)


def test_known_payloads_and_counts(ranks):
    rows = [
        ("all_reduce", 4, 4000, 6000),  # [1000] fp32; modelled 2·3/4·4000
        ("all_gather", 2, 8000, 4000),  # the [2, 1000] output; modelled 1/2·8000
        ("all_gather", 4, 16000, 12000),  # list form: 4 outputs of 4000
        ("reduce_scatter", 2, 8000, 4000),  # the [2, 1000] input
        ("broadcast", 4, 2000, 1500),  # [1000] fp16
        ("all_reduce", 2, 4000, 4000),  # functional, group by name
    ]
    for r in ranks:
        assert r["known"][0] == rows
        assert r["known"][2] == ["float32"] * 4 + ["float16", "float32"]  # what each one carried
        summary = r["known"][1]
        assert summary["count"] == 6 and summary["payload_bytes"] == 42000
        assert summary["modelled_wire_bytes"] == 31500
        assert summary["by_kind"] == {
            "all_reduce": {"count": 2, "payload_bytes": 8000, "modelled_wire_bytes": 10000},
            "all_gather": {"count": 2, "payload_bytes": 24000, "modelled_wire_bytes": 16000},
            "reduce_scatter": {"count": 1, "payload_bytes": 8000, "modelled_wire_bytes": 4000},
            "broadcast": {"count": 1, "payload_bytes": 2000, "modelled_wire_bytes": 1500},
        }


def test_payloads_do_not_come_from_the_model(ranks):
    for r in ranks:
        summary = r["no_model"]
        assert summary["count"] == 2 and summary["payload_bytes"] == 12000
        assert summary["by_kind"]["all_reduce"]["payload_bytes"] == 4000
        assert summary["by_kind"]["all_gather"]["payload_bytes"] == 8000
        assert summary["modelled_wire_bytes"] == -2  # only the labelled model field moved


def test_plain_collectives(ranks):
    common = [
        ("all_reduce", 4, 24, 36),  # 2·3/4·24
        ("all_gather", 4, 96, 72),  # the gathered output
        ("reduce_scatter", 4, 96, 72),  # the unreduced input
        ("broadcast", 4, 24, 18),
        ("all_reduce", 2, 24, 24),
        ("all_reduce", 1, 24, 0),  # counted, sends nothing
        ("all_gather", 2, 48, 24),
        ("send", 4, 10, 10),  # batch_isend_irecv: one send, one receive per rank
        ("recv", 4, 10, 0),
    ]
    tails = [[("send", 4, 24, 24)], [("recv", 4, 24, 0)], [], []]
    for rank, tail in enumerate(tails):
        assert ranks[rank]["plain"][0] == common + tail, f"rank {rank}"
    summary = ranks[0]["plain"][1]
    assert summary["count"] == 10
    assert summary["payload_bytes"] == 24 + 96 + 96 + 24 + 24 + 24 + 48 + 10 + 10 + 24
    assert summary["modelled_wire_bytes"] == 36 + 72 + 72 + 18 + 24 + 0 + 24 + 10 + 0 + 24
    assert summary["by_kind"]["all_reduce"] == {"count": 3, "payload_bytes": 72, "modelled_wire_bytes": 60}
    assert summary["by_kind"]["send"] == {"count": 2, "payload_bytes": 34, "modelled_wire_bytes": 34}
    assert summary["by_kind"]["recv"] == {"count": 1, "payload_bytes": 10, "modelled_wire_bytes": 0}


def test_ddp_one_bucket_all_reduce(ranks):
    num_params = 4 * 3 + 3 + 3 * 2 + 2
    for r in ranks:
        assert r["ddp"] == [("all_reduce", 4, 4 * num_params, 4 * num_params * 3 // 2)]


def test_zero1_broadcasts_each_partition(ranks):
    # Linear(4, 3): weight and bias, each broadcast from the rank that updated it.
    for r in ranks:
        assert sorted(r["zero1"]) == [("broadcast", 4, 12, 9), ("broadcast", 4, 48, 36)]


def test_fsdp2_gathers_and_reduce_scatters_padded_units(ranks):
    # Each parameter's dim 0 is padded to a multiple of 4: Linear(4, 3) -> 4·4 + 4 = 20 numel,
    # Linear(3, 5) -> 8·3 + 8 = 32, the root's Linear(5, 2) -> 4·5 + 4 = 24 (fp32: ×4 bytes).
    # Forward gathers all three units, backward the two blocks again (the root stays gathered).
    for r in ranks:
        gathers = sorted(p for kind, n, p, _ in r["fsdp2"] if kind == "all_gather")
        scatters = sorted(p for kind, n, p, _ in r["fsdp2"] if kind == "reduce_scatter")
        assert gathers == [80, 80, 96, 128, 128]
        assert scatters == [80, 96, 128]
        assert len(r["fsdp2"]) == 8
        assert all(n == 4 and sent == p * 3 // 4 for _, n, p, sent in r["fsdp2"])


def test_dtensor_collectives_counted_once(ranks):
    for r in ranks:
        assert r["redistribute"] == [("all_gather", 4, 96, 72)]  # Shard(0) -> Replicate of 8×3
        # Issued inside DTensor's dispatch of aten.mm, on local tensors: w (3×2) gathered, its
        # uneven shards padded to one row each: 4·2 fp32 on the wire.
        assert r["matmul"] == ([("all_gather", 4, 32, 24)], "(Shard(dim=0),)")
