"""The planner's mixtures of experts and expert parallelism (plan/experts.py and its callers): total and
active parameters against GPTConfig's (presets and Hugging Face config.json files), the routed experts'
states per rank with ep worked by hand, the dispatch's bytes, FLOPs of the active parameters, the load
imbalance, which ep splits are candidates, dense plans untouched, --emit and --explain, and the
recommendations for DeepSeek-V3."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from loom.cli import main
from loom.config import load_config, resolve_dims, to_toml
from loom.hf_config import read_hf_config
from loom.models.gpt.config import PRESETS, GPTConfig, preset
from loom.plan import device, experts
from loom.plan.candidate import Candidate, Workload
from loom.plan.comm import comm_per_step, ep_payload_per_step
from loom.plan.command import local_cluster
from loom.plan.efficiency import compute_fraction, link_efficiency
from loom.plan.explain import explain
from loom.plan.hardware import Cluster, lookup
from loom.plan.memory import expert_state_bytes, gpu_memory, stage_memory
from loom.plan.search import (
    config_candidate,
    config_workload,
    emit_config,
    enumerate_candidates,
    estimate,
    search,
)
from loom.plan.shapes import ModelShape, from_hf_config, from_preset, grouped_experts, moe_ffn_saved_bytes
from loom.plan.step import step_time

# h = 64, 4 heads of 16, 2 kv heads (kv = 32), dense f = 192; block 0 dense, blocks 1-3 MoE: 8 experts of
# h_e = 32, top 2, one shared expert (h_s = 32)
SHAPE = ModelShape("moe", vocab_size=1000, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=192,
                   moe_experts=8, moe_top_k=2, moe_hidden=32, moe_shared_hidden=32, moe_dense_first=1)
GPT = GPTConfig(vocab_size=1000, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=192,
                moe_experts=8, moe_top_k=2, moe_shared_experts=1, moe_ffn_hidden=32, moe_dense_first=1)
ATTENTION = 2 * 64 * 64 + 2 * 64 * 32  # wq, wo; wk, wv
DENSE = ATTENTION + 3 * 64 * 192 + 2 * 64
ROUTED = 3 * 64 * 32 * 8  # one MoE block's routed experts
MOE_FFN = 64 * 8 + ROUTED + 3 * 64 * 32  # router, routed, shared
MOE = ATTENTION + 2 * 64 + MOE_FFN
TOTAL = DENSE + 3 * MOE + 1000 * 64 + (1000 * 64 + 64)
P_E = 3 * ROUTED  # every routed expert
REST = TOTAL - P_E
H100 = Cluster(lookup("H100-SXM"), 8, 1)
CPU = device.load(Path(__file__).resolve().parents[1] / "data" / "device_cpu.json")


def bf16(seq: int = 32, batch: int = 8, shape: ModelShape = SHAPE, **kw) -> Workload:
    return Workload(shape, seq, batch, "bf16", "torch", 0, **kw)


# ---------------------------------------------------------------------------------------------
# shapes


def test_parameters_by_hand_and_as_gptconfig_counts_them():
    assert (SHAPE.num_params, SHAPE.moe_layers, SHAPE.routed_params_per_block) == (TOTAL, 3, ROUTED)
    assert SHAPE.num_params == GPT.num_params()
    assert SHAPE.active_params == TOTAL - 3 * (8 - 2) * 3 * 64 * 32 == GPT.num_params(active=True)
    assert [SHAPE.block_params(i) for i in range(4)] == [DENSE, MOE, MOE, MOE]


@pytest.mark.parametrize("name", [n for n, cfg in PRESETS.items() if cfg.moe_experts])
def test_every_moe_preset_counts_as_gptconfig(name):
    cfg, shape = preset(name), from_preset(name)
    assert shape.moe and shape.moe_layers == cfg.moe_layers
    assert shape.num_params == cfg.num_params()
    assert shape.active_params == cfg.num_params(active=True)
    # every pipeline split adds up to the whole, each stage holding its own dense and MoE blocks
    for pp in (2, 4, 8):
        assert sum(shape.stage_params(s, pp) for s in range(pp)) == shape.num_params + \
            (shape.embedding_params if shape.tie_embeddings and pp > 1 else 0)
        assert sum(shape.stage_moe_layers(s, pp) for s in range(pp)) == cfg.moe_layers


def test_dense_shapes_have_no_experts():
    shape = from_preset("8b")
    assert not shape.moe and shape.moe_layers == 0 and shape.active_params == shape.num_params
    assert shape.stage_routed_params(0, 2) == 0 and shape.priced_stages(8) == [0, 7]


def test_deepseek_stages_hold_dense_then_moe_blocks_and_the_heaviest_is_priced():
    """DeepSeek-V3's first three blocks are dense: its first stage holds them and the embedding, a
    middle stage only MoE blocks, the heaviest; gpu_memory prices that one too."""
    shape, cfg = from_preset("deepseek-v3"), preset("deepseek-v3")
    assert cfg.moe_dense_first == 3
    # 61 blocks in 4 stages: 15, 16, 15, 15 (the extra block to a middle stage, as the run splits them)
    first = 3 * shape.layer_params + (15 - 3) * shape.moe_layer_params + shape.embedding_params
    assert shape.stage_layers(0, 4) == (0, 15) and shape.stage_params(0, 4) == first
    assert shape.stage_layers(1, 4) == (15, 16) and shape.stage_params(1, 4) == 16 * shape.moe_layer_params
    assert shape.stage_moe_layers(0, 4) == 12
    assert shape.stage_routed_params(1, 4) == 16 * shape.routed_params_per_block
    assert shape.priced_stages(8) == [0, 1, 7]  # stage 1: eight MoE blocks, more than the first's or last's
    w = Workload(shape, 4096, 64)
    c = Candidate("zero3", 8, pp=8, schedule="1f1b", grad_accum=8, activation_checkpointing="full", ep=8)
    assert gpu_memory(w, c).total == max(stage_memory(w, c, s).total for s in range(8))


def test_tp_leaves_the_moe_feed_forward_whole():
    """The norms' gains and an MoE block's whole feed-forward (router, experts, shared) are on every TP
    rank."""
    assert SHAPE.tp_replicated_params(4, True, 3) == 4 * 128 + 64 + 3 * MOE_FFN
    assert SHAPE.tp_replicated_params(4, True) == 4 * 128 + 64


def test_flops_per_token_from_active_parameters():
    seq = 4096
    for name in ("mixtral-8x7b", "deepseek-v3", "qwen3-moe-30b"):
        cfg, shape = preset(name), from_preset(name)
        matmul = cfg.num_params(active=True) - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model)
        want = 6 * matmul + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq
        assert shape.flops_per_token(seq) == want
        assert shape.flops_per_token(seq) < 6 * shape.num_params / 2  # far below the total's
    plan = search(Workload(from_preset("mixtral-8x7b"), 4096, 64), Cluster(lookup("H100-SXM"), 8, 2))
    plan = plan.to_dict()
    assert plan["model"]["active_params"] == preset("mixtral-8x7b").num_params(active=True)
    assert plan["model"]["flops_per_token"] == from_preset("mixtral-8x7b").flops_per_token(4096)


# ---------------------------------------------------------------------------------------------
# Hugging Face config.json


BASE = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256)
HF = {
    "mixtral": dict(model_type="mixtral", num_local_experts=8, num_experts_per_tok=2),
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                      decoder_sparse_step=2, norm_topk_prob=True, mlp_only_layers=[]),
    "qwen2_moe": dict(model_type="qwen2_moe", num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64),
    "deepseek_v3": dict(model_type="deepseek_v3", n_routed_experts=16, n_shared_experts=1,
                        num_experts_per_tok=4, moe_intermediate_size=32, first_k_dense_replace=2,
                        moe_layer_freq=1, scoring_func="sigmoid", routed_scaling_factor=2.5,
                        norm_topk_prob=True),
}


def _written(tmp_path, name: str, **extra) -> object:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({**BASE, **HF[name], **extra}))
    return path


@pytest.mark.parametrize("name, moe_layers", [("mixtral", 6), ("qwen3_moe", 3), ("qwen2_moe", 6),
                                              ("deepseek_v3", 4)])
def test_hf_moe_configs_count_as_gptconfig(tmp_path, name, moe_layers):
    path = _written(tmp_path, name)
    shape, hf = from_hf_config(path), read_hf_config(path)
    gpt = GPTConfig(vocab_size=1000, d_model=64, n_layers=6, n_heads=4, n_kv_heads=2, ffn_hidden=128,
                    **hf.gpt_moe_fields())
    assert shape.moe_layers == gpt.moe_layers == moe_layers
    assert shape.num_params == gpt.num_params() and shape.active_params == gpt.num_params(active=True)


def test_hf_moe_fields(tmp_path):
    mixtral = read_hf_config(_written(tmp_path, "mixtral"))
    assert (mixtral.moe.experts, mixtral.moe.top_k, mixtral.moe.hidden) == (8, 2, 128)
    qwen3 = read_hf_config(_written(tmp_path, "qwen3_moe")).gpt_moe_fields()
    assert (qwen3["moe_dense_first"], qwen3["moe_every"], qwen3["moe_norm_topk"]) == (1, 2, True)  # (i+1) % 2
    qwen2 = read_hf_config(_written(tmp_path, "qwen2_moe")).gpt_moe_fields()
    assert (qwen2["moe_shared_experts"], qwen2["moe_shared_gate"]) == (2, True)
    deepseek = read_hf_config(_written(tmp_path, "deepseek_v3")).gpt_moe_fields()
    assert (deepseek["moe_dense_first"], deepseek["moe_score"]) == (2, "sigmoid")
    assert deepseek["moe_route_scale"] == 2.5
    assert read_hf_config(_written(tmp_path, "deepseek_v3", moe_layer_freq=2, first_k_dense_replace=1)) \
        .gpt_moe_fields()["moe_dense_first"] == 2  # blocks 2, 4: i ≥ 1 and i % 2 == 0
    dense = tmp_path / "llama.json"
    dense.write_text(json.dumps({**BASE, "model_type": "llama"}))
    assert read_hf_config(dense).moe is None and not from_hf_config(dense).moe


@pytest.mark.parametrize("name, extra, message", [
    ("qwen3_moe", {"mlp_only_layers": [1, 3]}, "mlp_only_layers must be empty"),
    ("qwen3_moe", {"num_experts_per_tok": 99}, "num_experts_per_tok must be an integer in [1, 16]"),
    ("mixtral", {"num_local_experts": 0}, "num_local_experts must be an integer in [1, "),
    ("deepseek_v3", {"scoring_func": "relu"}, "scoring_func must be one of"),
    ("deepseek_v3", {"routed_scaling_factor": -1}, "routed_scaling_factor must be a finite number"),
])
def test_bad_hf_moe_fields_are_one_line(tmp_path, capsys, name, extra, message):
    path = _written(tmp_path, name, **extra)
    assert main(["plan", "--model", str(path), "--gpu", "H100-SXM"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


# ---------------------------------------------------------------------------------------------
# model states


@pytest.mark.parametrize("strategy, dp, shard, ep, recipe, want", [
    # zero3: the rest over N = 8, each rank's P_e/ep over N_e = dp/ep: 16·P_e/dp, as at ep = 1
    ("zero3", 8, 0, 4, "torch", 16 * REST / 8 + 16 * P_E / 4 / 2),
    ("zero3", 8, 0, 1, "torch", 16 * TOTAL / 8),
    # ddp replicates: the rest whole, the experts split over ep only
    ("ddp", 8, 0, 4, "torch", 16 * REST + 16 * P_E / 4),
    # zero2 on FSDP2 (params sharded at rest) and on the ZeRO paper's recipe (16-bit params whole)
    ("zero2", 8, 0, 2, "torch", 16 * REST / 8 + 16 * P_E / 2 / 4),
    ("zero2", 8, 0, 2, "zero", 2 * REST + 14 * REST / 8 + 2 * P_E / 2 + 14 * P_E / 2 / 4),
    # hsdp: shard groups of 4, the experts over 4/ep of them
    ("hsdp", 8, 4, 2, "torch", 16 * REST / 4 + 16 * P_E / 2 / 2),
])
def test_model_states_with_ep_by_hand(strategy, dp, shard, ep, recipe, want):
    w = Workload(SHAPE, 32, 8, "bf16", recipe, 0)
    c = Candidate(strategy, dp, dp_shard=shard, ep=ep)
    assert gpu_memory(w, c, 0.0).model_states == pytest.approx(want)
    experts_only = expert_state_bytes(w, c).total
    p, g, o = {"torch": (4, 4, 8), "zero": (2, 2, 12)}[recipe]
    n_e = c.expert_shard_size
    whole_params = strategy == "ddp" or (strategy == "zero2" and recipe == "zero")
    assert experts_only == pytest.approx(p * P_E / ep / (1 if whole_params else n_e)
                                         + (g + o) * P_E / ep / (1 if strategy == "ddp" else n_e))


def test_model_states_under_tp_keep_the_moe_whole():
    """zero3 dp 4 × tp 2, ep 2: the attention and dense SwiGLU split over tp; the norms and the MoE
    blocks' router and shared expert whole on each TP rank; the routed experts split over ep only."""
    w = bf16()
    c = Candidate("zero3", 4, 2, ep=2, sequence_parallel=True)
    whole = 4 * 128 + 64 + 3 * (MOE_FFN - ROUTED)
    rest = (REST - whole) / 2 + whole
    assert gpu_memory(w, c, 0.0).model_states == pytest.approx(16 * rest / 4 + 16 * P_E / 2 / 2)


def test_routed_activations_by_hand_and_imbalance():
    """One MoE block at T = 32 tokens, e = 2: scores 4·T·E, dispatched rows and the experts' gate and up
    T·k·(h + 2h_e)·e (× imbalance), combined rows T·k·h·e, the shared expert's gate and up 2·T·h_s·e."""
    t = 32
    want = 4 * t * 8 + t * 2 * (64 + 64) * 2 + t * 2 * 64 * 2 + 2 * t * 32 * 2
    assert moe_ffn_saved_bytes(SHAPE, t, 1, 2) == want
    assert moe_ffn_saved_bytes(SHAPE, t, 1, 2, 1.5) - want == pytest.approx(0.5 * t * 2 * (64 + 64) * 2)
    # the busiest rank holds imbalance × its experts' share under ep, each of the three MoE blocks
    moments = {}
    for imbalance in (1.0, 1.5):
        named: list = []
        stage_memory(bf16(moe_imbalance=imbalance), Candidate("zero3", 8, ep=4), 0, moments=named)
        moments[imbalance] = dict((name, act) for name, act, _ in named)
    assert moments[1.5]["loss"] - moments[1.0]["loss"] == pytest.approx(3 * 0.5 * t * 2 * (64 + 64) * 2)
    # at ep = 1 a rank holds every expert and runs exactly T·k rows: no imbalance
    one = [stage_memory(bf16(moe_imbalance=x), Candidate("zero3", 8), 0).activations for x in (1.0, 1.5)]
    assert one[0] == one[1]



def test_cudas_grouped_experts_are_priced_where_they_run():
    """CUDA in bf16 runs the experts as grouped GEMMs (moe.py grouped_dtype): each of the three MoE
    blocks keeps its E/ep experts' padding rows, E_r·(GROUP_ROWS − 1)·(h + 2h_e)·e more than the loop
    that CPUs, fp16 and unaligned widths run."""
    def loss_moment(device: str, precision: str, ep: int, shape: ModelShape = SHAPE) -> float:
        named: list = []
        stage_memory(Workload(shape, 32, 8, precision, "torch", 0), Candidate("zero3", 8, ep=ep), 0,
                     device=device, moments=named)
        return dict((name, act) for name, act, _ in named)["loss"]

    loop = loss_moment("cpu", "bf16", 1)
    assert loss_moment("cuda", "fp16", 1) == loss_moment("cpu", "bf16", 4) == loop
    for ep in (1, 4):
        padding = 3 * (8 // ep) * 7 * (64 + 2 * 32) * 2
        assert loss_moment("cuda", "bf16", ep) - loop == padding
    unaligned = dataclasses.replace(SHAPE, moe_hidden=36)
    assert loss_moment("cuda", "bf16", 1, unaligned) == loss_moment("cpu", "bf16", 1, unaligned)
    assert grouped_experts(SHAPE, "bf16", "cuda", 2, lora_rank=12) == 0  # a rank unaligned too
    assert grouped_experts(SHAPE, "bf16", "cuda", 2, lora_rank=16) == 4

# ---------------------------------------------------------------------------------------------
# the dispatch


def test_ep_alltoall_bytes_by_hand():
    """T = 32 tokens, k = 2, h = 64, e = 2: the rows 32·2·64·2 = 8192 bytes. Per MoE block and micro-batch
    8·E + 4·rows = 64 + 32768 in 5 all_to_alls; 3 MoE blocks: 98496 bytes in 15. Full checkpointing runs
    each block's forward again: + 3·(64 + 2·8192) in 9 more; two micro-steps double it all."""
    w = bf16()
    c = Candidate("zero3", 8, micro_batch=1, grad_accum=1, ep=4)
    per_block = 8 * 8 + 4 * 32 * 2 * 64 * 2
    assert ep_payload_per_step(w, c) == (3 * per_block, 15)
    acc, groups = comm_per_step(w, c, 8)
    payload = acc.payload_dict()
    assert payload["payload_bytes_by_kind"]["ep_alltoall"] == 3 * per_block
    assert payload["count_by_kind"]["ep_alltoall"] == 15
    assert acc.by_kind["ep_alltoall"] == groups["ep"] == pytest.approx(3 / 4 * 3 * per_block)
    full = Candidate("zero3", 8, micro_batch=1, grad_accum=1, activation_checkpointing="full", ep=4)
    assert ep_payload_per_step(w, full) == (3 * per_block + 3 * (8 * 8 + 2 * 8192), 24)
    two = Candidate("zero3", 4, micro_batch=1, grad_accum=2, ep=4)
    assert ep_payload_per_step(w, two) == (2 * 3 * per_block, 30)
    # selective/2 recomputes blocks 0 and 2: one MoE block
    selective = Candidate("zero3", 8, micro_batch=1, grad_accum=1, activation_checkpointing="selective", ep=4)
    assert ep_payload_per_step(w, selective)[0] == 3 * per_block + 8 * 8 + 2 * 8192
    assert ep_payload_per_step(w, Candidate("zero3", 8)) == (0, 0)  # ep = 1: no exchange
    assert "ep_alltoall" not in comm_per_step(w, Candidate("zero3", 8), 8)[0].payload_by_kind


def test_ep_link_is_intra_node_while_ep_times_tp_fits_a_node():
    """zero3 dp 8, ep 4: on nodes of 4 the data-parallel group spans nodes but the ep group (4
    consecutive ranks) does not; on nodes of 2 it does too."""
    w = bf16()
    c = Candidate("zero3", 8, ep=4)
    four, _ = comm_per_step(w, c, 4)
    two, _ = comm_per_step(w, c, 2)
    assert four.intra_node == four.by_kind["ep_alltoall"] > 0 and two.intra_node == 0
    assert not experts.inter_node(c, 4) and experts.inter_node(c, 2)
    assert experts.inter_node(Candidate("zero3", 4, 2, ep=4), 4)  # ep·tp = 8


def test_experts_gradients_synced_over_the_ranks_holding_them():
    """zero3 dp 8, ep 4 (N_e = 2), one micro-step: the rest (Ψ − P_e) all-gathered in bf16 forward and
    backward but the head's unit, and its fp32 gradients reduce-scattered, over N = 8; each rank's
    routed experts P_e/ep all-gathered twice and reduce-scattered over N_e = 2, (2−1)/2 of each on the
    wire. ddp: the rest all-reduced over 8, the experts over edp = 2."""
    w = bf16()
    psi, head = P_E / 4, 1000 * 64 + 64
    acc, _ = comm_per_step(w, Candidate("zero3", 8, micro_batch=1, grad_accum=1, ep=4, fsdp_unit_mb=0), 8)
    assert acc.payload_by_kind["all_gather"] == pytest.approx(2 * 2 * REST - 2 * head + 2 * 2 * psi)
    assert acc.by_kind["all_gather"] == pytest.approx(7 / 8 * (2 * 2 * REST - 2 * head) + 1 / 2 * 2 * 2 * psi)
    assert acc.payload_by_kind["reduce_scatter"] == pytest.approx(4 * REST + 4 * psi)
    assert acc.by_kind["reduce_scatter"] == pytest.approx(7 / 8 * 4 * REST + 1 / 2 * 4 * psi)
    assert acc.count_by_kind["all_gather"] == (6 + 5) + 2 * 3  # 6 units, all but the head's twice; experts
    ddp, _ = comm_per_step(w, Candidate("ddp", 8, ep=4), 8)
    assert ddp.payload_by_kind["all_reduce"] == pytest.approx(4 * REST + 4 * psi)
    assert ddp.by_kind["all_reduce"] == pytest.approx(2 * 7 / 8 * 4 * REST + 2 * 1 / 2 * 4 * psi)


# ---------------------------------------------------------------------------------------------
# time


def test_routed_compute_scales_with_imbalance_and_the_moe_runs_whole_on_each_tp_rank():
    shape = from_preset("mixtral-8x7b")
    fraction = compute_fraction(H100.gpu, shape, 1)
    tokens, routed = 64 * 4096, shape.routed_flops_per_token()

    def compute(imbalance: float, c: Candidate) -> float:
        w = Workload(shape, 4096, 64, moe_imbalance=imbalance)
        acc, groups = comm_per_step(w, c, 8)
        return step_time(w, c, H100, acc, groups).compute

    ep8 = Candidate("zero3", 8, grad_accum=8, ep=8)
    extra = tokens / 8 * 0.5 * routed / (H100.gpu.bf16_tflops * 1e12 * fraction)
    assert compute(1.5, ep8) - compute(1.0, ep8) == pytest.approx(extra)
    ep1 = Candidate("zero3", 8, grad_accum=8)
    assert compute(1.5, ep1) == compute(1.0, ep1)
    # tp 2: each TP rank runs the MoE feed-forwards whole, twice their FLOPs on the TP group
    tp2 = Candidate("zero3", 4, 2, grad_accum=16, sequence_parallel=True)
    fraction2 = compute_fraction(H100.gpu, shape, 2)
    w = Workload(shape, 4096, 64)
    acc, groups = comm_per_step(w, tp2, 8)
    flops = tokens * shape.flops_per_token(4096) / 8 + tokens / 8 * shape.moe_ffn_flops_per_token()
    assert step_time(w, tp2, H100, acc, groups).compute == pytest.approx(
        flops / (H100.gpu.bf16_tflops * 1e12 * fraction2))


def test_ep_alltoall_is_exposed_at_the_links_rate():
    shape = from_preset("mixtral-8x7b")
    w = Workload(shape, 4096, 64)
    c = Candidate("zero3", 8, grad_accum=8, ep=8)
    acc, groups = comm_per_step(w, c, 8)
    exposed = step_time(w, c, H100, acc, groups).comm_exposed
    record = estimate(w, c, H100)
    gpu = H100.gpu
    alltoall = groups["ep"] / (gpu.intra_node_gbps * 1e9 * link_efficiency(gpu)) \
        + gpu.intra_node_latency_s * 8 * 32 * 5  # 8 micro-steps × 32 MoE blocks × 5 all_to_alls
    assert acc.count_by_group["ep"] == 8 * 32 * 5
    assert exposed == pytest.approx(alltoall)  # the data-parallel collectives hide behind compute
    assert record["ep_alltoall_payload_bytes_per_step"] == ep_payload_per_step(w, c)[0]
    assert record["expert_state_bytes"]["total"] == expert_state_bytes(w, c).total


def test_dualpipev_overlap_hides_the_paired_share_of_the_alltoall():
    """Under dualpipev with ep the paired forwards and backwards (rank 0's 2m − 3p + 1 pairs of its 2m
    passes) hide their share of the all-to-alls, up to that share of the compute; without the overlap,
    or under 1f1b, every all-to-all stays exposed."""
    shape = from_preset("mixtral-8x7b")
    w = Workload(shape, 4096, 64)

    def exposed(schedule: str, overlap: bool = True):
        c = Candidate("zero3", 4, pp=2, schedule=schedule, virtual_stages=2 if schedule == "dualpipev" else 1,
                      grad_accum=16, ep=4, dualpipev_overlap=overlap)
        acc, groups = comm_per_step(w, c, 8)
        t = step_time(w, c, H100, acc, groups)
        ep = groups["ep"] / (H100.gpu.intra_node_gbps * 1e9 * link_efficiency(H100.gpu)) \
            + H100.gpu.intra_node_latency_s * acc.count_by_group["ep"]
        return t.comm_exposed, ep, t.compute

    without, ep, compute = exposed("dualpipev", overlap=False)
    with_overlap, ep2, _ = exposed("dualpipev")
    assert ep == ep2 and without >= ep
    assert without - with_overlap == pytest.approx((2 * 16 - 3 * 2 + 1) / 32 * min(ep, compute))
    assert exposed("1f1b")[0] >= exposed("1f1b")[1]  # the all-to-alls whole, as without the overlap


# ---------------------------------------------------------------------------------------------
# candidates


@pytest.mark.parametrize("candidate, ok", [
    (Candidate("zero3", 8, ep=4), True), (Candidate("zero2", 8, ep=8), True),
    (Candidate("ddp", 8, ep=2), True),
    (Candidate("hsdp", 8, dp_shard=4, ep=4), True), (Candidate("zero3", 8, 2, ep=8), True),
    (Candidate("hsdp", 8, dp_shard=4, ep=8), False),  # ep must divide the shard group
    (Candidate("zero3", 8, ep=16), False), (Candidate("zero3", 6, ep=4), False),
    (Candidate("zero1", 8, ep=2), False),  # ZeroRedundancyOptimizer: refused
    (Candidate("zero3", 8, ep=2, framework="deepspeed"), False),
    (Candidate("zero3", 4, ep=2, cp=2), False),
])
def test_which_ep_splits_are_valid(candidate, ok):
    assert experts.valid(SHAPE, candidate) is ok
    assert experts.valid(from_preset("8b"), candidate) is (candidate.ep == 1)  # a dense model: never
    assert experts.valid(dataclasses.replace(SHAPE, moe_experts=6, moe_top_k=2),
                         Candidate("zero3", 8, ep=4)) is False  # 6 experts do not divide over 4


def test_search_enumerates_ep_for_moe_models_only():
    found = list(enumerate_candidates(bf16(batch=16), Cluster(lookup("H100-SXM"), 8, 2)))
    eps = {c.ep for c in found}
    assert eps == {1, 2, 4, 8}  # powers of two dividing dp and E = 8
    assert all(experts.valid(SHAPE, c) and c.runs_in_loom and c.cp == 1 for c in found if c.ep > 1)
    assert not any(c.strategy == "zero1" or c.engine == "deepspeed" for c in found if c.ep > 1)
    dense = list(enumerate_candidates(bf16(batch=16, shape=from_preset("8b")),
                                      Cluster(lookup("H100-SXM"), 8, 2)))
    assert {c.ep for c in dense} == {1}


def test_dense_plans_are_unchanged():
    """A dense model's records carry no MoE keys, its explanation no expert lines, and the workload's
    load imbalance changes nothing."""
    shape = from_preset("1b")
    cluster = Cluster(lookup("H100-SXM"), 8, 1)
    one = search(Workload(shape, 2048, 64), cluster)
    other = search(Workload(shape, 2048, 64, moe_imbalance=3.0), cluster)
    assert one.candidates == other.candidates and one.recommended == other.recommended
    assert not any("ep" in r or "expert_state_bytes" in r for r in one.candidates)
    assert "active" not in json.dumps(one.to_dict()["model"])
    text = explain(one, one.recommended)
    assert "expert" not in text and "MoE" not in text


# ---------------------------------------------------------------------------------------------
# emit, explain, the run's plan


def test_emit_writes_parallel_ep_and_the_config_reads_back_the_candidate():
    w = bf16(batch=16)
    cluster = Cluster(lookup("H100-SXM"), 8, 1)
    for c in (Candidate("zero3", 8, micro_batch=2, grad_accum=1, ep=4),
              Candidate("ddp", 8, micro_batch=1, grad_accum=2, ep=2),
              Candidate("hsdp", 8, dp_shard=4, micro_batch=2, grad_accum=1, ep=2)):
        cfg = emit_config(load_config(None), estimate(w, c, Cluster(lookup("H100-SXM"), 4, 2)))
        assert cfg.parallel.ep == c.ep and f"ep = {c.ep}" in to_toml(cfg)
        cfg.train.batch_size = w.global_batch
        dims = resolve_dims(cfg.parallel, c.world)
        assert dims.ep == c.ep
        assert config_candidate(cfg, dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp) == c
    cfg = load_config(None, ["parallel.ep=2", "parallel.strategy=zero3"])
    assert config_candidate(cfg, 1, 8, 1, 1).ep == 2 and config_workload(cfg, SHAPE).moe_imbalance == 1.0
    assert estimate(config_workload(cfg, SHAPE), config_candidate(cfg, 1, 8, 1, 1), cluster)["ep"] == 2


def test_emit_from_the_command_line(tmp_path, capsys):
    target = tmp_path / "run.toml"
    assert main(["plan", "--model", "mixtral-8x7b", "--gpu", "H100-SXM", "--gpus-per-node", "8",
                 "--nodes", "2", "--emit", str(target)]) == 0
    out = capsys.readouterr().out
    assert "mixtral-8x7b (46.7B, 12.9B active params)" in out
    best = load_config(target)
    assert best.parallel.ep > 1 and best.model.preset == "mixtral-8x7b"


def test_explain_shows_the_ep_lines_and_checks_itself():
    plan = search(Workload(from_preset("mixtral-8x7b"), 4096, 64), Cluster(lookup("H100-SXM"), 8, 2))
    for want in ({"ep": 8, "strategy": "zero3"}, {"ep": 2, "strategy": "ddp"}, {"ep": 4, "strategy": "hsdp"}):
        index = next(i for i, r in enumerate(plan.candidates)
                     if all(r.get(k) == v for k, v in want.items()) and r["tp"] == r["pp"] == 1)
        text = explain(plan, index)
        for line in ("expert parallel: ep = ", "P_e routed experts", "expert params", "ep payload",
                     "T·k·h·e rows", "Ψ_active", "expert parallel     ", "MoE feed-forward"):
            assert line in text, line
        assert text.count("✓") == 3 and "✗" not in text
    # a pipeline of MoE and dense stages, TP, the local CPU's measured rates: every section adds up
    for w, cluster in ((Workload(from_preset("deepseek-v3"), 4096, 256), Cluster(lookup("H100-SXM"), 8, 32)),
                       (Workload(from_preset("tiny-moe"), 128, 16, "fp32", moe_imbalance=1.5),
                        local_cluster(CPU, 2))):
        plan = search(w, cluster)
        picks = [plan.recommended] + [i for i, r in enumerate(plan.candidates)
                                      if r.get("ep", 1) > 1 and (r["tp"] > 1 or r["pp"] > 1)][:3]
        for i in picks:
            text = explain(plan, i)
            assert text.count("✓") == 3 and "✗" not in text, plan.candidates[i]["label"]


def test_measured_device_prices_the_experts_and_their_exchange():
    cluster = local_cluster(CPU, 2)
    w = Workload(from_preset("tiny-moe"), 128, 16, "fp32")
    c = Candidate("zero3", 2, micro_batch=8, grad_accum=1, ep=2)
    acc, groups = comm_per_step(w, c, 2)
    with_ep = step_time(w, c, cluster, acc, groups)
    plain = Candidate("zero3", 2, micro_batch=8, grad_accum=1)
    acc1, groups1 = comm_per_step(w, plain, 2)
    without = step_time(w, plain, cluster, acc1, groups1)
    assert with_ep.comm_exposed > 0 and with_ep.compute > 0 and without.compute > 0
    fit = CPU.ranks_entry(2)["collectives"]["all_reduce"]
    payload, calls = ep_payload_per_step(w, c)
    assert calls * fit["alpha_s"] + payload / fit["bytes_per_s"] <= with_ep.comm_exposed


# ---------------------------------------------------------------------------------------------
# the recommendations


def test_deepseek_v3_on_256_gpus_fits(capsys):
    assert main(["plan", "--format", "json", "--model", "deepseek-v3", "--gpu", "H100-SXM",
                 "--gpus-per-node", "8", "--nodes", "32"]) == 0
    plan = json.loads(capsys.readouterr().out)
    best = plan["candidates"][plan["recommended"]]
    assert best["fits"] and best["runs_in_loom"] and best["memory_bytes"]["total"] <= 0.8 * 80e9
    assert best["ep"] > 1 and best["strategy"] in ("zero2", "zero3", "hsdp")
    assert plan["model"]["active_params"] == preset("deepseek-v3").num_params(active=True)


def test_deepseek_v3_on_8_gpus_says_what_fits(capsys):
    """667B parameters × 16 bytes / 8 GPUs is 1.3 TB per GPU: nothing loom runs fits on one node; the
    planner names the smallest cluster that does."""
    assert main(["plan", "--model", "deepseek-v3", "--gpu", "H100-SXM", "--gpus-per-node", "8",
                 "--nodes", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "the smallest cluster that fits is" in err, err
