"""Traced memory (loom/plan/trace.py): loom's real model and FSDP2 strategy stepped on fake tensors
with a fake process group, checked against the planner's 16Ψ/N formula and against a real step."""

from __future__ import annotations

import math
import resource

import pytest
import torch
import torch.distributed as dist
from torch._guards import active_fake_mode

from loom.config import Config
from loom.errors import ConfigError
from loom.models.gpt.config import preset
from loom.models.gpt.model import build_model
from loom.train.trace import _trace, trace_memory, traced_vs_analytic

KINDS = ("params_bytes", "grads_bytes", "optimizer_bytes", "model_state_bytes")


def _cfg(strategy: str, model: str = "tiny", seq_len: int = 128, **parallel) -> Config:
    cfg = Config()
    cfg.model.preset = model
    cfg.data.seq_len = seq_len
    cfg.parallel.strategy = strategy
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    return cfg


def _rank0_shard_numel(model: str, n: int) -> tuple[int, int]:
    """Rank 0's FSDP2 shard, from the shapes alone: dim 0 is cut into n chunks of ceil(dim0 / n)
    rows, and rank 0 always gets a full first chunk. Also returns the number of parameters."""
    params = list(build_model(preset(model), "meta").parameters())
    numel = sum(math.ceil(p.shape[0] / n) * math.prod(p.shape[1:]) for p in params)
    return numel, len(params)


def _assert_close(traced: dict, expected: dict, rel: float = 0.02) -> None:
    for kind in KINDS:
        assert traced[kind] == pytest.approx(expected[kind], rel=rel), kind


def test_zero3_tiny_world64_matches_padded_formula():
    r = traced_vs_analytic(_cfg("zero3"), 64)
    t = r["traced"]
    assert (t["world_size"], t["strategy"], r["shard_size"]) == (64, "zero3", 64)
    assert t["num_params"] == preset("tiny").num_params() == 106816
    # The tiny model's dims (32 kv rows, 64-wide norms) are smaller than N = 64: FSDP2 pads every
    # shard to ceil(dim0/N) rows, so rank 0 holds 1797 elements, not Ψ/N = 1669.
    numel, n_tensors = _rank0_shard_numel("tiny", 64)
    assert t["local_numel"] == numel == 1797
    assert t["params_bytes"] == t["grads_bytes"] == 4 * numel
    # Adam m and v per element, plus AdamW's 4-byte `step` per parameter tensor.
    assert t["optimizer_bytes"] == 8 * numel + 4 * n_tensors
    _assert_close(t, r["analytic_padded"])
    # Against the unpadded 16Ψ/N: padding costs this small model 7.7% at N = 64.
    assert 1.0 < r["ratio"]["model_state_bytes"] < 1.09
    assert t["peak_bytes"] > t["model_state_bytes"]


def test_zero3_125m_world64_matches_16psi_over_n():
    """GPT-3 Small's shape (tied embeddings, 50304 vocab) divides evenly by 64: no padding."""
    r = traced_vs_analytic(_cfg("zero3", model="125m"), 64)
    t = r["traced"]
    psi = preset("125m").num_params()
    assert t["num_params"] == psi  # tied weights counted once
    assert r["analytic"]["model_state_bytes"] == pytest.approx(16 * psi / 64)
    _assert_close(t, r["analytic"])
    assert t["params_bytes"] == t["grads_bytes"] == 4 * psi // 64
    # At rest each rank holds 1/64th; the step all-gathers blocks and keeps activations.
    assert t["peak_bytes"] > 2 * t["model_state_bytes"]
    # AdamW steps 1/64th shards, so the peak is not in the optimizer step. (It would be if the
    # global-shape fake tensors DTensor runs to infer output shapes were counted: 12Ψ.)
    assert t["peak_breakdown"]["Optstate"] == 0
    assert t["peak_bytes"] < 8 * psi


def test_zero2_world8_and_its_peak_above_zero3():
    zero2 = traced_vs_analytic(_cfg("zero2", fsdp_unit_mb=0), 8)  # a unit per block: the tiny
    t = zero2["traced"]  # model's would otherwise be one unit, kept gathered under both strategies
    assert zero2["shard_size"] == 8
    _assert_close(t, zero2["analytic"])  # 8 divides every dim: exact up to AdamW's step scalars
    assert t["peak_bytes"] > t["model_state_bytes"]
    # Same states at rest; zero2 keeps the blocks' parameters gathered from forward to backward.
    zero3 = trace_memory(_cfg("zero3", fsdp_unit_mb=0), 8)
    assert zero3["model_state_bytes"] == t["model_state_bytes"]
    assert t["peak_bytes"] > zero3["peak_bytes"]


def test_hsdp_shards_over_dp_shard_only():
    r = traced_vs_analytic(_cfg("hsdp", dp_replicate=2), 8)
    assert r["shard_size"] == 4
    _assert_close(r["traced"], r["analytic"])
    assert r["traced"]["params_bytes"] == 4 * preset("tiny").num_params() // 4


def test_fake_trace_equals_a_real_step():
    """World size 1: the same step on real tensors (gloo) measures exactly what the fake one does."""
    cfg = _cfg("zero3", activation_checkpointing="full")
    fake = trace_memory(cfg, 1)
    real = _trace(cfg, 1, 1, fake=False)
    for kind in (*KINDS, "peak_bytes"):
        assert fake[kind] == real[kind], kind
    assert fake["peak_breakdown"] == real["peak_breakdown"]


def test_the_peak_follows_the_config():
    base = trace_memory(_cfg("zero3"), 8)
    longer = trace_memory(_cfg("zero3", seq_len=128), 8, micro_batch=4)
    checkpointed = trace_memory(_cfg("zero3", activation_checkpointing="full"), 8)
    assert longer["peak_bytes"] > 2 * base["peak_bytes"]  # 4x the activations
    assert checkpointed["peak_bytes"] < base["peak_bytes"]
    assert longer["model_state_bytes"] == checkpointed["model_state_bytes"] == base["model_state_bytes"]


def test_a_large_model_allocates_no_real_memory():
    """70B's widths (128256 × 8192 embeddings: 4.2 GB each in fp32) on 2 layers, world 64."""
    cfg = _cfg("zero3", model="70b")
    cfg.model.n_layers = 2
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    t = trace_memory(cfg, 64)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    psi = preset("70b", n_layers=2).num_params()
    assert t["params_bytes"] == pytest.approx(4 * psi / 64, rel=0.02)
    assert t["peak_bytes"] > 1e9  # what rank 0 would hold: over a GB...
    assert grown_mib < 500  # ...while this process's memory barely moved


def test_repeatable_and_leaves_no_state_behind():
    first = trace_memory(_cfg("zero3"), 16)
    second = trace_memory(_cfg("zero3"), 16)
    assert first == second
    assert not dist.is_initialized()
    assert active_fake_mode() is None
    assert torch.ones(3).sum().item() == 3.0  # real tensors again


@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_ddp_strategies_are_refused_in_one_line(strategy):
    with pytest.raises(ConfigError, match="zero2, zero3, hsdp") as e:
        trace_memory(_cfg(strategy), 8)
    assert "\n" not in str(e.value)
    assert not dist.is_initialized()


def test_bad_layouts_are_config_errors():
    with pytest.raises(ConfigError, match="tp=1"):
        trace_memory(_cfg("zero3", tp=2), 8)
    with pytest.raises(ConfigError, match="max_seq_len"):
        trace_memory(_cfg("zero3", seq_len=4096), 8)
    with pytest.raises(ConfigError, match="hsdp"):
        trace_memory(_cfg("hsdp", dp_replicate=3), 8)
    assert not dist.is_initialized()
