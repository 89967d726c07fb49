"""The planner's Muon (loom/plan/muon.py): its states (one momentum per matrix: the recipe's optimizer
bytes less 4), its Newton-Schulz FLOPs in closed form, its exchange (2·⌈M/G⌉ all-to-alls of
2·e·Ψ_m/G bytes), the layouts it runs on, and what `loom plan --set train.optimizer=muon` shows."""

from __future__ import annotations

import contextlib
import dataclasses
import io

import pytest

from loom.cli import main
from loom.config import load_config
from loom.models.gpt.config import preset
from loom.models.gpt.model import build_model
from loom.plan import muon
from loom.plan.candidate import Candidate
from loom.plan.memory import stage_memory
from loom.plan.search import config_workload
from loom.plan.shapes import from_preset
from loom.train.muon import assignment


def _workload(*sets: str, model: str = "tiny"):
    cfg = load_config(None, [f"model.preset={model}", "train.optimizer=muon", *sets])
    return config_workload(cfg, from_preset(model))


@pytest.mark.parametrize("model", ["tiny", "tiny-moe", "small"])
def test_the_matrices_are_what_the_optimizer_steps(model):
    """The plan's Muon parameters are the ones loom/train/muon.py gives Muon, to the parameter."""
    sides = assignment(build_model(preset(model), device="meta"))
    shape = from_preset(model)
    assert muon.stage_matrices(shape, 0, 1).params == sides["muon"]["params"]


@pytest.mark.parametrize("strategy, world, shard", [("ddp", 2, 1), ("zero1", 2, 2), ("zero3", 2, 2),
                                                    ("zero3", 4, 4), ("hsdp", 4, 2)])
def test_states_are_four_bytes_per_matrix_parameter(strategy, world, shard):
    shape = from_preset("tiny")
    muon_params = muon.stage_matrices(shape, 0, 1).params
    adamw_params = shape.num_params - muon_params
    w = _workload()
    c = Candidate(strategy, world, dp_shard=shard if strategy == "hsdp" else 0)
    m = stage_memory(w, c, 0, device="cpu")
    n = 1 if strategy == "ddp" else shard
    assert m.optimizer == pytest.approx((4 * muon_params + 8 * adamw_params) / n)


def test_moe_experts_keep_one_momentum_too():
    w, adamw = _workload(model="tiny-moe"), config_workload(load_config(None, ["model.preset=tiny-moe"]),
                                                          from_preset("tiny-moe"))
    c = Candidate("zero3", 2, ep=2)
    shape = from_preset("tiny-moe")
    mats = muon.stage_matrices(shape, 0, 1)
    assert mats.routed_params == 2 * 3 * 8 * 64 * 32  # 2 MoE blocks × 3 matrices × E 8 × d × h_e
    saved = stage_memory(adamw, c, 0, device="cpu").optimizer - stage_memory(w, c, 0, device="cpu").optimizer
    # 4 bytes of each Muon parameter this rank holds: the rest over N = 2, the routed experts over ep
    # (E/ep each) and their N_e = 1
    assert saved == pytest.approx(4 * (mats.dense_params / 2 + mats.routed_params / 2))


def test_newton_schulz_flops_closed_form():
    assert muon.ns_flops(256, 768, 5) == 5 * (4 * 256 ** 2 * 768 + 2 * 256 ** 3)
    assert muon.ns_flops(768, 256, 5) == muon.ns_flops(256, 768, 5)  # the wide side either way
    shape = from_preset("tiny")
    c = Candidate("ddp", 2)
    per_block = 2 * muon.ns_flops(64, 64, 5) + 2 * muon.ns_flops(32, 64, 5) + 3 * muon.ns_flops(64, 128, 5)
    assert muon.rank_cost(shape, c, muon.Muon()).flops == 2 * per_block  # ddp: every matrix everywhere
    assert muon.rank_cost(shape, Candidate("zero3", 2), muon.Muon()).flops == per_block  # owners: half


@pytest.mark.parametrize("world, dtype_bytes", [(2, 2), (4, 2), (3, 4)])
def test_exchange_is_two_all_to_alls_a_batch(world, dtype_bytes):
    shape = from_preset("tiny")
    cost = muon.rank_cost(shape, Candidate("zero3", world), muon.Muon(5, dtype_bytes))
    mats = muon.stage_matrices(shape, 0, 1)
    assert cost.kind == "all_to_all" and cost.group == world
    assert cost.count == 2 * -(-14 // world)  # 14 matrices, `world` of them a batch
    assert cost.payload == pytest.approx(2 * dtype_bytes * mats.dense_params / world)
    assert muon.rank_cost(shape, Candidate("ddp", world), muon.Muon()).count == 0
    tp = muon.rank_cost(shape, Candidate("zero3", 2, tp=2), muon.Muon())  # FSDP2 × TP: gathered whole
    assert (tp.kind, tp.count) == ("all_gather", 28)
    assert tp.payload == pytest.approx(4 * (mats.dense_params / 2 + mats.dense_params))


def test_layouts_muon_does_not_run_are_not_searched():
    from loom.strategies import lookup
    assert not muon.runs(lookup("zero1"), 2, "none") and muon.runs(lookup("zero1"), 1, "none")
    assert not muon.runs(lookup("zero3"), 1, "optimizer+params")


def _plan(*argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", "--model", "8b", "--gpu", "H100-SXM", "--set", "train.batch_size=64",
                     "--set", "data.seq_len=2048", *argv]) in (0, None)
    return out.getvalue()


def test_plan_shows_the_memory_drop_and_the_time_it_costs():
    adamw, with_muon = _plan(), _plan("--set", "train.optimizer=muon")
    assert "muon: the blocks' matrices (6.98B of 8.03B trained params) keep one momentum" in with_muon
    assert "deepspeed" not in with_muon.split("model states per GPU")[1].split("\n\n")[1]
    assert "offload" not in with_muon.split("model states per GPU")[1].split("\n\n")[0]
    line = next(x for x in with_muon.splitlines() if x.startswith("muon vs AdamW on the recommendation"))
    assert "less)" in line and "vs" in line

    def zero3(text: str) -> tuple[float, float]:
        row = next(line for line in text.splitlines() if line.startswith("  zero3 ") and "GPU" in line)
        states = float(row.split("GPU")[1].split()[0])
        best = next(line for line in text.splitlines() if line.startswith("*"))
        return states, float(best.split()[-4])

    (states_a, step_a), (states_m, step_m) = zero3(adamw), zero3(with_muon)
    assert states_m < states_a and step_m > step_a


def test_lora_adapters_are_the_matrices():
    """Under LoRA Muon steps the adapters (A [r, in], B [out, r]); trained embeddings stay on AdamW."""
    w = _workload("lora.rank=4", "lora.train_embeddings=true")
    sets = ["model.preset=tiny", "lora.rank=4", "lora.train_embeddings=true"]
    adamw = config_workload(load_config(None, sets), from_preset("tiny"))
    mats = muon.stage_matrices(w.shape, 0, 1, w.lora)
    # 2 blocks × r·((64+64) + 2·(64+32) + (64+64) + 2·(64+128) + (128+64))
    assert mats.params == 2 * 4 * (128 + 192 + 128 + 384 + 192)
    sides = assignment(_lora_model())
    assert mats.params == sides["muon"]["params"]
    c = Candidate("zero3", 2)
    saved = stage_memory(adamw, c, 0, device="cpu").optimizer - stage_memory(w, c, 0, device="cpu").optimizer
    assert saved == pytest.approx(4 * mats.params / 2)
    cost = muon.rank_cost(w.shape, c, w.muon, 0, w.lora)
    assert cost.count == 2 * -(-28 // 2)  # 2 blocks × 7 linears × (A, B)
    assert cost.flops == pytest.approx(sum(k * muon.ns_flops(r, col, 5) for k, r, col, _ in mats.dense) / 2)


def _lora_model():
    """tiny with rank-4 adapters on every linear of its blocks, trained with its embedding and head."""
    from loom.models.lora import LoRASpec, add_lora
    model = build_model(preset("tiny"), device="meta")
    add_lora(model, list(model.layers), LoRASpec(4, 8.0), ["all-linear"])
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name or name.split(".")[0] in ("tok_embeddings", "output"))
    return model


def test_the_explanation_adds_up_and_names_muon():
    """--explain: Muon's optimizer bytes, exchange and Newton-Schulz seconds, every check line ✓."""
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        main(["plan", "--model", "8b", "--gpu", "H100-SXM", "--set", "train.optimizer=muon",
              "--explain", "0"])
    out = text.getvalue()
    for item in ("muon optimizer", "muon Newton-Schulz", "Ψ_m: the blocks' matrices"):
        assert item in out, item
    checks = [line for line in out.splitlines() if line.strip().startswith("check:")]
    assert checks and all("✓" in line for line in checks), checks


def test_the_optimizer_time_is_newton_schulz_plus_the_exchange():
    """The catalog's optimizer time grows by the NS FLOPs at peak × fraction and the exchange's
    seconds; the exchange is not also counted in the exposed communication."""
    from loom.plan.hardware import Cluster, lookup
    from loom.plan.search import estimate
    cfg = load_config(None, ["model.preset=small", "train.optimizer=muon"])
    w = config_workload(cfg, from_preset("small"))
    c, cluster = Candidate("zero3", 8), Cluster(lookup("H100-SXM"), 8, 1)
    m, a = estimate(w, c, cluster), estimate(dataclasses.replace(w, muon=None), c, cluster)
    planned, base = m["step_time_breakdown_s"], a["step_time_breakdown_s"]
    assert planned["comm_exposed"] == pytest.approx(base["comm_exposed"])
    assert planned["optimizer"] > base["optimizer"]
    assert m["memory_bytes"]["optimizer"] < a["memory_bytes"]["optimizer"]
