"""Bytes each GPU sends per optimizer step, by collective and by link.

Ring algorithms: all-reduce sends 2(N−1)/N·Φ, all-gather and reduce-scatter (N−1)/N·Φ each
(Φ = the full tensor), broadcast (N−1)/N·Φ; pipeline point-to-point sends each activation once.
What the engines issue per step (as loom runs them; `loom train` measures the same counts):
  ddp    one all-reduce of the fp32 gradients (no_sync on the non-final micro-steps; under TP or EP
         FSDP2 replicates the model, and syncs on the last micro-step too)
  zero1  ddp's all-reduce + the broadcast of each rank's updated partition
  zero2  an all-gather of the parameters per micro-step (FSDP2 reshards after backward) and a
         reduce-scatter of the gradients per micro-step (parallel.reduce_every_micro_step; false:
         one per step)
  zero3  zero2 + a second all-gather in backward (resharded after forward), except the unit of the
         final norm and head, which stays gathered from forward to backward
  hsdp   zero3 within the shard group + an all-reduce of the gradient shards across replicas
  tp     per block and micro-batch two all-reduces of the activations in forward and two in
         backward, one more in a checkpointed block's recompute (sequence parallel: an all-gather
         and a reduce-scatter for each, the same bytes); one each for the vocabulary-split
         embedding and head
  pp     each micro-batch's activation to the next stage in forward, its gradient back in backward;
         FSDP2 within it gathers a stage's units once a step, but zero3 under 1F1B or GPipe in each
         micro-batch's forward and once in backward
  cp     per block and micro-batch the attention's exchange (plan/context.py: ring sends, or
         Ulysses' all_to_alls), again for a recomputed block's forward; the gradients of the
         data-parallel collectives above are synced over dp·cp ranks (the cp ranks hold one model)
  ep     per MoE block and micro-batch the dispatch's all_to_alls (plan/experts.py: the split counts,
         the tokens' rows out and back, forward and backward), again for a recomputed block's
         forward; the routed experts' gradients are synced apart, over the edp = dp/ep ranks holding
         the same experts (ddp: all-reduce; FSDP2: their own units' all-gathers and reduce-scatters
         over N_e = N/ep), the rest of the model's as above
  LoRA   (plan/lora.py) the same collectives, but only what trains has gradients: the all-reduce
         or reduce-scatter carries the trainable parameters' fp32 4·Ψ_lora (a unit with nothing
         trainable reduces nothing), zero1 broadcasts only them; FSDP2 gathers the frozen base with
         the adapters (in the compute dtype), and in backward only the units after the first that
         trains (before it no output needs a gradient)
A group lies within a node when its ranks fit in one (TP innermost, then CP, dp_shard, dp_replicate,
PP outermost); otherwise its bytes are counted on the inter-node link.

Beside the bytes sent (a model: the ring factors), the account keeps what a rank can observe,
the payload Φ per collective kind (as loom/observe/collectives.py counts it) and, where the plan knows
it, how many collectives carry it: FSDP2 issues one per unit (a block, the embedding, norm + head)
and TP and PP one per activation, but DDP's buckets and ZeRO-1's per-parameter broadcasts are
the engine's choice (None). Groups of one rank issue nothing, but FSDP2's all-reduce across replicas
and ZeroRedundancyOptimizer's broadcasts (a payload, no bytes on the wire). Left out of the search's account:
the loop's few-byte collectives (the mean loss's and gradient norm's all-reduces, DDP's broadcast
of its rebuilt bucket order in step 2); `loop_collectives` plans them apart for `loom train`'s
measured-vs-planned (record.planned_collectives), where known (under TP also the vocabulary-split
loss's statistics and the norm's partial sums over tp, under EP the experts' norm apart, with MoE the
router's tally).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from loom.config import V_SCHEDULES, rank_stages, stages_per_rank
from loom.plan import context, experts, lora, muon
from loom.plan.candidate import loss_chunk, stage_fsdp_unit_parts
from loom.plan.in_flight import cross_rank_sends
from loom.plan.memory import (
    GRAD_COMM_BYTES,
    RECIPES,
    heaviest_rank,
    holds_last_stage,
    rank_blocks,
    rank_lora_params,
    rank_stages_of,
    rank_sum,
)
from loom.plan.shapes import checkpointed_layers
from loom.plan.terms import NO_TERMS, Terms, gb, num

DDP_BUCKET = 25 * 2**20  # DDP's default bucket (parallel.ddp_bucket_mb)


@dataclass
class CommAccount:
    intra_node: float = 0.0
    inter_node: float = 0.0
    by_kind: dict[str, float] = field(default_factory=dict)
    # seconds at link bandwidth, split by whether compute can hide them
    overlappable: dict[str, float] = field(default_factory=dict)
    # Observable per rank, by collective kind (all_reduce, all_gather, ..., send, recv): payload
    # bytes before any ring factor, and the count of collectives (None: not known to the plan).
    payload_by_kind: dict[str, float] = field(default_factory=dict)
    count_by_kind: dict[str, int | None] = field(default_factory=dict)
    # Collectives per group ("dp", "tp", "pp", "cp", "ep"), each paying a latency: DDP's buckets, which the
    # engine sizes, counted as one per 25 MiB.
    count_by_group: dict[str, int] = field(default_factory=dict)
    group: str = "dp"

    @property
    def total(self) -> float:
        return self.intra_node + self.inter_node

    def add(self, kind: str, sent: float, inter: bool) -> None:
        if sent <= 0:
            return
        if inter:
            self.inter_node += sent
        else:
            self.intra_node += sent
        self.by_kind[kind] = self.by_kind.get(kind, 0.0) + sent

    def issue(self, kind: str, n: int, payload: float, count: int | None = None, alone: bool = False) -> None:
        """Collectives of `kind` over groups of n ranks carrying `payload` bytes in all. Over a group of
        one only where the engine issues them there too (`alone`, as observed on gloo: FSDP2's all-reduce
        across replicas, ZeroRedundancyOptimizer's broadcasts; FSDP2's shards on dp = 1 issue nothing)."""
        if (n <= 1 and not alone) or payload <= 0:
            return
        self.payload_by_kind[kind] = self.payload_by_kind.get(kind, 0.0) + payload
        n_issued = count if count is not None else max(1, math.ceil(payload / DDP_BUCKET))
        if n > 1:  # what pays a latency (a group of one's is a local copy)
            self.count_by_group[self.group] = self.count_by_group.get(self.group, 0) + n_issued
        known = count is not None and self.count_by_kind.get(kind, 0) is not None
        self.count_by_kind[kind] = self.count_by_kind.get(kind, 0) + count if known else None

    def payload_dict(self) -> dict:
        counts = list(self.count_by_kind.values())
        return {"payload_bytes": sum(self.payload_by_kind.values()),
                "payload_bytes_by_kind": dict(self.payload_by_kind),
                "count": None if None in counts else sum(counts), "count_by_kind": dict(self.count_by_kind)}

    def to_dict(self) -> dict:
        return {"intra_node": self.intra_node, "inter_node": self.inter_node, "total": self.total,
                "by_kind": dict(self.by_kind)}


def ring(kind: str, n: int, size: float) -> float:
    """Bytes one rank sends in a ring (or pipelined chain) collective over n ranks on a tensor of
    `size` bytes. The planner predicts with it; loom/observe/collectives.py models (does not observe)
    wire bytes with it from the payloads it sees."""
    if kind == "send":
        return size
    if n <= 1 or kind in ("recv", "barrier"):
        return 0.0
    if kind == "all_reduce":  # reduce-scatter then all-gather
        return 2 * (n - 1) / n * size
    if kind in ("gather", "scatter"):  # n-1 of the n chunks move, spread over the n ranks
        return (n - 1) / (n * n) * size
    return (n - 1) / n * size  # all_gather, reduce_scatter, broadcast, reduce, all_to_all


def tp_reductions(w, c) -> tuple[float, float]:
    """(bytes of one micro-batch's activation, TP reductions of it per micro-batch on a stage).
    Per block: forward 2 (attention and MLP outputs), backward 2 (their inputs' gradients); a
    checkpointed block's recompute stops at its last saved tensor, before the MLP's reduction: one
    more. "op" keeps the matmuls' outputs but not the collectives' (the attention's reduction, and
    under sequence parallel the all-gathers before the column linears, run again): one more as well.
    The embedding (forward) and the head (backward) add one each. An MoE block's feed-forward runs
    whole on each TP rank (the sequence gathered around it): no reduction of its own, or under
    sequence parallel the all-gather of its input and, backward, the reduce-scatter of its gradient
    (one in all). Under LoRA with a frozen embedding (one pipeline stage) the first block's input needs
    no gradient: one fewer."""
    shape = w.shape
    activation = c.local_seq(w.seq_len) * c.micro_batch * shape.d_model * w.act_bytes
    layers = shape.n_layers / c.pp
    ckpt = checkpointed_layers(round(layers), c.activation_checkpointing, c.ac_every)
    moe = shape.moe_layers / c.pp * (1 if c.sequence_parallel else 2) if shape.moe else 0
    frozen_input = w.lora is not None and not w.lora.train_embeddings and c.pp == 1
    return activation, 4 * layers - moe + ckpt + (2 if c.pp == 1 else 1) - frozen_input


def pp_sends(w, c) -> tuple[float, int]:
    """(bytes of one micro-batch's activation between stages, sends per micro-batch on a rank). A
    rank sends forward from each of its v stages but the model's last, and backward from each but
    the first: 2v on a middle rank, 2v − 1 when p = 2. On a V (zbv, dualpipev: stages r and 2p − 1 − r)
    the turn between stages p − 1 and p stays on the last rank and rank 0 holds both ends: 4 on a
    middle rank, 2 when p = 2. Sequence parallel sends the split activation."""
    activation = c.local_seq(w.seq_len) * c.micro_batch * w.shape.d_model * w.act_bytes
    if c.sequence_parallel:
        activation /= c.tp
    if c.schedule in V_SCHEDULES:
        return activation, 2 if c.pp == 2 else 4
    return activation, 2 * c.virtual_stages - (1 if c.pp == 2 else 0)


def rank_sends(pp: int, virtual: int, schedule: str, rank: int) -> int:
    """Sends per micro-batch on pipeline rank `rank` (as many receives): forward from each of its stages
    whose next stage is on another rank, backward from each whose previous one is; pp_sends prices the
    busiest rank, a middle one, where the two ends send one direction only (1F1B: half)."""
    per = stages_per_rank(schedule, virtual)
    return sum(cross_rank_sends(rank_stages(rank, pp, per, schedule), pp * per))


def _link(inter: bool) -> str:
    return "inter-node" if inter else "intra-node"


def _tokens(c, seq_len: int | None = None) -> str:
    """A rank's tokens of a sequence in a formula: s, or s/cp under context parallelism (the symbol
    without `seq_len`, its numbers with it)."""
    if seq_len is None:
        return "s/cp" if c.cp > 1 else "s"
    return f"{seq_len}/{c.cp}" if c.cp > 1 else f"{seq_len}"


def cp_exchange(w, c) -> tuple[context.Exchange, int, int]:
    """(one block's exchange for one micro-batch, blocks of the heaviest stage, those recomputed)."""
    shape = w.shape
    layers = max(rank_blocks(shape, c.pp, c.schedule, c.virtual_stages))
    ckpt = checkpointed_layers(layers, c.activation_checkpointing, c.ac_every)
    ex = context.exchange(shape, c.local_seq(w.seq_len), c.micro_batch, w.act_bytes, c.tp, c.cp, c.cp_mode)
    return ex, layers, ckpt


def cp_payload_per_step(w, c) -> tuple[float, int]:
    """(payload bytes, operations) of the context-parallel exchange a rank sends per step: every
    micro-batch's forward and backward of each block, and the forward again of each recomputed one."""
    ex, layers, ckpt = cp_exchange(w, c)
    return _exchanges_per_step(ex, layers, ckpt, c.grad_accum)


def _exchanges_per_step(ex, blocks: int, recomputed: int, micro_batches: int) -> tuple[float, int]:
    """(payload, operations) of an exchange run in each block's forward and backward, and again in
    each recomputed block's forward, per micro-batch."""
    payload = micro_batches * (blocks * (ex.forward + ex.backward) + recomputed * ex.forward)
    ops = micro_batches * (blocks * (ex.forward_ops + ex.backward_ops) + recomputed * ex.forward_ops)
    return payload, ops


def _context_exchange(w, c, gpus_per_node: int, acc: CommAccount, terms: Terms) -> float:
    """The attention's exchange between the cp ranks (plan/context.py), in the account as its own kind
    (cp_ring: the bytes a rank sends; cp_alltoall: its all_to_alls' inputs). Returns the wire bytes."""
    shape, e = w.shape, w.act_bytes
    ex, layers, ckpt = cp_exchange(w, c)
    payload, ops = cp_payload_per_step(w, c)
    kind, inter = context.KINDS[c.cp_mode], c.cp * c.tp > gpus_per_node
    sent = payload if c.cp_mode == "ring" else ring("all_to_all", c.cp, payload)
    if terms:
        sl, b, tp, cp = f"{w.seq_len}/{c.cp}", c.micro_batch, c.tp, c.cp
        width = context.kv_width(shape, tp, cp, c.cp_mode)
        wide = "h" if width * tp != shape.kv_dim else "kv"
        terms.note(f"context parallel ({_link(inter)}, cp = {cp}, {c.cp_mode}): per block and micro-batch "
                   f"the attention's exchange, again for each recomputed block's forward")
        if c.cp_mode == "ring":
            terms.item("B_kv k or v block", "b·(s/cp)·(kv/tp)·e", f"{b}·{sl}·{num(width * tp)}/{tp}·{e}",
                       gb(ex.block))
            terms.item("ring forward", "2·(cp−1)·B_kv (k, v passed on cp−1 hops)",
                       f"2·({cp}−1)·{gb(ex.block)}", gb(ex.forward))
            terms.item("ring backward", "2·(cp−1)·B_kv + 2·cp·B_kv·4/e (k, v again; fp32 dk, dv, cp hops)",
                       f"2·({cp}−1)·{gb(ex.block)} + 2·{cp}·{gb(ex.block)}·4/{e}", gb(ex.backward))
        else:
            terms.item("q, out inputs", "b·(s/cp)·(h/tp)·e", f"{b}·{sl}·{shape.d_model}/{tp}·{e}",
                       gb(ex.block))
            kv = (ex.forward - 2 * ex.block) / 2
            why = " (repeated to the query heads: kv heads/tp do not divide over cp)" if wide == "h" else ""
            terms.item("k, v inputs", f"b·(s/cp)·({wide}/tp)·e{why}", f"{b}·{sl}·{num(width * tp)}/{tp}·{e}",
                       gb(kv))
            terms.item("all_to_all per pass", "2·q + 2·kv (4 all_to_all_single; backward the same)",
                       f"2·{gb(ex.block)} + 2·{gb(kv)}", gb(ex.forward))
        terms.item("cp payload", "m·(L_s·(forward + backward) + c·forward), c recomputed blocks",
                   f"{c.grad_accum}·({layers}·({gb(ex.forward)} + {gb(ex.backward)}) + "
                   f"{ckpt}·{gb(ex.forward)})",
                   gb(payload))
        if c.cp_mode == "alltoall":
            terms.item("cp bytes", "(cp−1)/cp·payload (each all_to_all keeps its own share)",
                       f"({cp}−1)/{cp} × {gb(payload)}", gb(sent))
    acc.add(kind, sent, inter)
    acc.issue(kind, c.cp, payload, ops)
    return sent


def ep_exchange(w, c) -> tuple[experts.Dispatch, int, int]:
    """(one MoE block's dispatch for one micro-batch, MoE blocks of the stage holding the most, those
    recomputed)."""
    shape = w.shape
    stage = max(range(c.pp), key=lambda s: shape.stage_moe_layers(s, c.pp))
    start, layers = shape.stage_layers(stage, c.pp)
    moe = shape.moe_layers_in(start, layers)
    ckpt = experts.checkpointed_moe_layers(shape, start, layers, c.activation_checkpointing, c.ac_every)
    return experts.dispatch(shape, c.local_seq(w.seq_len) * c.micro_batch, w.act_bytes), moe, ckpt


def ep_payload_per_step(w, c) -> tuple[float, int]:
    """(payload bytes, all_to_all_single calls) of expert parallelism's dispatch a rank issues per
    step (kind ep_alltoall, each call's input as the observer records it): per MoE block of its stage
    and micro-batch 8·E + 4·T·k·h·e in 5 calls, and a recomputed block's forward, 8·E + 2·T·k·h·e in
    3, again. (0, 0) at ep = 1 or for a dense model."""
    if c.ep == 1 or not w.shape.moe:
        return 0.0, 0
    ex, moe, ckpt = ep_exchange(w, c)
    return _exchanges_per_step(ex, moe, ckpt, c.grad_accum)


def _expert_dispatch(w, c, gpus_per_node: int, acc: CommAccount, terms: Terms) -> float:
    """Expert parallelism's all_to_alls in the account as their own kind (ep_alltoall: their inputs);
    returns the wire bytes, (ep−1)/ep of the payload."""
    ex, moe, ckpt = ep_exchange(w, c)
    payload, ops = ep_payload_per_step(w, c)
    inter = experts.inter_node(c, gpus_per_node)
    sent = ring("all_to_all", c.ep, payload)
    if terms:
        shape, e = w.shape, w.act_bytes
        terms.note(f"expert parallel ({_link(inter)}, ep = {c.ep}, ep·tp = {c.ep * c.tp} ranks): per MoE "
                   f"block and micro-batch the split counts, the tokens' rows to their experts and back, "
                   f"forward and backward; again for each recomputed block's forward")
        terms.item("T·k·h·e rows", "b·s·k·h·e (T tokens, each to k experts)",
                   f"{c.micro_batch}·{c.local_seq(w.seq_len)}·{shape.moe_top_k}·{shape.d_model}·{e}",
                   gb(ex.rows))
        terms.item("ep forward", "8·E + 2·rows (counts; dispatch, combine: 3 all_to_alls)",
                   f"8·{shape.moe_experts} + 2·{gb(ex.rows)}", gb(ex.forward))
        terms.item("ep backward", "2·rows (their gradients: 2 all_to_alls)", f"2·{gb(ex.rows)}",
                   gb(ex.backward))
        terms.item("ep payload", "m·(L_m·(forward + backward) + c_m·forward), c_m recomputed MoE blocks",
                   f"{c.grad_accum}·({moe}·({gb(ex.forward)} + {gb(ex.backward)}) + {ckpt}·{gb(ex.forward)})",
                   gb(payload))
        terms.item("ep bytes", "(ep−1)/ep·payload (each all_to_all keeps its own share)",
                   f"({c.ep}−1)/{c.ep} × {gb(payload)}", gb(sent))
    acc.add(experts.KIND, sent, inter)
    acc.issue(experts.KIND, c.ep, payload, ops)
    return sent


def _expert_sync(w, c, routed: int, micro_steps: int, inter: bool, acc: CommAccount, terms: Terms,
                 held: lora.Params | None = None) -> None:
    """Under expert parallelism the routed experts' gradient sync, apart from the rest of the model's:
    a rank's P_e/ep over the ranks holding the same experts (ddp: all-reduced over edp = dp/ep; FSDP2:
    each MoE block's experts a unit of their own over N_e = N/ep, gathered in forward and (zero3)
    again in backward, reduce-scattered; hsdp: all-reduced across the replicas too). Under LoRA `held`:
    a rank's experts, frozen and their adapters (gathered), of which only the adapters are reduced."""
    s, shape = c.strategy_info, w.shape
    psi = routed / c.ep
    gathered_psi, trained_psi = (held.total, held.trainable) if held is not None else (psi, psi)
    gbytes = GRAD_COMM_BYTES[w.recipe]
    per_param = w.act_bytes if w.recipe == "torch" else RECIPES[w.recipe][0]
    grad_bytes, param_bytes = gbytes * trained_psi, per_param * gathered_psi
    blocks = routed // shape.routed_params_per_block  # MoE blocks: one expert unit each
    reduced_blocks = blocks if trained_psi else 0  # units with nothing trainable reduce nothing
    if terms:
        terms.note(f"routed experts apart (ep = {c.ep}): P_e/ep = {num(routed)}/{c.ep} = {num(psi)} "
                   f"parameters per rank, synced over the ranks holding the same experts ({_link(inter)})")
    if w.recipe != "torch" and s.zero_stage in (1, 2):
        n = c.expert_shard_size
        rs, ag = ring("reduce_scatter", n, grad_bytes), ring("all_gather", n, param_bytes)
        if terms:
            terms.item("expert reduce-scatter", "(N_e−1)/N_e·gbytes·P_e/ep",
                       f"({n}−1)/{n} × {gb(grad_bytes)}", gb(rs))
            terms.item("expert all-gather", "(N_e−1)/N_e·pbytes·P_e/ep",
                       f"({n}−1)/{n} × {gb(param_bytes)}", gb(ag))
        acc.add("reduce_scatter", rs, inter)
        acc.add("all_gather", ag, inter)
        acc.issue("reduce_scatter", n, grad_bytes)
        acc.issue("all_gather", n, param_bytes)
    elif not s.shards_params:  # ddp: each rank's experts replicated over edp
        n = c.dp // c.ep
        ar = ring("all_reduce", n, grad_bytes)
        if terms:
            terms.item("expert all-reduce", "2(edp−1)/edp·gbytes·P_e/ep, edp = dp/ep",
                       f"2({n}−1)/{n} × {gb(grad_bytes)}", gb(ar))
        acc.add("all_reduce", ar, inter)
        acc.issue("all_reduce", n, grad_bytes, alone=True)  # FSDP2 across the replicas, edp = 1 too
    else:
        n = c.expert_shard_size
        passes = 2 if s.reshard_after_forward else 1  # zero3: gathered again in backward
        gathered = micro_steps * passes * param_bytes
        reduces = micro_steps if w.reduce_every_micro_step else 1
        reduced = reduces * grad_bytes
        ag, rs = ring("all_gather", n, gathered), ring("reduce_scatter", n, reduced)
        if terms:
            terms.item("expert all-gather", f"(N_e−1)/N_e·k·{passes}·pbytes·P_e/ep, N_e = N/ep",
                       f"({n}−1)/{n} × {micro_steps}·{passes}·{gb(param_bytes)}", gb(ag))
            terms.item("expert reduce-scatter", f"(N_e−1)/N_e·{reduces}·gbytes·P_e/ep",
                       f"({n}−1)/{n} × {reduces}·{gb(grad_bytes)}", gb(rs))
        acc.add("all_gather", ag, inter)
        acc.add("reduce_scatter", rs, inter)
        counted = c.pp == 1
        acc.issue("all_gather", n, gathered, micro_steps * passes * blocks if counted else None)
        acc.issue("reduce_scatter", n, reduced, reduces * reduced_blocks if counted else None)
        if s.dp_mesh == "hybrid":
            r = c.replicate_size
            ar = ring("all_reduce", r, reduced / n)
            if terms:
                terms.item("expert all-reduce replicas", "2(R−1)/R·reduced/N_e",
                           f"2({r}−1)/{r} × {gb(reduced)}/{n}", gb(ar))
            acc.add("all_reduce", ar, inter)
            acc.issue("all_reduce", r, reduced / n, reduces * reduced_blocks if counted else None)


def _frozen_lead(units: list[lora.Params] | None) -> int:
    """How many units come before the first that trains, among all but the last (kept gathered)."""
    if not units:
        return 0
    lead = next((i for i, u in enumerate(units) if u.trainable), len(units))
    return min(lead, len(units) - 1)


def comm_per_step(w, c, gpus_per_node: int, terms: Terms = NO_TERMS,
                  stage: int | None = None) -> tuple[CommAccount, dict[str, float]]:
    """(bytes sent per GPU per step by link and kind, bytes per group: {"dp", "tp", "pp", "cp", "ep"});
    each quantity recorded in `terms` as it is computed (plan/terms.py). Within a pipeline, of the
    heaviest stage, or of `stage` (what one rank of it issues: loom train's measured-vs-planned)."""
    shape = w.shape
    acc = CommAccount()
    groups = {"dp": 0.0, "tp": 0.0, "pp": 0.0, "cp": 0.0, "ep": 0.0}

    # Data parallel over the rank's local (TP-split) parameters, over its stages: the heaviest rank's
    # (or pipeline rank `stage`'s)
    heaviest = stage if stage is not None else heaviest_rank(shape, c)
    stage_params = rank_sum(c, heaviest, shape.stage_params)
    # the routed experts (under ep) synced apart, over the ranks holding the same experts
    routed = rank_sum(c, heaviest, shape.stage_routed_params) if c.ep > 1 else 0
    trained = None  # LoRA: what trains of the synced parameters (only its gradients are reduced)
    if w.lora is not None:  # the frozen base gathered with the adapters, a rank's (plan/lora.py)
        rest, held = rank_lora_params(w, c, heaviest)
        rest = rest if routed else rest + held  # at ep = 1 the experts are synced with the rest
        local, trained = rest.total, rest.trainable
        if terms:
            terms.item("Ψ_dp synced per rank", "Ψ_base + Ψ_lora (a rank's, after TP" + (
                "; the routed experts apart)" if routed else ")"),
                f"{num(rest.frozen)} + {num(rest.trainable)}", num(local))
    elif c.tp > 1 and shape.known:
        layers = rank_sum(c, heaviest, shape.stage_blocks)
        moe_layers = rank_sum(c, heaviest, shape.stage_moe_layers)
        replicated = shape.tp_replicated_params(layers, holds_last_stage(c, heaviest), moe_layers)
        rest = replicated - routed
        local = (stage_params - routed - rest) / c.tp + rest
        if terms and shape.moe:
            terms.item("Ψ_dp synced per rank", "(Ψ_stage − P_e − R)/tp + R (R: norms, the MoE blocks' "
                       "feed-forward but routed experts under ep, P_e)",
                       f"({num(stage_params - routed)} − {num(rest)})/{c.tp} + {num(rest)}", num(local))
        elif terms:
            terms.item("Ψ_dp synced per rank", "(Ψ_stage − R)/tp + R",
                       f"({num(stage_params)} − {num(replicated)})/{c.tp} + {num(replicated)}", num(local))
    elif routed:
        local = stage_params - routed
        if terms:
            terms.item("Ψ_dp synced per rank", "Ψ_stage − P_e (the routed experts apart)",
                       f"{num(stage_params)} − {num(routed)}", num(local))
    else:
        local = stage_params / c.tp
        if terms:
            several = len(rank_stages_of(c, heaviest)[0]) > 1
            what = "Ψ" if c.pp == 1 else "Ψ_rank (the heaviest rank's stages)" if several \
                else "Ψ_stage (heaviest stage)"
            terms.item("Ψ_dp synced per rank", what, None, num(local))
    gbytes = GRAD_COMM_BYTES[w.recipe]
    grad_bytes = gbytes * (local if trained is None else trained)
    per_param = w.act_bytes if w.recipe == "torch" else RECIPES[w.recipe][0]  # gathered dtype
    param_bytes = per_param * local
    if terms and trained is not None:
        terms.item("Φ_g gradients", f"{gbytes}·Ψ_lora (only what trains)", f"{gbytes} × {num(trained)}",
                   gb(grad_bytes))
    elif terms:
        terms.item("Φ_g gradients", f"{gbytes}·Ψ_dp", f"{gbytes} × {num(local)}", gb(grad_bytes))
    if terms:
        terms.item("Φ_p parameters", f"{per_param}·Ψ_dp (gathered dtype)", f"{per_param} × {num(local)}",
                   gb(param_bytes))
    dp_inter = c.grad_sync_size * c.tp > gpus_per_node
    dp_ranks, dp_sym = c.grad_sync_size, "dp·cp" if c.cp > 1 else "dp"  # the cp ranks sync gradients too
    micro_steps = c.grad_accum if c.pp == 1 else 1  # a pipeline runs its micro-batches in one step
    s = c.strategy_info
    if w.recipe != "torch" and s.zero_stage in (1, 2):
        # The ZeRO paper's stages 1-2 (DeepSpeed): reduce-scatter the gradients, all-gather the
        # updated parameters once per step: 2Φ, as DDP.
        n = dp_ranks
        if terms:
            terms.note(f"ZeRO paper stage {s.zero_stage}: reduce-scatter the gradients, all-gather the "
                       f"updated parameters once: Φ_g + Φ_p ≈ 2Φ, as DDP ({_link(dp_inter)}, N = {n})")
        rs, ag = ring("reduce_scatter", n, grad_bytes), ring("all_gather", n, param_bytes)
        if terms:
            terms.item("reduce-scatter", "(N−1)/N·Φ_g", f"({n}−1)/{n} × {gb(grad_bytes)}", gb(rs))
            terms.item("all-gather", "(N−1)/N·Φ_p", f"({n}−1)/{n} × {gb(param_bytes)}", gb(ag))
        acc.add("reduce_scatter", rs, dp_inter)
        acc.add("all_gather", ag, dp_inter)
        acc.issue("reduce_scatter", dp_ranks, grad_bytes)
        acc.issue("all_gather", dp_ranks, param_bytes)
    elif not s.shards_params:  # ddp, zero1: gradients all-reduced; zero1 broadcasts updated params
        n = dp_ranks
        ar = ring("all_reduce", n, grad_bytes)
        if terms:
            terms.note(f"{c.strategy}: the gradients all-reduced once per step: 2Φ "
                       f"({_link(dp_inter)}, N = {dp_sym} = {n})")
            terms.item("all-reduce", "2(N−1)/N·Φ_g", f"2({n}−1)/{n} × {gb(grad_bytes)}", gb(ar))
        acc.add("all_reduce", ar, dp_inter)
        # loom's FSDP2 replicating the model (under TP or EP) all-reduces over one replica too; DDP on
        # one replica is not wrapped (memory.no_ddp)
        replicas = w.recipe == "torch" and c.engine != "deepspeed" and c.uses_fsdp
        acc.issue("all_reduce", dp_ranks, grad_bytes, alone=replicas)
        if "broadcast" in s.collectives:
            updated = local if trained is None else trained  # the parameters the optimizer steps
            bc = ring("broadcast", n, 4 * updated)  # the updated fp32 params
            if terms:
                terms.item("broadcast", "(N−1)/N·4Ψ_dp (updated fp32 partitions)" if trained is None else
                           "(N−1)/N·4Ψ_lora (updated fp32 partitions of what trains)",
                           f"({n}−1)/{n} × 4 × {num(updated)}", gb(bc))
            acc.add("broadcast", bc, dp_inter)
            # ZeroRedundancyOptimizer broadcasts over one rank too
            acc.issue("broadcast", dp_ranks, 4 * updated, alone=c.engine != "deepspeed")
    else:
        n = c.shard_size
        shard_inter = n * c.tp > gpus_per_node
        # One collective per FSDP unit (modules grouped up to parallel.fsdp_unit_mb). The last
        # unit (the head's, or the root's) stays gathered into backward. Within a pipeline, the priced
        # stage's units (one stage a rank, of an untied model; counts unknown otherwise).
        start, layers = (0, shape.n_layers) if c.pp == 1 else shape.stage_layers(heaviest, c.pp)
        last_stage = start + layers == shape.n_layers
        one_stage = stages_per_rank(c.schedule, c.virtual_stages) == 1
        staged = c.pp == 1 or (one_stage and not shape.tie_embeddings)
        units = c.fsdp_unit_params(shape, layers, start == 0, last_stage, start) if shape.known and staged \
            else None
        # fsdp.py keeps a unit gathered from forward to backward: the head's (norm + head) or the root's;
        # a pipeline stage without the head and of several units keeps none
        keeps = bool(units) and (last_stage or len(units) == 1)
        # torch's pipeline schedules (1F1B, GPipe) keep a stage's units gathered from its first backward
        # to the step's end, and zero3 reshards one after each forward: m micro-batches gather a unit
        # m + 1 times (measured on gloo), a unit kept gathered once. A schedule that splits the
        # backward keeps every unit gathered (fsdp.py): once.
        reshards = s.reshard_after_forward and not c.split_backward
        lora_units = None  # LoRA: a rank's units (the base and adapters), what trains in each
        if w.lora is not None and units:
            lora_units = lora.fsdp_units(shape, w.lora, layers, start == 0, last_stage, start, c.fsdp_unit_mb,
                                         c.tp, c.ep, experts_apart=c.ep > 1)
            units = [u.total for u in lora_units]
        # LoRA: the units before the first that trains (a frozen embedding's) output no gradient: FSDP2
        # does not gather them again in backward
        idle = _frozen_lead(lora_units)
        lead = per_param * sum(units[:idle]) if lora_units else 0.0
        # the unit kept gathered, as a TP rank holds it: split over tp but what TP keeps whole (its norms'
        # gains, an MoE block's feed-forward); LoRA's units are a rank's already
        whole = 0
        if keeps and c.tp > 1 and not lora_units:
            whole = stage_fsdp_unit_parts(shape, shape.moe and c.ep > 1, c.fsdp_unit_mb, layers, start == 0,
                                          last_stage, start)[-1][1]
        kept = 0.0 if not keeps else per_param * units[-1] if lora_units else \
            per_param * ((units[-1] - whole) / c.tp + whole)
        if reshards and c.pp > 1:
            m = c.grad_accum  # the pipeline's micro-batches
            gathered = (m + 1) * (param_bytes - kept) + kept - lead
            if terms:
                terms.note(f"{c.strategy} within a pipeline: each unit all-gathered in each of the m = {m} "
                           f"micro-batches' forwards and once in backward (kept gathered from the first "
                           f"backward to the step's end), but the unit kept gathered: once "
                           f"({_link(shard_inter)}, N = {n})")
                terms.item("all-gathered Φ", "(m + 1)·(Φ_p − Φ_kept) + Φ_kept",
                           f"{m + 1}·({gb(param_bytes)} − {gb(kept)}) + {gb(kept)}", gb(gathered))
        elif reshards:  # backward again, but for the unit kept gathered (and LoRA's frozen lead)
            kept += lead
            if terms:
                terms.note(f"{c.strategy}: all-gather in forward, again in backward (but the unit kept "
                           f"gathered), reduce-scatter the gradients: 3Φ against DDP's 2Φ "
                           f"({_link(shard_inter)}, N = {n})")
            if lora_units and terms:
                terms.item("Φ_kept", f"{per_param}·(P_last unit + P_frozen lead) (a rank's; not gathered in "
                           f"backward: the last unit stays gathered, the {idle} frozen unit(s) before the "
                           f"first that trains output no gradient)",
                           f"{per_param} × ({num(units[-1])} + {num(sum(units[:idle]))})", gb(kept))
            elif units and terms and whole:
                terms.item("Φ_kept last unit",
                           f"{per_param}·((P_unit − R_unit)/tp + R_unit) (R: what TP keeps whole)",
                           f"{per_param} × (({num(units[-1])} − {num(whole)})/{c.tp} + {num(whole)})",
                           gb(kept))
            elif units and terms:
                terms.item("Φ_kept last unit", f"{per_param}·P_unit/tp",
                           f"{per_param} × {num(units[-1])}/{c.tp}", gb(kept))
            gathered = micro_steps * param_bytes + micro_steps * (param_bytes - kept)
            if terms:
                terms.item("all-gathered Φ", "k·Φ_p + k·(Φ_p − Φ_kept), k micro-steps",
                           f"{micro_steps}·{gb(param_bytes)} + {micro_steps}·({gb(param_bytes)} "
                           f"− {gb(kept)})", gb(gathered))
        else:
            gathered = micro_steps * param_bytes  # forward
            if terms and c.split_backward:
                terms.note(f"{c.strategy} under {c.schedule}, which splits the backward: every unit kept "
                           f"gathered to the step's end, all-gathered once; reduce-scatter the gradients: 2Φ "
                           f"({_link(shard_inter)}, N = {n})")
            elif terms:
                terms.note(f"{c.strategy}: all-gather once per micro-step (kept to backward), "
                           f"reduce-scatter the gradients: 2Φ ({_link(shard_inter)}, N = {n})")
                terms.item("all-gathered Φ", "k·Φ_p, k micro-steps", f"{micro_steps}·{gb(param_bytes)}",
                           gb(gathered))
        reduces = micro_steps if w.reduce_every_micro_step else 1  # the gradients kept sharded
        reduced = reduces * grad_bytes
        ag, rs = ring("all_gather", n, gathered), ring("reduce_scatter", n, reduced)
        if terms:
            terms.item("all-gather", "(N−1)/N·Φ", f"({n}−1)/{n} × {gb(gathered)}", gb(ag))
        if terms and reduces > 1:  # parallel.reduce_every_micro_step
            terms.item("reduce-scatter", "k·(N−1)/N·Φ_g, each micro-step",
                       f"{reduces}·({n}−1)/{n} × {gb(grad_bytes)}", gb(rs))
        elif terms:
            terms.item("reduce-scatter", "(N−1)/N·Φ_g", f"({n}−1)/{n} × {gb(grad_bytes)}", gb(rs))
        acc.add("all_gather", ag, shard_inter)
        acc.add("reduce_scatter", rs, shard_inter)
        if s.dp_mesh == "hybrid":  # the shards' gradients all-reduced across the replica groups
            r = c.replicate_size
            ar = ring("all_reduce", r, reduced / n)
            k = f"{reduces}·" if reduces > 1 else ""
            if terms:
                terms.item("all-reduce replicas", f"{k}2(R−1)/R·Φ_g/N",
                           f"{k}2({r}−1)/{r} × {gb(grad_bytes)}/{n}", gb(ar))
            acc.add("all_reduce", ar, dp_inter)
        # a unit reduces only if something in it trains (LoRA), every unit otherwise
        reducing = sum(1 for u in lora_units if u.trainable) if lora_units else len(units) if units else None
        units = len(units) if units else None
        if units and reshards and c.pp > 1:
            gathers = (c.grad_accum + 1) * (units - keeps) + keeps - idle
        elif units:
            gathers = micro_steps * (units + (units - 1 - idle if reshards else 0))
        else:
            gathers = None
        acc.issue("all_gather", n, gathered, gathers)
        acc.issue("reduce_scatter", n, reduced, reduces * reducing if units else None)
        if s.dp_mesh == "hybrid":
            acc.issue("all_reduce", c.replicate_size, reduced / n, reduces * reducing if units else None)
    if routed:
        shard_inter = c.shard_size * c.tp > gpus_per_node
        held = rank_lora_params(w, c, heaviest)[1] if w.lora is not None else None
        link = shard_inter if s.shards_params else dp_inter
        _expert_sync(w, c, routed, micro_steps, link, acc, terms, held)
    groups["dp"] = acc.total

    acc.group = "tp"
    if c.tp > 1 and shape.known:
        activation, reductions = tp_reductions(w, c)
        layers = shape.n_layers / c.pp
        ckpt = checkpointed_layers(round(layers), c.activation_checkpointing, c.ac_every)
        per_micro = reductions * ring("all_reduce", c.tp, activation)
        kinds = "an all-gather + a reduce-scatter each (sequence parallel)" if c.sequence_parallel else \
            "all-reduces"
        if terms:
            terms.note(f"tensor parallel ({_link(c.tp > gpus_per_node)}, {kinds}): per block 2 in forward, "
                       f"2 in backward, +1 per checkpointed block, +{2 if c.pp == 1 else 1} for the "
                       f"embedding/head")
            terms.item("Φ_a activation", f"{_tokens(c)}·b·h·e",
                       f"{_tokens(c, w.seq_len)}·{c.micro_batch}·{shape.d_model}·{w.act_bytes}",
                       gb(activation))
            if shape.moe:  # the MoE feed-forwards whole on each TP rank
                less = 1 if c.sequence_parallel else 2
                terms.item("reductions", f"4·L/p − {less}·L_m/p + c + {2 if c.pp == 1 else 1} (MoE blocks: "
                           f"{'the gathered input and its gradient' if less == 1 else 'none'} for the FFN)",
                           f"4·{num(layers)} − {less}·{num(shape.moe_layers / c.pp)} + {ckpt} + "
                           f"{2 if c.pp == 1 else 1}", num(reductions))
            else:
                terms.item("reductions", f"4·L/p + c + {2 if c.pp == 1 else 1}",
                           f"4·{num(layers)} + {ckpt} + {2 if c.pp == 1 else 1}", num(reductions))
            terms.item("tp bytes", "m × reductions × 2(tp−1)/tp·Φ_a",
                       f"{c.grad_accum} × {num(reductions)} × 2({c.tp}−1)/{c.tp} × {gb(activation)}",
                       gb(per_micro * c.grad_accum))
        acc.add("tp", per_micro * c.grad_accum, c.tp > gpus_per_node)
        groups["tp"] = per_micro * c.grad_accum
        # Sequence parallel turns each all-reduce into an all-gather and a reduce-scatter, each
        # of the whole (sequence-gathered) activation; but an MoE block's pair is two all-gathers: its
        # input's in forward and, in backward, its output's gradient (the output, whole on each TP rank,
        # split back to the sequence shards; the input's gradient is whole too: no reduction)
        count = round(reductions * c.grad_accum)
        if c.sequence_parallel:
            moe_pairs = round(shape.moe_layers / c.pp * c.grad_accum) if shape.moe else 0
            # a recomputed MoE block gathers its feed-forward's input again (measured: full, op)
            moe_pairs_again = round(ckpt * shape.moe_layers / shape.n_layers * c.grad_accum) if shape.moe \
                else 0
            gathers = count + moe_pairs + moe_pairs_again
            acc.issue("all_gather", c.tp, gathers * activation, gathers)
            if moe_pairs_again:  # on the wire too (the reductions count a recomputed block's pair once)
                again = ring("all_gather", c.tp, activation) * moe_pairs_again
                if terms:
                    terms.item("recomputed MoE inputs", "MoE blocks recomputed × (tp−1)/tp·Φ_a (gathered "
                               "again)",
                               f"{moe_pairs_again} × ({c.tp}−1)/{c.tp} × {gb(activation)}", gb(again))
                acc.add("tp", again, c.tp > gpus_per_node)
                groups["tp"] += again
            acc.issue("reduce_scatter", c.tp, (count - moe_pairs) * activation, count - moe_pairs)
        else:
            acc.issue("all_reduce", c.tp, count * activation, count)
        if c.sequence_parallel and (w.lora is None or w.lora.train_norms):
            # the norms run on sequence shards: each TP rank's gradient of a gain is a partial sum,
            # which DTensor all-reduces in backward (fp32), one per norm: each micro-step, or within a
            # pipeline once, in the stage's last backward (measured); the final norm on the last stage
            final = holds_last_stage(c, heaviest)
            norms = round(layers) * shape.layer_norm_params + (shape.d_model if final else 0)
            times = c.grad_accum if c.pp == 1 else 1
            calls = (2 * round(layers) + final) * times
            if terms:
                terms.item("norms' gradients over tp", f"{'m' if times > 1 else '1'} × 4·(L·2h + h) "
                           "(sequence parallel: partial sums)", f"{times} × 4 × {num(norms)}",
                           gb(4 * norms * times))
            acc.add("tp", ring("all_reduce", c.tp, 4 * norms) * times, c.tp > gpus_per_node)
            acc.issue("all_reduce", c.tp, 4 * norms * times, calls)
            groups["tp"] += ring("all_reduce", c.tp, 4 * norms) * times
        if w.lora is not None:  # the adapter factors whole on each TP rank
            moe_layers = shape.moe_layers / c.pp if shape.moe else 0
            calls, synced = lora.tp_synced_grads(shape, w.lora, round(layers), moe_layers)
            if terms:
                terms.item("LoRA gradients over tp", f"m × Σ 4·r·(a column split A's in, a row split B's "
                           f"out), {calls} adapted linears", f"{c.grad_accum} × {gb(synced)}",
                           gb(synced * c.grad_accum))
            acc.add("tp", ring("all_reduce", c.tp, synced) * c.grad_accum, c.tp > gpus_per_node)
            acc.issue("all_reduce", c.tp, synced * c.grad_accum, calls * c.grad_accum)
            groups["tp"] += ring("all_reduce", c.tp, synced) * c.grad_accum

    acc.group = "pp"
    if c.pp > 1 and shape.known:
        activation, sends = pp_sends(w, c)
        sent = sends * c.grad_accum * activation
        # stages on other nodes
        pp_inter = c.world > gpus_per_node and c.grad_sync_size * c.tp >= gpus_per_node
        if terms:
            terms.note(f"pipeline ({_link(pp_inter)}): each micro-batch's activation forward from each of a "
                       f"rank's v stages, its gradient backward: 2v·m sends ((2v−1)·m when p = 2; on a V "
                       f"4·m, 2·m when p = 2)")
            terms.item("pp bytes", f"sends·m·{_tokens(c)}·b·h·e" + ("/tp" if c.sequence_parallel else ""),
                       f"{sends}·{c.grad_accum}·{_tokens(c, w.seq_len)}·{c.micro_batch}·{shape.d_model}·"
                       f"{w.act_bytes}"
                       + (f"/{c.tp}" if c.sequence_parallel else ""), gb(sent))
        acc.add("send", sent, pp_inter)
        groups["pp"] = sent
        for kind in ("send", "recv"):  # as many received as sent, on the rank modelled here
            acc.issue(kind, c.pp, sent, sends * c.grad_accum)
    acc.group = "cp"
    if c.cp > 1 and shape.known:
        groups["cp"] = _context_exchange(w, c, gpus_per_node, acc, terms)
    acc.group = "ep"
    if c.ep > 1 and shape.moe:
        groups["ep"] = _expert_dispatch(w, c, gpus_per_node, acc, terms)
    acc.group = "dp"
    groups["muon"] = _muon_exchange(w, c, gpus_per_node, acc, terms) if w.muon is not None and shape.known \
        else 0.0
    if terms:
        counts = ", ".join(f"{g} {n}" for g, n in acc.count_by_group.items()) or "none"
        terms.note(f"collectives issued per step (each pays a latency α): {counts}")
    return acc, groups


def _muon_exchange(w, c, gpus_per_node: int, acc: CommAccount, terms: Terms) -> float:
    """Muon's whole matrices from their shards, in the optimizer step (plan/muon.py): its wire bytes."""
    wire = 0.0
    for ex in muon.workload_cost(w, c).exchanges:
        sent = ring(ex.kind, ex.group, ex.payload)
        if terms:
            what = ("2·⌈M/G⌉ all-to-alls, a rank's input 2·e·Ψ_m/G (its shards to the owners, its owned "
                    "results back)" if ex.kind == muon.KIND else
                    "2 all-gathers per matrix split over FSDP2 × TP, their output 4·(Ψ_m/tp + Ψ_m) (fp32)")
            terms.item(f"muon {ex.kind}", what, f"{ex.count} over G = {ex.group}", gb(ex.payload))
            terms.item("  its wire bytes", "ring: all-to-all (G−1)/G·payload, all-gather (G−1)/G·output",
                       None, gb(sent))
        acc.add(ex.kind, sent, ex.group > gpus_per_node)
        acc.issue(ex.kind, ex.group, ex.payload, ex.count)
        wire += sent
    return wire


@dataclass(frozen=True)
class LoopCollective:
    """A collective the training loop itself issues each step (the control plane: a few bytes that
    steer the step), beside the engines' (the data plane: gradients, parameters, activations)."""

    kind: str
    count: int
    payload: float  # bytes, as loom/observe/collectives.py counts them
    what: str


def loop_collectives(w, c, trained_tensors: int, bucket_bytes: float, grad_bytes: float,
                     sft: bool = False, tp_split_tensors: int = 0, ep_split_tensors: int = 0,
                     pp_rank: int = 0, tp_mesh_tensors: int | None = None) -> list[LoopCollective] | None:
    """The loop's own collectives in a step (loom/train/step.py) on pipeline rank `pp_rank`, as loom runs
    them on the torch engine: the mean loss's all-reduce (an fp32 scalar, over every rank, a world of one
    too); under FSDP2 the gradient norm's over the shard group, which carries one fp32 partial norm per
    tensor with a gradient (`trained_tensors`, the rank's; none on a group of one); SFT's count of loss
    tokens; and where DDP wraps the model (ddp, zero1 on more than one replica), in the step it rebuilds
    its buckets (the second of a process: the one `loom train` measures) the broadcast of their order,
    int32: the indices and their count, then each bucket's size. A pipeline adds its stages' squared
    norms (an fp32 scalar over the pp group); its DDP settles the bucket order before step 1 (no
    broadcast). Under tensor parallelism (tp_loop_collectives) the vocabulary-split loss's statistics
    (on the rank holding the last stage), and the norm's partial sums over tp of the `tp_split_tensors`
    split over it. A mixture of experts adds the router's tally (loom/train/moe_step.py: each MoE block's
    tokens per expert, dropped choices and auxiliary loss, fp32 over dp·cp, on a rank holding MoE
    blocks), and within a pipeline the stages' sums and the largest imbalance over pp; under expert
    parallelism the `ep_split_tensors` split over ep (the routed experts, and their adapters) add their
    partial norms apart, in one all-reduce over the ranks holding them (ep, with their own shards).
    Beside TP the experts (whole on each TP rank) keep their norm apart too. None where not planned:
    the deepspeed engine, whose collectives of this kind are theirs."""
    s, shape = c.strategy_info, w.shape
    if c.engine == "deepspeed":
        return None
    stages, total = rank_stages_of(c, pp_rank)
    loop = [LoopCollective("all_reduce", 1, 4, "mean loss")]
    if sft:
        loop.append(LoopCollective("all_reduce", 1, 4, "loss tokens"))
    if shape.moe:
        experts = shape.moe_experts
        blocks = sum(shape.moe_layers_in(*shape.stage_layers(stage, total)) for stage in stages)
        if blocks:
            loop.append(LoopCollective("all_reduce", 1, 4 * blocks * (experts + 2), "the router's tally"))
        if c.pp > 1:  # the stages' sums (aux loss, blocks, dropped, each expert's tokens), their imbalance
            loop.append(LoopCollective("all_reduce", 2, 4 * (experts + 3) + 4, "the stages' tallies"))
    dense = trained_tensors - ep_split_tensors if c.ep > 1 else trained_tensors
    if c.tp > 1:
        loop += tp_loop_collectives(w, c, dense, tp_split_tensors, total - 1 in stages, tp_mesh_tensors)
    elif s.shards_params and c.shard_size > 1 and dense:
        loop.append(LoopCollective("all_reduce", 1, 4 * dense, "gradient norm"))
    if c.ep > 1 and ep_split_tensors:
        loop.append(LoopCollective("all_reduce", 1, 4 * ep_split_tensors, "the experts' gradient norm"))
    if c.pp > 1:
        loop.append(LoopCollective("all_reduce", 1, 4, "the stages' gradient norms"))
    elif not s.shards_params and not c.uses_fsdp and c.grad_sync_size > 1:  # DDP's rebuilt bucket order
        buckets = max(1, math.ceil(grad_bytes / bucket_bytes))
        loop.append(LoopCollective("broadcast", 2, 4 * (trained_tensors + 1 + buckets), "DDP's bucket order"))
    return loop


def tp_loop_collectives(w, c, trained_tensors: int, split: int, last: bool = True,
                        on_mesh: int | None = None) -> list[LoopCollective]:
    """Tensor parallelism's share of the loop's collectives (measured on gloo, torch 2.11 and 2.13):
      loss     the head splits the vocabulary: each token's logsumexp needs the global max and the
               sums of exp (with the target's logit, 0 but on its owner), fp32 over tp: 4 + 8 bytes
               a token, in two all-reduces per chunk of train.loss_chunk tokens
               (loom/models/chunked_loss.py); unchunked, torch's loss_parallel: three of 4 a token.
               Within a pipeline, on the rank holding the last stage only (`last`)
      norm     each of the `split` tensors split over tp (a matmul's weight: DTensor Shard on tp) adds
               its partial norm over tp, and under FSDP2 over the shards too; the rest (the norms'
               gains, whole on each TP rank) over the shards only: fp32 a tensor. DDP and ZeRO-1 run
               FSDP2 over the replicas there (apply.uses_fsdp), their gradients whole: over tp only.
    Per micro-step the loss's, on its micro-batch's s·b tokens (s/cp under context parallelism)."""
    tokens, steps = c.micro_batch * c.local_seq(w.seq_len), c.grad_accum
    chunk = loss_chunk(w, c)  # (the full logits under plain_ops)
    calls = 2 * math.ceil(tokens / chunk) if chunk > 0 else 3
    loop = [LoopCollective("all_reduce", calls * steps, 12 * tokens * steps,
                           "the loss's vocabulary statistics")] if last else []
    if w.lora is not None or c.sequence_parallel:
        # measured: where the gradients of tensors whole on each TP rank are partial sums reduced in
        # backward (LoRA's whole factors, sequence parallel's norms), DTensor stacks the norm of every
        # tensor on the TP mesh (`on_mesh`; of a dense model every one) as partial over tp, in one
        # all-reduce over tp and one over the shards; an MoE block's feed-forward, on a mesh without tp,
        # in one more over the shards
        split = trained_tensors if on_mesh is None else on_mesh
    count, payload = (1, 4 * split) if split else (0, 0)
    if c.strategy_info.shards_params and c.shard_size > 1:
        whole = trained_tensors - split
        count, payload = count + (split > 0) + (whole > 0), payload + 4 * split + 4 * whole
    if count:
        loop.append(LoopCollective("all_reduce", count, payload, "gradient norm"))
    return loop


def with_loop(payload: dict, loop: list[LoopCollective] | None) -> dict:
    """`payload` (CommAccount.payload_dict) with the loop's collectives added to their kinds, and listed
    apart as `loop` ({kind: {"count", "payload_bytes", "what"}}; None: not planned)."""
    if loop is None:
        return {**payload, "loop": None}
    by_kind, counts, listed = dict(payload["payload_bytes_by_kind"]), dict(payload["count_by_kind"]), {}
    for op in loop:
        by_kind[op.kind] = by_kind.get(op.kind, 0.0) + op.payload
        known = counts.get(op.kind, 0)
        counts[op.kind] = None if known is None else known + op.count
        entry = listed.setdefault(op.kind, {"count": 0, "payload_bytes": 0.0, "what": []})
        entry["count"] += op.count
        entry["payload_bytes"] += op.payload
        entry["what"].append(op.what)
    total = list(counts.values())
    return {"payload_bytes": sum(by_kind.values()), "payload_bytes_by_kind": by_kind,
            "count": None if None in total else sum(total), "count_by_kind": counts,
            "loop": {k: {**v, "what": ", ".join(v["what"])} for k, v in listed.items()}}
