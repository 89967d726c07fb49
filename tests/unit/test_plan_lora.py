"""The planner prices LoRA fine-tuning (plan/lora.py and its callers): the adapters and the frozen base
counted by hand and against the trainer's own model (loom/models/lora.py), per rank under TP and EP, the
model states of each strategy (lora_state_bytes), the gradient payload of what trains, the activations
the adapters keep, the step without frozen weights' gradients, no DeepSpeed candidates, --explain,
--emit, and the recommendations for a 70B LoRA on one node and on one GPU."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from loom.cli import main
from loom.config import load_config, resolve_dims, validate
from loom.errors import ConfigError
from loom.models.gpt.config import preset
from loom.models.gpt.model import GPT
from loom.models.lora import LoRASpec, add_lora, blocks_of, freeze_base
from loom.plan import device, lora
from loom.plan.candidate import Candidate, Workload
from loom.plan.comm import comm_per_step
from loom.plan.command import local_cluster
from loom.plan.explain import explain
from loom.plan.hardware import Cluster, lookup
from loom.plan.memory import expert_state_bytes, gpu_memory, lora_state_bytes, stage_memory
from loom.plan.search import config_candidate, config_workload, enumerate_candidates, estimate, search
from loom.plan.shapes import ModelShape, from_params, from_preset, llama_like
from loom.plan.step import forward_share, step_time

# h = 64, 4 heads of 16, 2 kv heads (kv = 32), f = 192, 4 blocks, V = 1000, untied
SHAPE = ModelShape("lora", vocab_size=1000, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=192)
BLOCK = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 192 + 2 * 64
PSI = 4 * BLOCK + 1000 * 64 + (1000 * 64 + 64)
# rank 4 on every linear: r·(in + out) for q (64 + 64), k and v (64 + 32), o (64 + 64), gate and up
# (64 + 192), down (192 + 64)
PER_BLOCK = 4 * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + 3 * (64 + 192))
PSI_LORA = 4 * PER_BLOCK
LORA = lora.LoRA(4)
# the MoE shape of test_plan_moe: block 0 dense, blocks 1-3 MoE (8 experts of h_e = 32, top 2, a shared one
# of 32)
MOE_SHAPE = dataclasses.replace(SHAPE, name="moe", moe_experts=8, moe_top_k=2, moe_hidden=32,
                                moe_shared_hidden=32, moe_dense_first=1)
H100 = Cluster(lookup("H100-SXM"), 8, 1)
CPU = device.load(Path(__file__).resolve().parents[1] / "data" / "device_cpu.json")


def bf16(shape: ModelShape = SHAPE, spec: lora.LoRA | None = LORA, seq: int = 32, batch: int = 8) -> Workload:
    return Workload(shape, seq, batch, "bf16", "torch", 0, lora=spec)


# ---------------------------------------------------------------------------------------------
# counting


def test_adapters_by_hand():
    assert SHAPE.num_params == PSI == 325184 and PER_BLOCK == 4864
    assert lora.adapter_params(SHAPE, LORA) == lora.trainable_params(SHAPE, LORA) == PSI_LORA == 19456
    qv = lora.LoRA(4, targets=("q", "v"))
    assert lora.adapter_params(SHAPE, qv) == 4 * 4 * ((64 + 64) + (64 + 32))
    rest, routed = lora.stage_params(SHAPE, LORA)
    assert (rest.frozen, rest.trainable, routed.total) == (PSI, PSI_LORA, 0)


def test_local_counts_under_tp_by_hand():
    """tp 2: q, k, v, gate, up keep A [r, in] whole and split B [out/tp, r]; o and down split A [r, in/tp]
    and keep B [out, r] whole; the base split but the norms' gains, the embedding and head by vocabulary."""
    adapters = 4 * ((64 + 32) + 2 * (64 + 16) + (32 + 64) + 2 * (64 + 96) + (96 + 64))
    base = 4 * ((BLOCK - 128) / 2 + 128) + 32000 + (32000 + 64)
    rest, _ = lora.stage_params(SHAPE, LORA, tp=2)
    assert (rest.frozen, rest.trainable) == (base, 4 * adapters)
    # a pipeline stage holds its blocks' and its end's
    first, _ = lora.stage_params(SHAPE, LORA, 0, 2)
    last, _ = lora.stage_params(SHAPE, LORA, 1, 2)
    assert (first.frozen, last.frozen) == (2 * BLOCK + 64000, 2 * BLOCK + 64064)
    assert first.trainable == last.trainable == 2 * PER_BLOCK


def test_moe_experts_adapters_by_hand_and_split_over_ep():
    """An MoE block: attention's adapters, the shared expert's (h_s = 32) and each of the 8 routed experts'
    (h_e = 32): gate and up r·(64 + 32), down r·(32 + 64)."""
    attention = 4 * ((64 + 64) + 2 * (64 + 32) + (64 + 64))
    swiglu = 3 * 4 * (64 + 32)
    assert lora.block_adapters(MOE_SHAPE, LORA, True) == (attention + swiglu, 8 * swiglu)
    assert lora.adapter_params(MOE_SHAPE, LORA) == PER_BLOCK + 3 * (attention + swiglu + 8 * swiglu)
    routed = 3 * 64 * 32 * 8
    rest, held = lora.stage_params(MOE_SHAPE, LORA, ep=4)
    assert (held.frozen, held.trainable) == (3 * routed / 4, 3 * 8 * swiglu / 4)
    assert rest.frozen == MOE_SHAPE.num_params - 3 * routed
    # zero3 dp 8, ep 4: the rest over N = 8, each rank's experts over N_e = 2
    w, c = bf16(MOE_SHAPE), Candidate("zero3", 8, ep=4)
    want = (2 * rest.frozen + 16 * rest.trainable) / 8 + (2 * held.frozen + 16 * held.trainable) / 2
    assert gpu_memory(w, c, 0.0).model_states == pytest.approx(want)
    assert expert_state_bytes(w, c).total == pytest.approx((2 * held.frozen + 16 * held.trainable) / 2)
    record = estimate(w, c, H100)
    assert record["expert_state_bytes"]["total"] == pytest.approx(expert_state_bytes(w, c).total)


def test_trained_norms_and_embeddings():
    norms = lora.LoRA(4, train_norms=True)
    rest, _ = lora.stage_params(SHAPE, norms)
    assert (rest.trainable, rest.frozen) == (PSI_LORA + 4 * 128 + 64, PSI - 4 * 128 - 64)
    embeddings = lora.LoRA(4, train_embeddings=True)
    assert lora.trainable_params(SHAPE, embeddings) == PSI_LORA + 2 * 64000  # the embedding and the head
    tied = dataclasses.replace(SHAPE, tie_embeddings=True)
    assert lora.trainable_params(tied, embeddings) == PSI_LORA + 64000  # one matrix
    rest, _ = lora.stage_params(tied, embeddings, 1, 2)  # a tied model's last stage: its own copy
    assert rest.trainable == 2 * PER_BLOCK + 64000


@pytest.mark.parametrize("name, sets", [
    ("tiny", []), ("tiny", ['lora.targets=["q", "v"]']), ("tiny-moe", []),
    ("tiny-moe", ['lora.targets=["*.experts.w2", "o"]', "lora.train_norms=true",
                  "lora.train_embeddings=true"]),
    ("small", ["lora.train_embeddings=true", "lora.rank=8"]),
])
def test_counts_match_the_trainers_model(name, sets):
    """The planner's frozen and trainable counts are those of loom's GPT with the trainer's adapters
    (loom/models/lora.py), built on the meta device."""
    cfg = load_config(None, ["lora.rank=4", *sets])
    with torch.device("meta"):
        model = GPT(preset(name))
    add_lora(model, blocks_of(model.layers), LoRASpec(cfg.lora.rank, cfg.lora.alpha), cfg.lora.targets)
    freeze_base(model, torch.bfloat16, cfg.lora.train_embeddings, cfg.lora.train_norms)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    adapters = sum(p.numel() for n, p in model.named_parameters() if n.endswith(("lora_A", "lora_B")))
    spec, shape = lora.from_config(cfg, "bf16"), from_preset(name)
    rest, routed = lora.stage_params(shape, spec)
    assert (rest.frozen + routed.frozen, rest.trainable + routed.trainable) == (frozen, trainable)
    assert lora.adapter_params(shape, spec) == adapters and lora.trainable_params(shape, spec) == trainable


def test_targets_resolve_by_role_and_pattern():
    assert lora.resolve_targets(["all-linear"]) == {"block": lora.ROLES, "experts": lora.SWIGLU,
                                                    "shared": lora.SWIGLU}
    assert lora.resolve_targets(["v", "gate"]) == {"block": ("v", "gate"), "experts": ("gate",),
                                                   "shared": ("gate",)}
    # loom's names: the dense SwiGLU's w2 is not the experts' or the shared experts' w2
    assert lora.resolve_targets(["*.attention.wq", "*.feed_forward.w2"]) == {
        "block": ("q", "down"), "experts": (), "shared": ()}
    assert lora.resolve_targets(["*.experts.*"])["experts"] == lora.SWIGLU
    # Hugging Face's names; a pattern naming one block (priced as if it named every block)
    assert lora.resolve_targets(["*q_proj", "layers.3.*.w3"])["block"] == ("q", "up")
    with pytest.raises(ConfigError, match="names no linear the planner knows") as e:
        lora.resolve_targets(["q", "*.router"])
    assert len(str(e.value).splitlines()) == 1


def test_base_dtype():
    assert lora.from_config(load_config(None)) is None  # full fine-tuning
    cfg = load_config(None, ["lora.rank=8"])
    assert lora.from_config(cfg).base_bytes == 4  # auto: the config's fp32
    assert lora.from_config(cfg, "bf16").base_bytes == 2  # the plan's bf16
    fp32 = load_config(None, ["lora.rank=8", "lora.base_dtype=fp32"])
    assert lora.from_config(fp32, "bf16").base_bytes == 4


# ---------------------------------------------------------------------------------------------
# model states


@pytest.mark.parametrize("strategy, dp_shard, want", [
    ("zero3", 0, (2 * PSI + 16 * PSI_LORA) / 8),  # 2Ψ_base/N + 16Ψ_lora/N
    ("zero2", 0, (2 * PSI + 16 * PSI_LORA) / 8),  # FSDP2 shards the parameters at rest too
    ("ddp", 0, 2 * PSI + 16 * PSI_LORA),
    ("zero1", 0, 2 * PSI + 4 * PSI_LORA + 4 * PSI_LORA + 8 * PSI_LORA / 8),  # the optimizer's only
    ("hsdp", 4, (2 * PSI + 16 * PSI_LORA) / 4),  # over the shard group
])
def test_model_states_by_strategy(strategy, dp_shard, want):
    c = Candidate(strategy, 8, dp_shard=dp_shard)
    assert gpu_memory(bf16(), c, 0.0).model_states == pytest.approx(want)
    states = lora_state_bytes(strategy, PSI, PSI_LORA, c.shard_size, 2)
    assert states.total == pytest.approx(want)
    over = 1 if strategy == "ddp" else dp_shard or 8
    assert states.optimizer == pytest.approx(8 * PSI_LORA / over)


def test_lora_state_bytes_parts():
    s = lora_state_bytes("zero3", 1000, 10, 4, 2)
    assert (s.params, s.grads, s.optimizer) == ((2 * 1000 + 4 * 10) / 4, 4 * 10 / 4, 8 * 10 / 4)
    s = lora_state_bytes("ddp", 1000, 10, 4, 4)  # an fp32 base, nothing sharded
    assert (s.params, s.grads, s.optimizer) == (4 * 1000 + 4 * 10, 40, 80)


def test_model_states_under_tp():
    rest, _ = lora.stage_params(SHAPE, LORA, tp=2)
    c = Candidate("zero3", 4, 2, sequence_parallel=True)
    want = (2 * rest.frozen + 16 * rest.trainable) / 4
    assert gpu_memory(bf16(), c, 0.0).model_states == pytest.approx(want)
    assert estimate(bf16(), c, H100)["lora_params"] == {"base": rest.frozen, "trainable": rest.trainable}


def test_offload_puts_the_base_on_the_host():
    """FSDP2's CPU offload on one GPU: every state on the host, the base in its 2 bytes."""
    m = gpu_memory(bf16(), Candidate("zero3", 1, offload="optimizer+params"), 0.0)
    assert m.model_states == 0 and m.host == pytest.approx(2 * PSI + 16 * PSI_LORA)


# ---------------------------------------------------------------------------------------------
# activations and buffers


def test_adapters_activations_by_hand():
    """32 tokens, e = 2, r = 4: each of the 7 adapted linears keeps A·x (r·e per token), an adapted down its
    input (the product, f·e); dropout adds each adapter's dropped input and mask (in·(e + 1)); with only o
    adapted, the two norm outputs no adapter reads are not kept."""
    assert lora.saved_bytes(SHAPE, LORA, 32, 2) == 7 * 32 * 4 * 2 + 32 * 192 * 2
    dropout = lora.saved_bytes(SHAPE, dataclasses.replace(LORA, dropout=0.1), 32, 2)
    assert dropout - lora.saved_bytes(SHAPE, LORA, 32, 2) == 32 * (6 * 64 + 192) * 3
    only_o = lora.LoRA(4, targets=("o",), expert_targets=(), shared_targets=())
    assert lora.saved_bytes(SHAPE, only_o, 32, 2) == 32 * 4 * 2 - 2 * 32 * 64 * 2
    # under TP the dense block keeps the product already; o's and down's dropped inputs are split
    assert lora.saved_bytes(SHAPE, LORA, 32, 2, tp=2) == 7 * 32 * 4 * 2
    # MoE: the experts count their rows (k per token), the shared expert every token
    moe = lora.saved_bytes(MOE_SHAPE, LORA, 32, 2, moe=True)
    assert moe == 4 * 32 * 4 * 2 + 3 * 64 * 4 * 2 + 64 * 32 * 2 + 3 * 32 * 4 * 2 + 32 * 32 * 2


def _moments(w: Workload, c: Candidate) -> dict:
    named: list = []
    stage_memory(w, c, 0, moments=named)
    return {name: (act, buf) for name, act, buf in named}


def test_activations_and_gradient_buffers_against_full_fine_tuning():
    """zero3, one micro-batch of 32 tokens: every block keeps its adapters' tensors more; no head weight
    gradient in the head's backward, and the frozen embedding unit reduce-scatters nothing."""
    c = Candidate("zero3", 8, micro_batch=1, grad_accum=1, fsdp_unit_mb=0)
    full, tuned = _moments(bf16(spec=None), c), _moments(bf16(), c)
    assert tuned["loss"][0] - full["loss"][0] == pytest.approx(4 * lora.saved_bytes(SHAPE, LORA, 32, 2))
    assert full["head backward"][1] > full["loss"][1]  # the head weight's gradient
    assert tuned["head backward"][1] == tuned["loss"][1]
    assert full["reduce-scatter"][1] > 0 and tuned["reduce-scatter"][1] == 0


def test_a_16_bit_base_under_ddp_keeps_no_weight_copies():
    """ddp reaches bf16 through autocast, which caches each fp32 weight's 16-bit copy: a bf16 base needs none
    (only the fp32 adapters' copies); an fp32 base's copies are kept as at full fine-tuning."""
    c = Candidate("ddp", 8, micro_batch=1, grad_accum=1)
    fp32_base = dataclasses.replace(LORA, base_bytes=4)
    full, base16, base32 = (_moments(bf16(spec=s), c)["loss"][1] for s in (None, LORA, fp32_base))
    assert base16 == pytest.approx(2 * PSI_LORA)  # the adapters' 16-bit copies
    assert base32 == pytest.approx(full + 2 * PSI_LORA)


# ---------------------------------------------------------------------------------------------
# communication


def test_gradient_payload_is_what_trains():
    """The data-parallel gradient collectives carry 4Ψ_lora; zero3 gathers the bf16 base with the adapters
    (the head's unit kept, the frozen embedding's not gathered again in backward) and reduce-scatters only
    the four blocks' units."""
    w = bf16()
    ddp, _ = comm_per_step(w, Candidate("ddp", 8), 8)
    assert ddp.payload_by_kind == {"all_reduce": 4 * PSI_LORA}
    zero1, _ = comm_per_step(w, Candidate("zero1", 8), 8)
    assert zero1.payload_by_kind == {"all_reduce": 4 * PSI_LORA, "broadcast": 4 * PSI_LORA}
    zero3, _ = comm_per_step(w, Candidate("zero3", 8, micro_batch=1, grad_accum=1, fsdp_unit_mb=0), 8)
    gathered = 2 * (PSI + PSI_LORA)
    assert zero3.payload_by_kind == {"all_gather": 2 * gathered - 2 * (64064 + 64000),
                                     "reduce_scatter": 4 * PSI_LORA}
    assert zero3.count_by_kind == {"all_gather": 6 + 4, "reduce_scatter": 4}
    assert zero3.by_kind["reduce_scatter"] == pytest.approx(7 / 8 * 4 * PSI_LORA)
    hsdp, _ = comm_per_step(w, Candidate("hsdp", 8, dp_shard=4, micro_batch=1, grad_accum=1), 8)
    assert hsdp.payload_by_kind["all_reduce"] == pytest.approx(4 * PSI_LORA / 4)
    # ep: each rank's experts' adapters reduced over the ranks holding the same ones
    moe, _ = comm_per_step(bf16(MOE_SHAPE), Candidate("ddp", 8, ep=4), 8)
    rest, held = lora.stage_params(MOE_SHAPE, LORA, ep=4)
    assert moe.payload_by_kind["all_reduce"] == pytest.approx(4 * rest.trainable + 4 * held.trainable)


# ---------------------------------------------------------------------------------------------
# time


def test_flops_per_token_by_hand():
    """4N + 12·L·H·Q·T + 6A against full fine-tuning's 6N + 12·L·H·Q·T (N = Ψ − V·h: the input embedding is
    a lookup); a forward 2N + 4·L·H·Q·T + 2A."""
    n, attention = PSI - 64000, 12 * 4 * 4 * 16 * 32
    assert SHAPE.flops_per_token(32) == 6 * n + attention
    assert lora.flops_per_token(SHAPE, LORA, 32) == (4 * n + attention + 6 * PSI_LORA,
                                                      2 * n + attention / 3 + 2 * PSI_LORA)
    trained_head = lora.flops_per_token(SHAPE, lora.LoRA(4, train_embeddings=True), 32)[0]
    assert trained_head - lora.flops_per_token(SHAPE, LORA, 32)[0] == 2 * 64000


def test_lora_steps_faster_than_full_fine_tuning():
    shape = from_preset("8b")
    full, tuned = Workload(shape, 4096, 64), Workload(shape, 4096, 64, lora=lora.LoRA(16))
    for c in (Candidate("zero3", 8, micro_batch=1, grad_accum=8),
              Candidate("ddp", 4, 2, micro_batch=2, grad_accum=8, sequence_parallel=True)):
        times = []
        for w in (full, tuned):
            acc, groups = comm_per_step(w, c, 8)
            times.append(step_time(w, c, H100, acc, groups))
        ratio = lora.flops_per_token(shape, tuned.lora, 4096)[0] / shape.flops_per_token(4096)
        assert 0.6 < ratio < 0.75 and times[1].compute == pytest.approx(times[0].compute * ratio)
        assert times[1].total < times[0].total
        trainable = lora.stage_params(shape, tuned.lora, tp=c.tp)[0].trainable / c.shard_size
        assert times[1].optimizer == pytest.approx(40 * trainable / (H100.gpu.hbm_tbps * 1e12))


def test_recompute_repeats_a_lora_forward():
    """A checkpointed block's recompute is a forward again: about half of a LoRA step's compute."""
    w = Workload(from_preset("8b"), 4096, 64, lora=lora.LoRA(16))
    c = Candidate("zero3", 8, micro_batch=1, grad_accum=8, activation_checkpointing="full")
    acc, groups = comm_per_step(w, c, 8)
    t = step_time(w, c, H100, acc, groups)
    assert 0.45 < forward_share(w) < 0.55
    assert t.recompute == pytest.approx(t.compute * forward_share(w))


def test_measured_device_prices_lora():
    """This machine's measured rates (a CPU profile): LoRA's step is priced and below full fine-tuning's."""
    cluster = local_cluster(CPU, 2)
    shape = from_preset("tiny")
    c = Candidate("zero3", 2, micro_batch=8, grad_accum=1)
    full = Workload(shape, 128, 16, "fp32")
    tuned = dataclasses.replace(full, lora=lora.LoRA(8, base_bytes=4))
    times = [step_time(w, c, cluster, *comm_per_step(w, c, 2)) for w in (full, tuned)]
    assert 0 < times[1].compute < times[0].compute and times[1].optimizer < times[0].optimizer


# ---------------------------------------------------------------------------------------------
# candidates, explain, emit


def test_no_deepspeed_candidates_under_lora():
    """loom's deepspeed engine refuses LoRA: only torch-engine candidates, FSDP2's CPU offload among them."""
    tuned = list(enumerate_candidates(bf16(batch=16), Cluster(lookup("H100-SXM"), 8, 2)))
    assert tuned and all(c.engine != "deepspeed" for c in tuned)
    assert {c.offload for c in tuned} == {"none", "optimizer+params"}
    full = list(enumerate_candidates(bf16(spec=None, batch=16), Cluster(lookup("H100-SXM"), 8, 2)))
    assert any(c.engine == "deepspeed" for c in full)


def test_dense_plans_carry_no_lora():
    """Without lora.rank a config's workload has no LoRA and its records and plan no LoRA keys (the golden
    explanation, tests/unit/test_plan_explain_golden.py, keeps the dense numbers)."""
    cfg = load_config(None)
    w = config_workload(cfg, SHAPE)
    assert w.lora is None
    plan = search(dataclasses.replace(w, global_batch=8, seq_len=32), H100)
    assert not any("lora_params" in r for r in plan.candidates)
    assert "lora" not in plan.to_dict()["model"] and "LoRA" not in explain(plan, plan.recommended)


def test_explain_shows_lora_and_checks_itself():
    plan = search(Workload(from_preset("8b"), 4096, 64, lora=lora.LoRA(16)), H100)
    picks = {plan.recommended}
    for want in ({"strategy": "zero3", "tp": 1}, {"strategy": "ddp", "tp": 2}, {"strategy": "zero1", "tp": 1},
                 {"strategy": "zero3", "offload": "optimizer+params"}, {"pp": 2},
                 {"activation_checkpointing": "full"}):
        picks.add(next(i for i, r in enumerate(plan.candidates)
                       if all(r.get(k) == v for k, v in want.items())))
    for i in sorted(picks):
        text = explain(plan, i)
        assert text.count("✓") == 3 and "✗" not in text, plan.candidates[i]["label"]
        for line in ("LoRA rank 16 on q, k, v, o, gate, up, down", "Ψ_lora adapters", "Ψ_base on a rank",
                     "4·Ψ_lora (only what trains)", "4N + 12·L·H·Q·T + 6A", "Ψ_lora/N"):
            assert line in text, line
    zero3 = next(i for i, r in enumerate(plan.candidates) if r["label"] == "zero3 ac full")
    assert "2Ψ_base/N + 16Ψ_lora/N" in explain(plan, zero3)
    ddp = next(i for i, r in enumerate(plan.candidates) if r["label"] == "ddp tp2+sp")
    assert "2Ψ_base + 16Ψ_lora" in explain(plan, ddp)
    # an MoE model with ep, a parameter count, and this machine's measured rates
    for w, cluster in ((bf16(MOE_SHAPE, batch=16), Cluster(lookup("H100-SXM"), 8, 2)),
                       (Workload(from_params(70e9), 4096, 64, lora=lora.LoRA(16)), H100),
                       (Workload(from_preset("tiny-moe"), 128, 16, "fp32", lora=lora.LoRA(8, base_bytes=4)),
                        local_cluster(CPU, 2))):
        plan = search(w, cluster)
        picks = [plan.recommended] + [i for i, r in enumerate(plan.candidates) if r.get("ep", 1) > 1][:2]
        for i in picks:
            text = explain(plan, i)
            assert text.count("✓") == 3 and "✗" not in text, plan.candidates[i]["label"]


def test_a_parameter_count_counts_adapters_on_its_llama_shape():
    shape = from_params(70e9)
    stand_in = llama_like(70e9)
    assert lora.adapter_params(shape, LORA) == lora.adapter_params(stand_in, LORA) > 0
    m = gpu_memory(Workload(shape, 4096, 64, lora=LORA), Candidate("zero3", 8), 0.0)
    assert m.model_states == pytest.approx((2 * 70e9 + 16 * lora.adapter_params(stand_in, LORA)) / 8)


def test_emit_writes_the_lora_section_and_reads_back(tmp_path, capsys):
    target = tmp_path / "run.toml"
    assert main(["plan", "--model", "8b", "--gpu", "H100-SXM", "--gpus-per-node", "8", "--nodes", "1",
                 "--set", "lora.rank=16", "--set", 'lora.targets=["q", "v"]', "--set", "lora.dropout=0.05",
                 "--emit", str(target)]) == 0
    out = capsys.readouterr().out
    assert "LoRA rank 16 on q, v: " in out
    text = target.read_text()
    assert "# LoRA: rank 16 on q, v" in text and "[lora]" in text
    cfg = load_config(target)
    assert (cfg.lora.rank, cfg.lora.targets, cfg.lora.dropout) == (16, ["q", "v"], 0.05)
    assert cfg.train.precision == "bf16" and cfg.lora.base_dtype == "auto" and cfg.parallel.engine == "torch"
    dims = validate(cfg, 8, cuda_available=True, this_machine=False)
    w = config_workload(cfg, from_preset("8b"))
    assert w.lora == lora.LoRA(16, ("q", "v"), (), (), base_bytes=2, dropout=0.05)
    c = config_candidate(cfg, dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp)
    assert estimate(w, c, H100)["fits"]
    for alternative in tmp_path.glob("run.*.toml"):  # every alternative runs as loom train would check it
        emitted = load_config(alternative)
        assert emitted.lora.rank == 16
        validate(emitted, 8, cuda_available=True, this_machine=False)
        assert resolve_dims(emitted.parallel, 8)


def test_an_explicit_16_bit_base_plans_in_its_dtype(capsys):
    """lora.base_dtype = bf16 on an fp32 config: the GPU plan (and what it would emit) computes in bf16."""
    assert main(["plan", "--format", "json", "--model", "8b", "--gpu", "H100-SXM", "--gpus-per-node", "8",
                 "--set", "lora.rank=8", "--set", "lora.base_dtype=bf16"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"]["lora"]["base_bytes"] == 2
    assert plan["candidates"][plan["recommended"]]["precision"] == "bf16"


# ---------------------------------------------------------------------------------------------
# the recommendations


def _plan(capsys, *args: str) -> dict:
    assert main(["plan", "--format", "json", "--model", *args, "--set", "lora.rank=16"]) == 0
    return json.loads(capsys.readouterr().out)


def test_70b_lora_on_one_node_of_8_fits(capsys):
    """70B in bf16 is 141 GB: 17.6 GB per GPU over 8, with 3.3 GB of adapters' states: zero3 fits."""
    plan = _plan(capsys, "70b", "--gpu", "H100-SXM", "--gpus-per-node", "8", "--nodes", "1")
    best = plan["candidates"][plan["recommended"]]
    assert best["fits"] and best["runs_in_loom"] and best["offload"] == "none"
    assert best["engine"] != "deepspeed"
    assert best["memory_bytes"]["total"] <= 0.8 * 80e9 and best["precision"] == "bf16"
    psi, psi_lora = preset("70b").num_params(), plan["model"]["lora"]["trainable_params"]
    assert psi_lora == lora.adapter_params(from_preset("70b"), lora.LoRA(16)) == 207_093_760
    zero3 = [r for r in plan["candidates"] if r["strategy"] == "zero3" and r["tp"] == r["pp"] == r["cp"] == 1
             and r["offload"] == "none"]
    assert any(r["fits"] for r in zero3)
    assert zero3[0]["memory_bytes"]["model_states"] == pytest.approx((2 * psi + 16 * psi_lora) / 8)
    ddp = [r for r in plan["candidates"] if r["strategy"] == "ddp" and r["tp"] == r["pp"] == 1]
    assert ddp and not any(r["fits"] for r in ddp)  # 141 GB of base on every GPU


def test_70b_lora_on_one_gpu_says_it_does_not_fit_without_offload(capsys):
    plan = _plan(capsys, "70b", "--gpu", "H100-SXM", "--gpus-per-node", "1", "--nodes", "1")
    assert not any(r["fits"] for r in plan["candidates"] if r["offload"] == "none")
    best = plan["candidates"][plan["recommended"]]
    assert best["offload"] == "optimizer+params" and best["fits"]
    assert main(["plan", "--model", "70b", "--gpu", "H100-SXM", "--gpus-per-node", "1", "--nodes", "1",
                 "--set", "lora.rank=16"]) == 0
    out = capsys.readouterr().out
    for words in ("the frozen base is 141 GB (2 bytes × 70.6B)",
                  "without offload it does not fit 1 node(s) × 1 H100-SXM: the base alone is 141 GB per GPU, "
                  "more than its 80 GB; it fits only with the parameters on the host (parallel.offload=cpu)",
                  "without offload the fewest that fit are 1 node(s) × 4 H100-SXM"):
        assert words in out, words


def test_8b_lora_on_one_gpu_fits(capsys):
    plan = _plan(capsys, "8b", "--gpu", "H100-SXM", "--gpus-per-node", "1", "--nodes", "1")
    best = plan["candidates"][plan["recommended"]]
    assert best["fits"] and best["offload"] == "none" and best["memory_bytes"]["total"] <= 80e9
