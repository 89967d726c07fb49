"""Findings from a step ledger, in the order an expert debugs a slow step.

1. Compute share first: when compute is not most of the step, which of IO, a slower peer (a
   straggler arriving late, or a rank that computes longer: imbalance), communication not hidden
   under compute (split by collective kind) or idle host time takes the rest.
2. Then the forward / backward / optimizer split.
3. Then the specific op, kernel or collective (host syncs, tiny kernels).
Each finding names the evidence (numbers), the likely cause, what to try and the expected
effect. What to try is a config key with a valid TOML value (`knob`, `value`) and prose beside
it (`note`); where no config key can fix the cause, `knob` is None and `note` says what to do.
Keys fit the layout that ran: no FSDP prefetch for DDP or a model that is one FSDP unit, no DDP
bucket size for FSDP; for context parallelism's exchange, the cp_mode or cp that its heads and
ranks allow; for expert parallelism's all-to-all, fewer ep ranks. A mixture of experts' routing
(metrics.jsonl, read by analyze.py into `analysis["moe"]`) is judged beside the ranks' imbalance:
experts far busier than the mean (the aux-loss coefficient, or the bias update rate of aux-loss-free
balancing), tokens dropped at the experts' capacity (the capacity factor). A healthy ledger gives
no finding.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict

from loom.models.gpt.config import PRESETS
from loom.observe.ledger import CP_KINDS, EP_KINDS, MUON_ALLTOALL

# A part of the step worth a finding (percent of wall time).
SHARE = 15.0
# Strategies whose collectives are FSDP's all-gathers and reduce-scatters (torch engine).
_SHARDED = ("zero2", "zero3", "hsdp")
# Why context parallelism's exchange is exposed, by its kind (ledger.CP_KINDS).
_CP_CAUSE = {
    "cp_ring": "each ring hop's k/v (and in backward dk/dv) transfer takes longer than the attention of the "
               "block it should hide under",
    "cp_alltoall": "the all-to-alls turning sequence shards into head shards and back run between the "
                   "projections and attention: nothing computes while they move",
    # expert parallelism's dispatch and combine (ledger.EP_KINDS)
    "ep_alltoall": "every MoE block sends its tokens to their experts' ranks and back (forward and backward) "
                   "between the router and the experts' matmuls: nothing computes while they move, and "
                   "across nodes they cross the network",
    # Muon's exchange (ledger.MUON_ALLTOALL)
    MUON_ALLTOALL: "Muon's optimizer step gathers each matrix's shards to its owner and scatters the "
                   "orthogonalized result back: after backward, only the other matrices' iterations "
                   "can hide them",
}
# The pipeline rank holding the head's stage computing this much more than the mean pipeline rank
# is worth a finding: the pipeline runs at its pace (the 1b's head is 3.4 of its blocks at 4,096
# tokens: 1.5× the mean at pp 4), and measured compute wobbles by a few percent between ranks.
STAGE_IMBALANCE = 1.15
# The busiest expert's tokens over the mean (metrics.jsonl moe_load_imbalance, max over MoE blocks)
# worth a finding. The MoE block waits for its busiest expert: under expert parallelism every rank
# waits at the combine all-to-all for the one holding it, on one rank its matmul is the longest,
# and a capacity factor below it drops tokens. At 1.5 a third of that expert's time is waiting on
# a balanced share; routers trained with an auxiliary loss keep it near 1.1-1.3 (Switch
# Transformer, GShard), so above 1.5 the balancing is too weak rather than noise.
EXPERT_IMBALANCE = 1.5
# The share of routed choices dropped at the experts' capacity (moe_dropped over tokens × top-k, every
# MoE block) worth a finding: those tokens skip their expert (only the residual carries them).
DROPPED_SHARE = 1.0  # percent


def _mean(values) -> float:
    values = list(values)
    return statistics.fmean(values) if values else 0.0


def _steps(ranks: dict) -> list[dict]:
    return [s for info in ranks.values() for s in info.get("steps", [])]


def _share(steps: list[dict], part: str) -> float:
    return _mean(s["shares"][part] for s in steps)


def _ms(step: dict, part: str) -> float:
    """A part of the step in ms: its `<part>_ms`, else its share of the wall time."""
    if step.get(f"{part}_ms") is not None:
        return step[f"{part}_ms"]
    return step["shares"][part] * step["wall_ms"] / 100


def toml_value(value) -> str:
    """A value as TOML writes it: true, 2, 12.5, "zero2", [5, 5, 5, 1]."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return f"{value:g}" if isinstance(value, float) else str(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(str(value))


def try_text(finding: dict) -> str:
    """What a finding says to try as one line: `key = value  (note)`, or the note alone."""
    note = finding.get("note") or ""
    if not finding.get("knob"):
        return note
    line = f"{finding['knob']} = {toml_value(finding['value'])}"
    return f"{line}  ({note})" if note else line


def _finding(category: str, title: str, evidence: str, cause: str, knob: str | None, value, note: str,
             effect: str, **extra) -> dict:
    return {"category": category, "title": title, "evidence": evidence, "cause": cause, "knob": knob,
            "value": value, "note": note, "expected_effect": effect, **extra}


def diagnose(analysis: dict, config: dict | None = None) -> list[dict]:
    """`analysis`: {"ranks": {rank: {"steps", "collectives", "top_ops", "kind"}}, "collectives":
    matched across ranks, "stragglers": [...]}; `config`: the run's loom config (as a dict) when
    known, to name current values and the layout that ran."""
    ranks = analysis.get("ranks", {})
    steps = _steps(ranks)
    if not steps:
        return []
    cfg = config or {}
    data_cfg, train_cfg = cfg.get("data", {}), cfg.get("train", {})
    findings: list[dict] = []
    wall = _mean(s["wall_ms"] for s in steps)
    compute = _share(steps, "compute")
    stragglers = analysis.get("stragglers") or []

    # 1. What takes the step when compute does not.
    io = _share(steps, "io")
    if io >= SHARE:
        workers = data_cfg.get("num_workers")
        suggest = max(4, 2 * workers) if workers else 4
        findings.append(_finding(
            "io", f"Input pipeline stalls the step: IO is {io:.0f}% of it",
            f"IO {io:.0f}% of a {wall:.1f} ms step (compute {compute:.0f}%), mean over {len(steps)} "
            f"steps and {len(ranks)} rank(s); DataLoader waits "
            f"{_mean(s.get('data_ms', 0) for s in steps):.1f} ms per step",
            "batches are produced in the training process (or by too few workers), so the step waits for "
            "them",
            "data.num_workers", suggest,
            f"now {workers if workers is not None else 'unknown'}; and data.prefetch_factor ≥ 2",
            f"up to {io:.0f}% shorter steps once loading overlaps compute"))

    for s in stragglers:
        rank = str(s["rank"])
        mine = ranks.get(rank, {}).get("steps", [])
        others = [st for r, info in ranks.items() if r != rank for st in info.get("steps", [])]
        own_io, own_idle = _share(mine, "io") if mine else 0.0, _share(mine, "idle") if mine else 0.0
        waiting = _share(others, "comm_exposed") if others else 0.0
        if own_io >= SHARE:
            workers = data_cfg.get("num_workers")
            knob, value, note = ("data.num_workers", max(4, 2 * workers) if workers else 4,
                                 f"on every rank (rank {rank}'s IO is high)")
        else:
            knob, value, note = None, None, (f"remove what stalls rank {rank}'s host before each step "
                                             "(sleeps, CPU contention, a slow disk, uneven data)")
        findings.append(_finding(
            "straggler", f"Rank {rank} is a straggler; the other ranks wait for it",
            f"{s['evidence']}; rank {rank}'s step is {own_idle:.0f}% idle and {own_io:.0f}% IO, the others' "
            f"{waiting:.0f}% exposed communication",
            f"rank {rank} reaches each collective late, so every collective waits for it", knob, value, note,
            f"about {s['late_ms_mean']:.1f} ms less per step on the other ranks "
            f"(their exposed communication {waiting:.0f}% → near the transfer time)"))

    waits = _waits(analysis.get("collectives") or [])
    # a pipeline's head's stage computing longest is not a rank slower at the same work: the stages'
    # finding names it (and its split), not the imbalance's
    stages = _stage_balance(ranks, cfg)
    if stages:
        findings.append(stages)
    elif not stragglers:
        imbalance = _imbalance(ranks, waits, analysis.get("collectives") or [], data_cfg,
                               int(cfg.get("parallel", {}).get("pp") or 1))
        if imbalance:
            findings.append(imbalance)

    # A mixture of experts' routing: the experts' load is an imbalance of its own (under expert
    # parallelism the ranks wait for the one with the busiest experts), judged before the transfers.
    findings += _expert_load(analysis.get("moe"), cfg)

    findings += _exposed_by_kind(ranks, waits, analysis.get("collectives") or [], cfg,
                                 (analysis.get("plan") or {}).get("pipeline_bubble"))

    idle = _share(steps, "idle")
    if idle >= SHARE and not stragglers:
        findings.append(_finding(
            "idle", f"The step is {idle:.0f}% idle",
            f"idle {idle:.0f}% of a {wall:.1f} ms step: nothing computing, communicating or loading",
            "host-side gaps: Python overhead between small ops, synchronizations, sleeps", "train.compile",
            True, "fewer, larger kernels and less Python per step", f"up to {idle:.0f}% shorter steps"))

    # 2. The forward / backward / optimizer split.
    opt = _mean(100 * s.get("optimizer_ms", 0.0) / s["wall_ms"] for s in steps if s["wall_ms"] > 0)
    if opt >= 30.0:
        gpu = any(info.get("kind") == "gpu" for info in ranks.values())
        findings.append(_finding(
            "optimizer", f"The optimizer step takes {opt:.0f}% of the step",
            f"optimizer {opt:.0f}%, forward {_mean(s.get('forward_ms', 0) for s in steps):.1f} ms, backward "
            f"{_mean(s.get('backward_ms', 0) for s in steps):.1f} ms, optimizer "
            f"{_mean(s.get('optimizer_ms', 0) for s in steps):.1f} ms per step",
            "a per-parameter optimizer loop (many small kernels) or states far from the compute",
            "train.optimizer_impl", "fused" if gpu else "foreach",
            f"now {train_cfg.get('optimizer_impl', 'unknown')}; one kernel (fused, on GPUs) or one op per "
            "tensor list (foreach) instead of a loop over parameters",
            "the optimizer share falls to a few percent of the step"))

    # 3. The specific op: host syncs in the step (loom's own loop is never counted: ledger.py),
    # tiny kernels.
    syncs = _mean(s.get("host_syncs", 0) for s in steps)
    if syncs >= 1:
        findings.append(_finding(
            "sync", f"{syncs:.0f} host synchronization(s) per step in the training step's code",
            f"{syncs:.1f} ops per step that read a tensor's value on the host (aten::item / "
            "_local_scalar_dense / stream syncs), each one stalls the host until the device catches up",
            "a .item(), .cpu(), print or Python branch on a tensor inside the model, the loss or the data",
            None, None, "in the model, loss or data code: read values a step late (as loom's loop does) or "
            "keep them as tensors, instead of .item() or a Python branch on a tensor",
            "the host runs ahead again; on GPUs the device no longer idles at every sync"))
    kernel_steps = [s for s in steps if s.get("kernels")]
    if kernel_steps:
        per_step = _mean(s["kernels"] for s in kernel_steps)
        mean_us = _mean(s.get("mean_kernel_us", 0.0) for s in kernel_steps)
        if per_step >= 1000 and mean_us < 20:
            findings.append(_finding(
                "kernels", f"{per_step:.0f} kernels per step averaging {mean_us:.1f} µs",
                f"{per_step:.0f} kernels per step, mean {mean_us:.1f} µs, occupancy "
                f"{_mean(s.get('occupancy_pct', 0.0) for s in kernel_steps):.0f}%",
                "many tiny kernels: launch overhead and unfused elementwise ops", "train.compile", True,
                "fused kernels from torch.compile", "fewer, fused kernels; compute share rises"))
    return findings


# -- waiting for a slower rank -------------------------------------------------------------------

def _waits(matched: list[dict]) -> dict[str, dict]:
    """Per rank and step, the ms its matched collectives spent waiting for the last rank."""
    out: dict[str, dict] = defaultdict(lambda: defaultdict(float))
    for m in matched:
        for rank, v in m["per_rank"].items():
            out[str(rank)][m.get("step")] += v["wait_ms"]
    return out


def _imbalance(ranks: dict, waits: dict, matched: list[dict], data_cfg: dict, pp: int = 1) -> dict | None:
    """A rank that waits a large part of its step at collectives for a slower one, which is not
    late for lack of work on its host (a straggler) but slow at the same work, or, in a pipeline (`pp`
    stages), at its stage's own work."""
    share: dict[str, float] = {}
    for rank, info in ranks.items():
        per = [100 * min(waits.get(rank, {}).get(s.get("step"), 0.0), _ms(s, "comm_exposed")) / s["wall_ms"]
               for s in info.get("steps", []) if s["wall_ms"] > 0]
        share[rank] = _mean(per)
    if not share:
        return None
    waiter = max(share, key=share.get)
    if share[waiter] < SHARE:
        return None
    caused: dict[str, float] = defaultdict(float)  # the wait a rank caused by arriving last
    for m in matched:
        caused[str(m["last_rank"])] += max(v["wait_ms"] for v in m["per_rank"].values())
    slow = max((r for r in caused if r != waiter and r in ranks), key=caused.get, default=None)
    if slow is None:
        return None
    w_steps, s_steps = ranks[waiter]["steps"], ranks[slow]["steps"]
    others = [st for r, info in ranks.items() if r != slow for st in info.get("steps", [])]
    mine = waits[waiter]
    wait_ms = _mean(min(mine.get(s.get("step"), 0.0), _ms(s, "comm_exposed")) for s in w_steps)
    transfer = _mean(max(_ms(s, "comm_exposed") - mine.get(s.get("step"), 0.0), 0.0) for s in w_steps)
    parts = {p: _mean(_ms(s, p) for s in s_steps) - _mean(_ms(s, p) for s in others)
             for p in ("compute", "io", "idle")}
    behind = max(parts, key=parts.get)
    slow_compute = _mean(_ms(s, "compute") for s in s_steps)
    other_compute = _mean(_ms(s, "compute") for s in others)
    step_ms = _mean(s["wall_ms"] for s in w_steps)
    evidence = (f"rank {waiter} waits {wait_ms:,.0f} ms per step ({share[waiter]:.0f}% of its "
                f"{step_ms:,.0f} ms step) at collectives for rank {slow}, and moves bytes for "
                f"{transfer:,.0f} ms; "
                f"rank {slow} computes {slow_compute:,.0f} ms per step against "
                f"{other_compute:,.0f} ms on the other rank(s)") + _slowest_op(ranks, slow)
    if behind == "io":
        workers = data_cfg.get("num_workers")
        cause = f"rank {slow} waits longer for its batches than the others, and they wait for it"
        knob, value, note = ("data.num_workers", max(4, 2 * workers) if workers else 4,
                             f"now {workers if workers is not None else 'unknown'}: rank {slow}'s loading "
                             "holds every rank back")
    elif behind == "idle":
        cause = f"rank {slow}'s host stalls between ops (CPU contention, Python overhead), the others wait"
        knob, value, note = None, None, f"find what else runs on rank {slow}'s host and move it off"
    elif pp > 1:
        cause = (f"rank {slow}'s pipeline stage computes longer than the others' (its blocks, and the head "
                 "and loss where it holds them), so the others wait for it at their sends and receives")
        knob, value, note = None, None, (
            "move blocks between the stages with parallel.pp_stage_layers (fewer on the slow one's; `loom "
            "plan --explain` prices a split), or run fewer stages")
    else:
        cause = (f"rank {slow} is slower at the same work (a slower or shared device or core, another "
                 "process on it, or heavier batches), so the others wait at the next collective: "
                 "imbalance, which no overlap setting can hide")
        knob, value, note = None, None, (
            f"give every rank the same hardware share: one device (or core set) per rank with nothing else "
            f"on rank {slow}'s; on CPU no more ranks than free cores (OMP_NUM_THREADS = cores / ranks)")
    return _finding(
        "imbalance", f"Imbalance: rank {waiter} waits {share[waiter]:.0f}% of its step for rank {slow}",
        evidence, cause, knob, value, note,
        f"about {wait_ms:,.0f} ms less per step on rank {waiter} once rank {slow} keeps pace",
        slow_rank=int(slow) if slow.lstrip("-").isdigit() else slow, slow_compute_ms=round(slow_compute, 3))


def _slowest_op(ranks: dict, slow: str) -> str:
    """"; its aten::mm takes 900 ms a step against 600 ms": the op (self time) that differs most."""
    def per_step(rank: str) -> dict[str, float]:
        n = max(len(ranks[rank].get("steps", [])), 1)
        return {op["name"]: op.get("self_ms", op["total_ms"]) / n for op in ranks[rank].get("top_ops") or []}

    mine = per_step(slow)
    others = [per_step(r) for r in ranks if r != slow]
    best, gap = None, 0.0
    for name, ms in mine.items():
        rest = [o[name] for o in others if name in o]
        if rest and ms - max(rest) > gap:
            best, gap = name, ms - max(rest)
    if best is None:
        return ""
    rest = max(o[best] for o in others if best in o)
    return f"; its {best} takes {mine[best]:,.0f} ms a step (self time) against {rest:,.0f} ms"


# -- a pipeline's stages -------------------------------------------------------------------------

def _stage_balance(ranks: dict, cfg: dict) -> dict | None:
    """A pipeline whose head's rank (the last; rank 0 of a V, which holds both ends) computes much
    more than the mean pipeline rank: the whole pipeline runs at its pace, the other ranks waiting at
    their sends and receives, whatever the schedule. Fewer blocks on the head's stage even the ranks
    out: the planner's balanced split (plan/shapes.balanced_split) is the value to try. Ranks are
    placed pp outermost (rank // (world / pp) is the pipeline rank)."""
    par = cfg.get("parallel", {})
    pp, schedule = int(par.get("pp") or 1), par.get("pp_schedule", "1f1b")
    if pp < 2 or len(ranks) % pp or not all(r.isdigit() for r in ranks):
        return None
    per_stage = len(ranks) // pp
    by_rank: dict[int, list[float]] = defaultdict(list)
    for rank, info in ranks.items():
        if info.get("steps"):
            by_rank[int(rank) // per_stage].append(_mean(_ms(s, "compute") for s in info["steps"]))
    if len(by_rank) < pp:
        return None
    compute = {r: _mean(v) for r, v in by_rank.items()}
    mean = _mean(compute.values())
    head = 0 if schedule in ("zbv", "dualpipev") else pp - 1
    if mean <= 0 or compute[head] < STAGE_IMBALANCE * mean or compute[head] < max(compute.values()):
        return None
    now = par.get("pp_stage_layers") or []
    split, even, gain = _balanced_split(cfg, pp, schedule, int(par.get("pp_virtual_stages") or 1))
    now_text = f"now {list(now)}" if now else "now an even split" + (f", {even}" if even else "")
    if split and list(split) != list(now):
        knob, value, note = "parallel.pp_stage_layers", list(split), (
            f"{now_text}: fewer blocks on the head's stage, more on the others, balanced by FLOPs "
            "(`loom plan --explain` prices the split)")
        effect = f"about {gain:.0%} less compute on the busiest rank, the pace of the whole pipeline"
    else:
        knob, value, note = None, None, (
            f"{now_text}: move blocks off the head's stage with parallel.pp_stage_layers (fewer there, "
            "more on the others), or give the pipeline fewer stages (a smaller parallel.pp)")
        effect = f"up to {1 - mean / compute[head]:.0%} shorter steps once the ranks compute alike"
    where = "rank 0 of the V, which holds the first and the last stage" if head == 0 else \
        f"pipeline rank {head}, the last stage"
    return _finding(
        "stages", f"Pipeline stages unbalanced: the head's rank computes {compute[head] / mean:.2f}× the "
        "mean",
        "compute per step by pipeline rank: " + ", ".join(f"{r}: {compute[r]:,.0f} ms"
                                                           for r in sorted(compute))
        + f" (the mean {mean:,.0f} ms); the head's is {where}",
        "the stage holding the head also runs the vocabulary-sized output matmul and the loss beside its "
        "blocks, so it computes longest and every other rank waits for it at its sends and receives",
        knob, value, note, effect, head_rank=head)


def _balanced_split(cfg: dict, pp: int, schedule: str, virtual: int) -> tuple[tuple, list, float]:
    """(the planner's balanced split, the even split, the busiest rank's FLOPs it saves) of the run's
    loom GPT; ((), [], 0) where the model's shape is not known here (a pretrained folder)."""
    from loom.config import load_config_text, stages_per_rank, to_toml
    from loom.errors import LoomError
    from loom.plan.command import model_shape
    from loom.plan.shapes import balanced_split, rank_flops_per_token, with_stage_split

    try:
        config = load_config_text(to_toml(cfg), "the run's config.toml")
        if config.model.init_from:
            return (), [], 0.0
        shape = model_shape(config, None, None)
    except LoomError:
        return (), [], 0.0
    seq = config.data.seq_len
    per = stages_per_rank(schedule, virtual)
    if not shape.known or pp * per > shape.n_layers:  # not a pipeline that ran
        return (), [], 0.0
    even = with_stage_split(shape, ())
    split = balanced_split(even, seq, pp, schedule, virtual)
    args = (seq, pp, schedule, virtual)
    gain = 1 - max(rank_flops_per_token(with_stage_split(shape, split), *args)) / \
        max(rank_flops_per_token(even, *args)) if split else 0.0
    return split, list(even.stage_sizes(pp * per)), gain


# -- exposed transfer, by collective kind ---------------------------------------------------------

def _exposed_by_kind(ranks: dict, waits: dict, matched: list[dict], cfg: dict,
                     planned_bubble: float | None = None) -> list[dict]:
    """Exposed communication less the waiting for a slower rank, shared among the collective
    kinds by their transfer time (context parallelism's exchange takes what the ledger measured as
    its own); a finding for each kind holding a quarter of it or more."""
    transfer: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))  # rank -> kind -> ms
    if matched:
        for m in matched:
            for rank, v in m["per_rank"].items():
                transfer[str(rank)][m["kind"]] += v["transfer_ms"]
    else:
        for rank, info in ranks.items():
            for c in info.get("collectives", []):
                transfer[rank][c["kind"]] += c.get("duration_ms", 0.0)
    per_kind: dict[str, list[float]] = defaultdict(list)  # kind -> exposed share per rank-step
    shares = []
    for rank, info in ranks.items():
        kinds = transfer.get(rank, {})
        for s in info.get("steps", []):
            if s["wall_ms"] <= 0:
                continue
            exposed = max(_ms(s, "comm_exposed") - waits.get(rank, {}).get(s.get("step"), 0.0), 0.0)
            shares.append(100 * exposed / s["wall_ms"])
            for kind, ms in _split_exposed(exposed, s, kinds).items():
                per_kind[kind].append(100 * ms / s["wall_ms"])
    exposed = _mean(shares)
    if exposed < SHARE:
        return []
    overall = {k: sum(v) / len(shares) for k, v in per_kind.items()}
    if not overall:  # exposed time with no collective recorded (sizes and kinds unknown)
        overall = {"unknown": exposed}
    layout = _layout(ranks, cfg) | {"planned_bubble": planned_bubble}
    wall = _mean(s["wall_ms"] for s in _steps(ranks))
    groups: dict[tuple, list[tuple[str, float]]] = {}  # kinds one key moves share one finding
    ranked = sorted(overall.items(), key=lambda kv: -kv[1])
    for i, (kind, share) in enumerate(ranked):
        if i and share < exposed / 4:
            break
        groups.setdefault(_kind_knob(kind, layout), []).append((kind, share))
    out = []
    for (knob, value, note), members in groups.items():
        kind, share = " + ".join(k for k, _ in members), sum(v for _, v in members)
        out.append(_finding(
            "comm", f"{kind} exposed: {share:.0f}% of the step waits on the transfers",
            f"exposed communication {exposed:.0f}% of a {wall:.1f} ms step once waiting for slower ranks is "
            f"taken out; {kind} {share:.0f}% ({share * wall / 100:.1f} ms per step); by kind "
            + ", ".join(f"{k} {v:.0f}%" for k, v in ranked) + f"; layout {layout['label']}",
            _CP_CAUSE.get(kind, f"{kind} transfers run after the compute that could hide them"), knob, value,
            note, f"up to {share:.0f}% shorter steps as {kind} overlaps compute"
            if kind not in (*CP_KINDS, *EP_KINDS, MUON_ALLTOALL) else
            f"up to {share:.0f}% shorter steps as less of the exchange waits", kind=kind))
    return out


def _split_exposed(exposed: float, step: dict, kinds: dict[str, float]) -> dict[str, float]:
    """A step's exposed ms per kind, shared by transfer time; EP's all-to-alls and CP's exchange take
    the parts the ledger measured as their own (`ep_exposed_ms`, `cp_exposed_ms`), the other kinds
    the rest."""
    def by_transfer(ms: float, members: dict[str, float]) -> dict[str, float]:
        total = sum(members.values())
        return {k: ms * t / total if total else 0.0 for k, t in members.items()}

    ep = {k: t for k, t in kinds.items() if k in EP_KINDS}
    if ep and step.get("ep_exposed_ms") is not None and len(ep) < len(kinds):
        ep_ms = min(step["ep_exposed_ms"], exposed)
        others = {k: t for k, t in kinds.items() if k not in EP_KINDS}
        return by_transfer(ep_ms, ep) | _split_exposed(exposed - ep_ms, step, others)
    cp = {k: t for k, t in kinds.items() if k in CP_KINDS}
    rest = {k: t for k, t in kinds.items() if k not in CP_KINDS}
    if not cp or step.get("cp_exposed_ms") is None or not rest:
        return by_transfer(exposed, kinds)
    cp_ms = min(step["cp_exposed_ms"], exposed)
    return by_transfer(cp_ms, cp) | by_transfer(exposed - cp_ms, rest)


def _heads(cfg: dict) -> tuple[int, int] | None:
    """The run's attention heads and kv heads, where its config says (a loom GPT preset or overrides;
    a model from init_from brings its own shape, not known here)."""
    model = cfg.get("model", {})
    if model.get("init_from"):
        return None
    base = PRESETS.get(model.get("preset", "small"))
    heads = model.get("n_heads") or (base.n_heads if base else None)
    kv = model.get("n_kv_heads") or (base.n_kv_heads if base else None)
    return (heads, kv) if heads and kv else None


def _layout(ranks: dict, cfg: dict) -> dict:
    """What ran: strategy, engine, tp, pp and the FSDP units (one reduce-scatter each per step)."""
    par = cfg.get("parallel", {})
    counts: dict[str, float] = defaultdict(float)
    sizes: dict[str, float] = defaultdict(float)
    stepped = [info for info in ranks.values() if info.get("steps")]
    for info in stepped:
        for c in info.get("collectives", []):
            counts[c["kind"]] += 1 / len(info["steps"]) / len(stepped)
            sizes[c["kind"]] = max(sizes[c["kind"]], c.get("bytes") or 0)
    strategy = par.get("strategy")
    if strategy is None:  # not a loom run: what its collectives say
        strategy = "fsdp" if counts.get("reduce_scatter") or counts.get("all_gather") else "ddp"
    units = round(counts.get("reduce_scatter") or counts.get("all_gather") or 0)
    layout = {"strategy": strategy, "engine": par.get("engine", "torch"), "tp": par.get("tp", 1),
              "pp": par.get("pp", 1), "cp": par.get("cp"), "ep": par.get("ep"), "heads": _heads(cfg),
              "experts": moe_config(cfg).get("experts"), "units": units,
              "unit_mib": max(sizes.get("all_gather", 0), sizes.get("reduce_scatter", 0)) / 2**20, **par}
    label = f"{strategy}" + (f" ({layout['engine']})" if layout["engine"] != "torch" else "")
    if strategy in (*_SHARDED, "fsdp"):
        label += f", {units} FSDP unit(s) per step"
    label += "".join(f", {k} {layout[k]}" for k in ("tp", "pp") if layout[k] > 1)
    if (layout["cp"] or 1) > 1:
        label += f", cp {layout['cp']} ({layout.get('cp_mode', 'ring')})"
    if (layout["ep"] or 1) > 1:
        label += f", ep {layout['ep']}"
    layout["label"] = label
    layout["n_layers"] = _layers(cfg)
    return layout


def _kind_knob(kind: str, layout: dict) -> tuple[str | None, object, str]:
    """The key that moves a kind's exposed transfer, for the layout that ran: (key, value, note)."""
    strategy, tp, pp = layout["strategy"], layout["tp"], layout["pp"]
    if kind in CP_KINDS:
        return _cp_knob(kind, layout)
    if kind in EP_KINDS:
        return _ep_knob(layout)
    if kind == MUON_ALLTOALL:
        return "train.optimizer", "adamw", ("Muon's gathers and scatters move every matrix once a step, "
                                            "in the optimizer step; AdamW steps shards where they are "
                                            "(hybrid sharding, parallel.strategy = hsdp, keeps them "
                                            "within the smaller shard group)")
    if layout["engine"] == "deepspeed" and kind in ("all_gather", "reduce_scatter", "all_reduce"):
        return None, None, ("DeepSpeed overlaps ZeRO's collectives itself: overlap_comm and the bucket sizes "
                            "in the JSON of parallel.deepspeed_config")
    if tp > 1 and (kind == "all_reduce" or (kind in ("all_gather", "reduce_scatter")
                                            and strategy not in (*_SHARDED, "fsdp"))):
        return "parallel.tp", max(tp // 2, 1), (f"now {tp}: tensor-parallel collectives sit on the critical "
                                                "path of every layer; fewer tp ranks, within one node")
    if kind in ("all_gather", "reduce_scatter") and strategy in (*_SHARDED, "fsdp"):
        if layout["units"] <= 1:
            unit = layout["unit_mib"]
            size = max(1, int(unit // 4)) if unit else 1
            now = layout.get("fsdp_unit_mb")
            return "parallel.fsdp_unit_mb", size, (
                f"now {now if now is not None else 'unknown'}: the model is one FSDP unit"
                + (f" of {unit:.1f} MiB" if unit else "") + ", so its gather and reduce-scatter have no "
                "compute to run under; smaller units overlap each other's transfers with their compute")
        prefetch = int(layout.get("fsdp_prefetch", 1))
        return "parallel.fsdp_prefetch", prefetch + 1, (
            f"now {prefetch}: gather the next FSDP units earlier"
            + ('; or keep parameters gathered through backward: parallel.strategy = "zero2"'
               if strategy == "zero3" and kind == "all_gather" else ""))
    if kind == "all_reduce" and strategy in ("ddp", "zero1"):
        bucket = float(layout.get("ddp_bucket_mb", 25.0))
        return "parallel.ddp_bucket_mb", max(bucket / 2, 1.0), (
            f"now {bucket:g}: smaller buckets start reducing earlier in backward")
    if kind == "all_reduce":
        return None, None, ("the all-reduces of a sharded run are small (the loss, the gradient norm, loom's "
                            "stop agreement): latency, not a layout setting; fewer optimizer steps per "
                            "token (a larger train.batch_size) amortize them")
    if kind in ("p2p", "send", "recv") and pp > 1:
        return _schedule_knob(layout)
    if kind in ("p2p", "send", "recv"):
        return None, None, "point-to-point transfers come from the model's own code, not from loom's layout"
    if kind == "all_to_all":
        return None, None, ("all-to-all comes from the model's own code (expert or context-parallel layers): "
                            "no loom key moves it; keep the exchange within a node, or exchange less")
    return None, None, f"{kind} on the step's path comes from the step's own code (a barrier, a broadcast)"


def _schedule_knob(layout: dict) -> tuple[str | None, object, str]:
    """Exposed pipeline p2p is the bubble: ranks wait for their neighbour stage. The V schedules fill
    it with deferred weight gradients (zbv) or overlap one micro-batch's forward with another's
    backward (dualpipev, which also hides expert all-to-alls: the pick under ep > 1). Both put two
    stages on each rank, so they need 2·pp layers and at least 2·pp micro-batches."""
    pp, schedule = int(layout["pp"]), layout.get("pp_schedule", "1f1b")
    micro = int(layout.get("microbatches") or 0) or pp
    layers = layout.get("n_layers")
    planned = layout.get("planned_bubble")
    now = f"now {schedule}" + (f", planned bubble {planned:.2f}" if planned is not None else "")
    if schedule in ("zbv", "dualpipev"):
        return "parallel.microbatches", 2 * micro, (f"{now}, {micro} micro-batches: more, smaller "
                                                    "micro-batches shorten the V's ramp-up and ramp-down")
    target = "dualpipev" if (layout.get("ep") or 1) > 1 and layout.get("experts") else "zbv"
    missing = [f"parallel.microbatches ≥ {2 * pp} (now {micro})"] if micro < 2 * pp else []
    if layers is not None and layers < 2 * pp:
        missing.append(f"model.n_layers ≥ {2 * pp} (now {layers})")
    if not missing:
        return "parallel.pp_schedule", target, (
            f"{now}: {target} places two stages per rank in a V and fills the bubble "
            + ("by overlapping one micro-batch's forward with another's backward (and its all-to-alls)"
               if target == "dualpipev" else "with deferred weight gradients")
            + "; `loom plan --explain` prices its bubble" + ("" if layers is not None else
                                                               f" (needs model.n_layers ≥ {2 * pp})"))
    if schedule == "gpipe":
        return "parallel.pp_schedule", "1f1b", (f"{now}: 1F1B sends while the next micro-batch computes; "
                                                f"{target} would need " + " and ".join(missing))
    return "parallel.microbatches", max(2 * micro, 2 * pp), (
        f"{now}: more, smaller micro-batches keep the stages computing; pp_schedule = \"{target}\" "
        "would empty the bubble once " + " and ".join(missing))


def _cp_knob(kind: str, layout: dict) -> tuple[str | None, object, str]:
    """Exposed CP exchange. Ring: each hop's k/v transfer hides under the attention of the block
    before it, which the chunk length (sequence / cp) sets: attention per hop grows with its square,
    the transfer with it. All-to-all (Ulysses) moves q, k, v and the output at once, on the critical
    path, about (h + kv') / (kv · cp) of the ring's bytes, where the h heads divide by cp (kv' = kv
    when the kv heads do too, else h: context_parallel.py repeats them to the query heads)."""
    cp, heads = layout.get("cp"), layout.get("heads")
    if not cp or cp < 2:
        return None, None, ("context parallelism's exchange with the layout unknown (no config.toml): fewer "
                            "ranks in parallel.cp, or the other parallel.cp_mode")
    if kind == "cp_alltoall":
        return "parallel.cp_mode", "ring", (
            f"now alltoall over {cp} ranks: its all-to-alls wait before and after attention; the ring passes "
            "k/v blocks while each block's attention computes, hidden once sequence / cp is long enough")
    fewer = ("parallel.cp", cp // 2, (
        f"now {cp}: each hop's attention over sequence / {cp} is too short to hide the next k/v block; half "
        "the ranks double the chunk: attention per hop ×4, its transfer ×2 (more activation memory per "
        "rank; a larger micro-batch grows both alike and does not help)"))
    if heads is None:
        return fewer[0], fewer[1], fewer[2] + '; or parallel.cp_mode = "alltoall" where the attention heads '\
            "and kv heads divide by cp"
    h, kv = heads
    ratio = (h + (h if kv % cp else kv)) / (kv * cp)
    if h % cp or ratio >= 1:
        return fewer
    return "parallel.cp_mode", "alltoall", (
        f"now ring over {cp} ranks: its {h} heads divide by {cp} and the all-to-alls would move {ratio:.2f}× "
        f"the ring's bytes ({kv} kv heads; exposed, but fewer); or fewer ranks: parallel.cp = {cp // 2}")


def _ep_knob(layout: dict) -> tuple[str | None, object, str]:
    """Exposed EP all-to-all. Each MoE block sends its tokens' rows to their experts' ranks and back
    (again in backward) on the critical path, between the router and the experts; fewer ep ranks
    keep the exchange within fewer ranks (one node's links rather than the network) and send fewer
    rows away (a token's expert is on its own rank for 1/ep of its choices), at the cost of more
    experts, and their memory, per rank. The next smaller ep that divides this one (so that it still
    divides the experts and the data-parallel ranks); from 2, none."""
    ep = layout.get("ep")
    if not ep or ep < 2:
        return None, None, ("expert parallelism's all-to-all with the layout unknown (no config.toml): fewer "
                            "ranks in parallel.ep, within one node")
    pp, schedule = int(layout.get("pp") or 1), layout.get("pp_schedule", "1f1b")
    if pp > 1 and schedule == "dualpipev" and layout.get("dualpipev_overlap") is False:
        return "parallel.dualpipev_overlap", True, (
            "now false: DualPipeV's paired forward and backward run one after the other; overlapped, each "
            "one's all-to-alls run under the other's compute")
    micro = int(layout.get("microbatches") or 0) or pp
    layers = layout.get("n_layers")
    if pp > 1 and schedule != "dualpipev" and micro >= 2 * pp and (layers is None or layers >= 2 * pp):
        return "parallel.pp_schedule", "dualpipev", (
            f"now {schedule}: DualPipeV pairs one micro-batch's forward with another's backward, each one's "
            "all-to-alls under the other's compute (two stages per rank in a V)")
    fewer = max(d for d in range(1, ep) if ep % d == 0)
    experts = layout.get("experts")
    held = f"{experts // ep} → {experts // fewer} experts per rank" if experts else \
        f"{ep // fewer}× the experts per rank"
    if fewer == 1:
        return "parallel.ep", 1, (f"now 2: no all-to-all at all, every rank holds every expert ({held}); "
                                  "FSDP still shards them over the data-parallel ranks")
    return "parallel.ep", fewer, (
        f"now {ep}: each MoE block's dispatch and combine wait on the slowest of {ep} ranks; {fewer} ranks "
        f"keep the all-to-all within fewer ranks (one node: its own links, not the network) and keep more "
        f"of each token's experts at home ({held}: more memory per rank)")


# -- a mixture of experts' routing --------------------------------------------------------------

def _layers(cfg: dict) -> int | None:
    """The model's blocks: config.toml's model.n_layers, else its preset's (None: unknown)."""
    model = cfg.get("model", {})
    base = None if model.get("init_from") else PRESETS.get(model.get("preset", "small"))
    return model.get("n_layers") or (base.n_layers if base is not None else None)


def moe_config(cfg: dict) -> dict:
    """The run's mixture of experts as its config says (config.toml's model.moe_* keys, else the
    preset's values; a model from init_from brings its own, not known here): experts, top_k,
    aux_loss_coef, bias_update_rate, capacity_factor, each None where unknown."""
    model = cfg.get("model", {})
    base = None if model.get("init_from") else PRESETS.get(model.get("preset", "small"))
    keys = {"experts": "moe_experts", "top_k": "moe_top_k", "aux_loss_coef": "moe_aux_loss_coef",
            "bias_update_rate": "moe_bias_update_rate", "capacity_factor": "moe_capacity_factor"}
    out = {}
    for name, key in keys.items():
        value = model.get(key)
        out[name] = value if value is not None else (getattr(base, key) if base is not None else None)
    return out


def _expert_load(moe: dict | None, cfg: dict) -> list[dict]:
    """Findings from a mixture of experts' routing over the analysed steps (analyze.py's
    `analysis["moe"]`): the busiest expert's load over the mean, and the share of the routed choices
    dropped at the experts' capacity."""
    if not moe:
        return []
    out = []
    cf = moe_config(cfg)
    steps = moe.get("steps") or []
    over = f"the median over {len(steps)} {'profiled' if moe.get('profiled') else 'logged'} step(s)"
    imbalance = moe.get("load_imbalance")
    if imbalance is not None and imbalance > EXPERT_IMBALANCE:
        tokens = moe.get("expert_tokens")
        spread = ""
        if tokens and sum(tokens):
            mean = sum(tokens) / len(tokens)
            busiest = max(range(len(tokens)), key=tokens.__getitem__)
            spread = (f"; over those steps expert {busiest} took {tokens[busiest] / mean:.2f}× the mean "
                      f"of the {len(tokens)} experts' tokens, the least busy {min(tokens) / mean:.2f}×")
        rate, coef = cf.get("bias_update_rate"), cf.get("aux_loss_coef")
        if rate:  # aux-loss-free balancing runs: its bias moves too slowly
            knob, value = "model.moe_bias_update_rate", rate * 10
            note = (f"now {rate:g}: the experts' bias moves by this much per step towards the balanced load; "
                    "faster, it catches the router's drift (or raise model.moe_aux_loss_coef)")
        elif coef:
            knob, value = "model.moe_aux_loss_coef", coef * 10
            note = (f"now {coef:g}: a stronger auxiliary loss pulls the router towards equal loads; too "
                    "strong, it costs the language-model loss: watch moe_aux_loss and the loss")
        else:
            knob, value = "model.moe_aux_loss_coef", 0.01
            note = ("now 0: nothing balances the router" if coef == 0 else
                    "now unknown (the model of model.init_from): 0.01 is the usual weight, ×10 if it "
                    "already is")
            note += "; or aux-loss-free balancing: model.moe_bias_update_rate = 0.001"
        ep = cfg.get("parallel", {}).get("ep") or 1
        out.append(_finding(
            "moe", f"Expert load imbalance: the busiest expert takes {imbalance:.2f}× the mean load",
            f"moe_load_imbalance {imbalance:.2f} (the busiest expert's tokens over the mean, in the worst "
            f"MoE block; {over}), above {EXPERT_IMBALANCE:g}{spread}",
            "the router sends more tokens to some experts than to others, and each MoE block waits for its "
            "busiest expert" + (f" (under expert parallelism over {ep} ranks every rank waits at the combine "
                                "all-to-all for the rank holding it)" if ep > 1 else "")
            + ("; at their capacity the busiest experts drop tokens" if cf.get("capacity_factor") else ""),
            knob, value, note,
            f"the busiest expert's load towards the mean: up to {1 - 1 / imbalance:.0%} less time in the "
            "routed experts' slowest path"))
    share = moe.get("dropped_pct")
    if share is not None and share > DROPPED_SHARE and cf.get("capacity_factor") != 0:
        capacity = cf.get("capacity_factor")
        if capacity:
            knob, value = "model.moe_capacity_factor", capacity * 2
            note = (f"now {capacity:g}: each expert takes at most capacity × top-k × tokens / experts of a "
                    "sequence's choices; or 0 for dropless routing, where every choice reaches its expert "
                    "and the busiest one sets the block's time")
        else:
            knob, value = "model.moe_capacity_factor", 0
            note = ("now unknown (the model of model.init_from): dropless routing, where every choice "
                    "reaches its expert and the busiest one sets the block's time")
        out.append(_finding(
            "moe", f"{share:.1f}% of the routed tokens are dropped at the experts' capacity",
            f"moe_dropped is {share:.1f}% of the tokens × top-k routed ({over}, every MoE block), above "
            f"{DROPPED_SHARE:g}%",
            "experts chosen by more of a sequence's tokens than their capacity skip the rest: those tokens "
            "pass the block on the residual (and the shared experts) only", knob, value, note,
            "no dropped tokens: every token is trained through its experts"
            + ("; balance the load too (the expert load finding)" if out else "")))
    return out
