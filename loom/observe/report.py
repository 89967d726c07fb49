"""One self-contained HTML page for a run's step ledger: where each rank's step time went.

The page has to open anywhere a run directory is copied to — a laptop, a cluster login node
with no internet, an attachment — so everything is inline: CSS in a <style>, charts as inline
SVG built here from the numbers, no scripts, fonts or images fetched. Every text that comes from
the analysis is escaped, since op names and evidence strings are arbitrary.

Every key except "ranks" may be missing, empty or None; a section with nothing to show is left
out rather than drawn empty.
"""

from __future__ import annotations

import html
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from loom.files import atomic_write
from loom.observe import curves
from loom.observe.diagnose import toml_value

# The ledger's four parts, in bar order: (key, label, fill, text color on the fill).
LEDGER_PARTS: tuple[tuple[str, str, str, str], ...] = (
    ("compute", "compute", "#4c78a8", "#ffffff"),
    ("comm_exposed", "exposed comm", "#e45756", "#ffffff"),
    ("io", "IO", "#f58518", "#1f2328"),
    ("idle", "idle", "#bab0ac", "#1f2328"),
)
# Context parallelism's exchange: the part of exposed comm that was CP's (ledger.py's cp_exposed_ms),
# drawn inside the exposed comm where a rank had one.
CP_PART: tuple[str, str, str, str] = ("cp_exposed", "exposed CP exchange", "#9c2f5a", "#ffffff")
# Expert parallelism's all-to-alls likewise (ledger.py's ep_exposed_ms), beside CP's.
EP_PART: tuple[str, str, str, str] = ("ep_exposed", "exposed EP all-to-all", "#6a3d9a", "#ffffff")
PHASE_PARTS: tuple[tuple[str, str, str, str], ...] = (
    ("forward_ms", "forward", "#72b7b2", "#1f2328"),
    ("backward_ms", "backward", "#b279a2", "#ffffff"),
    ("optimizer_ms", "optimizer", "#eeca3b", "#1f2328"),
    ("data_ms", "data", "#9d755d", "#ffffff"),
)
WAIT_COLOR, TRANSFER_COLOR = "#d6616b", "#54a24b"
RANK_COLORS = ("#1b9e77", "#7570b3", "#d95f02", "#e7298a", "#66a61e", "#a6761d", "#1f78b4", "#666666")

LEDGER_BAR_W = 720  # px of a 100% ledger bar
_LABEL_W, _BAR_H, _BAR_GAP = 120, 26, 10
_MAX_TABLE_ROWS, _MAX_OPS, _MAX_COLLECTIVES, _MAX_RANK_COLUMNS = 400, 20, 20, 8
OFF_PLAN = 0.25  # measured this far from planned (either way) is flagged

_CSS = """
*{box-sizing:border-box}
body{margin:0;background:#f3f4f6;color:#1f2328;font:14px/1.45 system-ui,-apple-system,"Segoe UI",
Roboto,"Liberation Sans","DejaVu Sans",sans-serif}
main{max-width:1120px;margin:0 auto;padding:20px 24px 40px}
h1{font-size:22px;margin:0 0 10px}
h2{font-size:17px;margin:0 0 10px}
h3{font-size:15px;margin:0 0 6px}
section{background:#fff;border:1px solid #d8dee4;border-radius:8px;padding:16px 20px;margin:14px 0}
.meta{display:flex;flex-wrap:wrap;gap:8px 28px;margin:0}
.meta div{display:flex;flex-direction:column}
.meta dt{font-size:12px;color:#57606a;text-transform:uppercase;letter-spacing:.03em}
.meta dd{margin:0;font-size:16px;font-weight:600}
.note{color:#57606a;font-size:13px;margin:6px 0 0}
.ok{color:#1a7f37;font-weight:600;margin:0}
.finding{border-left:4px solid #e45756;background:#fbfbfc;padding:10px 14px;margin:10px 0;\
border-radius:0 6px 6px 0}
.finding p{margin:3px 0}
.finding .k{color:#57606a;font-size:12px;text-transform:uppercase;letter-spacing:.03em;margin-right:6px}
code{background:#eef1f4;border-radius:4px;padding:1px 5px;font-size:13px;
font-family:ui-monospace,"DejaVu Sans Mono","Liberation Mono",monospace}
.legend{display:flex;flex-wrap:wrap;gap:4px 18px;margin:4px 0 8px;font-size:13px}
.legend span{display:inline-flex;align-items:center;gap:6px}
.legend i{display:inline-block;width:12px;height:12px;border-radius:2px}
svg{display:block;max-width:100%;height:auto;overflow:visible}
svg text{font-size:12px;fill:#1f2328}
.scroll{max-width:100%}
table{border-collapse:collapse;width:100%;font-size:13px;font-variant-numeric:tabular-nums}
th,td{padding:4px 8px;border-bottom:1px solid #eaeef2;text-align:left;white-space:nowrap}
th{background:#f6f8fa;font-weight:600;white-space:normal}
td.n,th.n{text-align:right}
td.name{white-space:normal;word-break:break-all;max-width:420px}
tr.straggler td{background:#fdecea}
td.straggler{background:#fdecea;font-weight:600}
.tag{display:inline-block;background:#e45756;color:#fff;border-radius:10px;padding:0 7px;font-size:11px;\
margin-left:6px}
.callout{border-left:4px solid #d6616b;background:#fdf3f3;padding:8px 12px;margin:8px 0;\
border-radius:0 6px 6px 0}
.callout p{margin:2px 0}
.off{color:#b42318;font-weight:700}
.traces a{margin-right:14px}
"""


# ---- values -------------------------------------------------------------------------------------

def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _num(x: Any) -> float | None:
    """A finite float, or None for anything missing, non-numeric, NaN or infinite."""
    if isinstance(x, bool) or x is None:
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _mean(values: Iterable[Any]) -> float | None:
    nums = [v for v in (_num(x) for x in values) if v is not None]
    return sum(nums) / len(nums) if nums else None


def _ms(v: Any) -> str:
    v = _num(v)
    if v is None:
        return "—"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.2f}" if abs(v) < 10 else f"{v:.1f}"


def _pct(share: float) -> str:
    return f"{share * 100:.0f}%" if share >= 0.1 else f"{share * 100:.1f}%"


def size_text(v: Any) -> str:
    v = _num(v)
    if v is None:
        return "—"
    units, i = ("B", "KiB", "MiB", "GiB", "TiB"), 0
    while abs(v) >= 1024 and i < len(units) - 1:
        v, i = v / 1024, i + 1
    return f"{v:.0f} B" if i == 0 else f"{v:.2f} {units[i]}"


def _f(v: float) -> str:
    """An SVG coordinate: two decimals, no trailing zeros."""
    return f"{v:.2f}".rstrip("0").rstrip(".") or "0"


def _rank_color(i: int) -> str:
    return RANK_COLORS[i] if i < len(RANK_COLORS) else f"hsl({(i * 47) % 360},55%,42%)"


def _nice_max(v: float) -> float:
    """The smallest 1/2/2.5/5 × 10^k at or above v: the top of a readable axis."""
    if v <= 0:
        return 1.0
    base = 10 ** math.floor(math.log10(v))
    for m in (1, 2, 2.5, 5, 10):
        if m * base >= v * 0.999999:
            return m * base
    return 10 * base


# ---- shaping the analysis -----------------------------------------------------------------------

def _ranks(analysis: dict) -> list[tuple[str, dict]]:
    """(rank id, rank record) sorted numerically where the ids are numbers."""
    raw = analysis.get("ranks") or {}
    items = list(raw.items()) if isinstance(raw, dict) else list(enumerate(raw))
    items = [(str(k), v if isinstance(v, dict) else {}) for k, v in items]
    return sorted(items, key=lambda kv: (0, int(kv[0]), "") if kv[0].lstrip("-").isdigit() else (1, 0, kv[0]))


def _steps(rank: dict) -> list[dict]:
    steps = [s for s in rank.get("steps") or [] if isinstance(s, dict)]
    return sorted(steps, key=lambda s: _num(s.get("step")) or 0.0)


def _step_shares(step: dict) -> dict[str, float] | None:
    """The step's four ledger shares summing to 1: its "shares", or else its milliseconds."""
    given = step.get("shares") if isinstance(step.get("shares"), dict) else {}
    parts = {k: _num(given.get(k)) for k, *_ in LEDGER_PARTS}
    if all(v is None for v in parts.values()):
        parts = {k: _num(step.get(f"{k}_ms")) for k, *_ in LEDGER_PARTS}
    clean = {k: max(v or 0.0, 0.0) for k, v in parts.items()}
    total = sum(clean.values())
    return {k: v / total for k, v in clean.items()} if total > 0 else None


def _mean_shares(rank: dict) -> dict[str, float] | None:
    """A rank's mean ledger: each step's shares averaged, so every step weighs the same."""
    per_step = [s for s in (_step_shares(st) for st in _steps(rank)) if s is not None]
    if not per_step:
        return None
    mean = {k: sum(s[k] for s in per_step) / len(per_step) for k, *_ in LEDGER_PARTS}
    total = sum(mean.values())
    return {k: v / total for k, v in mean.items()}


def _wall(step: dict) -> float | None:
    wall = _num(step.get("wall_ms"))
    if wall is not None:
        return wall
    parts = [_num(step.get(f"{k}_ms")) for k, *_ in LEDGER_PARTS]
    return sum(p for p in parts if p is not None) if any(p is not None for p in parts) else None


def _stragglers(analysis: dict) -> dict[str, dict]:
    out = {}
    for s in analysis.get("stragglers") or []:
        if isinstance(s, dict) and s.get("rank") is not None:
            out[str(s["rank"])] = s
    return out


# ---- SVG pieces ---------------------------------------------------------------------------------

def _legend(parts: Iterable[tuple[str, str]]) -> str:
    items = "".join(f'<span><i style="background:{c}"></i>{_e(label)}</span>' for label, c in parts)
    return f'<div class="legend">{items}</div>'


def _stacked_rows(rows: list[tuple[str, list[tuple[str, str, str, str, float, str]], str, bool]],
                  css_class: str, bar_w: float = LEDGER_BAR_W) -> str:
    """Horizontal stacked bars, one row per (label, segments, right text, highlighted).

    A segment is (key, label, fill, text color, width in px, text inside); the inside text is
    drawn only where it fits.
    """
    right_w = 170
    width = _LABEL_W + bar_w + right_w
    height = len(rows) * (_BAR_H + _BAR_GAP) + _BAR_GAP
    out = [f'<svg class="{css_class}" width="{width}" height="{height}" viewBox="0 0 {width} {height}">']
    for i, (label, segments, right, highlight) in enumerate(rows):
        y = _BAR_GAP + i * (_BAR_H + _BAR_GAP)
        ty = _f(y + _BAR_H / 2 + 4)
        weight = ' font-weight="700" style="fill:#b42318"' if highlight else ""
        out.append(f'<text x="{_LABEL_W - 10}" y="{ty}" text-anchor="end"{weight}>{_e(label)}</text>')
        out.append(f'<rect x="{_LABEL_W}" y="{y}" width="{_f(bar_w)}" height="{_BAR_H}" fill="#f6f8fa"/>')
        x = float(_LABEL_W)
        for key, seg_label, fill, ink, w, inside in segments:
            if w <= 0:
                continue
            out.append(f'<rect x="{_f(x)}" y="{y}" width="{_f(w)}" height="{_BAR_H}" fill="{fill}" '
                       f'data-rank="{_e(label)}" data-part="{_e(key)}"><title>{_e(label)} · {_e(seg_label)}: '
                       f'{_e(inside)}</title></rect>')
            if inside and w >= 7 * len(inside) + 6:  # about 7 px a character at 12 px
                out.append(f'<text x="{_f(x + w / 2)}" y="{ty}" text-anchor="middle" style="fill:{ink}">'
                           f'{_e(inside)}</text>')
            x += w
        if highlight:
            out.append(f'<rect x="{_LABEL_W - 2}" y="{y - 2}" width="{_f(bar_w + 4)}" height="{_BAR_H + 4}" '
                       f'fill="none" stroke="#b42318" stroke-width="2"/>')
        out.append(f'<text x="{_f(_LABEL_W + bar_w + 10)}" y="{ty}">{_e(right)}</text>')
    out.append("</svg>")
    return "".join(out)


def _mini_bar(shares: dict[str, float], width: int = 160, height: int = 12, cp: float | None = None,
              ep: float | None = None) -> str:
    """A step's ledger as a small bar; `cp`, `ep`: the shares of it CP's exchange and EP's
    all-to-alls were exposed (inside the exposed comm)."""
    out = [f'<svg class="mini" width="{width}" height="{height}" viewBox="0 0 {width} {height}">']
    x = 0.0
    parts = []
    for key, label, fill, _ in LEDGER_PARTS:
        share = shares.get(key, 0.0)
        if key == "comm_exposed" and cp:
            parts.append((CP_PART[1], CP_PART[2], min(cp, share)))
            share -= parts[-1][2]
        if key == "comm_exposed" and ep:
            parts.append((EP_PART[1], EP_PART[2], min(ep, share)))
            share -= parts[-1][2]
        parts.append((label, fill, share))
    for label, fill, share in parts:
        w = share * width
        if w > 0:
            out.append(f'<rect x="{_f(x)}" y="0" width="{_f(w)}" height="{height}" fill="{fill}">'
                       f'<title>{_e(label)} {_pct(share)}</title></rect>')
        x += w
    out.append("</svg>")
    return "".join(out)


def _line_chart(series: list[tuple[str, str, list[tuple[float, float]]]], y_label: str) -> str:
    """One path per series over a shared x (step) and y axis starting at 0."""
    w, h, left, right, top, bottom = 980, 260, 64, 16, 12, 40
    pw, ph = w - left - right, h - top - bottom
    xs = sorted({x for _, _, pts in series for x, _ in pts})
    y_max = _nice_max(max((y for _, _, pts in series for _, y in pts), default=1.0))
    x0, x1 = xs[0], xs[-1]

    def px(x: float) -> float:
        return left + (pw / 2 if x1 == x0 else (x - x0) / (x1 - x0) * pw)

    def py(y: float) -> float:
        return top + ph - y / y_max * ph

    out = [f'<svg class="chart-steptime" width="{w}" height="{h}" viewBox="0 0 {w} {h}">']
    for i in range(6):
        v = y_max * i / 5
        y = _f(py(v))
        out.append(f'<path d="M{left} {y}H{left + pw}" stroke="#e6e8eb" stroke-width="1"/>')
        out.append(f'<text x="{left - 8}" y="{_f(py(v) + 4)}" text-anchor="end">{v:g}</text>')
    if len(xs) <= 12:
        ticks = xs
    else:  # round steps: 0, 20, 40, ... rather than every tenth recorded step
        every = _nice_max((x1 - x0) / 10)
        ticks = [k * every for k in range(math.ceil(x0 / every), math.floor(x1 / every) + 1)]
    for x in ticks:
        out.append(f'<path d="M{_f(px(x))} {top + ph}v5" stroke="#8c959f"/>')
        out.append(f'<text x="{_f(px(x))}" y="{top + ph + 18}" text-anchor="middle">{_e(f"{x:g}")}</text>')
    out.append(f'<path d="M{left} {top}V{top + ph}H{left + pw}" fill="none" stroke="#8c959f"/>')
    out.append(f'<text x="{left + pw / 2}" y="{h - 4}" text-anchor="middle">step</text>')
    out.append(f'<text x="14" y="{top + ph / 2}" text-anchor="middle" '
               f'transform="rotate(-90 14 {top + ph / 2})">{_e(y_label)}</text>')
    for label, color, pts in series:
        if not pts:
            continue
        d = "".join(f'{"M" if j == 0 else "L"}{_f(px(x))} {_f(py(y))}' for j, (x, y) in enumerate(pts))
        out.append(f'<path class="series" data-rank="{_e(label)}" d="{d}" fill="none" stroke="{color}" '
                   f'stroke-width="2.5" stroke-linejoin="round"/>')
        if len(pts) <= 80:
            for x, y in pts:
                out.append(f'<circle cx="{_f(px(x))}" cy="{_f(py(y))}" r="3.5" fill="{color}">'
                           f'<title>{_e(label)} step {x:g}: {_e(_ms(y))} ms</title></circle>')
    out.append("</svg>")
    return "".join(out)


def _table(head: list[tuple[str, bool]], rows: list[tuple[list[tuple[str, str]], str]]) -> str:
    """head: (label, numeric); rows: (cells of (html, td class), tr class). Cells are already HTML."""
    th = "".join(f'<th class="{"n" if num else ""}">{_e(h)}</th>' for h, num in head)
    body = []
    for cells, cls in rows:
        tds = "".join(f'<td class="{c}">{v}</td>' for v, c in cells)
        body.append(f'<tr class="{cls}">{tds}</tr>')
    return (f'<div class="scroll"><table><thead><tr>{th}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table></div>')


def _section(sid: str, title: str, body: str) -> str:
    return f'<section id="{sid}"><h2>{_e(title)}</h2>{body}</section>'


# ---- sections -----------------------------------------------------------------------------------

def _header(analysis: dict, ranks: list[tuple[str, dict]], base: Path | None = None) -> str:
    run = analysis.get("run") if isinstance(analysis.get("run"), dict) else {}
    plan = analysis.get("plan") if isinstance(analysis.get("plan"), dict) else {}
    steps = {_num(s.get("step")) for _, r in ranks for s in _steps(r)}
    kinds = sorted({str(r.get("kind")) for _, r in ranks if r.get("kind")})
    walls = [_wall(s) for _, r in ranks for s in _steps(r)]
    params = _num(run.get("params"))
    model = " · ".join(x for x in (run.get("model") and str(run["model"]),
                                   params is not None and f"{params / 1e6:.2f}M params") if x)
    items = [
        ("model", model or None),
        ("strategy", run.get("strategy") or plan.get("strategy") or "—"),
        ("context parallel", f"cp {run['cp']} · {run.get('cp_mode') or 'ring'}"
         if (_num(run.get("cp")) or 1) > 1 else None),
        ("mixture of experts", _moe_text(run)),
        ("expert load", _expert_load_text(analysis.get("moe"))),
        ("ranks", run.get("world_size") or len(ranks)),
        ("batch", run.get("batch")),
        ("precision", run.get("precision")),
        ("steps profiled", len(steps - {None})),
        ("device", " / ".join(kinds) or "—"),
        ("mean step", f"{_ms(_mean(walls))} ms"),
        ("loss", _loss_text(run.get("loss"))),
        ("peak memory", _peaks_text(run.get("peak_memory_bytes"))),
        ("profiled", run.get("profiled_at")),
        ("loom commit", run.get("commit")),
    ]
    if plan.get("label"):
        items.append(("plan", plan["label"]))
    meta = "".join(f"<div><dt>{_e(k)}</dt><dd>{_e(v)}</dd></div>" for k, v in items if v not in (None, ""))
    name = run.get("name") or "training run"
    return (f'<header><h1>Step ledger · {_e(name)}</h1><dl class="meta">{meta}</dl>'
            f"{_trace_links(run.get('traces'), base)}</header>")


def _moe_text(run: dict) -> str | None:
    """"8 experts · top-2 · ep 4": the run's mixture of experts, where it has one."""
    moe = run.get("moe") if isinstance(run.get("moe"), dict) else {}
    experts, top_k, ep = _num(moe.get("experts")), _num(moe.get("top_k")), _num(run.get("ep"))
    if not experts:
        return None
    return " · ".join([f"{experts:.0f} experts"] + ([f"top-{top_k:.0f}"] if top_k else [])
                      + ([f"ep {ep:.0f}"] if ep and ep > 1 else []))


def _expert_load_text(moe: Any) -> str | None:
    """"busiest expert 1.62× the mean · 0.40% dropped · aux loss 1.02 (median of 3 profiled steps)"."""
    if not isinstance(moe, dict):
        return None
    imbalance, dropped, aux = (_num(moe.get(k)) for k in ("load_imbalance", "dropped_pct", "aux_loss"))
    parts = ([f"busiest expert {imbalance:.2f}× the mean"] if imbalance is not None else []) \
        + ([f"{dropped:.2f}% dropped"] if dropped is not None else []) \
        + ([f"aux loss {aux:.3g}"] if aux is not None else [])
    steps = moe.get("steps") if isinstance(moe.get("steps"), list) else []
    if not parts:
        return None
    return " · ".join(parts) + (f" (median of {len(steps)} {'profiled' if moe.get('profiled') else 'logged'} "
                                f"step{'s' if len(steps) != 1 else ''})" if steps else "")


def _loss_text(loss: Any) -> str | None:
    """"5.574 → 2.595 (eval 2.811); profiled, training steps 3–5: 4.222, 4.012, 4.090"."""
    if not isinstance(loss, dict):
        return None
    first, final, held = (_num(loss.get(k)) for k in ("first", "final", "eval"))
    text = " → ".join(f"{v:.3f}" for v in (first, final) if v is not None)
    if held is not None:
        text += f" (eval {held:.3f})"
    steps = loss.get("profiled_steps")
    if isinstance(steps, dict) and steps:
        named = sorted((int(k), _num(v)) for k, v in steps.items()
                       if str(k).isdigit() and _num(v) is not None)
        if named:
            # training steps (analyze.py: ProfilerStep#N, the charts' steps, is step start_step + N + 1)
            text += (f"; profiled, training steps {named[0][0]}–{named[-1][0]}: "
                     + ", ".join(f"{v:.3f}" for _, v in named))
    return text.strip("; ") or None


def _peaks_text(peaks: Any) -> str | None:
    """Per rank peak memory: "rank 0 136 MiB · rank 1 136 MiB"."""
    if not isinstance(peaks, dict) or not peaks:
        return None
    return " · ".join(f"rank {r} {size_text(v)}" for r, v in sorted(
        peaks.items(), key=lambda kv: int(kv[0]) if str(kv[0]).isdigit() else 0))


def _trace_links(traces: Any, base: Path | None) -> str:
    """Links to the per-rank Chrome traces, relative to the page (they travel with the run)."""
    if not isinstance(traces, dict) or not traces:
        return ""
    links = []
    for rank, paths in sorted(traces.items(), key=lambda kv: int(kv[0]) if str(kv[0]).isdigit() else 0):
        paths = [paths] if isinstance(paths, str) else paths if isinstance(paths, list) else []
        for i, path in enumerate(paths):
            href = os.path.relpath(path, base) if base is not None else str(path)
            label = f"rank {rank} trace" + (f" {i + 1}" if len(paths) > 1 else "")
            links.append(f'<a href="{_e(Path(href).as_posix())}">{_e(label)}</a>')
    return ('<p class="note traces">' + "".join(links) + " Chrome traces: open one in Perfetto "
            "(ui.perfetto.dev, “Open trace file”) or chrome://tracing.</p>")


def _findings(analysis: dict) -> str:
    findings = [f for f in analysis.get("findings") or [] if isinstance(f, dict)]
    if not findings:
        return _section("findings", "Findings", '<p class="ok">No problems found.</p>')
    cards = []
    for f in findings:
        parts = [f"<h3>{_e(f.get('title') or 'finding')}</h3>"]
        for key, label in (("evidence", "evidence"), ("cause", "cause")):
            if f.get(key):
                parts.append(f'<p><span class="k">{label}</span>{_e(f[key])}</p>')
        note = f" {_e(f['note'])}" if f.get("note") else ""
        if f.get("knob"):  # a TOML line to paste into the config, the prose beside it
            value = "" if f.get("value") is None else f" = {toml_value(f['value'])}"
            parts.append(f'<p><span class="k">try</span><code>{_e(f["knob"])}{_e(value)}</code>{note}</p>')
        elif note:
            parts.append(f'<p><span class="k">do</span>{note}</p>')
        if f.get("expected_effect"):
            parts.append(f'<p><span class="k">expected</span>{_e(f["expected_effect"])}</p>')
        cards.append(f'<div class="finding">{"".join(parts)}</div>')
    return _section("findings", f"Findings ({len(findings)})", "".join(cards))


def _cp_share(rank: dict, exchange: str = "cp") -> float | None:
    """The mean share of a rank's steps its CP exchange (`exchange` "ep": EP's all-to-alls) was
    exposed (None: the rank had none)."""
    key = f"{exchange}_exposed_ms"
    per_step = [(_num(s.get(key)), _wall(s)) for s in _steps(rank) if key in s]
    shares = [cp / wall for cp, wall in per_step if cp is not None and wall]
    return max(sum(shares) / len(shares), 0.0) if shares else None


def _ledger(ranks: list[tuple[str, dict]], stragglers: dict[str, dict]) -> str:
    rows, with_cp, with_ep = [], False, False
    for rid, r in ranks:
        shares = _mean_shares(r)
        if shares is None:
            continue
        segs = []
        for k, label, fill, ink in LEDGER_PARTS:
            share, cp = shares[k], _cp_share(r) if k == "comm_exposed" else None
            ep = _cp_share(r, "ep") if k == "comm_exposed" else None
            if cp is not None:  # CP's exchange first, the rest of the exposed comm beside it
                with_cp, cp = True, min(cp, share)
                segs.append((*CP_PART, cp * LEDGER_BAR_W, _pct(cp)))
                share -= cp
            if ep is not None:  # then EP's all-to-alls
                with_ep, ep = True, min(ep, share)
                segs.append((*EP_PART, ep * LEDGER_BAR_W, _pct(ep)))
                share -= ep
            segs.append((k, label, fill, ink, share * LEDGER_BAR_W, _pct(share)))
        wall = _mean(_wall(s) for s in _steps(r))
        hidden = _mean(s.get("comm_hidden_ms") for s in _steps(r))
        right = f"{_ms(wall)} ms/step" + (f" · {_ms(hidden)} ms hidden" if hidden else "")
        rows.append((f"rank {rid}", segs, right, rid in stragglers))
    if not rows:
        return ""
    parts = LEDGER_PARTS[:1] + ((CP_PART,) if with_cp else ()) + ((EP_PART,) if with_ep else ()) \
        + LEDGER_PARTS[1:]
    legend = _legend((label, fill) for _, label, fill, _ in parts)
    note = ('<p class="note">Mean share of each step\'s wall time. Exposed comm is communication the '
            "step waited on; hidden comm ran under compute and costs nothing here."
            + (" The exposed CP exchange is context parallelism's (ring k/v blocks or all-to-alls), "
               "the exposed comm beside it the rest." if with_cp else "")
            + (" The exposed EP all-to-all is expert parallelism's (tokens to their experts' ranks and "
               "back), the exposed comm beside it the rest." if with_ep else "") + "</p>")
    return _section("ledger", "Where the step time goes", legend + _stacked_rows(rows, "chart-ledger") + note)


def _step_times(ranks: list[tuple[str, dict]]) -> str:
    series = []
    for i, (rid, r) in enumerate(ranks):
        pts = [(_num(s.get("step")), _wall(s)) for s in _steps(r)]
        pts = [(x, y) for x, y in pts if x is not None and y is not None]
        if pts:
            series.append((f"rank {rid}", _rank_color(i), pts))
    if not series:
        return ""
    legend = _legend((label, color) for label, color, _ in series)
    return _section("step-time", "Step time per rank", legend + _line_chart(series, "wall ms"))


def _step_table(ranks: list[tuple[str, dict]], stragglers: dict[str, dict]) -> str:
    rows = []
    for rid, r in ranks:
        for s in _steps(r):
            rows.append((_num(s.get("step")) or 0.0, rid, s))
    if not rows:
        return ""
    order = {rid: i for i, (rid, _) in enumerate(ranks)}
    rows.sort(key=lambda t: (t[0], order[t[1]]))
    shown = rows[:_MAX_TABLE_ROWS]
    cp = any("cp_exposed_ms" in s for _, _, s in shown)  # columns of CP's exchange, where there is one
    ep = any("ep_exposed_ms" in s for _, _, s in shown)  # and of EP's all-to-alls
    head = [("step", True), ("rank", True), ("wall ms", True), ("compute", True), ("exposed comm", True),
            ("hidden comm", True)]
    head += [("CP exchange exposed", True), ("CP exchange hidden", True)] if cp else []
    head += [("EP all-to-all exposed", True), ("EP all-to-all hidden", True)] if ep else []
    head += [("IO", True), ("idle", True), ("overlap", True), ("ledger", False)]
    keys = ["compute_ms", "comm_exposed_ms", "comm_hidden_ms"]
    keys += ["cp_exposed_ms", "cp_hidden_ms"] if cp else []
    keys += ["ep_exposed_ms", "ep_hidden_ms"] if ep else []
    body = []
    for _, rid, s in shown:
        shares = _step_shares(s)
        overlap = _num(s.get("overlap_pct"))
        cells = [(_e(s.get("step", "—")), "n"), (_e(rid), "n"), (_ms(_wall(s)), "n")]
        cells += [(_ms(s.get(k)), "n") for k in [*keys, "io_ms", "idle_ms"]]
        cp_ms, ep_ms, wall = _num(s.get("cp_exposed_ms")), _num(s.get("ep_exposed_ms")), _wall(s)
        cells += [("—" if overlap is None else f"{overlap:.0f}%", "n"),
                  (_mini_bar(shares, cp=cp_ms / wall if cp_ms and wall else None,
                             ep=ep_ms / wall if ep_ms and wall else None) if shares else "", "")]
        body.append((cells, "straggler" if rid in stragglers else ""))
    note = "" if len(rows) == len(shown) else f'<p class="note">First {len(shown)} of {len(rows)} rows.</p>'
    return _section("steps", "Ledger per step (ms)", _table(head, body) + note)


def _phases(ranks: list[tuple[str, dict]]) -> str:
    means = []
    for rid, r in ranks:
        m = {k: _mean(s.get(k) for s in _steps(r)) for k, *_ in PHASE_PARTS}
        if any(v is not None for v in m.values()):
            means.append((rid, m))
    if not means:
        return ""
    scale = max(sum(v or 0.0 for v in m.values()) for _, m in means) or 1.0
    rows = []
    for rid, m in means:
        segs = [(k, label, fill, ink, (m[k] or 0.0) / scale * LEDGER_BAR_W, _ms(m[k]))
                for k, label, fill, ink in PHASE_PARTS if m[k]]
        rows.append((f"rank {rid}", segs, f"{_ms(sum(v or 0.0 for v in m.values()))} ms", False))
    present = [p for p in PHASE_PARTS if any(m[p[0]] is not None for _, m in means)]
    legend = _legend((label, fill) for _, label, fill, _ in present)
    head = ([("rank", True)] + [(f"{label} ms", True) for _, label, *_ in present]
            + [("backward / forward", True)])
    body = []
    for rid, m in means:
        ratio = (m["backward_ms"] / m["forward_ms"] if m["forward_ms"] and m["backward_ms"] is not None
                 else None)
        cells = [(_e(rid), "n")] + [(_ms(m[k]), "n") for k, *_ in present]
        body.append((cells + [("—" if ratio is None else f"{ratio:.2f}×", "n")], ""))
    return _section("phases", "Forward / backward / optimizer per rank (mean ms)",
                    legend + _stacked_rows(rows, "chart-phases") + _table(head, body))


def _top_ops(ranks: list[tuple[str, dict]]) -> str:
    ops: dict[str, dict[str, tuple[float, float]]] = {}
    for rid, r in ranks:
        for op in r.get("top_ops") or []:
            if not isinstance(op, dict) or op.get("name") is None:
                continue
            total, count = _num(op.get("total_ms")) or 0.0, _num(op.get("count")) or 0.0
            own = _num(op.get("self_ms"))
            own = total if own is None else own  # a ledger from before self times: totals
            prev = ops.setdefault(str(op["name"]), {}).get(rid, (0.0, 0.0, 0.0))
            ops[str(op["name"])][rid] = (prev[0] + own, prev[1] + count, prev[2] + total)
    kernel_rows = []
    for rid, r in ranks:
        k = {key: _mean(s.get(key) for s in _steps(r))
             for key in ("kernels", "mean_kernel_us", "occupancy_pct")}
        if any(v is not None for v in k.values()):
            kernel_rows.append(([(_e(rid), "n"),
                                 ("—" if k["kernels"] is None else f"{k['kernels']:,.0f}", "n"),
                                 (_ms(k["mean_kernel_us"]), "n"),
                                 ("—" if k["occupancy_pct"] is None else f"{k['occupancy_pct']:.0f}%", "n")],
                                ""))
    if not ops and not kernel_rows:
        return ""
    body = ""
    if ops:
        top = sorted(ops.items(), key=lambda kv: -sum(t for t, _, _ in kv[1].values()))[:_MAX_OPS]
        head = [("op / kernel", False), ("ranks", True), ("calls", True),
                ("self ms (mean over ranks)", True), ("self ms per call", True), ("min self ms (rank)", True),
                ("max self ms (rank)", True), ("with nested ops ms", True)]
        rows = []
        for name, per in top:
            owns = [t for t, _, _ in per.values()]
            calls = sum(c for _, c, _ in per.values())
            lo = min(per.items(), key=lambda kv: kv[1][0])
            hi = max(per.items(), key=lambda kv: kv[1][0])
            rows.append(([(_e(name), "name"), (str(len(per)), "n"), (f"{calls:,.0f}", "n"),
                          (_ms(sum(owns) / len(owns)), "n"),
                          (_ms(sum(owns) / calls) if calls else "—", "n"),
                          (f"{_ms(lo[1][0])} ({_e(lo[0])})", "n"), (f"{_ms(hi[1][0])} ({_e(hi[0])})", "n"),
                          (_ms(sum(t for _, _, t in per.values()) / len(per)), "n")], ""))
        body += ('<p class="note">Self time: an op\'s own time, without the ops it calls (aten::linear '
                 "without its aten::mm), so the rows add up to no more than the profiled steps. Over all "
                 "profiled steps.</p>") + _table(head, rows)
    if kernel_rows:
        head = [("rank", True), ("kernels / step", True), ("mean kernel µs", True), ("occupancy", True)]
        body += '<h3 style="margin-top:14px">GPU kernels</h3>' + _table(head, kernel_rows)
    return _section("top-ops", "Top ops and kernels", body)


def _collectives(analysis: dict, ranks: list[tuple[str, dict]], stragglers: dict[str, dict]) -> str:
    matched = [c for c in analysis.get("collectives") or [] if isinstance(c, dict)]
    parts = [_kinds_table(ranks, matched)]
    for rid, s in stragglers.items():
        late = _num(s.get("late_ms_mean"))
        evidence = f" — {_e(s['evidence'])}" if s.get("evidence") else ""
        parts.append(f'<div class="callout"><p><b>Straggler: rank {_e(rid)}</b>'
                     f'{"" if late is None else f" arrives {_ms(late)} ms late on average"}'
                     f'{evidence}</p></div>')
    parts.append(_wait_vs_transfer(matched, ranks, stragglers))
    body = "".join(parts)
    return _section("collectives", "Collectives", body) if body else ""


def _kinds_table(ranks: list[tuple[str, dict]], matched: list[dict]) -> str:
    """Count, bytes and time per kind from each rank's own record, else from the matched list."""
    by_kind: dict[str, dict[str, list[float]]] = {}  # kind -> rank -> [count, bytes, ms]
    for rid, r in ranks:
        for c in r.get("collectives") or []:
            if isinstance(c, dict):
                acc = by_kind.setdefault(str(c.get("kind") or "?"), {}).setdefault(rid, [0.0, 0.0, 0.0])
                acc[0] += 1
                acc[1] += _num(c.get("bytes")) or 0.0
                acc[2] += _num(c.get("duration_ms")) or 0.0
    if by_kind:
        head = [("kind", False), ("calls per rank", True), ("bytes per rank", True),
                ("ms per rank (mean)", True), ("slowest rank ms", True)]
        rows = []
        for kind, per in sorted(by_kind.items(), key=lambda kv: -sum(a[2] for a in kv[1].values())):
            n = len(per)
            slow_rank, slow = max(per.items(), key=lambda kv: kv[1][2])
            rows.append(([(_e(kind), ""), (f"{sum(a[0] for a in per.values()) / n:,.0f}", "n"),
                          (size_text(sum(a[1] for a in per.values()) / n), "n"),
                          (_ms(sum(a[2] for a in per.values()) / n), "n"),
                          (f"{_ms(slow[2])} (rank {_e(slow_rank)})", "n")], ""))
        return _table(head, rows)
    kinds: dict[str, list[float]] = {}
    for c in matched:
        acc = kinds.setdefault(str(c.get("kind") or "?"), [0.0, 0.0])
        acc[0] += 1
        acc[1] += _num(c.get("bytes")) or 0.0
    rows = [([(_e(k), ""), (f"{a[0]:,.0f}", "n"), (size_text(a[1]), "n")], "")
            for k, a in sorted(kinds.items())]
    return _table([("kind", False), ("calls", True), ("bytes", True)], rows) if rows else ""


def _wait_vs_transfer(matched: list[dict], ranks: list[tuple[str, dict]], stragglers: dict[str, dict]) -> str:
    """Per rank, the time matched collectives spent waiting for the last rank vs moving bytes."""
    per_rank = [c for c in matched if isinstance(c.get("per_rank"), dict)]
    totals: dict[str, list[float]] = {}
    for c in per_rank:
        for rid, v in c["per_rank"].items():
            if isinstance(v, dict):
                acc = totals.setdefault(str(rid), [0.0, 0.0])
                acc[0] += _num(v.get("wait_ms")) or 0.0
                acc[1] += _num(v.get("transfer_ms")) or 0.0
    if not totals:
        return ""
    order = [rid for rid, _ in ranks if rid in totals] + sorted(set(totals) - {rid for rid, _ in ranks})
    scale = max(sum(totals[r]) for r in order) or 1.0
    rows = []
    for rid in order:
        wait, transfer = totals[rid]
        segs = [("wait", "wait", WAIT_COLOR, "#ffffff", wait / scale * LEDGER_BAR_W, _ms(wait)),
                ("transfer", "transfer", TRANSFER_COLOR, "#ffffff", transfer / scale * LEDGER_BAR_W,
                 _ms(transfer))]
        right = f"{_ms(wait + transfer)} ms" + (" · straggler" if rid in stragglers else "")
        rows.append((f"rank {rid}", segs, right, rid in stragglers))
    return (f'<h3 style="margin-top:14px">Wait vs transfer over {len(per_rank)} matched collectives</h3>'
            + _legend([("waiting for the last rank", WAIT_COLOR), ("transfer", TRANSFER_COLOR)])
            + _stacked_rows(rows, "chart-wait") + _collective_table(per_rank, order, stragglers))


def _collective_table(per_rank: list[dict], order: list[str], stragglers: dict[str, dict]) -> str:
    def spread(c: dict) -> float:
        waits = [_num(v.get("wait_ms")) or 0.0 for v in c["per_rank"].values() if isinstance(v, dict)]
        return max(waits, default=0.0) - min(waits, default=0.0)

    top = sorted(per_rank, key=spread, reverse=True)[:_MAX_COLLECTIVES]
    wide = len(order) <= _MAX_RANK_COLUMNS
    head = [("#", True), ("kind", False), ("bytes", True), ("last rank", True)]
    head += ([(f"r{rid} wait / transfer ms", True) for rid in order] if wide
             else [("max wait ms (rank)", True)])
    rows = []
    for c in top:
        last = None if c.get("last_rank") is None else str(c["last_rank"])
        cells = [(_e(c.get("index", "—")), "n"), (_e(c.get("kind") or "?"), ""),
                 (size_text(c.get("bytes")), "n"),
                 ("—" if last is None else _e(last), "n straggler" if last in stragglers else "n")]
        pr = {str(k): v for k, v in c["per_rank"].items() if isinstance(v, dict)}
        if wide:
            for rid in order:
                v = pr.get(rid)
                text = "—" if v is None else f"{_ms(v.get('wait_ms'))} / {_ms(v.get('transfer_ms'))}"
                cells.append((text, "n straggler" if rid in stragglers else "n"))
        elif pr:
            rid, v = max(pr.items(), key=lambda kv: _num(kv[1].get("wait_ms")) or 0.0)
            cells.append((f"{_ms(v.get('wait_ms'))} ({_e(rid)})", "n"))
        else:
            cells.append(("—", "n"))
        rows.append((cells, ""))
    note = f'<p class="note">The {len(top)} collectives with the widest spread of wait across ranks.</p>'
    return note + _table(head, rows)


def _planned(analysis: dict, ranks: list[tuple[str, dict]]) -> str:
    # Collectives: payload bytes and counts are observed; wire bytes only modelled (ring model).
    labels = {"model_state_bytes": "model states", "activation_peak_bytes": "activation peak",
              "comm_payload_bytes": "collective payload / step (observed)",
              "comm_count": "collectives / step (observed)",
              "comm_modelled_wire_bytes": "wire bytes / step (ring model, not observed)",
              "comm_sent_bytes": "wire bytes / step (ring model, not observed)"}  # runs before the split
    rows, flagged = [], []
    # A plan that leaves out the loop's few-byte collectives (plan.json's comm_loop_by_kind null: under
    # TP, loss parallel's statistics) counts fewer all-reduces and broadcasts than run: not a miss.
    told = analysis.get("plan") if isinstance(analysis.get("plan"), dict) else {}
    loop_unplanned = "comm_loop_by_kind" in told and told["comm_loop_by_kind"] is None
    for entry in analysis.get("measured_vs_planned") or []:
        if not isinstance(entry, dict):
            continue
        pairs: list[tuple[str, Any, bool]] = []  # (label, [measured, planned], is a count)
        for key, pair in entry.items():
            if key == "comm_by_kind" and isinstance(pair, dict):
                for kind, v in pair.items():
                    if isinstance(v, dict):
                        pairs += [(f"{kind} payload / step", v.get("payload_bytes"), False),
                                  (f"{kind} count / step", v.get("count"), True)]
            elif key != "rank":
                pairs.append((labels.get(key, key), pair, key == "comm_count"))
        for label, pair, is_count in pairs:
            if not isinstance(pair, list | tuple) or len(pair) != 2:
                continue
            m, p = _num(pair[0]), _num(pair[1])
            ratio = f"{m / p:.2f}×" if m is not None and p else "—"
            off = _off_plan(m, p)
            if off and loop_unplanned and label in LOOP_COUNTS:
                off, ratio = None, f"{ratio} · the loop's few-byte collectives not planned here"
            if off:
                ratio = f'<span class="off">{ratio} · {_e(off)}</span>'
                flagged.append(f"rank {entry.get('rank', '—')} {label}")
            fmt = _count if is_count else size_text
            rows.append(([(_e(entry.get("rank", "—")), "n"), (_e(label), ""), (fmt(m), "n"),
                          (fmt(p), "n"), (ratio, "n"), (_pair_bar(m, p), "")], "off-plan" if off else ""))
    plan = analysis.get("plan") if isinstance(analysis.get("plan"), dict) else {}
    facts = []
    if plan:
        mem = plan.get("memory_bytes")
        mem_total = mem.get("total") if isinstance(mem, dict) else mem
        if _num(mem_total) is not None:
            facts.append(("memory per rank", size_text(mem_total), None))
        if _num(plan.get("comm_payload_bytes_per_step")) is not None:
            payload = size_text(plan["comm_payload_bytes_per_step"])
            facts.append(("collective payload per step", payload, None))
        if _num(plan.get("comm_bytes_per_step")) is not None:
            facts.append(("wire bytes per step (ring model)", size_text(plan["comm_bytes_per_step"]), None))
        planned_s = _num(plan.get("step_time_s"))
        measured = _mean(_wall(s) for _, r in ranks for s in _steps(r))
        planned = "not predicted" if planned_s is None else f"{_ms(planned_s * 1000)} ms"
        off = _off_plan(measured, planned_s * 1000 if planned_s is not None else None)
        if off:
            flagged.append("step time")
        facts.append(("step time", f"{planned} planned · {_ms(measured)} ms measured"
                      + (f" · {off}" if off else ""), off))
    if not rows and not facts:
        return ""
    body = ""
    if flagged:
        body += (f'<div class="callout"><p><b>Off plan by more than {OFF_PLAN:.0%}</b>: '
                 + _e(", ".join(flagged)) + ". The planner's model of this run is wrong there: "
                 "the measured number is the true one.</p></div>")
    if facts:
        label = f"<div><dt>plan</dt><dd>{_e(plan['label'])}</dd></div>" if plan.get("label") else ""
        body += '<dl class="meta">' + label + "".join(
            f'<div><dt>{_e(k)}</dt><dd{" class=off" if off else ""}>{_e(v)}</dd></div>'
            for k, v, off in facts) + "</dl>"
    if rows:
        head = [("rank", True), ("what", False), ("measured", True), ("planned", True),
                ("measured / planned", True), ("", False)]
        body += '<div style="height:10px"></div>' + _legend([("measured", "#4c78a8"), ("planned", "#bab0ac")])
        body += _table(head, rows)
    return _section("measured-vs-planned", "Measured vs planned", body)


# The rows the loop's own collectives add to (all-reduces, broadcasts) where the plan leaves them out.
LOOP_COUNTS = ("collectives / step (observed)", "all_reduce count / step", "broadcast count / step")


def _off_plan(measured: float | None, planned: float | None) -> str | None:
    """"measured 42% below plan" when measured is more than OFF_PLAN away from planned."""
    if measured is None or not planned:
        return None
    change = measured / planned - 1
    if abs(change) <= OFF_PLAN:
        return None
    return f"measured {abs(change):.0%} {'above' if change > 0 else 'below'} plan"


def _count(v: Any) -> str:
    v = _num(v)
    return "—" if v is None else f"{v:,.0f}"


def _pair_bar(m: float | None, p: float | None, width: int = 180) -> str:
    top = max(m or 0.0, p or 0.0)
    if top <= 0:
        return ""
    out = [f'<svg class="mini" width="{width}" height="16" viewBox="0 0 {width} 16">']
    for i, (v, fill) in enumerate(((m, "#4c78a8"), (p, "#bab0ac"))):
        if v:
            out.append(f'<rect x="0" y="{i * 8}" width="{_f(v / top * width)}" height="7" fill="{fill}"/>')
    out.append("</svg>")
    return "".join(out)


# ---- the page -----------------------------------------------------------------------------------

def render_html(analysis: dict, base: Path | None = None) -> str:
    """The report as one HTML string (see render_report); `base`: the page's folder, which the
    links to the trace files are relative to."""
    analysis = analysis if isinstance(analysis, dict) else {}
    ranks = _ranks(analysis)
    stragglers = _stragglers(analysis)
    run = analysis.get("run") if isinstance(analysis.get("run"), dict) else {}
    sections = [
        _header(analysis, ranks, base),
        _findings(analysis),
        # the run's curves (metrics.jsonl; loom/observe/curves.py), where analyze found them
        *(_section(sid, title, body) for sid, title, body in curves.sections(analysis.get("curves"))),
        _ledger(ranks, stragglers),
        _step_times(ranks),
        _step_table(ranks, stragglers),
        _phases(ranks),
        _top_ops(ranks),
        _collectives(analysis, ranks, stragglers),
        _planned(analysis, ranks),
    ]
    title = f"loom step ledger · {run.get('name') or 'training run'}"
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width,initial-scale=1\">"
            f"<title>{_e(title)}</title><style>{_CSS}</style></head>"
            f"<body><main>{''.join(s for s in sections if s)}</main></body></html>\n")


def render_report(analysis: dict, out_path: Path) -> Path:
    """Write the step-ledger report for `analysis` to `out_path` as one self-contained HTML file."""
    out_path = Path(out_path)
    page = render_html(analysis, out_path.parent.resolve())
    atomic_write(out_path, page.encode("utf-8"))  # replaces a planted link, never follows it
    return out_path
