"""Findings from a step ledger, in the order an expert debugs a slow step.

1. Compute share first: when compute is not most of the step, which of IO, exposed
   communication (a late peer, or collectives not hidden under compute) or idle host time takes
   the rest.
2. Then the forward / backward / optimizer split.
3. Then the specific op, kernel or collective (host syncs, tiny kernels).
Each finding names the evidence (numbers), the likely cause, the config key and value to try and
the expected effect. A healthy ledger gives no finding.
"""

from __future__ import annotations

import statistics

# A part of the step worth a finding (percent of wall time).
SHARE = 15.0


def _mean(values) -> float:
    values = list(values)
    return statistics.fmean(values) if values else 0.0


def _steps(ranks: dict) -> list[dict]:
    return [s for info in ranks.values() for s in info.get("steps", [])]


def _share(steps: list[dict], part: str) -> float:
    return _mean(s["shares"][part] for s in steps)


def _finding(category: str, title: str, evidence: str, cause: str, knob: str, value: str,
             effect: str) -> dict:
    return {"category": category, "title": title, "evidence": evidence, "cause": cause, "knob": knob,
            "value": value, "expected_effect": effect}


def diagnose(analysis: dict, config: dict | None = None) -> list[dict]:
    """`analysis`: {"ranks": {rank: {"steps", "collectives", ...}}, "stragglers": [...]};
    `config`: the run's resolved loom config (as a dict) when known, to name current values."""
    ranks = analysis.get("ranks", {})
    steps = _steps(ranks)
    if not steps:
        return []
    cfg = config or {}
    data_cfg, par = cfg.get("data", {}), cfg.get("parallel", {})
    findings: list[dict] = []
    wall = _mean(s["wall_ms"] for s in steps)
    compute = _share(steps, "compute")

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
            "data.num_workers", (f"{suggest} (now {workers if workers is not None else 'unknown'}); and "
                                 "data.prefetch_factor ≥ 2"),
            f"up to {io:.0f}% shorter steps once loading overlaps compute"))

    for s in analysis.get("stragglers", []):
        rank = str(s["rank"])
        mine = ranks.get(rank, {}).get("steps", [])
        others = [st for r, info in ranks.items() if r != rank for st in info.get("steps", [])]
        own_io, own_idle = _share(mine, "io") if mine else 0.0, _share(mine, "idle") if mine else 0.0
        waiting = _share(others, "comm_exposed") if others else 0.0
        knob, value = ("data.num_workers",
                       "more workers on every rank (rank's IO is high)") if own_io >= SHARE else \
            ("the host of rank " + rank, "remove what stalls it before each step (sleeps, CPU contention, "
             "a slow disk, uneven data)")
        findings.append(_finding(
            "straggler", f"Rank {rank} is a straggler; the other ranks wait for it",
            f"{s['evidence']}; rank {rank}'s step is {own_idle:.0f}% idle and {own_io:.0f}% IO, the others' "
            f"{waiting:.0f}% exposed communication",
            f"rank {rank} reaches each collective late, so every collective waits for it", knob, value,
            f"about {s['late_ms_mean']:.1f} ms less per step on the other ranks "
            f"(their exposed communication {waiting:.0f}% → near the transfer time)"))

    comm = _share(steps, "comm_exposed")
    if comm >= SHARE and not analysis.get("stragglers"):
        overlap = _mean(s.get("overlap_pct", 0.0) for s in steps)
        kinds = {}
        for info in ranks.values():
            for c in info.get("collectives", []):
                kinds[c["kind"]] = kinds.get(c["kind"], 0.0) + c.get("duration_ms", 0.0)
        sharded = (kinds.get("all_gather", 0.0) + kinds.get("reduce_scatter", 0.0)
                   > kinds.get("all_reduce", 0.0))
        if sharded:
            knob, value = "parallel.fsdp_prefetch", (f"{int(par.get('fsdp_prefetch', 1)) + 1} (gather the "
                                                     "next FSDP units earlier); or parallel.strategy=zero2 "
                                                     "to keep parameters gathered through backward")
        else:
            bucket = par.get("ddp_bucket_mb", 25.0)
            knob, value = "parallel.ddp_bucket_mb", (f"{max(bucket / 2, 1):g} (now {bucket:g}): smaller "
                                                     "buckets start reducing earlier in backward")
        findings.append(_finding(
            "comm", f"Communication is exposed: {comm:.0f}% of the step waits on collectives",
            f"exposed {comm:.0f}%, overlap {overlap:.0f}% of collective time hidden under compute; by kind "
            + ", ".join(f"{k} {v:.1f} ms" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])),
            "collectives run after the compute that could hide them", knob, value,
            f"up to {comm:.0f}% shorter steps as more of the communication overlaps compute"))

    idle = _share(steps, "idle")
    if idle >= SHARE and not analysis.get("stragglers"):
        findings.append(_finding(
            "idle", f"The step is {idle:.0f}% idle",
            f"idle {idle:.0f}% of a {wall:.1f} ms step: nothing computing, communicating or loading",
            "host-side gaps: Python overhead between small ops, synchronizations, sleeps", "train.compile",
            "true (fewer, larger kernels and less Python per step)", f"up to {idle:.0f}% shorter steps"))

    # 2. The forward / backward / optimizer split.
    opt = _mean(100 * s.get("optimizer_ms", 0.0) / s["wall_ms"] for s in steps if s["wall_ms"] > 0)
    if opt >= 30.0:
        findings.append(_finding(
            "optimizer", f"The optimizer step takes {opt:.0f}% of the step",
            f"optimizer {opt:.0f}%, forward {_mean(s.get('forward_ms', 0) for s in steps):.1f} ms, backward "
            f"{_mean(s.get('backward_ms', 0) for s in steps):.1f} ms, optimizer "
            f"{_mean(s.get('optimizer_ms', 0) for s in steps):.1f} ms per step",
            "a per-parameter optimizer loop (many small kernels) or states far from the compute",
            "train.optimizer_impl", "fused on GPUs (foreach on CPU)",
            "the optimizer share falls to a few percent of the step"))

    # 3. The specific op: host syncs in the step, tiny kernels.
    syncs = _mean(s.get("host_syncs", 0) for s in steps)
    if syncs >= 1:
        findings.append(_finding(
            "sync", f"{syncs:.0f} host synchronization(s) per step outside the optimizer",
            f"{syncs:.1f} ops per step that read a tensor's value on the host (aten::item / "
            "_local_scalar_dense / stream syncs), each one stalls the host until the device catches up",
            "a .item(), .cpu(), print or Python branch on a tensor inside the training step",
            "code: the training step",
            "read losses and metrics a step late (as loom does) instead of .item()",
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
                "many tiny kernels: launch overhead and unfused elementwise ops", "train.compile", "true",
                "fewer, fused kernels; compute share rises"))
    return findings
