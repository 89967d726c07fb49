"""The step ledger of a real 2-rank gloo DDP trace."""

from __future__ import annotations

import os

import pytest
from distributed import run_ranks

from loom.observe.ledger import analyze_dir


def _profiled_ddp(out_dir: str) -> int:
    """A tiny DDP loop under torch.profiler: DataLoader, AdamW, 5 iterations, 3 of them recorded."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.profiler import ProfilerActivity, profile, schedule

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(256, 16),
                                                                      torch.randn(256, 4)),
                                       batch_size=32)
    path = os.path.join(out_dir, f"trace_rank{rank}.json")
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                 schedule=schedule(wait=1, warmup=1, active=3),
                 on_trace_ready=lambda p: p.export_chrome_trace(path)) as prof:
        for _, (x, y) in zip(range(5), data):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss.item()
            prof.step()
    return rank


def test_real_gloo_ddp_trace(tmp_path):
    run_ranks(_profiled_ddp, 2, str(tmp_path))
    out = analyze_dir(tmp_path)
    assert sorted(out["ranks"]) == ["0", "1"] and out["warnings"] == []
    params = 16 * 32 + 32 + 32 * 4 + 4
    for led in out["ranks"].values():
        assert led["kind"] == "cpu" and led["warnings"] == []
        assert [s["step"] for s in led["steps"]] == [2, 3, 4]  # all recorded steps, the last included
        for s in led["steps"]:
            assert sum(s["shares"].values()) == pytest.approx(100, abs=0.5)
            parts = s["compute_ms"] + s["comm_exposed_ms"] + s["io_ms"] + s["idle_ms"]
            assert parts == pytest.approx(s["wall_ms"], abs=1e-6)
            assert s["compute_ms"] > 0 and s["io_ms"] > 0 and s["comm_exposed_ms"] + s["comm_hidden_ms"] > 0
            assert s["forward_ms"] > 0 and s["backward_ms"] > 0 and s["optimizer_ms"] > 0 and s["data_ms"] > 0
            assert s["host_syncs"] >= 1  # loss.item()
        # DDP's one gradient bucket: one all-reduce of every parameter per step
        assert [(c["step"], c["kind"], c["bytes"], c["group_size"]) for c in led["collectives"]] == [
            (n, "all_reduce", 4 * params, 2) for n in (2, 3, 4)]
        for c in led["collectives"]:
            assert c["enqueue_us"] <= c["start_us"] < c["end_us"]
        assert led["top_ops"] and len(led["top_ops"]) <= 20
