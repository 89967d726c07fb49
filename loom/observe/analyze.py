"""`loom analyze`: traces → per-rank ledger → collectives across ranks → findings → table / JSON / HTML.

Works on any torch.profiler Chrome traces (one file per rank), loom's or not. When the traces sit
in a loom run directory (RUN_DIR/traces), its config, plan and measurements join the analysis.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from loom.observe.diagnose import diagnose
from loom.observe.ledger import analyze_dir
from loom.observe.report import render_report
from loom.observe.stragglers import find_stragglers, match_collectives


def analyze(trace_dir: Path) -> dict:
    analysis = analyze_dir(trace_dir)
    analysis["collectives"] = match_collectives(analysis["ranks"])
    analysis["stragglers"] = find_stragglers(analysis["collectives"], analysis["ranks"])
    run_dir = trace_dir.parent if trace_dir.name == "traces" else trace_dir
    config = _read(run_dir / "config.toml", tomllib.loads)
    summary = _read(run_dir / "summary.json", json.loads) or {}
    analysis["run"] = {"name": run_dir.name, "strategy": (config or {}).get("parallel", {}).get("strategy"),
                       "world_size": len(analysis["ranks"])}
    analysis["plan"] = _read(run_dir / "plan.json", json.loads)
    analysis["measured_vs_planned"] = summary.get("measured_vs_planned")
    analysis["findings"] = diagnose(analysis, config)
    return analysis


def _read(path: Path, parse):
    try:
        return parse(path.read_text())
    except (OSError, ValueError):
        return None


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
    ledger.write_text(json.dumps(analysis, indent=1))
    return ledger, render_report(analysis, out_dir / "report.html")
