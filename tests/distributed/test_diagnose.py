"""`loom analyze` on real traces of a plain PyTorch DDP loop (not loom) with a planted problem.

Two gloo ranks train a small MLP under DDP with torch.profiler on; each case plants one problem
and the diagnosis must name it (and a healthy loop gets no IO, straggler or sync finding).
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import pytest
from distributed import run_ranks

from loom.cli import main
from loom.observe.analyze import analyze

STEPS = 5  # profiler: wait 1, warmup 1, active 3


def _plain_ddp_loop(out: str, plant: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.profiler import ProfilerActivity, profile, schedule
    from torch.utils.data import DataLoader, Dataset

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)

    class Tokens(Dataset):
        def __len__(self) -> int:
            return 4096

        def __getitem__(self, i: int):
            if plant == "slow_data":
                time.sleep(0.004)  # a slow source: decoding, a network disk, ...
            g = torch.Generator().manual_seed(i)
            return torch.randn(256, generator=g), torch.randn(256, generator=g)

    model = DDP(nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = iter(DataLoader(Tokens(), batch_size=16, num_workers=0))
    accum = 4

    def write(prof) -> None:
        prof.export_chrome_trace(str(Path(out) / f"rank{rank}.json.gz"))

    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=3),
                 on_trace_ready=write) as prof:
        for _ in range(STEPS):
            if plant == "straggler" and rank == 1:
                time.sleep(0.15)  # this rank reaches every collective late
            for micro in range(accum):
                x, y = next(loader)
                with (model.no_sync() if micro < accum - 1 else torch.enable_grad()):
                    loss = nn.functional.mse_loss(model(x), y)
                    loss.backward()
                if plant == "item":
                    print(end="" if loss.item() > -1 else "?")  # logging that reads the value each micro-step
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step()


@functools.cache
def _traces(tmp_root: str, plant: str) -> Path:
    out = Path(tmp_root) / plant
    out.mkdir(parents=True, exist_ok=True)
    run_ranks(_plain_ddp_loop, 2, str(out), plant)
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("planted"))


def _categories(analysis: dict) -> set[str]:
    return {f["category"] for f in analysis["findings"]}


def _assert_ledger_sound(analysis: dict) -> None:
    assert set(analysis["ranks"]) == {"0", "1"}
    for info in analysis["ranks"].values():
        assert len(info["steps"]) == 3  # every active step, the last one included
        for s in info["steps"]:
            assert abs(sum(s["shares"].values()) - 100) <= 0.5, s
            parts = s["compute_ms"] + s["comm_exposed_ms"] + s["io_ms"] + s["idle_ms"]
            assert abs(parts - s["wall_ms"]) <= 0.01 * s["wall_ms"], s


def test_slow_dataset_without_workers_is_io(root):
    analysis = analyze(_traces(root, "slow_data"))
    _assert_ledger_sound(analysis)
    io = [s["shares"]["io"] for info in analysis["ranks"].values() for s in info["steps"]]
    assert min(io) > 50, io  # 4 × 16 items × 4 ms of loading per step dominates
    first = analysis["findings"][0]
    assert first["category"] == "io" and first["knob"] == "data.num_workers", analysis["findings"]


def test_sleeping_rank_is_the_straggler(root):
    analysis = analyze(_traces(root, "straggler"))
    _assert_ledger_sound(analysis)
    assert [s["rank"] for s in analysis["stragglers"]] == [1], analysis["stragglers"]
    assert "straggler" in _categories(analysis)
    # rank 0's communication is mostly waiting for rank 1, not moving bytes
    waits = [m["per_rank"]["0"]["wait_ms"] for m in analysis["collectives"]]
    transfers = [m["per_rank"]["0"]["transfer_ms"] for m in analysis["collectives"]]
    assert sum(waits) > 3 * sum(transfers), (waits, transfers)
    rank0 = analysis["ranks"]["0"]["steps"]
    assert sum(s["comm_exposed_ms"] for s in rank0) > 300  # ~150 ms of waiting per step
    rank1 = analysis["ranks"]["1"]["steps"]
    assert min(s["shares"]["idle"] for s in rank1) > 20  # the sleep is idle time on rank 1


def test_item_each_micro_step_is_flagged(root):
    analysis = analyze(_traces(root, "item"))
    _assert_ledger_sound(analysis)
    assert all(s["host_syncs"] >= 4 for info in analysis["ranks"].values() for s in info["steps"])
    assert "sync" in _categories(analysis)


def test_healthy_loop_has_no_io_straggler_or_sync_finding(root):
    analysis = analyze(_traces(root, "none"))
    _assert_ledger_sound(analysis)
    assert not {"io", "straggler", "sync"} & _categories(analysis), analysis["findings"]
    assert analysis["stragglers"] == []


def test_analyze_cli_formats(root, tmp_path, capsys):
    traces = _traces(root, "slow_data")
    assert main(["analyze", str(traces), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "findings:" in out and "data.num_workers" in out
    assert (tmp_path / "ledger.json").exists() and (tmp_path / "report.html").exists()
    assert main(["analyze", str(traces), "--format", "json", "--out", str(tmp_path)]) == 0
    import json

    data = json.loads(capsys.readouterr().out)
    assert {"ranks", "collectives", "stragglers", "findings"} <= data.keys()
    step = data["ranks"]["0"]["steps"][0]
    assert {"step", "wall_ms", "compute_ms", "comm_exposed_ms", "comm_hidden_ms", "io_ms", "idle_ms",
            "forward_ms", "backward_ms", "optimizer_ms"} <= step.keys()
    assert {"title", "evidence", "cause", "knob", "value", "expected_effect"} <= data["findings"][0].keys()


def test_analyze_bad_input(tmp_path, capsys):
    assert main(["analyze", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["analyze", str(tmp_path)]) == 2  # empty
    err = capsys.readouterr().err.strip()
    assert err.startswith("loom: error:") and len(err.splitlines()) == 1
