"""Context parallelism: each sequence split over the cp ranks, attention exchanged between them.

The split is balanced for causal attention: a sequence is cut into 2·cp chunks and rank r holds
chunk r and its mirror 2·cp−1−r, so every rank has as many early positions (little to attend to)
as late ones (much): no rank waits for the one holding the end of the sequence.

Two exchanges (`parallel.cp_mode`), both on torch's own point-to-point and all-to-all collectives:
  ring      the k/v of each rank travel around the ring (batch_isend_irecv); each rank computes
            attention of its query chunks against each k/v chunk that is not in their future, with
            the logsumexp, and merges the pieces by online softmax. The next block's transfer runs
            while the current one is computed. Backward passes k/v around again, recomputes each
            piece from the saved output and logsumexp, and sends the dk/dv accumulators (fp32) along
            with them until they are home.
  alltoall  Ulysses: all_to_all_single turns [seq/cp tokens, all heads] into [all tokens, heads/cp]
            before attention and back after it. k/v heads that cp does not divide are repeated to
            the query heads first (grouped-query attention then runs as multi-head).

Packed documents (`data.packing = documents`): attention never crosses a document's end. Every rank
holds the document index of every position of the whole sequence (`Sequence.docs`, from the tokens
every cp rank reads), so each rank builds any piece's mask itself: only k/v travel.

Each piece runs a fused kernel that returns its logsumexp: CPU's flash kernel, CUDA's
memory-efficient kernel (fp32, bf16 and fp16, with a bias for documents). What the CUDA kernel
assumes of its inputs beyond their shapes is written down in `_Efficient`, and
tests/unit/test_cp_kernels.py holds an emulation of that contract that runs on a CPU.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.profiler import record_function

from loom.parallel.sdpa import attend, expand_heads

CP_MODES = ("ring", "alltoall")
RING, ALLTOALL = "cp_ring", "cp_alltoall"  # the exchanges' kinds: profiler ranges, observed collectives
EP_ALLTOALL = "ep_alltoall"  # expert parallelism's dispatch and combine (loom/parallel/expert_parallel.py)
_active = threading.local()


@contextlib.contextmanager
def exchanging(kind: str) -> Iterator[None]:
    """Mark the collectives issued inside as CP's exchange `kind`: a profiler range (the ledger) and
    `active_exchange()` (loom/observe/collectives.py)."""
    _active.kind = kind
    try:
        with record_function(kind):
            yield
    finally:
        _active.kind = None


def active_exchange() -> str | None:
    """The CP exchange being issued on this thread, or None."""
    return getattr(_active, "kind", None)


@dataclass
class ExchangeTally:
    """What this rank's exchanges (CP's; EP's has its own) sent since the last `take`, and the host
    time spent waiting for them (on CPU the exposed exchange; on a GPU the wait is the stream's, not
    the host's)."""

    bytes_sent: int = 0
    wait_s: float = 0.0

    def take(self, prefix: str) -> dict:
        """{"<prefix>_bytes", "<prefix>_wait_s"} (per step: metrics.jsonl), and start again."""
        done = {f"{prefix}_bytes": self.bytes_sent, f"{prefix}_wait_s": self.wait_s}
        self.bytes_sent, self.wait_s = 0, 0.0
        return done


_tally = ExchangeTally()


def take_tally() -> dict:
    """{"cp_bytes", "cp_wait_s"} since the last call (per step: metrics.jsonl), and start again."""
    return _tally.take("cp")


@dataclass(frozen=True)
class ContextGroup:
    """This rank's place among the ranks that share each sequence."""

    group: dist.ProcessGroup | None
    size: int
    rank: int
    mode: str = "ring"

    def peer(self, offset: int) -> int:
        """The global rank `offset` steps along the ring."""
        return dist.get_global_rank(self.group, (self.rank + offset) % self.size)


@dataclass
class Sequence:
    """What attention needs to know of this rank's tokens."""

    positions: torch.Tensor  # [T_local] int64: where this rank's tokens sit in the whole sequence
    docs: torch.Tensor | None  # [B, T] int: each position's document (packing = documents), or None
    cp: ContextGroup | None  # None: the whole sequence is on this rank

    @property
    def chunk(self) -> int:
        return self.positions.numel() // 2 if self.cp is not None else self.positions.numel()

    @functools.cached_property
    def gathered_order(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All-to-all's gathered tokens (each rank's two chunks in rank order): their positions, and
        the permutation that sorts them. Once per sequence, not once per layer."""
        cp, seq_len = self.cp, self.positions.numel() * self.cp.size
        device = self.positions.device
        rank_order = torch.cat([local_positions(seq_len, cp.size, r, device) for r in range(cp.size)])
        return rank_order, torch.argsort(rank_order)


@dataclass(frozen=True)
class SequenceSplit:
    """How a model lays its input sequences out (set on loom's GPT by parallelize): over the cp
    ranks, and into documents by `eos` (packing = documents; None: attention sees the whole window)."""

    cp: ContextGroup | None
    eos: int | None = None

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of x [B, T, ...] (the whole of every sequence on every cp rank)."""
        if self.cp is None:
            return x
        return x.index_select(1, local_positions(x.shape[1], self.cp.size, self.cp.rank, x.device))

    def sequence(self, seq_len: int, tokens: torch.Tensor | None, device) -> Sequence:
        """What attention needs for sequences of `seq_len` tokens; `tokens` [B, T] whole (documents)."""
        cp = self.cp
        positions = local_positions(seq_len, cp.size if cp else 1, cp.rank if cp else 0, device)
        docs = document_ids(tokens, self.eos) if self.eos is not None and tokens is not None else None
        return Sequence(positions, docs, cp)

    def rope_positions(self, seq: Sequence) -> torch.Tensor:
        """Where RoPE places each of this rank's tokens: [T_local], or [B, T_local] with documents
        (positions restart at each document)."""
        if seq.docs is None:
            return seq.positions
        return document_positions(seq.docs)[:, seq.positions]


def chunk_ids(size: int, rank: int) -> tuple[int, int]:
    """The two chunks (of 2·size) that `rank` holds: one from the front, its mirror from the back."""
    return rank, 2 * size - 1 - rank


def local_positions(seq_len: int, size: int, rank: int, device: torch.device | str) -> torch.Tensor:
    """Positions, in the whole sequence of `seq_len` tokens, of the tokens cp rank `rank` of `size`
    holds, in order."""
    if size == 1:
        return torch.arange(seq_len, device=device)
    chunk = seq_len // (2 * size)
    return torch.cat([torch.arange(i * chunk, (i + 1) * chunk, device=device) for i in chunk_ids(size, rank)])


def sequence_share(seq_len: int, cp: ContextGroup | None) -> dict:
    """memory.json's record of the tokens of each sequence this rank holds (nothing when cp = 1)."""
    if cp is None:
        return {}
    chunk = seq_len // (2 * cp.size)
    return {"cp": cp.size, "cp_rank": cp.rank, "cp_mode": cp.mode, "sequence_tokens": 2 * chunk,
            "sequence_positions": [[i * chunk, (i + 1) * chunk] for i in chunk_ids(cp.size, cp.rank)]}


def document_ids(tokens: torch.Tensor, eos: int) -> torch.Tensor:
    """[B, T] tokens -> [B, T] the index of the document each token belongs to: a document ends with
    its EOS, so the next token starts another (no host sync: cumulative sums on the device)."""
    ends = (tokens == eos).to(torch.int32)
    return torch.cumsum(ends, dim=1) - ends


def document_positions(docs: torch.Tensor) -> torch.Tensor:
    """[B, T] document ids -> [B, T] each token's position within its document (RoPE restarts)."""
    steps = torch.arange(docs.shape[1], device=docs.device).expand_as(docs)
    starts = torch.ones_like(docs, dtype=torch.bool)
    starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
    return steps - torch.where(starts, steps, 0).cummax(dim=1).values


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """Causal attention of this rank's queries [B, H, T_local, D] over the whole sequence, k/v
    [B, H_kv, T_local, D] (grouped heads allowed), within documents when `seq.docs` is set."""
    if seq.cp is None:  # documents on one rank: the whole mask, one kernel
        mask = _document_mask(seq.docs, seq.positions, seq.positions)
        return attend(q, k, v, attn_mask=mask)
    if seq.cp.mode == "alltoall":
        return _ulysses(q, k, v, seq)
    return _RingAttention.apply(q, k, v, seq)


def _document_mask(docs: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """[B, 1, Tq, Tk] bool: key at or before the query, in the same document."""
    same = docs[:, q_pos, None] == docs[:, None, k_pos]
    return (same & (k_pos[None, None, :] <= q_pos[None, :, None]))[:, None]


# ---- one piece: queries of one chunk against keys of one chunk, with the logsumexp ----

class _CpuFlash:
    """CPU's flash kernel: takes the mask as a bias and grouped k/v heads as they are."""

    def output(self, q: torch.Tensor) -> torch.Tensor:
        """The fp32 buffer the pieces' outputs merge into."""
        return torch.zeros(q.shape, dtype=torch.float32, device=q.device)

    def forward(self, q, k, v, causal: bool, mask: torch.Tensor | None):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal,
                                                                              attn_mask=_bias(mask, q))
        return out, lse, None

    def backward(self, grad, q, k, v, out, lse, causal: bool, mask: torch.Tensor | None, aux):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, causal, attn_mask=_bias(mask, q))


class _Efficient:
    """CUDA's memory-efficient kernel (fp32, bf16, fp16; takes a bias). Its contract beyond shapes:
    - its half-precision backward computes rowsum(dO·O) itself and reads `out` as if each query row
      were H·D elements after the last, the layout of its own forward's output ([B, T, H, D] in
      memory), whatever out's strides say; fp32 computes that sum outside, by strides. So the
      merged output is kept in that layout, and any other is copied into it;
    - the bias's rows start 16-byte aligned (padded here, then sliced);
    - its logsumexp has its rows padded (to 32), and its backward takes them padded again;
    - k/v have as many heads as q.
    `forward_op`/`backward_op` are the aten ops (a test gives an emulation of the same contract)."""

    def __init__(self, forward_op=None, backward_op=None):
        self.forward_op = forward_op or torch.ops.aten._scaled_dot_product_efficient_attention
        self.backward_op = backward_op or torch.ops.aten._scaled_dot_product_efficient_attention_backward

    def output(self, q: torch.Tensor) -> torch.Tensor:
        b, h, t, d = q.shape
        return torch.zeros(b, t, h, d, dtype=torch.float32, device=q.device).transpose(1, 2)

    def forward(self, q, k, v, causal: bool, mask: torch.Tensor | None):
        k, v = expand_heads(k, q.shape[1]), expand_heads(v, q.shape[1])
        out, lse, seed, offset = self.forward_op(q, k, v, self._bias(mask, q), True, 0.0, causal)
        aux = (seed, offset, lse.shape[-1])  # its RNG state, and its logsumexp's padded length
        if mask is not None:  # rows that see no key: whatever the kernel wrote there, 0
            out = out.masked_fill(~mask.any(-1)[..., None], 0.0)
        return out, lse[..., : q.shape[2]], aux

    def backward(self, grad, q, k, v, out, lse, causal: bool, mask: torch.Tensor | None, aux):
        seed, offset, lse_len = aux
        groups = q.shape[1] // k.shape[1]
        kx, vx = expand_heads(k, q.shape[1]), expand_heads(v, q.shape[1])
        padded = torch.zeros((*lse.shape[:-1], lse_len), dtype=torch.float32, device=lse.device)
        padded[..., : lse.shape[-1]] = lse
        dq, dk, dv, _ = self.backward_op(grad, q, kx, vx, self._bias(mask, q), _rows_packed(out), padded,
                                         seed, offset, 0.0, [True, True, True, False], causal)
        if groups > 1:  # the repeated heads' gradients summed back onto their kv head
            dk, dv = (t.unflatten(1, (k.shape[1], groups)).sum(2) for t in (dk, dv))
        return dq, dk, dv

    @staticmethod
    def _bias(mask: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
        bias = _bias(mask, q, row_multiple=16)  # 16 elements: 16-byte rows in every dtype
        return None if bias is None else bias.expand(q.shape[0], q.shape[1], -1, -1)


def _rows_packed(t: torch.Tensor) -> torch.Tensor:
    """t [B, H, T, D] whose query rows lie H·D elements apart in memory (a view of [B, T, H, D]),
    as the efficient kernel's backward reads its output: t itself when they already do."""
    if t.stride(-1) == 1 and t.stride(1) == t.shape[3] and t.stride(2) == t.shape[1] * t.shape[3]:
        return t
    return t.transpose(1, 2).contiguous().transpose(1, 2)


_KERNELS = {"cpu": _CpuFlash()}  # by device type; anything else: CUDA's efficient kernel
_EFFICIENT = _Efficient()


def _kernel(device: torch.device):
    return _KERNELS.get(device.type, _EFFICIENT)


def _piece_forward(q, k, v, causal: bool, mask: torch.Tensor | None):
    """(out, lse, aux) of one piece; rows that see no key get lse −inf (and out 0), so merging drops
    them. `aux`: what the kernel's backward needs of its forward."""
    out, lse, aux = _kernel(q.device).forward(q, k, v, causal, mask)
    if mask is not None:
        lse = lse.masked_fill(~mask.any(-1), float("-inf"))
    return out, lse, aux


def _piece_backward(grad, q, k, v, out, lse, causal: bool, mask: torch.Tensor | None, aux):
    """(dq, dk, dv) of one piece, given the merged output and logsumexp of the whole row."""
    return _kernel(q.device).backward(grad, q, k, v, out, lse, causal, mask, aux)


def _bias(mask: torch.Tensor | None, q: torch.Tensor, row_multiple: int = 1) -> torch.Tensor | None:
    """A boolean mask as the additive bias the fused kernels take (0 or −inf, in q's dtype), its rows
    starting `row_multiple` elements apart (the storage padded, the view not)."""
    if mask is None:
        return None
    keys = mask.shape[-1]
    padded = -(-keys // row_multiple) * row_multiple
    bias = torch.zeros((*mask.shape[:-1], padded), dtype=q.dtype, device=q.device)[..., :keys]
    return bias.masked_fill_(~mask, float("-inf"))


def _pieces(cp: ContextGroup, source: int):
    """The (query chunk slot, key chunk slot, causal) pieces this rank computes against the k/v of
    rank `source`: keys never in the queries' future; diagonal pieces first, so every row's running
    logsumexp is finite before a piece that may mask a whole row is merged."""
    mine, theirs = chunk_ids(cp.size, cp.rank), chunk_ids(cp.size, source)
    pieces = [(a, b, mine[a] == theirs[b]) for a in range(2) for b in range(2) if theirs[b] <= mine[a]]
    return sorted(pieces, key=lambda p: not p[2])


def _piece_mask(seq: Sequence, source: int, a: int, b: int) -> torch.Tensor | None:
    if seq.docs is None:
        return None
    c = seq.chunk
    q_pos = seq.positions[a * c:(a + 1) * c]
    k_pos = local_positions(2 * c * seq.cp.size, seq.cp.size, source, q_pos.device)[b * c:(b + 1) * c]
    return _document_mask(seq.docs, q_pos, k_pos)


class _Exchange:
    """One step's isend to the next rank and irecv from the previous, of a list of tensors."""

    def __init__(self, cp: ContextGroup, tensors: list[torch.Tensor], tag: int):
        self.received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, cp.peer(1), cp.group, tag) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, cp.peer(-1), cp.group, tag) for t in self.received]
        with exchanging(RING):
            self.works = dist.batch_isend_irecv(ops)
        _tally.bytes_sent += sum(t.numel() * t.element_size() for t in tensors)

    def wait(self) -> list[torch.Tensor]:
        start = time.perf_counter()
        with exchanging(RING):
            for work in self.works:
                work.wait()
        _tally.wait_s += time.perf_counter() - start
        return self.received


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, seq: Sequence):
        cp, c = seq.cp, seq.chunk
        with torch.autocast(q.device.type, enabled=False):
            out = _kernel(q.device).output(q)
            lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
            kv = [k.contiguous(), v.contiguous()]
            aux = []  # per piece, in order: what the kernel's backward needs of its forward
            for step in range(cp.size):
                source = (cp.rank - step) % cp.size
                exchange = _Exchange(cp, kv, tag=0) if step < cp.size - 1 else None
                for a, b, causal in _pieces(cp, source):
                    rows = slice(a * c, (a + 1) * c)
                    keys = slice(b * c, (b + 1) * c)
                    o, piece_lse, piece_aux = _piece_forward(q[:, :, rows], kv[0][:, :, keys],
                                                             kv[1][:, :, keys], causal,
                                                             _piece_mask(seq, source, a, b))
                    _merge(out[:, :, rows], lse[:, :, rows], o, piece_lse)
                    aux.append(piece_aux)
                if exchange is not None:
                    kv = exchange.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.seq, ctx.aux = seq, aux
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        seq = ctx.seq
        cp, c = seq.cp, seq.chunk
        grad = grad.contiguous()
        with torch.autocast(q.device.type, enabled=False):
            dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
            kv = [k.contiguous(), v.contiguous()]
            pending: _Exchange | None = None  # the dk/dv accumulators of the k/v now held, on their way
            aux = iter(ctx.aux)
            for step in range(cp.size):
                source = (cp.rank - step) % cp.size
                exchange = _Exchange(cp, kv, tag=0) if step < cp.size - 1 else None
                dkv = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in kv]
                for a, b, causal in _pieces(cp, source):
                    rows = slice(a * c, (a + 1) * c)
                    keys = slice(b * c, (b + 1) * c)
                    dq_p, dk_p, dv_p = _piece_backward(grad[:, :, rows], q[:, :, rows], kv[0][:, :, keys],
                                                       kv[1][:, :, keys], out[:, :, rows], lse[:, :, rows],
                                                       causal, _piece_mask(seq, source, a, b), next(aux))
                    dq[:, :, rows] += dq_p
                    dkv[0][:, :, keys] += dk_p
                    dkv[1][:, :, keys] += dv_p
                if pending is not None:  # what the ranks before this one added for the same k/v
                    for acc, before in zip(dkv, pending.wait()):
                        acc += before
                pending = _Exchange(cp, dkv, tag=1)
                if exchange is not None:
                    kv = exchange.wait()
            dk, dv = pending.wait()  # this rank's own k/v's, back from their round
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def _merge(out: torch.Tensor, lse: torch.Tensor, piece_out: torch.Tensor, piece_lse: torch.Tensor) -> None:
    """Online softmax, in place: out, lse (views of the running fp32 result) absorb one piece."""
    merged = torch.logaddexp(lse, piece_lse)
    out.mul_(torch.exp(lse - merged).unsqueeze(-1))
    out.add_(piece_out.float() * torch.exp(piece_lse - merged).unsqueeze(-1))
    lse.copy_(merged)


# ---- all-to-all (Ulysses) ----

class _AllToAll(torch.autograd.Function):
    """x [cp, ...]: block i goes to rank i, block j of the result came from rank j. Its own transpose,
    so backward is the same exchange of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad.contiguous(), ctx.group), None


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    out = torch.empty_like(x)
    start = time.perf_counter()
    with exchanging(ALLTOALL):
        dist.all_to_all_single(out, x, group=group)
    _tally.wait_s += time.perf_counter() - start
    _tally.bytes_sent += x.numel() * x.element_size()
    return out


def _heads_to_sequence(x: torch.Tensor, cp: ContextGroup) -> torch.Tensor:
    """[B, H, T_local, D] -> [B, H/cp, T, D]: this rank's share of the heads, every rank's tokens
    (in rank order: each rank's two chunks in turn)."""
    b, h, t, d = x.shape
    blocks = x.reshape(b, cp.size, h // cp.size, t, d).transpose(0, 1).contiguous()
    gathered = _AllToAll.apply(blocks, cp.group)  # [cp (source rank), B, H/cp, T_local, D]
    return gathered.permute(1, 2, 0, 3, 4).reshape(b, h // cp.size, cp.size * t, d)


def _sequence_to_heads(x: torch.Tensor, cp: ContextGroup) -> torch.Tensor:
    """The inverse of _heads_to_sequence."""
    b, hs, t_all, d = x.shape
    blocks = x.reshape(b, hs, cp.size, t_all // cp.size, d).permute(2, 0, 1, 3, 4).contiguous()
    scattered = _AllToAll.apply(blocks, cp.group)  # [cp (head group), B, H/cp, T_local, D]
    return scattered.transpose(0, 1).reshape(b, cp.size * hs, t_all // cp.size, d)


def _ulysses(q, k, v, seq: Sequence) -> torch.Tensor:
    cp = seq.cp
    if k.shape[1] % cp.size:  # grouped k/v heads cp cannot split: repeated to the query heads
        k, v = expand_heads(k, q.shape[1]), expand_heads(v, q.shape[1])
    rank_order, natural = seq.gathered_order  # position of each gathered token, and their sort
    q_all, k_all, v_all = (_heads_to_sequence(t, cp)[:, :, natural] for t in (q, k, v))
    if seq.docs is None:
        out = attend(q_all, k_all, v_all, is_causal=True)
    else:
        every = torch.arange(q_all.shape[2], device=q.device)
        out = attend(q_all, k_all, v_all, attn_mask=_document_mask(seq.docs, every, every))
    return _sequence_to_heads(out[:, :, rank_order], cp)
