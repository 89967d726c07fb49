"""Context parallelism for the planner: what splitting each sequence over cp ranks exchanges and holds
(loom/parallel/context_parallel.py runs it; plan/comm.py, memory.py and step.py price it from here).

Each rank holds s_l = s/cp tokens of each of its b sequences (chunk i and its mirror 2cp−1−i, so
causal attention is balanced). B_kv = b·s_l·(kv/tp)·e is one k (or v) block of a rank. Per block
(layer) and micro-batch, as a rank sends it (loom/observe/collectives.py: `send` = the tensor,
`all_to_all` = this rank's input):
  ring      forward: k and v passed on cp−1 hops, 2·(cp−1)·B_kv in 2·(cp−1) sends; backward: k and v
            again plus the fp32 dk, dv accumulators on cp hops (the last brings them home):
            2·(cp−1)·B_kv + 2·cp·B_kv·4/e in 2·(cp−1) + 2·cp sends
  alltoall  (Ulysses) forward: q, k, v and the output, one all_to_all_single each, q and the output
            b·s_l·(h/tp)·e, k and v B_kv (h/tp wide when (n_kv_heads/tp) % cp ≠ 0: repeated to the
            query heads first); backward the same four
A block whose forward is recomputed (activation checkpointing: full, selective's blocks, op) runs
its forward exchange again: the exchange is not saved.
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("ring", "alltoall")  # loom/config.py CP_MODES
KINDS = {"ring": "cp_ring", "alltoall": "cp_alltoall"}  # the CommAccount kinds of the exchange
OBSERVED = {"cp_ring": "send", "cp_alltoall": "all_to_all"}  # what the observer calls each


def split(seq_len: int, cp: int, tp: int, sequence_parallel: bool) -> int:
    """The chunks each sequence is cut into: 2·cp (a front chunk and its mirror per rank), each split
    again over tp under sequence parallel."""
    return 2 * cp * (tp if sequence_parallel and tp > 1 else 1)


def valid(shape, seq_len: int, cp: int, mode: str, tp: int = 1, sequence_parallel: bool = False) -> bool:
    """Whether loom runs this split: the sequence divides into its chunks and, for alltoall, the
    heads of a TP rank divide over the cp ranks."""
    if cp == 1:
        return True
    if not shape.known or seq_len % split(seq_len, cp, tp, sequence_parallel):
        return False
    return mode == "ring" or shape.n_heads % (cp * tp) == 0


def kv_width(shape, tp: int, cp: int, mode: str) -> float:
    """The width of the k and v a rank exchanges: kv/tp, or h/tp when Ulysses repeats them to the
    query heads first (a TP rank's kv heads do not divide over cp)."""
    if mode == "alltoall" and (shape.n_kv_heads // tp) % cp:
        return shape.d_model / tp
    return shape.kv_dim / tp


@dataclass(frozen=True)
class Exchange:
    """One block's exchange for one micro-batch, as a rank sends it: payload bytes and the
    operations carrying them (sends, or all_to_alls), in forward and in backward; `hops`, the
    latencies each direction pays."""

    mode: str
    block: float  # B_kv, or (alltoall) one q-sized input
    forward: float
    backward: float
    forward_ops: int
    backward_ops: int
    forward_hops: int
    backward_hops: int


def exchange(shape, seq_local: int, micro_batch: int, elem: int, tp: int, cp: int, mode: str) -> Exchange:
    """The exchange of one block, one micro-batch (the module's docstring)."""
    tokens = micro_batch * seq_local
    b_kv = tokens * kv_width(shape, tp, cp, mode) * elem
    if mode == "ring":
        forward = 2 * (cp - 1) * b_kv
        backward = forward + 2 * cp * b_kv * 4 / elem  # dk, dv accumulated in fp32
        sends = 2 * (cp - 1)
        return Exchange(mode, b_kv, forward, backward, sends, sends + 2 * cp, cp - 1, 2 * cp - 1)
    q = tokens * shape.d_model / tp * elem  # q and the output
    both = 2 * q + 2 * b_kv
    return Exchange(mode, q, both, both, 4, 4, 4, 4)


def ring_transients(shape, seq_local: int, micro_batch: int, elem: int, tp: int) -> tuple[float, float]:
    """(forward, backward) bytes one ring attention holds beyond its saved tensors: forward two k/v
    blocks in flight (the one computed on, the next received), 2·2·B_kv, and its fp32 output and
    log-sum-exp accumulators, b·s_l·(h/tp)·4 + b·s_l·(a/tp)·4; backward the k/v in flight as forward,
    six fp32 dk, dv blocks (this hop's, the last hop's on their way out, the next hop's arriving),
    6·b·s_l·(kv/tp)·4, the fp32 dq accumulator, the output gradient made contiguous and one piece's
    gradients (half the queries, one key chunk), b·s_l·(h/tp)·(4 + e + e/2) + b·s_l·(kv/tp)·e
    (loom/parallel/context_parallel.py's _RingAttention; measured within 6% at 2 × 2048 tokens)."""
    tokens = micro_batch * seq_local
    b_kv = tokens * shape.kv_dim / tp * elem
    forward = 4 * b_kv + tokens * (shape.d_model + shape.n_heads) / tp * 4
    dkv_and_dq = 6 * tokens * shape.kv_dim / tp * 4 + tokens * shape.d_model / tp * 4
    backward = 4 * b_kv + dkv_and_dq + tokens * shape.d_model / tp * 1.5 * elem + b_kv
    return forward, backward


def block_attention_flops(shape, seq_local: int, micro_batch: int, tp: int) -> float:
    """Forward FLOPs of one hop's attention on a rank: its b·s_l queries against one block of s_l
    keys, 4·(a/tp)·Q·s_l per query (the planner's 12·L·H·Q·T split: a third in forward); backward
    twice that."""
    return 4 * (shape.n_heads / tp) * shape.head_dim * seq_local * micro_batch * seq_local


def ring_exposed(ex: Exchange, rate: float, alpha: float, block_forward: float, overlap: bool,
                 elem: int) -> tuple[float, float]:
    """(forward, backward) seconds one block's ring exchange adds to the critical path: each hop's
    transfer overlaps the attention of the block in hand (the next block arrives while this one is
    computed), so only max(0, transfer − block compute) is exposed, plus one latency α per hop. In
    backward cp−1 hops carry k/v and the previous block's dk/dv beside the block's backward (twice its
    forward), and the last hop brings dk/dv home with nothing to hide behind. `overlap` False (a CPU,
    whose cores compute and send): every transfer is exposed."""
    cp = ex.forward_hops + 1
    kv = 2 * ex.block / rate
    dkv = 2 * ex.block * 4 / elem / rate
    hidden_f, hidden_b = (block_forward, 2 * block_forward) if overlap else (0.0, 0.0)
    forward = (cp - 1) * (max(0.0, kv - hidden_f) + alpha)
    backward = (cp - 1) * max(0.0, kv + dkv - hidden_b) + dkv + ex.backward_hops * alpha
    return forward, backward


def alltoall_seconds(ex: Exchange, share: float, rate: float, alpha: float) -> float:
    """Seconds of one direction's four all_to_alls of a block (on the critical path): `share` of
    their inputs at `rate` ((cp−1)/cp on a link: each keeps its own share; 1 at a rate measured per
    payload byte), and α each."""
    return share * ex.forward / rate + ex.forward_ops * alpha
