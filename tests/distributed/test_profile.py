"""loom's own profiling: per-rank gzip traces with loom's phase ranges, and the always-on light
ledger (data / forward / backward / optimizer seconds per step in metrics.jsonl, backward the
longer of the two)."""

from __future__ import annotations

import gzip
import json
import statistics
from pathlib import Path

import pytest
from distributed import run_ranks

from loom.config import ConfigError, load_config, validate
from loom.observe.analyze import analyze
from loom.train.driver import train


def _config(corpus: Path, *extra: str):
    return load_config(None, ["model.preset=tiny", f'data.source="{corpus}"', "data.seq_len=64",
                              "data.num_workers=0", "train.steps=6", "train.batch_size=8",
                              "train.eval_batches=1", *extra])


def _rank(cfg, out: str) -> None:
    train(cfg, Path(out), quiet=True)


def test_profiled_run_writes_traces_and_analyzes(corpus, tmp_path):
    cfg = _config(corpus, "profile.enabled=true", "profile.wait=1", "profile.warmup=1", "profile.active=3",
                  "parallel.strategy=ddp")
    run_ranks(_rank, 2, cfg, str(tmp_path))
    traces = sorted((tmp_path / "traces").glob("*.json.gz"))
    assert [t.name for t in traces] == ["rank0.json.gz", "rank1.json.gz"]
    with gzip.open(traces[0], "rt") as f:
        text = f.read()
    for phase in ("loom/data", "loom/forward", "loom/backward", "loom/optimizer"):
        assert phase in text, phase
    analysis = analyze(tmp_path / "traces")
    for info in analysis["ranks"].values():
        steps = info["steps"]
        assert len(steps) == 3
        for s in steps:
            assert abs(sum(s["shares"].values()) - 100) <= 0.5
            assert s["forward_ms"] > 0 and s["backward_ms"] > 0 and s["optimizer_ms"] > 0
            assert s["forward_ms"] + s["backward_ms"] + s["optimizer_ms"] <= s["wall_ms"] * 1.01
        assert any(c["kind"] == "all_reduce" for c in info["collectives"])  # DDP's gradient reduction
        # loom's own loop (the stop agreement reads its CPU tensor) is kept apart: not the user's syncs
        assert [(s["host_syncs"], s["host_syncs_loop"] >= 1) for s in steps] == [(0, True)] * 3
    assert analysis["plan"] is not None and analysis["run"]["strategy"] == "ddp"
    assert "sync" not in {f["category"] for f in analysis["findings"]}, analysis["findings"]


def test_light_ledger_in_metrics(corpus, tmp_path):
    # the small preset's width at 128 tokens: matmuls, not per-op overhead, take most of its forward
    # and backward (2 of its 4 blocks, to keep the test short)
    cfg = _config(corpus, "train.grad_accum=2", "model.preset=small", "model.n_layers=2", "data.seq_len=128")
    run_ranks(_rank, 1, cfg, str(tmp_path))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]  # every step, the last one included
    for r in records[1:]:
        phases = r["data_s"] + r["forward_s"] + r["backward_s"] + r["optimizer_s"]
        assert r["forward_s"] > 0 and r["backward_s"] > 0 and r["optimizer_s"] > 0 and r["data_s"] > 0
        # the phases cover the step (the rest is the loss read-back and bookkeeping)
        assert 0.5 * r["step_time_s"] <= phases <= 1.01 * r["step_time_s"], r
        assert r["pipeline_s"] == 0
    # Backward does twice forward's matmul FLOPs (the gradients of the inputs and of the weights):
    # over the steady steps, the timer that says backward must have measured the longer phase
    # (measured on 2 loaded cores: 1.7 times forward's).
    steady = records[1:]
    forward, backward = (statistics.median(r[k] for r in steady) for k in ("forward_s", "backward_s"))
    assert backward > forward, (forward, backward)


@pytest.mark.parametrize("extra,message", [
    (("profile.active=0",), "profile.active = 0"),
    (("profile.enabled=true", "profile.active=10"), "raise train.steps or lower profile.active"),
])
def test_profile_config_errors(corpus, extra, message):
    with pytest.raises(ConfigError, match=message):
        validate(_config(corpus, *extra), 2)
