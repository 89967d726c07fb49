"""`loom analyze`: traces → per-rank ledger → collectives across ranks → findings → table / JSON / HTML.

Works on any torch.profiler Chrome traces (one file per rank), loom's or not. When the traces sit
in a loom run directory (RUN_DIR/traces), its config, plan and measurements join the analysis:
each is optional, and one that is there but damaged or of the wrong types is one line naming the
file and the field (loom.checked), never a traceback or a report built on garbage.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from loom.checked import Fields, read_json, read_toml
from loom.files import atomic_write
from loom.observe.diagnose import diagnose
from loom.observe.ledger import analyze_dir
from loom.observe.report import render_report
from loom.observe.stragglers import find_stragglers, match_collectives


def analyze(trace_dir: Path) -> dict:
    analysis = analyze_dir(trace_dir)
    analysis["collectives"] = match_collectives(analysis["ranks"])
    analysis["stragglers"] = find_stragglers(analysis["collectives"], analysis["ranks"])
    run_dir = trace_dir.parent if trace_dir.name == "traces" else trace_dir
    config = run_config(run_dir / "config.toml")
    analysis["run"] = {"name": run_dir.name, "strategy": (config or {}).get("parallel", {}).get("strategy"),
                       "world_size": len(analysis["ranks"])}
    analysis["plan"] = run_plan(run_dir / "plan.json")
    analysis["measured_vs_planned"] = measured_vs_planned(run_dir / "summary.json")
    analysis["findings"] = diagnose(analysis, config)
    return analysis


# -- the run's records: absent is fine (any traces can be analyzed); present, they are typed -------

MAX_RECORD_BYTES = 64 << 20


def run_config(path: Path) -> dict | None:
    """The values of a run's config.toml that the analysis names (diagnose.py's findings)."""
    if not path.is_file():
        return None
    doc = Fields(read_toml(path), path)
    par, data = doc.section("parallel", default={}), doc.section("data", default={})
    config: dict = {"parallel": {}, "data": {}}
    if "strategy" in par:
        config["parallel"]["strategy"] = par.str("strategy", nonempty=True)
    if "fsdp_prefetch" in par:
        config["parallel"]["fsdp_prefetch"] = par.int("fsdp_prefetch", min=0, max=1024)
    if "ddp_bucket_mb" in par:
        config["parallel"]["ddp_bucket_mb"] = par.float("ddp_bucket_mb", min=0, min_open=True, max=1e6)
    if "num_workers" in data:
        config["data"]["num_workers"] = data.int("num_workers", min=0, max=4096)
    return config


def run_plan(path: Path) -> dict | None:
    """plan.json as written, once the fields the report reads are of their types."""
    if not path.is_file():
        return None
    doc = Fields(read_json(path, max_bytes=MAX_RECORD_BYTES), path)
    for key in ("label", "strategy"):
        if key in doc:
            doc.str(key)
    for key in ("step_time_s", "comm_payload_bytes_per_step", "comm_bytes_per_step"):
        _number_or_null(doc, key)
    if isinstance(doc.raw.get("memory_bytes"), dict):
        _number_or_null(doc.section("memory_bytes"), "total")
    else:
        _number_or_null(doc, "memory_bytes")
    return doc.raw


def measured_vs_planned(path: Path) -> list[dict] | None:
    """summary.json's measured-vs-planned rows: per rank, [measured, planned] pairs of numbers."""
    if not path.is_file():
        return None
    rows = Fields(read_json(path, max_bytes=MAX_RECORD_BYTES), path).list("measured_vs_planned", default=None)
    for i, raw in enumerate(rows or []):
        row = Fields(raw, path, f"measured_vs_planned[{i}]")
        for key in row.keys():
            if key == "rank":
                row.int(key, min=0)
            elif key == "comm_by_kind":
                kinds = row.section(key)
                for kind in kinds.keys():
                    per_kind = kinds.section(kind)
                    for part in per_kind.keys():
                        _pair(per_kind, part)
            else:
                _pair(row, key)
    return rows


def _number_or_null(doc: Fields, key: str) -> None:
    if doc.raw.get(key) is not None:
        doc.float(key, min=0)


def _pair(doc: Fields, key: str) -> None:
    """[measured, planned]: two finite numbers, either one null (not measured, not planned)."""
    pair = doc.list(key)
    if len(pair) != 2:
        raise doc.error(key, "a [measured, planned] pair", pair)
    for value in pair:
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value)):
            raise doc.error(key, "a [measured, planned] pair of finite numbers (or null)", pair)


def render_table(analysis: dict) -> str:
    lines = [(f"{'rank':>4} {'step':>5} {'wall ms':>9} {'compute':>8} {'comm exp':>9} {'io':>6} {'idle':>6} "
              f"{'hidden ms':>9} {'overlap':>7} {'fwd ms':>8} {'bwd ms':>8} {'opt ms':>8}")]
    for rank, info in sorted(analysis["ranks"].items(), key=lambda kv: int(kv[0])):
        for w in info.get("warnings", []):
            lines.append(f"  rank {rank}: warning: {w}")
        for s in info.get("steps", []):
            sh = s["shares"]
            lines.append(f"{rank:>4} {s['step']:>5} {s['wall_ms']:9.1f} {sh['compute']:7.1f}% "
                         f"{sh['comm_exposed']:8.1f}% {sh['io']:5.1f}% {sh['idle']:5.1f}% "
                         f"{s['comm_hidden_ms']:9.1f} {s['overlap_pct']:6.0f}% "
                         f"{s['forward_ms']:8.1f} {s['backward_ms']:8.1f} {s['optimizer_ms']:8.1f}")
    kinds: dict[str, list[float]] = {}
    for info in analysis["ranks"].values():
        for c in info.get("collectives", []):
            k = kinds.setdefault(c["kind"], [0, 0, 0.0])
            k[0] += 1
            k[1] += c.get("bytes") or 0
            k[2] += c.get("duration_ms", 0.0)
    if kinds:
        lines.append("\ncollectives (all ranks): " + "; ".join(
            f"{k} ×{n}, {b / 2**20:.1f} MiB, {ms:.1f} ms" for k, (n, b, ms) in sorted(kinds.items())))
    for s in analysis.get("stragglers", []):
        lines.append(f"straggler: {s['evidence']}")
    findings = analysis.get("findings", [])
    lines.append("\nfindings:" if findings else "\nfindings: none (compute-bound, nothing to fix)")
    for i, f in enumerate(findings, 1):
        lines += [f"{i}. {f['title']}", f"   evidence: {f['evidence']}", f"   cause:    {f['cause']}",
                  f"   try:      {f['knob']} = {f['value']}", f"   expect:   {f['expected_effect']}"]
    return "\n".join(lines)


def write_outputs(analysis: dict, out_dir: Path) -> tuple[Path, Path]:
    """ledger.json and report.html beside the traces' run."""
    ledger = out_dir / "ledger.json"
    atomic_write(ledger, json.dumps(analysis, indent=1).encode())  # replaces a planted link, never follows it
    return ledger, render_report(analysis, out_dir / "report.html")
