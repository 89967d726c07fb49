"""A run's curves over its steps, from metrics.jsonl: training loss, held-out (eval) loss and
tokens/s, read leniently (the page is a view: a damaged line is skipped, not an error) and drawn
as inline SVG polylines for the run's report and `loom analyze`'s.

Each chart's SVG carries its axes' ranges (`data-x`, `data-y`) and the plot box is PLOT, so a
point's pixel maps back to its number (the report's tests do that).
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path

MAX_POINTS = 1000  # per curve: a long run's metrics thinned evenly (the ledger and the page stay small)
MAX_METRICS_BYTES = 64 << 20
WIDTH, HEIGHT = 980, 240
PLOT = (64, 12, WIDTH - 64 - 16, HEIGHT - 12 - 40)  # left, top, width, height of the plotting area
# (metrics.jsonl key, label, color) of each curve
SERIES = {"loss": ("loss", "training loss", "#4c78a8"), "eval": ("eval_loss", "eval loss", "#e45756"),
          "tokens_per_s": ("tokens_per_s", "tokens/s", "#54a24b")}


def read_curves(metrics: Path) -> dict[str, list[list[float]]]:
    """{"loss": [[step, value], ...], "eval": ..., "tokens_per_s": ...} from a metrics.jsonl (empty
    where the file is absent or unreadable)."""
    try:
        if not metrics.is_file() or metrics.stat().st_size > MAX_METRICS_BYTES:
            return {}
        lines = metrics.read_text(errors="replace").splitlines()
    except OSError:
        return {}
    out: dict[str, list[list[float]]] = {name: [] for name in SERIES}
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:  # a line cut short by a kill
            continue
        step = row.get("step") if isinstance(row, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            continue
        for name, (key, _, _) in SERIES.items():
            value = row.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                out[name].append([step, float(value)])
    return {name: _thin(pts) for name, pts in out.items() if pts}


def _thin(pts: list[list[float]]) -> list[list[float]]:
    if len(pts) <= MAX_POINTS:
        return pts
    every = math.ceil(len(pts) / MAX_POINTS)
    return pts[::every] + ([pts[-1]] if (len(pts) - 1) % every else [])


def chart(cls: str, series: list[tuple[str, str, list[list[float]]]], y_label: str) -> str:
    """One polyline per (label, color, points) over shared axes; the y axis spans the values
    (a loss falls from 10 to 3: starting at 0 would flatten it)."""
    xs = [p[0] for _, _, pts in series for p in pts]
    ys = [p[1] for _, _, pts in series for p in pts]
    if not xs:
        return ""
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if y1 == y0:
        y0, y1 = y0 - 0.5, y1 + 0.5
    left, top, pw, ph = PLOT

    def px(x: float) -> float:
        return left + (pw / 2 if x1 == x0 else (x - x0) / (x1 - x0) * pw)

    def py(y: float) -> float:
        return top + ph - (y - y0) / (y1 - y0) * ph

    out = [f'<svg class="{cls}" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" '
           f'data-x="{x0:g} {x1:g}" data-y="{y0!r} {y1!r}">']
    for i in range(5):
        v = y0 + (y1 - y0) * i / 4
        out.append(f'<path d="M{left} {_f(py(v))}H{left + pw}" stroke="#e6e8eb" stroke-width="1"/>')
        out.append(f'<text x="{left - 8}" y="{_f(py(v) + 4)}" text-anchor="end">{_tick(v)}</text>')
    for x in sorted({x0, x1, round((x0 + x1) / 2)}):
        out.append(f'<text x="{_f(px(x))}" y="{top + ph + 18}" text-anchor="middle">{x:g}</text>')
    out.append(f'<path d="M{left} {top}V{top + ph}H{left + pw}" fill="none" stroke="#8c959f"/>')
    out.append(f'<text x="{left + pw / 2}" y="{HEIGHT - 4}" text-anchor="middle">step</text>')
    out.append(f'<text x="14" y="{top + ph / 2}" text-anchor="middle" '
               f'transform="rotate(-90 14 {top + ph / 2})">{html.escape(y_label)}</text>')
    for label, color, pts in series:
        points = " ".join(f"{_f(px(x))},{_f(py(y))}" for x, y in pts)
        name = html.escape(label, quote=True)
        out.append(f'<polyline class="curve" data-series="{name}" points="{points}" '
                   f'fill="none" stroke="{color}" stroke-width="2.5" stroke-linejoin="round"/>')
        if len(pts) == 1:  # one point (a single eval) has no line: a dot
            x, y = pts[0]
            out.append(f'<circle cx="{_f(px(x))}" cy="{_f(py(y))}" r="4" fill="{color}"/>')
    out.append("</svg>")
    return "".join(out)


def sections(curves: dict) -> list[tuple[str, str, str]]:
    """(id, title, body HTML) of the loss chart (training and eval) and the tokens/s chart."""
    curves = curves if isinstance(curves, dict) else {}
    out = []
    losses = [(SERIES[n][1], SERIES[n][2], curves[n]) for n in ("loss", "eval") if curves.get(n)]
    if losses:
        legend = "".join(f'<span><i style="background:{c}"></i>{html.escape(label)}</span>'
                         for label, c, _ in losses)
        out.append(("loss-curve", "Loss", f'<div class="legend">{legend}</div>'
                    + chart("chart-loss", losses, "loss")))
    if curves.get("tokens_per_s"):
        _, label, color = SERIES["tokens_per_s"]
        out.append(("throughput-curve", "Tokens/s",
                    chart("chart-tokens", [(label, color, curves["tokens_per_s"])], "tokens/s")
                    + '<p class="note">Steps 1-2 include the warm-up (compilation, allocation).</p>'))
    return out


def _f(v: float) -> str:
    return f"{v:.2f}".rstrip("0").rstrip(".") or "0"


def _tick(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"
