"""Muon in the plan (loom/train/muon.py): the states it keeps, the whole matrices it moves and the
Newton-Schulz FLOPs it runs, per rank.

- States: one momentum per matrix where AdamW keeps two moments: a Muon parameter holds the
  recipe's optimizer bytes less 4 (torch's recipe: 4 bytes, not 8).
- Work: each m × n matrix (m ≤ n: the iteration runs on the wide side) costs
  ns_steps · (4m²n + 2m³) FLOPs (X·Xᵀ, its square, the product with X). ddp iterates every matrix
  on every rank; ZeRO-1 and FSDP2's owners 1/N of them; FSDP2 × TP every whole matrix on every
  rank; a rank's experts where they are, each alone.
- Exchange (FSDP2: zero2, zero3, hsdp, cp's shards; or TP alone): the M matrices split over a group
  of G ranks go to their owners G at a time, two all-to-alls a batch: 2·⌈M/G⌉ all-to-alls carrying
  about 2·e·Ψ_split/G bytes of a rank's input (its shards, then its owned results; e the
  iteration's bytes). FSDP2 × TP gathers each matrix whole instead: an all-gather per split mesh
  dim, in the momentum's fp32, outputting 4·(Ψ_m/tp + Ψ_m) bytes a rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.plan import lora
from loom.plan.shapes import ModelShape

KIND = "all_to_all"  # how loom observes its exchange (loom/observe/collectives.py)


@dataclass(frozen=True)
class Muon:
    ns_steps: int = 5
    ns_bytes: int = 2  # muon.ns_dtype's: what is iterated and exchanged


def from_config(cfg) -> Muon | None:
    if cfg.train.optimizer != "muon":
        return None
    return Muon(cfg.muon.ns_steps, 2 if cfg.muon.ns_dtype == "bf16" else 4)


@dataclass(frozen=True)
class Matrices:
    """A stage's Muon matrices as (count, rows, cols, split over TP): the routed experts apart (each
    expert's matrix whole where the experts lie, never split over TP)."""

    dense: tuple[tuple[int, int, int, bool], ...]
    routed: tuple[tuple[int, int, int, bool], ...]

    @property
    def dense_params(self) -> int:
        return sum(k * r * c for k, r, c, _ in self.dense)

    @property
    def routed_params(self) -> int:
        return sum(k * r * c for k, r, c, _ in self.routed)

    @property
    def params(self) -> int:
        return self.dense_params + self.routed_params

    def rank_dense_params(self, tp: int) -> float:
        """The dense matrices' parameters a TP rank holds (before data-parallel sharding)."""
        return sum(k * r * c / (tp if split else 1) for k, r, c, split in self.dense)


def block_matrices(shape: ModelShape, layer: int) -> tuple[list, list]:
    """Block `layer`'s matrices Muon steps: (the rest, the routed experts). TP splits attention's and
    a dense SwiGLU's; an MoE block's feed-forward is whole on each TP rank."""
    d, kv = shape.d_model, shape.kv_dim
    dense = [(1, d, d, True), (1, kv, d, True), (1, kv, d, True), (1, d, d, True)]  # wq, wk, wv, wo
    routed = []
    if shape.is_moe(layer):
        e, h = shape.moe_experts, shape.moe_hidden
        routed = [(e, h, d, False), (e, h, d, False), (e, d, h, False)]  # each expert's w1, w3, w2
        s = shape.moe_shared_hidden
        if s:
            dense += [(1, s, d, False), (1, s, d, False), (1, d, s, False)]
    else:
        f = shape.ffn_hidden
        dense += [(1, f, d, True), (1, f, d, True), (1, d, f, True)]
    return dense, routed


def _adapters(roles, linears: dict, rank: int, count: int, split: bool) -> list:
    """A [r, in] and B [out, r] of each role's linear; under TP (`split`) a column linear's B and a row
    linear's A are split (plan/lora.py's layout), the other whole."""
    out = []
    for role in roles:
        inp, outp, how = linears[role]
        out += [(count, rank, inp, split and how == lora.ROW),
                (count, outp, rank, split and how == lora.COLUMN)]
    return out


def lora_block_matrices(shape: ModelShape, adapters, layer: int) -> tuple[list, list]:
    """Under LoRA the trained matrices are the adapters (the base is frozen): A and B of each adapted
    linear, the routed experts' stacked [E, r, in], [E, out, r]."""
    moe = shape.is_moe(layer)
    r = adapters.rank
    roles = [t for t in adapters.targets if t in lora.ATTENTION or not moe]
    dense = _adapters(roles, lora.linears(shape), r, 1, True)
    routed = []
    if moe:
        if shape.moe_shared_hidden:
            shared = lora.linears(shape, shape.moe_shared_hidden)
            dense += _adapters(adapters.shared_targets, shared, r, 1, False)
        routed = _adapters(adapters.expert_targets, lora.linears(shape, shape.moe_hidden), r,
                           shape.moe_experts, False)
    return dense, routed


def stage_matrices(shape: ModelShape, stage: int, stages: int, adapters=None) -> Matrices:
    """The Muon matrices of pipeline stage `stage`: the blocks' (or, under LoRA, their adapters)."""
    start, layers = shape.stage_layers(stage, stages)
    dense, routed = [], []
    for layer in range(start, start + layers):
        d, r = (block_matrices(shape, layer) if adapters is None
                else lora_block_matrices(shape, adapters, layer))
        dense += d
        routed += r
    return Matrices(tuple(dense), tuple(routed))


def ns_flops(rows: int, cols: int, steps: int) -> float:
    """One matrix's Newton-Schulz FLOPs: steps × (4m²n + 2m³), m ≤ n: X·Xᵀ (2m²n), its square (2m³),
    the product with X (2m²n)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m ** 3)


def runs(strategy, tp: int, offload: str) -> bool:
    """Whether loom runs Muon on this layout (loom/config.py's checks): not under ZeRO-1 with TP (it
    steps each TP shard alone), and not offloaded (its exchange runs on the device)."""
    return offload == "none" and not (strategy.shards_optimizer_only and tp > 1)


def rank_state_params(shape: ModelShape, c, stage: int = 0, adapters=None) -> tuple[float, float]:
    """(Muon parameters of the stage but its routed experts, of its routed experts) one rank holds
    before data-parallel sharding: the dense ones after TP's split, the routed E/ep of them."""
    mats = stage_matrices(shape, stage, c.pp, adapters)
    return mats.rank_dense_params(c.tp), mats.routed_params / c.ep


@dataclass(frozen=True)
class Exchange:
    kind: str  # all_to_all (owners'), or all_gather (FSDP2 × TP's whole matrices)
    group: int  # the ranks each spans
    # bytes of a rank's payload per step, as loom observes it (all-to-all: input; all-gather: output)
    payload: float
    count: int  # collectives per step


@dataclass(frozen=True)
class Cost:
    flops: float  # Newton-Schulz FLOPs a rank runs per step
    exchanges: tuple[Exchange, ...] = ()

    @property
    def payload(self) -> float:
        return sum(e.payload for e in self.exchanges)

    @property
    def count(self) -> int:
        return sum(e.count for e in self.exchanges)

    @property
    def kind(self) -> str:
        return self.exchanges[0].kind if self.exchanges else KIND

    @property
    def group(self) -> int:
        return max((e.group for e in self.exchanges), default=1)


def _owners(matrices, group: int, ns_bytes: int) -> Exchange | None:
    """The owners' exchange of `matrices` split over `group` ranks: ⌈M/G⌉ batches of two all-to-alls,
    a rank's input its shards (Ψ/G) and then its owned results (Ψ/G on average), e bytes each."""
    count = sum(k for k, _, _, _ in matrices)
    if group <= 1 or not count:
        return None
    params = sum(k * r * col for k, r, col, _ in matrices)
    return Exchange(KIND, group, 2 * ns_bytes * params / group, 2 * -(-count // group))


def rank_cost(shape: ModelShape, c, muon: Muon, stage: int = 0, adapters=None) -> Cost:
    """What one rank of pipeline stage `stage` runs and sends for Muon per step (`adapters`: the
    workload's LoRA, whose adapters are the matrices)."""
    mats = stage_matrices(shape, stage, c.pp, adapters)
    steps = muon.ns_steps
    split = [m for m in mats.dense if m[3] and c.tp > 1]  # split over TP
    whole = [m for m in mats.dense if not (m[3] and c.tp > 1)]  # whole on each TP rank

    def flops(ms) -> float:
        return sum(k * ns_flops(r, col, steps) for k, r, col, _ in ms)

    # a rank's experts (E/ep of them), over the ranks sharding them along the experts (N_e)
    routed_flops = flops(mats.routed) / (c.ep * c.expert_shard_size)
    fsdp = c.strategy_info.shards_params
    n = c.shard_size if (fsdp or c.strategy_info.shards_optimizer_only) else 1
    if not fsdp:  # ddp (owners over TP for TP's splits), ZeRO-1 (the owner of each matrix's state, tp = 1)
        ex = _owners(split, c.tp, muon.ns_bytes)
        return Cost(flops(whole) / n + flops(split) / c.tp + routed_flops, (ex,) if ex else ())
    exchanges = [_owners(whole, n, muon.ns_bytes)]
    split_flops = flops(split) / n
    if split and n > 1:  # FSDP2 × TP: gathered whole over the shards, then TP (fp32), iterated everywhere;
        # an all-gather's payload is what it outputs (loom/observe/collectives.py)
        params = sum(k * r * col for k, r, col, _ in split)
        exchanges.append(Exchange("all_gather", n * c.tp, 4 * (params / c.tp + params),
                                  2 * sum(k for k, _, _, _ in split)))
        split_flops = flops(split)
    elif split:  # FSDP2 over one rank, TP's splits: owners over TP
        exchanges.append(_owners(split, c.tp, muon.ns_bytes))
        split_flops = flops(split) / c.tp
    return Cost(flops(whole) / n + split_flops + routed_flops, tuple(e for e in exchanges if e))


def workload_cost(w, c) -> Cost:
    """rank_cost of a workload on a candidate: its heaviest stage's (the one plan/comm.py syncs)."""
    stage = max(w.shape.priced_stages(c.pp), key=lambda s: w.shape.stage_params(s, c.pp))
    return rank_cost(w.shape, c, w.muon, stage, w.lora)
