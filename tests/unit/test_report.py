"""The step-ledger HTML report: self-contained, charts drawn from the data, and really rendered.

The render test opens the page in headless Chromium and decodes its screenshot with the
standard library, so "the charts are there" is checked on pixels, not only on markup.
"""

from __future__ import annotations

import json
import struct
import subprocess
import zlib
from collections import Counter
from html.parser import HTMLParser
from itertools import groupby
from pathlib import Path

import pytest
from optional import require

from loom.observe.report import LEDGER_BAR_W, LEDGER_PARTS, render_html, render_report

CHROMIUM = Path("/usr/bin/chromium")
SHARES = {"0": {"compute": 0.55, "comm_exposed": 0.25, "io": 0.08, "idle": 0.12},
          "1": {"compute": 0.70, "comm_exposed": 0.10, "io": 0.10, "idle": 0.10}}


def analysis(findings: bool = True) -> dict:
    """Two ranks, six steps each, with every optional section filled in."""
    ranks = {}
    for rid, shares in SHARES.items():
        steps = []
        for step in range(6):
            wall = 100.0 + 10 * int(rid) + 3 * step
            steps.append({
                "step": step, "wall_ms": wall, **{f"{k}_ms": v * wall for k, v in shares.items()},
                "comm_hidden_ms": 8.0, "forward_ms": 0.3 * wall, "backward_ms": 0.5 * wall,
                "optimizer_ms": 0.1 * wall, "data_ms": 0.05 * wall, "overlap_pct": 25.0, "shares": shares,
            })
        ranks[rid] = {
            "kind": "cpu", "steps": steps,
            "collectives": [{"step": s, "kind": k, "bytes": 4 << 20, "duration_ms": 6.0}
                            for s in range(6) for k in ("all_gather", "reduce_scatter")],
            "top_ops": [{"name": "aten::mm", "total_ms": 300.0 + int(rid), "count": 120},
                        {"name": "aten::<script>alert(1)</script>", "total_ms": 40.0, "count": 12}],
        }
    return {
        "run": {"name": "zero3 <gpt>", "strategy": "zero3", "world_size": 2},
        "ranks": ranks,
        "collectives": [{"index": i, "kind": "all_gather", "bytes": 4 << 20, "last_rank": 1,
                         "per_rank": {"0": {"wait_ms": 4.0 + i, "transfer_ms": 2.0},
                                      "1": {"wait_ms": 0.2, "transfer_ms": 2.1}}} for i in range(5)],
        "stragglers": [{"rank": 1, "late_ms_mean": 5.5, "evidence": "last into 5 of 5 all_gathers"}],
        "findings": [{"title": "Exposed communication", "evidence": "25% of rank 0's step waits on comm",
                      "cause": "all-gathers are not prefetched", "knob": "parallel.prefetch", "value": True,
                      "expected_effect": "hide about half the exposed comm"}] if findings else [],
        "measured_vs_planned": [{"rank": 0, "model_state_bytes": [52_000_000, 50_000_000],
                                 "activation_peak_bytes": [30_000_000, 24_000_000],
                                 "comm_payload_bytes": [150_000_000, 150_000_000], "comm_count": [1234, None],
                                 "comm_by_kind": {"all_gather": {"payload_bytes": [100_000_000, 100_000_000],
                                                                 "count": [1234, None]}},
                                 "comm_modelled_wire_bytes": [75_000_000, 75_000_000]}],
        "plan": {"label": "zero3 dp2", "memory_bytes": {"total": 80_000_000},
                 "comm_bytes_per_step": 75_000_000, "comm_payload_bytes_per_step": 150_000_000,
                 "step_time_s": None},
    }


class _Rects(HTMLParser):
    """The ledger chart's segments: (rank label, part, x, width)."""

    def __init__(self) -> None:
        super().__init__()
        self.in_ledger, self.segments = False, []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "svg":
            self.in_ledger = "chart-ledger" in (a.get("class") or "")
        elif tag == "rect" and self.in_ledger and "data-part" in a:
            self.segments.append((a["data-rank"], a["data-part"], float(a["x"]), float(a["width"])))

    def handle_endtag(self, tag):
        if tag == "svg":
            self.in_ledger = False


def test_self_contained_and_escaped(tmp_path):
    path = render_report(analysis(), tmp_path / "sub" / "report.html")
    text = path.read_text()
    assert path.exists() and text.startswith("<!DOCTYPE html>")
    lowered = text.lower()
    for needle in ("http://", "https://", "<script", "<link", "@import", "url(", "<img", "<iframe"):
        assert needle not in lowered, needle
    assert "&lt;script&gt;" in text and "zero3 &lt;gpt&gt;" in text  # names from the data are escaped
    for sid in ("findings", "ledger", "step-time", "steps", "phases", "top-ops", "collectives",
                "measured-vs-planned"):
        assert f'<section id="{sid}">' in text, sid
    assert text.index('id="findings"') < text.index('id="ledger"') < text.index('id="step-time"')
    assert "parallel.prefetch = true" in text and "hide about half" in text
    assert "straggler" in text and 'class="n straggler"' in text


def test_measured_vs_planned_labels_observed_and_modelled():
    text = render_html(analysis())
    section = text[text.index('id="measured-vs-planned"'):]
    for label in ("collective payload / step (observed)", "collectives / step (observed)",
                  "all_gather payload / step", "all_gather count / step",
                  "wire bytes / step (ring model, not observed)", "wire bytes per step (ring model)"):
        assert label in section, label
    assert "1,234" in section and "1.21 KiB" not in section  # a count, not bytes
    # Runs written before payloads were split from modelled wire bytes still render.
    old = analysis()
    old["measured_vs_planned"] = [{"rank": 0, "comm_sent_bytes": [80_000_000, 75_000_000]}]
    assert "wire bytes / step (ring model, not observed)" in render_html(old)


def test_ledger_bar_widths_match_shares():
    parser = _Rects()
    parser.feed(render_html(analysis()))
    assert len(parser.segments) == len(SHARES) * len(LEDGER_PARTS)
    for rid, shares in SHARES.items():
        segs = [s for s in parser.segments if s[0] == f"rank {rid}"]
        assert [s[1] for s in segs] == [k for k, *_ in LEDGER_PARTS]  # fixed order
        x = segs[0][2]
        for _, part, sx, width in segs:
            assert width == pytest.approx(shares[part] * LEDGER_BAR_W, abs=0.01)
            assert sx == pytest.approx(x, abs=0.02)  # stacked edge to edge
            x += width
    # Shares in percent (as `loom analyze` writes them) draw the same bars.
    percent = analysis()
    for rank in percent["ranks"].values():
        for step in rank["steps"]:
            step["shares"] = {k: 100 * v for k, v in step["shares"].items()}
    again = _Rects()
    again.feed(render_html(percent))
    assert again.segments == parser.segments


def test_try_is_a_toml_line_with_the_prose_beside_it():
    """A finding's TRY is `key = value` in TOML (prose outside the code), or a DO without a key."""
    a = analysis()
    a["findings"] = [{"title": "t", "knob": "parallel.fsdp_prefetch", "value": 2,
                      "note": "now 1: gather the next FSDP units earlier"},
                     {"title": "u", "knob": "parallel.strategy", "value": "zero2", "note": ""},
                     {"title": "v", "knob": None, "value": None, "note": "give every rank the same cores"}]
    text = render_html(a)
    assert "<code>parallel.fsdp_prefetch = 2</code> now 1: gather the next FSDP units earlier</p>" in text
    assert "<code>parallel.strategy = &quot;zero2&quot;</code></p>" in text
    assert '<span class="k">do</span> give every rank the same cores</p>' in text


def test_top_ops_rank_by_self_time():
    """aten::linear (300 ms with its nested aten::mm) owns 20 ms: the table ranks and sums self time,
    so it adds up to no more than the step; a ledger without self times still shows its totals."""
    a = analysis()
    for rid, r in a["ranks"].items():
        r["top_ops"] = [{"name": "aten::linear", "total_ms": 300.0, "self_ms": 20.0, "count": 10},
                        {"name": "aten::mm", "total_ms": 280.0, "self_ms": 280.0 + int(rid), "count": 10}]
    text = render_html(a)
    section = text[text.index('id="top-ops"'):text.index('id="collectives"')]
    assert "self ms (mean over ranks)" in section
    section = section[section.index("<tbody>"):]
    assert section.index("aten::mm") < section.index("aten::linear")
    mm = section[section.index("aten::mm"):section.index("aten::linear")]
    assert '<td class="n">280.5</td>' in mm and "281.0 (1)" in mm  # the mean self ms; the slowest rank
    linear = section[section.index("aten::linear"):]
    assert '<td class="n">20.0</td>' in linear and '<td class="n">300.0</td>' in linear  # self; with nested
    old = analysis()  # written before self times: the totals it has
    assert "<td class=\"n\">300.5</td>" in render_html(old)  # aten::mm: 300 and 301 ms


def test_no_scroll_box_cuts_a_table():
    """Tables grow with their rows: no box of fixed height with its own scrollbar."""
    text = render_html(analysis())
    css = text[text.index("<style>"):text.index("</style>")]
    assert "max-height" not in css and "overflow-y" not in css and "overflow-x" not in css
    assert "position:sticky" not in css


def test_measured_vs_planned_flags_past_a_quarter():
    """Planned 1,202 ms against 702 measured is flagged (42% below plan), as is an activation peak
    25% above; model states 4% above are not."""
    a = analysis()
    for r in a["ranks"].values():
        for st in r["steps"]:
            st["wall_ms"] = 702.0
    a["plan"]["step_time_s"] = 1.202
    a["measured_vs_planned"][0]["activation_peak_bytes"] = [30_100_000, 24_000_000]
    text = render_html(a)
    section = text[text.index('id="measured-vs-planned"'):]
    assert "<dd class=off>1,202 ms planned · 702.0 ms measured · measured 42% below plan</dd>" in section
    assert "Off plan by more than 25%</b>: rank 0 activation peak, step time." in section
    assert section.count('class="off-plan"') == 1  # the activation peak row; model states are 1.04×
    assert '<span class="off">1.25× · measured 25% above plan</span>' in section
    a["plan"]["step_time_s"] = 0.8
    assert "below plan" not in render_html(a)


def test_header_names_model_batch_commit_date_memory_loss_and_traces(tmp_path):
    """From a run directory: what ran (model, batch), its result (loss, per-rank peak memory), when
    and with which loom, and links to its traces relative to the page."""
    from analysis_inputs import write_run

    from loom.observe.analyze import analyze, write_outputs

    run = write_run(tmp_path / "run")
    (run / "config.toml").write_text('[model]\npreset = "tiny"\n[parallel]\nstrategy = "ddp"\n'
                                     "[data]\nseq_len = 128\n[train]\nbatch_size = 16\ngrad_accum = 2\n")
    summary = json.loads((run / "summary.json").read_text())
    summary |= {"first_loss": 5.5, "final_loss": 2.25, "eval_loss": 2.5, "start_step": 0}
    (run / "summary.json").write_text(json.dumps(summary))
    memory = {"ranks": {"0": {"peak_bytes": 3 << 20, "num_params": 1_500_000}}}
    (run / "memory.json").write_text(json.dumps(memory))
    # ProfilerStep#1 and #2 are training steps 2 and 3 (the profiler starts before step 1)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": n, "loss": 5.0 - n}) + "\n"
                                               for n in range(1, 5)))
    analysis = analyze(run / "traces")
    _, page = write_outputs(analysis, run)
    text = page.read_text()
    header = text[:text.index('id="findings"')]
    for fact in ("tiny · 1.50M params", "16 sequences × 128 tokens, grad_accum 2",
                 "5.500 → 2.250 (eval 2.500); profiled, training steps 2–3: 3.000, 2.000", "rank 0 3.00 MiB",
                 " UTC</dd>"):
        assert fact in header, fact
    assert '<a href="traces/rank0.json">rank 0 trace</a>' in header and "Perfetto" in header
    import loom

    head = subprocess.run(["git", "-C", str(Path(loom.__file__).parents[1]), "rev-parse", "HEAD"],
                          capture_output=True, text=True)
    commit = analysis["run"]["commit"]
    if head.returncode == 0:  # a git checkout (a copy without .git has no commit to name)
        assert commit.rstrip("+") == head.stdout.strip()[:10] and f"<dd>{commit}</dd>" in header
    else:
        assert commit is None and "loom commit" not in header


def test_empty_findings_and_missing_sections():
    assert "No problems found." in render_html(analysis(findings=False))
    minimal = {"ranks": {"0": {"steps": [{"step": 0, "compute_ms": 3.0, "idle_ms": 1.0}]}, "1": {}}}
    text = render_html(minimal)
    assert "No problems found." in text and '<section id="ledger">' in text
    for sid in ("collectives", "measured-vs-planned", "top-ops", "phases"):
        assert f'id="{sid}"' not in text
    # Whatever is missing, None or malformed renders without error.
    for odd in ({"ranks": {}},
                {"ranks": {"0": {"steps": None, "top_ops": None}}, "findings": None, "plan": None},
                {"ranks": {"0": {"steps": [{"step": 1, "wall_ms": None, "shares": {"compute": "x"}}]}},
                 "collectives": [{"per_rank": {"0": None}}],
                 "measured_vs_planned": [{"rank": 0, "x": [1, None]}]}):
        assert "<main>" in render_html(odd)


# ---- rendering in Chromium ----------------------------------------------------------------------

def _paeth(a: int, b: int, c: int) -> int:
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    return a if pa <= pb and pa <= pc else b if pb <= pc else c


def read_png(data: bytes) -> tuple[int, int, int, bytes]:
    """(width, height, channels, raw pixels) of an 8-bit RGB/RGBA non-interlaced PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, head = 8, [], None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            head = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
        pos += 12 + length
    width, height, depth, color, _, _, interlace = head
    assert depth == 8 and color in (2, 6) and interlace == 0, head
    bpp = 3 if color == 2 else 4
    stride = width * bpp
    raw = zlib.decompress(b"".join(idat))
    out = bytearray(height * stride)
    prev = bytearray(stride)
    for y in range(height):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        if f == 1:  # Sub
            for i in range(bpp, stride):
                line[i] = (line[i] + line[i - bpp]) & 0xFF
        elif f == 2:  # Up
            line = bytearray((a + b) & 0xFF for a, b in zip(line, prev))
        elif f == 3:  # Average
            for i in range(stride):
                left = line[i - bpp] if i >= bpp else 0
                line[i] = (line[i] + ((left + prev[i]) >> 1)) & 0xFF
        elif f == 4:  # Paeth
            for i in range(stride):
                a, c = (line[i - bpp], prev[i - bpp]) if i >= bpp else (0, 0)
                line[i] = (line[i] + _paeth(a, prev[i], c)) & 0xFF
        else:
            assert f == 0, f"filter {f}"
        out[y * stride:(y + 1) * stride] = line
        prev = line
    return width, height, bpp, bytes(out)


def test_read_png_all_five_filters():
    """A PNG encoded here with every filter type (one per row, in turn) decodes to its pixels."""
    for bpp, color in ((3, 2), (4, 6)):
        width, height = 9, 10
        pixels = bytes((x * 37 + y * 91 + (x * y) % 13) & 0xFF
                       for y in range(height) for x in range(width * bpp))
        stride, prev, raw = width * bpp, bytes(width * bpp), bytearray()
        for y in range(height):
            line, f = pixels[y * stride:(y + 1) * stride], y % 5
            left = [line[i - bpp] if i >= bpp else 0 for i in range(stride)]
            up_left = [prev[i - bpp] if i >= bpp else 0 for i in range(stride)]
            pred = [(0, left[i], prev[i], (left[i] + prev[i]) >> 1, _paeth(left[i], prev[i], up_left[i]))[f]
                    for i in range(stride)]
            raw += bytes([f]) + bytes((v - p) & 0xFF for v, p in zip(line, pred))
            prev = line

        def chunk(kind: bytes, body: bytes) -> bytes:
            return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

        png = (b"\x89PNG\r\n\x1a\n"
               + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, color, 0, 0, 0))
               + chunk(b"IDAT", zlib.compress(bytes(raw))) + chunk(b"IEND", b""))
        assert read_png(png) == (width, height, bpp, pixels)


def _chromium(report: Path, tmp: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--hide-scrollbars", "--force-color-profile=srgb", f"--user-data-dir={tmp / 'profile'}",
           "--window-size=1280,2000", *args, report.as_uri()]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=90)


def test_renders_in_chromium(tmp_path):
    require("chromium", CHROMIUM.exists(), "apt-get install chromium (Debian's, as .ci/run installs it)")
    report = render_report(analysis(), tmp_path / "report.html")

    dom = _chromium(report, tmp_path, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    for chart in ("chart-ledger", "chart-steptime", "chart-phases", "chart-wait"):
        assert f'<svg class="{chart}"' in dom.stdout, chart

    shot = tmp_path / "shot.png"
    run = _chromium(report, tmp_path, f"--screenshot={shot}")
    assert run.returncode == 0 and shot.exists(), run.stderr[-2000:]

    width, height, bpp, px = read_png(shot.read_bytes())
    assert (width, height) == (1280, 2000)
    stride = width * bpp
    counts: Counter[bytes] = Counter(px[i:i + 3] for i in range(0, len(px), bpp))
    assert max(counts.values()) < 0.9 * width * height and len(counts) > 50  # not one flat color

    # Every ledger bar segment is on screen at its width: a run of its exact color, as many pixels
    # long as its share of the bar, across most of the bar's 26 pixel rows (the % label cuts some).
    runs: Counter[tuple[bytes, int]] = Counter()
    for y in range(height):
        row = px[y * stride:(y + 1) * stride]
        for color, group in groupby(row[i:i + 3] for i in range(0, stride, bpp)):
            runs[color, sum(1 for _ in group)] += 1
    for rid, shares in SHARES.items():
        for key, _, fill, _ in LEDGER_PARTS:
            want = shares[key] * LEDGER_BAR_W
            rows = sum(n for (c, length), n in runs.items()
                       if c == bytes.fromhex(fill[1:]) and abs(length - want) <= 2)
            assert rows >= 10, (rid, key, want, rows)
    for color in ("1b9e77", "7570b3"):  # the step-time lines of ranks 0 and 1
        assert counts[bytes.fromhex(color)] >= 800, color
