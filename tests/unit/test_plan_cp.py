"""The planner's context parallelism (plan/context.py): activations per rank for s/cp tokens, model
states sharded over the cp ranks like dp, the exchange's payloads worked by hand, what is and is not a
candidate, the long-sequence recommendation, and the emitted config's round trip."""

from __future__ import annotations

import json

import pytest

from loom.cli import main
from loom.config import load_config, resolve_dims
from loom.errors import ConfigError
from loom.plan import context
from loom.plan.candidate import Candidate, Workload
from loom.plan.comm import comm_per_step
from loom.plan.efficiency import link_efficiency
from loom.plan.hardware import Cluster, lookup
from loom.plan.memory import gpu_memory, stage_memory
from loom.plan.search import config_candidate, emit_config, enumerate_candidates, estimate
from loom.plan.shapes import ModelShape, activation_bytes_per_layer, from_preset
from loom.plan.step import step_time

# h = 64, 4 heads of 16, 2 kv heads: kv = 32
SHAPE = ModelShape("cp", vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128)
H100 = Cluster(lookup("H100-SXM"), 8, 1)


def bf16(seq: int, batch: int = 8, shape: ModelShape = SHAPE) -> Workload:
    return Workload(shape, seq, batch, "bf16", "torch", 0)


def payload(w: Workload, c: Candidate) -> dict:
    acc, _ = comm_per_step(w, c, 8)
    return acc.payload_dict()


def test_activations_per_rank_are_those_of_seq_over_cp():
    """Every per-token term is priced for s/cp tokens: a block's activations ÷ cp exactly, and the whole
    account of cp ranks on s tokens is that of one rank on s/cp (same N; alltoall: no ring transients),
    but for wo's copy of the attention's output, which the split leaves head-major (measured on gloo:
    bench/context_parallel.py, 1.12 of the plan without it)."""
    s = 256
    for cp in (2, 4):
        per_rank = activation_bytes_per_layer(SHAPE, s // cp, 1, 2)
        assert per_rank * cp == activation_bytes_per_layer(SHAPE, s, 1, 2)
        split = stage_memory(bf16(s), Candidate("zero3", 8 // cp, micro_batch=1, grad_accum=1, cp=cp,
                                                 cp_mode="alltoall"), 0)
        whole = stage_memory(bf16(s // cp), Candidate("zero3", 8, micro_batch=1, grad_accum=1), 0)
        # and, split, each block's attention output comes back head-major: wo keeps a sequence-major copy
        copy = SHAPE.n_layers * (s // cp) * SHAPE.d_model * 2
        assert split.activations == pytest.approx(whole.activations + copy)
        assert split.model_states == pytest.approx(whole.model_states)
    # and the activations themselves fall with cp
    one, four = (gpu_memory(bf16(s), Candidate("zero3", 8 // cp, cp=cp, cp_mode="alltoall"), 0).activations
                 for cp in (1, 4))
    assert four < one / 3


def test_ring_transients_are_a_moment_of_the_step():
    """Ring attention's k/v blocks in flight and fp32 accumulators: priced as moments, by hand."""
    moments: list = []
    c = Candidate("zero3", 2, cp=4, cp_mode="ring", fsdp_unit_mb=0)
    stage_memory(bf16(256), c, 0, moments=moments)
    named = {name: act for name, act, _ in moments}
    tokens = 256 // 4
    forward = 4 * tokens * 32 * 2 + tokens * (64 + 4) * 4  # 2·2·B_kv + fp32 out + lse
    # 2·2·B_kv + six fp32 dk, dv blocks + fp32 dq, the 16-bit output gradient and a piece's dq + its dk, dv
    backward = 4 * tokens * 32 * 2 + 6 * tokens * 32 * 4 + tokens * 64 * (4 + 3) + tokens * 32 * 2
    assert context.ring_transients(SHAPE, tokens, 1, 2, 1) == (forward, backward)
    assert {"ring forward", "ring backward"} <= named.keys()
    assert named["ring backward"] - named["ring forward"] == pytest.approx(backward - forward)
    alltoall: list = []
    ulysses = Candidate("zero3", 2, cp=4, cp_mode="alltoall", fsdp_unit_mb=0)
    stage_memory(bf16(256), ulysses, 0, moments=alltoall)
    assert not {"ring forward", "ring backward"} & {name for name, _, _ in alltoall}


@pytest.mark.parametrize("strategy, dp, cp, like", [("ddp", 2, 4, 8), ("zero1", 2, 4, 8), ("zero2", 4, 2, 8),
                                                     ("zero3", 1, 8, 8)])
def test_model_states_shard_over_cp_like_dp(strategy, dp, cp, like):
    """The cp ranks of a dp index hold one model: FSDP2 shards over dp_shard × cp, ZeRO-1's optimizer
    over dp × cp, ddp replicates; per-rank states are those of dp·cp data-parallel ranks."""
    w = bf16(256)
    split, plain = Candidate(strategy, dp, cp=cp), Candidate(strategy, like)
    assert split.world == plain.world == 8
    assert split.shard_size == plain.shard_size
    assert gpu_memory(w, split, 0.0).model_states == pytest.approx(gpu_memory(w, plain, 0.0).model_states)
    # and the gradients are synced over dp·cp ranks: the same data-parallel collectives
    one, other = comm_per_step(w, split, 8)[0], comm_per_step(w, plain, 8)[0]
    dp_kinds = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
    assert {k: one.by_kind[k] for k in dp_kinds if k in one.by_kind} == \
        pytest.approx({k: other.by_kind[k] for k in dp_kinds if k in other.by_kind})


def test_hsdp_shards_over_dp_shard_times_cp():
    c = Candidate("hsdp", 4, dp_shard=2, cp=2)  # 2 replicas × (2 dp_shard × 2 cp) = 8 ranks
    assert (c.world, c.shard_size, c.replicate_size) == (8, 4, 2)


def test_ring_payload_by_hand():
    """s = 32 over cp = 2: s/cp = 16 tokens, B_kv = 16·32·2 = 1024 bytes. Per block: forward 2·(cp−1)·B_kv
    = 2048, backward 2048 + 2·cp·B_kv·4/e = 2048 + 8192 = 10240; 2 blocks → 24576 bytes, in
    2·(2 + 6) = 16 sends. ac full repeats the forward exchange: + 2·2048."""
    w = bf16(32, batch=4)
    c = Candidate("zero3", 4, micro_batch=1, grad_accum=1, cp=2, cp_mode="ring")
    got = payload(w, c)
    assert got["payload_bytes_by_kind"]["cp_ring"] == 24576
    assert got["count_by_kind"]["cp_ring"] == 16
    assert "cp_alltoall" not in got["payload_bytes_by_kind"] and "send" not in got["payload_bytes_by_kind"]
    acc, groups = comm_per_step(w, c, 8)
    assert acc.by_kind["cp_ring"] == groups["cp"] == 24576  # a send's wire bytes are its payload
    full = payload(w, Candidate("zero3", 4, micro_batch=1, grad_accum=1, activation_checkpointing="full",
                                cp=2))
    assert full["payload_bytes_by_kind"]["cp_ring"] == 24576 + 2 * 2048
    # cp = 4: s/cp = 8, B_kv = 512: forward 2·3·512 = 3072, backward 3072 + 2·4·512·2 = 11264
    four = payload(w, Candidate("zero3", 2, micro_batch=1, grad_accum=2, cp=4))
    assert four["payload_bytes_by_kind"]["cp_ring"] == 2 * 2 * (3072 + 11264)  # 2 micro-steps × 2 blocks


def test_alltoall_payload_by_hand():
    """Ulysses, cp = 2: s/cp = 16 tokens; q and the output 16·64·2 = 2048 bytes, k and v 16·32·2 = 1024:
    4 all_to_alls of 6144 bytes a pass, forward and backward, 2 blocks → 24576 bytes in 16. cp = 4: the
    2 kv heads do not divide over 4 ranks, so k and v go repeated, h wide: 8·64·2 = 1024 each, as q."""
    w = bf16(32, batch=4)
    got = payload(w, Candidate("zero3", 4, micro_batch=1, grad_accum=1, cp=2, cp_mode="alltoall"))
    assert got["payload_bytes_by_kind"]["cp_alltoall"] == 24576
    assert got["count_by_kind"]["cp_alltoall"] == 16
    c = Candidate("zero3", 2, micro_batch=1, grad_accum=1, cp=4, cp_mode="alltoall")
    assert context.kv_width(SHAPE, 1, 4, "alltoall") == 64
    assert payload(w, c)["payload_bytes_by_kind"]["cp_alltoall"] == 2 * 2 * 4 * 1024
    acc, _ = comm_per_step(w, c, 8)
    assert acc.by_kind["cp_alltoall"] == pytest.approx(3 / 4 * 16384)  # each keeps its own share


def test_ring_hides_its_transfers_behind_attention_and_alltoall_does_not():
    """A long sequence: each ring hop's k/v transfer is shorter than its block's attention, so only the
    latencies are exposed; Ulysses' all_to_alls are on the critical path."""
    shape = from_preset("8b")
    w = Workload(shape, 65536, 8, "bf16", "torch", 512)
    ring = Candidate("zero3", 1, micro_batch=1, grad_accum=8, activation_checkpointing="full", cp=8)
    comm, groups = comm_per_step(w, ring, 8)
    t = step_time(w, ring, H100, comm, groups)
    layers, hops = 32, (8 - 1) + (2 * 8 - 1) + (8 - 1)  # forward, backward, the recomputed forward
    latency = H100.gpu.intra_node_latency_s
    link = H100.gpu.intra_node_gbps * 1e9 * link_efficiency(H100.gpu)
    dkv_home = 2 * 1 * 8192 * 1024 * 2 * 2 / link  # the last hop brings the fp32 dk, dv home
    assert t.comm_exposed == pytest.approx(8 * layers * (hops * latency + dkv_home), rel=1e-6)
    alltoall = Candidate("zero3", 1, micro_batch=1, grad_accum=8, activation_checkpointing="full", cp=8,
                         cp_mode="alltoall")
    comm, groups = comm_per_step(w, alltoall, 8)
    exposed = step_time(w, alltoall, H100, comm, groups).comm_exposed
    per_pass = 7 / 8 * (2 * 8192 * 4096 * 2 + 2 * 8192 * 1024 * 2) / link + 4 * latency  # every byte exposed
    assert exposed == pytest.approx(8 * (2 * layers + layers) * per_pass, rel=1e-6)
    ex = context.exchange(shape, 8192, 1, 2, 1, 8, "ring")
    no_overlap = context.ring_exposed(ex, 1e9, 0.0, 1.0, False, 2)  # a CPU: nothing hides, even 1 s blocks
    assert no_overlap[0] == pytest.approx(2 * 7 * 8192 * 1024 * 2 / 1e9)
    assert no_overlap[1] == pytest.approx(ex.backward / 1e9)


def test_alltoall_needs_heads_that_divide_and_the_split_must_divide_the_sequence():
    assert context.valid(SHAPE, 32, 4, "alltoall") and not context.valid(SHAPE, 32, 8, "alltoall")
    assert context.valid(SHAPE, 32, 8, "ring") and not context.valid(SHAPE, 24, 8, "ring")  # 24 % 16
    assert not context.valid(SHAPE, 32, 4, "alltoall", tp=2)  # 4 heads over cp·tp = 8
    assert context.valid(SHAPE, 24, 4, "ring", tp=2)  # 24 % (2·4)
    assert not context.valid(SHAPE, 24, 4, "ring", tp=2, sequence_parallel=True)  # 24 % (2·4·2)
    found = {(c.cp, c.cp_mode, c.tp) for c in enumerate_candidates(bf16(64), H100)}
    assert (8, "ring", 1) in found and (8, "alltoall", 1) not in found
    assert (4, "alltoall", 1) in found and (4, "alltoall", 2) not in found and (2, "alltoall", 2) in found


def test_deepspeed_does_not_run_context_parallelism():
    c = Candidate("zero2", 2, cp=2, framework="deepspeed")
    assert c.engine == "deepspeed" and not c.runs_in_loom
    assert Candidate("zero2", 2, framework="deepspeed").runs_in_loom
    assert not any(c.engine == "deepspeed" for c in enumerate_candidates(bf16(64), H100) if c.cp > 1)
    record = estimate(bf16(64), c, H100)
    with pytest.raises(ConfigError, match="splits sequences"):
        emit_config(load_config(None), record)


def _plan(capsys, seq: int) -> dict:
    assert main(["plan", "--format", "json", "--gpu", "H100-SXM", "--model", "8b",
                 "--set", f"data.seq_len={seq}"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_long_sequence_is_split_and_a_short_one_is_not(capsys):
    """llama3-8b at 131,072 tokens on 8 × H100: the sequence is what does not fit, CP is recommended;
    at 4096 the recommendation is what it was before CP (zero2, no alternative splits the sequence)."""
    long = _plan(capsys, 131072)
    best = long["candidates"][long["recommended"]]
    assert best["cp"] > 1 and best["fits"] and best["runs_in_loom"], best["label"]
    short = _plan(capsys, 4096)
    best = short["candidates"][short["recommended"]]
    assert (best["label"], best["cp"]) == ("zero2", 1)
    assert all(short["candidates"][i]["cp"] == 1 for i in short["recommendable"])


@pytest.mark.parametrize("strategy, dp, shard, tp, cp, mode", [
    ("zero3", 2, 0, 1, 4, "ring"), ("zero2", 1, 0, 2, 2, "alltoall"), ("hsdp", 4, 2, 1, 2, "ring"),
    ("zero1", 4, 0, 1, 2, "alltoall"), ("zero3", 8, 0, 1, 1, "ring")])
def test_emit_round_trips(strategy, dp, shard, tp, cp, mode):
    """emit_config writes parallel.cp and cp_mode; the config read back is the same candidate."""
    w = bf16(256, batch=16)
    c = Candidate(strategy, dp, tp, dp_shard=shard, micro_batch=2, grad_accum=16 // dp // 2,
                  sequence_parallel=tp > 1, cp=cp, cp_mode=mode)
    cfg = emit_config(load_config(None), estimate(w, c, Cluster(lookup("H100-SXM"), 4, 2)))
    assert (cfg.parallel.cp, cfg.parallel.cp_mode) == (cp, mode)
    cfg.train.batch_size = w.global_batch
    dims = resolve_dims(cfg.parallel, c.world)
    assert dims.cp == cp
    assert config_candidate(cfg, dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp) == c
    assert config_candidate(cfg, dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp, cp) == c


def test_tp_and_pp_move_a_ranks_share_of_the_sequence():
    """TP's reductions and PP's sends carry a rank's s/cp tokens: those of the sequence s/cp unsplit."""
    w, half = bf16(256), bf16(128)
    for kw in ({"tp": 2, "sequence_parallel": True}, {"pp": 2, "schedule": "1f1b", "grad_accum": 2}):
        split = comm_per_step(w, Candidate("zero3", 2, cp=2, **kw), 8)[1]
        whole = comm_per_step(half, Candidate("zero3", 2, **kw), 8)[1]
        assert (split["tp"], split["pp"]) == (whole["tp"], whole["pp"]) and split["tp"] + split["pp"] > 0
