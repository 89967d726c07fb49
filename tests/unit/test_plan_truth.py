"""Planner truth (issue 15): a parameter count plans on any cluster, a bare model gets a realistic
workload, latency bounds small models, near-ties go to the simpler layout, same-in-effect
candidates are merged, --emit writes every recommendable one, and the measured-device model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loom.cli import main
from loom.config import load_config, validate
from loom.plan.candidate import Candidate, Workload
from loom.plan.device import DeviceProfile, fit_alpha_beta, load
from loom.plan.hardware import Cluster, lookup
from loom.plan.search import choose, estimate, search
from loom.plan.shapes import from_preset
from loom.plan.step import BLOCK_ELEMENTWISE

GB = 1e9


def plan_json(capsys, *argv: str) -> dict:
    assert main(["plan", "--format", "json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("gpus", [1, 8, 64, 1024])
def test_params_plans_any_cluster_without_a_batch(capsys, gpus):
    per_node = min(gpus, 8)
    plan = plan_json(capsys, "--params", "7.5e9", "--gpu", "A100-80GB", "--gpus-per-node", str(per_node),
                     "--nodes", str(gpus // per_node))
    model = plan["model"]
    assert model["seq_len"] == 4096 and model["global_batch"] % gpus == 0
    assert 0.9e6 <= model["global_batch"] * model["seq_len"] <= max(1.2e6, gpus * 4096)
    assert "assumed workload" in plan["workload_origin"]
    ddp = next(c for c in plan["candidates"] if c["strategy"] == "ddp")
    assert ddp["memory_bytes"]["model_states"] == pytest.approx(16 * 7.5e9)  # 16Ψ, whatever the batch


def test_the_users_first_question_answers(capsys):
    """The issue's command, which used to fail on the CPU demo's batch of 16 sequences."""
    argv = ["--params", "7.5e9", "--gpu", "A100-80GB", "--gpus-per-node", "8", "--nodes", "8"]
    assert main(["plan", *argv]) == 0
    out = capsys.readouterr().out
    assert "7.5B params" in out and "assumed workload: 256 sequences" in out and "recommended (*)" in out


def test_a_bare_model_gets_a_realistic_workload_and_set_overrides_it(capsys):
    plan = plan_json(capsys, "--model", "8b", "--gpu", "H100-SXM")
    assert plan["model"]["seq_len"] == 8192 and plan["model"]["global_batch"] == 128  # 128 × 8192 = 2^20
    plan = plan_json(capsys, "--model", "8b", "--gpu", "H100-SXM", "--set", "train.batch_size=64",
                     "--set", "data.seq_len=2048")
    assert (plan["model"]["seq_len"], plan["model"]["global_batch"]) == (2048, 64)


def test_small_model_on_8_gpus_is_plain_data_parallel_and_launch_bound(capsys):
    """loom's 3.3M-parameter demo model on 8 H100s: launch and latency bound (MFU a few percent, not
    27%), and plain DDP, not a pipeline."""
    assert main(["plan", "--gpu", "H100-SXM"]) == 0
    out = capsys.readouterr().out
    assert "small (3.28M params)" in out  # not "0.00B params"
    plan = plan_json(capsys, "--gpu", "H100-SXM")
    best = plan["candidates"][plan["recommended"]]
    assert (best["strategy"], best["tp"], best["pp"], best["offload"]) == ("ddp", 1, 1, "none")
    assert best["mfu"] < 0.10
    pipelined = [c for c in plan["candidates"] if c["pp"] > 1]
    assert max(c["tokens_per_s"] for c in pipelined) < best["tokens_per_s"]


def _record(label: str, tokens: float, tp: int = 1, pp: int = 1, memory: float = 10 * GB, **kw) -> dict:
    return {"label": label, "tokens_per_s": tokens, "tp": tp, "pp": pp, "offload": kw.get("offload", "none"),
            "activation_checkpointing": "none", "strategy": kw.get("strategy", "zero3"), "engine": "torch",
            "memory_bytes": {"total": memory}}


def test_near_tie_goes_to_fewer_dimensions():
    records = [_record("zero3 tp2 pp2", 1000.0, tp=2, pp=2), _record("zero3", 970.0)]
    best, fastest, band = choose(records, [0, 1], 80 * GB)
    assert (best, fastest) == (1, 0) and band == [0, 1]
    records[1]["tokens_per_s"] = 900.0  # 10% slower: no longer a tie
    assert choose(records, [0, 1], 80 * GB)[0] == 0


def test_near_tie_prefers_no_offload_then_headroom_then_simpler_strategy():
    records = [_record("zero3 offload", 1000.0, offload="optimizer"), _record("zero3", 980.0, memory=40 * GB),
               _record("ddp", 990.0, strategy="ddp", memory=75 * GB)]
    assert choose(records, [0, 1, 2], 80 * GB)[0] == 1  # ddp is tight (75 of 80 GB): zero3's room wins
    records[2]["memory_bytes"]["total"] = 30 * GB
    assert choose(records, [0, 1, 2], 80 * GB)[0] == 2  # both roomy: the simpler strategy


def test_sharding_over_one_rank_is_merged(capsys):
    """70B on 8 GPUs with tp8 leaves dp = 1: zero1/2/3 there are ddp, and ZeRO-Offload of the
    optimizer is zero1's, not a distinct zero2 or zero3 candidate."""
    plan = plan_json(capsys, "--model", "70b", "--gpu", "H100-SXM")
    one = [c for c in plan["candidates"] if c["dp"] == 1 and c["cp"] == 1]  # cp > 1: shards over cp
    assert one
    for c in one:
        if c["offload"] == "none":
            assert c["strategy"] == "ddp", c["label"]
        elif c["offload"] == "optimizer":
            assert c["strategy"] == "zero1", c["label"]
    labels = [c["label"] for c in plan["candidates"]]
    assert len(labels) == len(set(labels)) or all(  # a label repeats only across micro-batch / AC choices
        c["strategy"] for c in plan["candidates"])


def test_emit_writes_every_recommendable_candidate_for_both_engines(tmp_path, capsys):
    target = tmp_path / "run.toml"
    assert main(["plan", "--model", "1b", "--gpu", "H100-SXM", "--emit", str(target)]) == 0
    written = sorted(tmp_path.glob("run*.toml"))
    assert target in written and len(written) >= 2
    engines = set()
    for path in written:
        cfg = load_config(path)
        validate(cfg, 8, cuda_available=True, this_machine=False)
        engines.add(cfg.parallel.engine)
        assert cfg.model.preset == "1b" and cfg.data.seq_len == 8192
    assert engines == {"torch", "deepspeed"}
    assert "wrote" in capsys.readouterr().out


def test_collective_latency_is_priced():
    """The same bytes in more collectives cost more: α per collective on top of the bandwidth."""
    w = Workload(from_preset("small"), 256, 64)
    cluster = Cluster(lookup("H100-SXM"), 8, 1)
    base = estimate(w, Candidate("zero3", 8, micro_batch=8, grad_accum=1), cluster)
    many = estimate(w, Candidate("zero3", 8, micro_batch=1, grad_accum=8), cluster)
    assert many["step_time_s"] > base["step_time_s"]


def test_alpha_beta_fit_recovers_the_line():
    points = [(b, 50e-6 + b / 2e9) for b in (4096, 65536, 2**20, 2**24)]
    fit = fit_alpha_beta(points)
    assert fit["alpha_s"] == pytest.approx(50e-6, rel=1e-6)
    assert fit["bytes_per_s"] == pytest.approx(2e9, rel=1e-6)


def _profile() -> DeviceProfile:
    return load(Path(__file__).parents[1] / "data" / "device_cpu.json")


def test_measured_device_prices_every_term():
    """On the measured profile a bigger micro-batch, more layers or a wider model cost more, and
    collectives show up only with more than one rank."""
    from loom.plan.command import local_cluster

    cluster = local_cluster(_profile(), 2)
    w = Workload(from_preset("small"), 128, 16, "fp32")
    ddp = estimate(w, Candidate("ddp", 2, micro_batch=8), cluster)
    one = estimate(w, Candidate("ddp", 1, micro_batch=16), local_cluster(_profile(), 1))
    t = ddp["step_time_breakdown_s"]
    assert t["compute"] > 0 and t["comm_exposed"] > 0 and t["optimizer"] > 0
    assert one["step_time_breakdown_s"]["comm_exposed"] == 0
    wide = estimate(Workload(from_preset("small", d_model=512, n_heads=8, n_kv_heads=4), 128, 16, "fp32"),
                    Candidate("ddp", 2, micro_batch=8), cluster)
    assert wide["step_time_s"] > 2 * ddp["step_time_s"]
    plan = search(w, cluster)
    assert plan.candidates[plan.recommended]["fits"]


def test_in_situ_factor_and_measured_optimizer_price_the_step():
    """A profile measured with the block's in-situ factor and the optimizer's rate: compute scales
    with the factor (interpolated by tensor size), the optimizer is Ψ_local × the rate; a profile
    from before either was measured prices as it did."""
    import copy

    from loom.plan.command import local_cluster

    w = Workload(from_preset("small"), 128, 16, "fp32")
    ddp, zero3 = Candidate("ddp", 2, micro_batch=8), Candidate("zero3", 2, micro_batch=8)
    old = _profile()
    assert "block_in_situ" not in old.ranks_entry(2) and old.block_in_situ(2, 1e6) == 1.0
    assert old.optimizer_seconds(2, 1e6) is None
    new = copy.deepcopy(old)
    new.ranks_entry(2).update(block_in_situ={"1048576": 1.5, "4194304": 1.5}, optimizer_s_per_param=1e-8)
    before = estimate(w, ddp, local_cluster(old, 2))["step_time_breakdown_s"]
    after = estimate(w, ddp, local_cluster(new, 2))["step_time_breakdown_s"]
    blocks = after["compute"] - before["compute"]  # only the blocks scale, not the head
    assert 0.4 * before["compute"] < blocks < 0.5 * before["compute"]
    assert after["optimizer"] == pytest.approx(1e-8 * 3_279_104)
    sharded = estimate(w, zero3, local_cluster(new, 2))["step_time_breakdown_s"]
    assert sharded["optimizer"] == pytest.approx(after["optimizer"] / 2, rel=1e-3)  # its shard
    assert before["optimizer"] != after["optimizer"]
    new.ranks_entry(2)["block_in_situ"] = {"1048576": 1.0, "4194304": 2.0}
    assert new.block_in_situ(2, 1048576) == 1.0 and new.block_in_situ(2, 4194304) == 2.0
    assert 1.0 < new.block_in_situ(2, 2097152) < 2.0
    assert new.block_in_situ(2, 1e9) == 2.0  # clamped at the grid's edge


def test_block_elementwise_count_matches_the_block():
    """BLOCK_ELEMENTWISE recounted: bytes in and out of every non-matmul op of loom's block's
    forward + backward, per token, against the formula, for two shapes."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from loom.models.gpt.config import preset
    from loom.models.gpt.model import Block, rope_tables
    from loom.observe.calibrate import MATMULS

    views = {"view", "_unsafe_view", "transpose", "t", "unsqueeze", "expand", "slice", "select", "permute",
             "as_strided", "alias", "detach", "unflatten", "reshape", "squeeze", "split", "unbind"}

    class Count(TorchDispatchMode):
        moved = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func._overloadpacket.__name__
            if name not in MATMULS and name not in views:
                for t in tree_flatten((args, kwargs, out))[0]:
                    if isinstance(t, torch.Tensor) and t.numel() > 1:
                        Count.moved += t.numel() * t.element_size()
            return out

    for d, f, heads, kv_heads in ((256, 768, 8, 4), (512, 1024, 8, 8)):
        cfg = preset("small", d_model=d, ffn_hidden=f, n_heads=heads, n_kv_heads=kv_heads, max_seq_len=64)
        block = Block(cfg)
        x = torch.randn(4, 64, d, requires_grad=True)
        Count.moved = 0
        with Count():
            block(x, rope_tables(cfg.head_dim, 64, 10000.0)).backward(torch.ones(4, 64, d))
        a, b, e = BLOCK_ELEMENTWISE
        kv = kv_heads * cfg.head_dim
        assert Count.moved == pytest.approx(4 * 256 * (a * d + b * f + e * kv), rel=0.03)
