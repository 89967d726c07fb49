"""The planner's formulas against independent counts: autograd's saved tensors of loom's block,
its parameters counted off the module, and hand computations for multi-unit FSDP layouts (every
block its own unit: `fsdp_unit_mb = 0`), where zero2 and zero3 differ (with one unit they are
the same numbers, so a test on a tiny model alone cannot tell them apart)."""

from __future__ import annotations

import contextlib

import pytest

from loom.plan.candidate import Candidate, Workload
from loom.plan.comm import comm_per_step
from loom.plan.in_flight import rank_moments
from loom.plan.memory import gpu_memory, model_state_bytes, stage_memory
from loom.plan.shapes import ModelShape, activation_bytes_per_layer, checkpointed_layers, from_preset

# d 64, 4 heads of 16, 2 kv heads, SwiGLU 192, 4 blocks, vocabulary 1000, untied.
SHAPE = ModelShape("hand", vocab_size=1000, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=192)
# By hand: wq 64·64 + wk 64·32 + wv 64·32 + wo 64·64 + w1, w3 64·192 + w2 192·64 + two norms 64.
BLOCK = 4096 + 2048 + 2048 + 4096 + 3 * 12288 + 128  # 49,280
EMBEDDING, HEAD = 1000 * 64, 1000 * 64 + 64  # the head unit holds the final norm too
PSI = 4 * BLOCK + EMBEDDING + HEAD  # 325,184
BF16 = Workload(SHAPE, 32, 8, "bf16")  # global batch 8 = micro-batch 2 × dp 4


def test_counts_by_hand():
    assert (SHAPE.layer_params, SHAPE.num_params) == (BLOCK, PSI) == (49_280, 325_184)
    # Llama 3 8B as Meta publishes it: 8,030,261,248 parameters
    assert from_preset("8b").num_params == 8_030_261_248


def test_block_parameters_are_the_modules():
    from loom.models.gpt.config import preset
    from loom.models.gpt.model import Block

    for d, f, heads, kv in ((64, 192, 4, 2), (96, 256, 6, 3)):
        cfg = preset("tiny", d_model=d, ffn_hidden=f, n_heads=heads, n_kv_heads=kv)
        shape = ModelShape("m", 100, d, 1, heads, kv, f)
        assert shape.layer_params == sum(p.numel() for p in Block(cfg).parameters())


def kept_bytes(run, shared) -> int:
    """Bytes of the tensors autograd keeps for backward while `run()` runs (each storage once), beside
    the `shared` tensors' storages."""
    import torch

    skip = {t.untyped_storage().data_ptr() for t in shared}
    kept: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(kept.values())


def _saved_bytes(block, x, rope, context) -> int:
    """Bytes of the tensors autograd keeps for backward in one block's forward, beside the parameters
    and the RoPE table every block shares."""

    def run():
        with context:
            block(x, rope)

    return kept_bytes(run, [*block.parameters(), rope])


@pytest.mark.parametrize("mode", ["fp32", "bf16", "autocast"])
def test_block_activations_are_what_autograd_keeps(mode):
    """activation_bytes_per_layer (SwiGLU fused with w2: gate, up = 2·e·f) against the saved tensors
    of loom's block, byte for byte, but for what the formula leaves out: under autocast its cached
    16-bit weight copies (which the planner counts among the buffers; not w2's, swiglu_down's own)."""
    import torch

    from loom.models.gpt.config import preset
    from loom.models.gpt.model import Block, rope_tables

    seq, batch = 32, 2
    for d, f, heads, kv in ((64, 192, 4, 2), (128, 320, 8, 8)):
        cfg = preset("tiny", d_model=d, ffn_hidden=f, n_heads=heads, n_kv_heads=kv, max_seq_len=seq)
        shape = ModelShape("m", 100, d, 1, heads, kv, f)
        dtype = torch.bfloat16 if mode == "bf16" else torch.float32
        torch.manual_seed(0)
        block = Block(cfg).to(dtype)
        x = torch.randn(batch, seq, d, dtype=dtype, requires_grad=True)
        rope = rope_tables(cfg.head_dim, seq, 10000.0).to(dtype)  # FSDP2 casts it with the block's input
        context = torch.autocast("cpu", torch.bfloat16) if mode == "autocast" else contextlib.nullcontext()
        measured = _saved_bytes(block, x, rope, context)
        if mode == "bf16":
            measured += rope.untyped_storage().nbytes()  # FSDP2's cast of the table is the block's own
        elem = 4 if mode == "fp32" else 2
        planned = activation_bytes_per_layer(shape, seq, batch, elem, autocast=mode == "autocast")
        left_out = 0
        if mode == "autocast":
            left_out += 2 * shape.autocast_cached_params
        assert measured == planned + left_out, (d, mode, measured, planned)


def test_activation_tally_by_hand():
    """Per token (docstring of activation_bytes_per_layer): fp32 24h + 8kv + 8f + 4a + 8; 16-bit
    weights 12h + 4kv + 4f + 4a + 8 plus FSDP2's 16-bit RoPE table (2·s·head_dim a block); autocast
    16h + 4kv + 4f + 4a + 8; under TP the MLP keeps its product too (12f in fp32)."""
    sb, h, kv, f, a = 32 * 2, 64, 32, 192, 4
    assert activation_bytes_per_layer(SHAPE, 32, 2, 4) == sb * (24 * h + 8 * kv + 8 * f + 4 * a + 8)
    bf16 = sb * (12 * h + 4 * kv + 4 * f + 4 * a + 8)
    assert activation_bytes_per_layer(SHAPE, 32, 2, 2) == bf16 + 2 * 32 * 16
    assert activation_bytes_per_layer(SHAPE, 32, 2, 2, autocast=True) == bf16 + sb * 4 * h
    # TP 2 splits what lies between the column- and row-split linears (q, k, v, out, the MLP, the
    # statistics), not the norms or the linears' inputs
    assert activation_bytes_per_layer(SHAPE, 32, 2, 4, tp=2) == sb * (
        (8 * h + 8 * kv + 12 * f + 4 * a) / 2 + 16 * h + 8)


def test_fsdp_units_by_hand():
    assert Candidate("zero3", 4, fsdp_unit_mb=0).fsdp_unit_params(SHAPE, 4) == [EMBEDDING, *[BLOCK] * 4, HEAD]
    assert Candidate("zero3", 4).fsdp_unit_params(SHAPE, 4) == [PSI]  # 1.3 MB < 25 MB: one root unit
    tied = ModelShape("tied", 1000, 64, 4, 4, 2, 192, tie_embeddings=True)
    # tied: the root unit holds the embedding (= the head) and the final norm, gathered last
    assert Candidate("zero3", 4, fsdp_unit_mb=0).fsdp_unit_params(tied, 4) == [*[BLOCK] * 4, EMBEDDING + 64]


def _moments(strategy: str, unit_mb: float, **kw) -> dict[str, float]:
    named: list = []
    c = Candidate(strategy, 4, micro_batch=2, fsdp_unit_mb=unit_mb, **kw)
    stage_memory(BF16, c, 0, 0.0, "cuda", named)
    return {name: buffers for name, _, buffers in named}


def test_zero2_keeps_every_unit_gathered_until_backward():
    """At backward's start (the loss moment) zero2 holds every unit's bf16 parameters gathered since
    forward, zero3 only the last (the head's); both less the sharded fp32 gradients zero_grad freed
    (4Ψ/N)."""
    sharded_grads = 4 * PSI / 4
    zero2, zero3 = _moments("zero2", 0), _moments("zero3", 0)
    assert zero2["loss"] == 2 * PSI - sharded_grads == 325_184
    assert zero3["loss"] == 2 * HEAD - sharded_grads == -197_056
    # forward's end adds the latest all-gather's flat buffer (the head's unit), freed after the root's
    assert zero2["forward's end"] == zero2["loss"] + 2 * HEAD
    # one unit: the same numbers for both (what a tiny model's tests see)
    assert _moments("zero2", 25) == _moments("zero3", 25)
    # the account's peak (both at forward's end, the logits beside every saved tensor): its buffers
    for strategy, gathered in (("zero2", PSI), ("zero3", HEAD)):
        peak = gpu_memory(BF16, Candidate(strategy, 4, micro_batch=2, fsdp_unit_mb=0), 0.0)
        assert peak.buffers == 2 * gathered + 2 * HEAD - sharded_grads, strategy


def test_model_states_by_hand():
    n = 4
    assert model_state_bytes("ddp", PSI, n).total == 16 * PSI
    zero1 = model_state_bytes("zero1", PSI, n)  # only Adam's m and v sharded
    assert (zero1.params, zero1.grads, zero1.optimizer) == (4 * PSI, 4 * PSI, 8 * PSI / n)
    for s in ("zero2", "zero3"):  # FSDP2: everything sharded at rest
        assert model_state_bytes(s, PSI, n).total == 16 * PSI / n
    paper = model_state_bytes("zero2", PSI, n, "zero", paper_stages=True)  # fp16 params whole
    assert (paper.params, paper.grads, paper.optimizer) == (2 * PSI, 2 * PSI / n, 12 * PSI / n)


def test_comm_bytes_by_hand():
    """Ring bytes a rank sends per step on 4 ranks: all-reduce 2·3/4·Φ, all-gather and reduce-scatter
    3/4·Φ; zero3 gathers the bf16 parameters in forward and again in backward but for the head's
    unit; the gradients reduce in fp32."""
    params, grads = 2 * PSI, 4 * PSI

    def sent(strategy: str) -> tuple[dict, dict]:
        acc, _ = comm_per_step(BF16, Candidate(strategy, 4, micro_batch=2, fsdp_unit_mb=0), 8)
        return acc.by_kind, acc.count_by_kind

    assert sent("ddp")[0] == {"all_reduce": 2 * 3 / 4 * grads}
    assert sent("zero1")[0] == {"all_reduce": 2 * 3 / 4 * grads, "broadcast": 3 / 4 * grads}
    assert sent("zero2") == ({"all_gather": 3 / 4 * params, "reduce_scatter": 3 / 4 * grads},
                             {"all_gather": 6, "reduce_scatter": 6})
    backward = params - 2 * HEAD
    assert sent("zero3") == ({"all_gather": 3 / 4 * (params + backward), "reduce_scatter": 3 / 4 * grads},
                             {"all_gather": 6 + 5, "reduce_scatter": 6})


def test_flops_per_token_by_hand():
    """PaLM's 6N + 12·L·H·Q·T for Llama 3 8B at T = 8192, N without the input embedding (a lookup)."""
    matmul = 8_030_261_248 - 128_256 * 4096
    assert from_preset("8b").flops_per_token(8192) == 6 * matmul + 12 * 32 * 32 * 128 * 8192


def test_pipeline_micro_batches_in_flight_by_hand():
    def in_flight(schedule: str, stage: int, v: int = 1) -> list[int]:
        return [chunk.live for chunk in rank_moments(schedule, 4, v, 8, stage)[0]]

    assert [in_flight("1f1b", s) for s in range(4)] == [[4], [3], [2], [1]]  # p − stage
    assert [in_flight("gpipe", s) for s in range(4)] == [[8]] * 4  # every micro-batch
    # interleaved: (v − 1)·p + 2(p − 1 − r) + 1 forwards, p of a stage in turn
    assert [in_flight("interleaved", s, v=2) for s in range(4)] == [[7, 4], [5, 4], [4, 3], [4, 1]]
    assert [in_flight("zbv", s) for s in range(4)] == [[7, 1], [6, 2], [5, 3], [4, 4]]  # 2p on each rank


def test_checkpointed_layers_by_hand():
    assert checkpointed_layers(5, "full", 2) == 5
    assert checkpointed_layers(5, "selective", 2) == 3  # blocks 0, 2, 4
    assert checkpointed_layers(6, "selective", 3) == 2  # blocks 0, 3
    assert checkpointed_layers(5, "none", 2) == 0
