"""RUN/report.html, written at the end of every run: the loss and eval curves, tokens/s, memory
per rank against the plan, and the plan's summary, from the run's own records (metrics.jsonl,
summary.json, memory.json, plan.json). Self-contained like the ledger report (loom/observe/report.py,
whose styles it shares): inline SVG, nothing fetched, every text escaped.

It replaces only a report.html that loom wrote (this page, or `loom analyze`'s ledger report, which
then adds the same curves): a user's own file of that name stays.
"""

from __future__ import annotations

from pathlib import Path

from loom.checked import BadFile, read_json
from loom.files import atomic_write
from loom.observe import curves
from loom.observe.report import _CSS, _e, _num, _pair_bar, _section, _table, size_text

REPORT = "report.html"
TITLE = "loom run report · "
LEDGER_TITLE = "loom step ledger "  # loom analyze's page (report.render_html)
MAX_RECORD_BYTES = 64 << 20


def is_loom_report(path: Path) -> bool:
    """A report.html that loom wrote: this page or the ledger report, by its title."""
    try:
        with path.open("rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return head.startswith(b"<!DOCTYPE html>") and any(
        f"<title>{t}".encode() in head for t in (TITLE, LEDGER_TITLE))


def write_run_report(run_dir: Path) -> Path | None:
    """RUN/report.html from the run's records; None (nothing written) where a report.html that is not
    loom's stands there. A symbolic link there is replaced, its target untouched."""
    path = run_dir / REPORT
    if path.exists() and not path.is_symlink() and not is_loom_report(path):
        return None
    atomic_write(path, render_run_report(run_dir).encode("utf-8"))
    return path


def render_run_report(run_dir: Path) -> str:
    summary, memory, plan = (_record(run_dir / n) for n in ("summary.json", "memory.json", "plan.json"))
    body = [_header(run_dir.name, summary, plan)]
    body += [_section(sid, title, html) for sid, title, html in curves.sections(
        curves.read_curves(run_dir / "metrics.jsonl"))]
    body += [_memory(summary, memory), _plan(plan)]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width,initial-scale=1\">"
            f"<title>{_e(TITLE + run_dir.name)}</title><style>{_CSS}</style></head>"
            f"<body><main>{''.join(b for b in body if b)}</main></body></html>\n")


def _record(path: Path) -> dict:
    """A JSON record of the run, or {} where it is absent, too big or unreadable (the page shows less)."""
    if not path.is_file():
        return {}
    try:
        doc = read_json(path, max_bytes=MAX_RECORD_BYTES)
    except BadFile:
        return {}
    return doc if isinstance(doc, dict) else {}


def _header(name: str, summary: dict, plan: dict) -> str:
    first, final, held, tps = (_num(summary.get(k)) for k in ("first_loss", "final_loss", "eval_loss",
                                                               "tokens_per_s"))
    figures = summary.get("figures") if isinstance(summary.get("figures"), dict) else {}
    mfu = _num(figures.get("mfu"))  # loom/train/run_figures.py
    items = [("strategy", summary.get("strategy") or plan.get("strategy")),
             ("steps", summary.get("steps")),
             ("loss", f"{first:.4f} → {final:.4f}" if first is not None and final is not None else None),
             ("eval loss", f"{held:.4f}" if held is not None else None),
             ("tokens/s", f"{tps:,.0f}" if tps is not None else None),
             ("MFU", f"{mfu:.1%}" if mfu is not None else None)]
    meta = "".join(f"<div><dt>{_e(k)}</dt><dd>{_e(v)}</dd></div>" for k, v in items if v not in (None, ""))
    return f'<header><h1>Run · {_e(name)}</h1><dl class="meta">{meta}</dl></header>'


def _memory(summary: dict, memory: dict) -> str:
    """Per rank: model states and the step's activation peak, measured beside planned (summary.json's
    measured_vs_planned), else memory.json's measured figures alone."""
    rows = []
    planned = summary.get("measured_vs_planned")
    if isinstance(planned, list) and planned:
        for row in planned:
            if not isinstance(row, dict):
                continue
            cells = [(_e(row.get("rank", "—")), "")]
            for key in ("model_state_bytes", "activation_peak_bytes"):
                pair = row.get(key)
                pair = pair if isinstance(pair, list) and len(pair) == 2 else [None, None]
                m, p = _num(pair[0]), _num(pair[1])
                cells += [(size_text(m), "n"), (size_text(p), "n"), (_pair_bar(m, p), "")]
            rows.append((cells, ""))
        head = [("rank", False), ("model states", True), ("planned", True), ("", False),
                ("activation peak", True), ("planned", True), ("", False)]
        note = '<p class="note">Bars: measured (blue) beside planned (grey).</p>'
        return _section("memory", "Memory per rank against the plan", _table(head, rows) + note)
    ranks = memory.get("ranks") if isinstance(memory.get("ranks"), dict) else {}
    for rank, m in ranks.items():
        if isinstance(m, dict):
            rows.append(([(_e(rank), ""), (size_text(m.get("model_state_bytes")), "n"),
                          (size_text(m.get("peak_bytes")), "n")], ""))
    if not rows:
        return ""
    return _section("memory", "Memory per rank", _table(
        [("rank", False), ("model states", True), ("peak in step", True)], rows))


def _plan(plan: dict) -> str:
    if not plan:
        return ""
    mem = plan.get("memory_bytes") if isinstance(plan.get("memory_bytes"), dict) else {}
    step, tps, mfu = (_num(plan.get(k)) for k in ("step_time_s", "tokens_per_s", "mfu"))
    layout = " × ".join(f"{k} {plan[k]}" for k in ("pp", "dp", "cp", "tp") if _num(plan.get(k)) is not None)
    items = [("layout", plan.get("label")), ("strategy", plan.get("strategy")), ("mesh", layout),
             ("micro-batch × grad_accum", f"{plan.get('micro_batch')} × {plan.get('grad_accum')}"),
             ("device", plan.get("gpu")),
             ("predicted memory per rank", size_text(mem.get("total")) if mem else None),
             ("predicted step time", f"{step:.3f} s" if step is not None else "not priced (no peak known)"),
             ("predicted tokens/s", f"{tps:,.0f}" if tps is not None else None),
             ("predicted MFU", f"{mfu:.1%}" if mfu is not None else None)]
    meta = "".join(f"<div><dt>{_e(k)}</dt><dd>{_e(v)}</dd></div>" for k, v in items if v not in (None, ""))
    return _section("plan", "The plan (plan.json)", f'<dl class="meta">{meta}</dl>')
