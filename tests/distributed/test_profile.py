"""loom's own profiling: per-rank gzip traces with loom's phase ranges, and the always-on light
ledger (data / forward / backward / optimizer seconds per step in metrics.jsonl)."""

from __future__ import annotations

import gzip
import json
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
    assert analysis["plan"] is not None and analysis["run"]["strategy"] == "ddp"


def test_light_ledger_in_metrics(corpus, tmp_path):
    cfg = _config(corpus, "train.grad_accum=2")
    run_ranks(_rank, 1, cfg, str(tmp_path))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 6  # every step, the last one included
    for r in records[1:]:
        phases = r["data_s"] + r["forward_s"] + r["backward_s"] + r["optimizer_s"]
        assert r["forward_s"] > 0 and r["backward_s"] > 0 and r["optimizer_s"] > 0 and r["data_s"] > 0
        # the phases cover the step (the rest is the loss read-back and bookkeeping)
        assert 0.5 * r["step_time_s"] <= phases <= 1.01 * r["step_time_s"], r
        assert r["pipeline_s"] == 0


@pytest.mark.parametrize("extra,message", [
    (("profile.active=0",), "profile.active = 0"),
    (("profile.enabled=true", "profile.active=10"), "raise train.steps or lower profile.active"),
])
def test_profile_config_errors(corpus, extra, message):
    with pytest.raises(ConfigError, match=message):
        validate(_config(corpus, *extra), 2)
