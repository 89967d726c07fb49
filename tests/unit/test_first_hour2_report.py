"""Issue 40, item 7 ("see, not read"): every run's report.html with its curves (checked on the SVG's
numbers and on Chromium's pixels), the progress line in place on a terminal, the final eval in
metrics.jsonl, and the end-of-run MFU / MoE / eval-trend lines."""

from __future__ import annotations

import io
import json
import re
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from optional import require
from test_report import CHROMIUM, _chromium, analysis, read_png

from loom.config import load_config, validate
from loom.observe import curves
from loom.observe.analyze import check_outputs
from loom.observe.report import render_html
from loom.observe.run_report import write_run_report
from loom.plan.hardware import CATALOG
from loom.train import record, run_figures
from loom.train.meters import Progress

STEPS = 60
LOSSES = [6.0 - 3.0 * s / STEPS + 0.1 * (s % 3) for s in range(1, STEPS + 1)]
EVALS = {20: 4.9, 40: 4.3, 60: 3.8}
TOKENS = [1000.0 + 50.0 * s for s in range(1, STEPS + 1)]  # rising: bottom left to top right


def fixture_run(root: Path, planned: bool = True) -> Path:
    """A run folder as `loom train` leaves it: metrics.jsonl, memory.json, plan.json, summary.json."""
    run = root / "run"
    run.mkdir()
    rows = [{"step": s, "loss": LOSSES[s - 1], "tokens_per_s": TOKENS[s - 1], "lr": 1e-3,
             **({"eval_loss": EVALS[s]} if s in EVALS else {})} for s in range(1, STEPS + 1)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 61, "lo')
    (run / "memory.json").write_text(json.dumps({"ranks": {"0": {"model_state_bytes": 3 * 2**20,
                                                                   "peak_bytes": 5 * 2**20}}}))
    (run / "plan.json").write_text(json.dumps({"label": "zero3 dp2", "strategy": "zero3", "pp": 1, "dp": 2,
                                               "cp": 1, "tp": 1, "micro_batch": 4, "grad_accum": 1,
                                               "memory_bytes": {"total": 7 * 2**20}, "step_time_s": 0.25,
                                               "tokens_per_s": 4096.0, "mfu": 0.123}))
    vs = [{"rank": 0, "model_state_bytes": [3 * 2**20, 3 * 2**20], "activation_peak_bytes": [2**20, 2**21]}]
    summary = {"strategy": "zero3", "steps": STEPS, "first_loss": LOSSES[0], "final_loss": LOSSES[-1],
               "eval_loss": 3.8, "tokens_per_s": 3000.0, **({"measured_vs_planned": vs} if planned else {})}
    (run / "summary.json").write_text(json.dumps(summary))
    return run


def curve_values(page: str, series: str) -> list[tuple[float, float]]:
    """The (step, value) points of a polyline, mapped back through its chart's axes."""
    for svg in re.findall(r"<svg [^>]*data-x=.*?</svg>", page):
        found = re.search(rf'data-series="{re.escape(series)}" points="([^"]*)"', svg)
        if found:
            x0, x1 = map(float, re.search(r'data-x="([^"]*)"', svg).group(1).split())
            y0, y1 = map(float, re.search(r'data-y="([^"]*)"', svg).group(1).split())
            left, top, pw, ph = curves.PLOT
            pts = [tuple(map(float, p.split(","))) for p in found.group(1).split()]
            return [(x0 + (px - left) / pw * (x1 - x0), y0 + (top + ph - py) / ph * (y1 - y0))
                    for px, py in pts]
    raise AssertionError(f"no curve {series!r}")


def test_run_report_curves_are_the_runs_numbers(tmp_path):
    run = fixture_run(tmp_path)
    page = write_run_report(run).read_text()
    loss = curve_values(page, "training loss")
    assert [round(s) for s, _ in loss] == list(range(1, STEPS + 1))  # the cut last line skipped
    assert [v for _, v in loss] == pytest.approx(LOSSES, abs=0.005)
    held = curve_values(page, "eval loss")
    assert [round(s) for s, _ in held] == list(EVALS)
    assert [v for _, v in held] == pytest.approx(list(EVALS.values()), abs=0.005)
    assert [v for _, v in curve_values(page, "tokens/s")] == pytest.approx(TOKENS, abs=2)
    assert "<script" not in page and "http" not in page.split("</title>")[1]  # nothing fetched
    assert "<title>loom run report · run</title>" in page
    for text in ("3.00 MiB", "2.00 MiB", "zero3 dp2", "0.250 s", "4,096", "12.3%", "3,000"):
        assert text in page, text


def test_run_report_is_fast(tmp_path):
    run = fixture_run(tmp_path)
    start = time.perf_counter()
    write_run_report(run)
    assert time.perf_counter() - start < 0.05  # 60 steps: milliseconds


def test_a_users_report_html_stays_and_loom_own_is_replaced(tmp_path):
    run = fixture_run(tmp_path)
    (run / "report.html").write_text("<html>my notes</html>")
    assert write_run_report(run) is None
    assert (run / "report.html").read_text() == "<html>my notes</html>"
    (run / "report.html").unlink()
    write_run_report(run)
    assert write_run_report(run) == run / "report.html"  # its own earlier one: rewritten
    check_outputs(run, overwrite=False)  # and loom analyze (loom profile) may replace it with the ledger's


def test_ledger_report_gains_the_curves(tmp_path):
    run = fixture_run(tmp_path)
    page = render_html({**analysis(), "curves": curves.read_curves(run / "metrics.jsonl")})
    assert [v for _, v in curve_values(page, "training loss")] == pytest.approx(LOSSES, abs=0.005)
    assert 'class="chart-ledger"' in page  # the ledger stays
    assert "chart-loss" not in render_html(analysis())  # no metrics.jsonl: no curves


def test_progress_redraws_in_place_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Terminal()
    progress = Progress(total_steps=5, log_every=2, enabled=True, stream=out)
    for step in range(1, 6):
        progress.update(step, 4.0, 100.0)
    text = out.getvalue()
    assert text.count("\r") == 5 and text.count("\n") == 1 and text.endswith("\n")
    assert text.startswith("\rstep 1/5") and text.count("\x1b[K") == 5  # a shorter line leaves no tail


def test_progress_in_a_pipe_prints_a_line_per_log_every():
    out = io.StringIO()
    progress = Progress(total_steps=10, log_every=4, enabled=True, stream=out)
    for step in range(1, 11):
        progress.update(step, 4.0, 100.0)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert [int(re.match(r"step +(\d+)/", line).group(1)) for line in lines] == [1, 4, 8, 10]


def test_a_run_writes_its_final_eval_report_and_mfu(corpus, tmp_path, world_of_one):
    from loom.train.driver import train

    cfg = load_config(None, [f'data.source="{corpus}"', "model.preset=tiny", "data.seq_len=32",
                             "train.batch_size=4", "data.num_workers=0", "train.device=cpu",
                             "parallel.strategy=ddp", "train.steps=3", "train.eval_every=2",
                             "train.ckpt_every=0"])
    validate(cfg, 1)
    run = tmp_path / "run"
    result = train(cfg, run, quiet=True)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r.get("eval_loss") for r in rows] == [None, result.extra["evals"][2], result.eval_loss]
    assert result.eval_loss is not None
    summary = json.loads((run / "summary.json").read_text())
    plan = json.loads((run / "plan.json").read_text())
    # the CPU's calibrated profile (tests/conftest.py) has a peak: MFU = tokens/s × FLOPs/token ÷ peak
    want = result.tokens_per_s * plan["flops_per_token"] / (plan["peak_tflops"] * 1e12)
    assert summary["figures"]["mfu"] == pytest.approx(want, rel=1e-9) and want > 0
    assert summary["figures"]["evals"] == [[2, result.extra["evals"][2]], [3, result.eval_loss]]
    page = (run / "report.html").read_text()
    assert [v for _, v in curve_values(page, "training loss")] == pytest.approx(result.losses, abs=1e-3)


class _Mesh:
    def __init__(self, n: int):
        self.n = n

    def size(self) -> int:
        return self.n


def test_mfu_on_a_catalog_gpu_and_na_without_a_peak(monkeypatch):
    """plan.json on a device torch calls "NVIDIA H100 80GB HBM3": the catalog's H100-SXM bf16 peak."""
    cfg = load_config(None, ["model.preset=tiny", "data.seq_len=32", "train.batch_size=8",
                             "parallel.strategy=ddp"])
    from loom.models.gpt.config import preset
    from loom.plan.shapes import from_gpt_config

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * 2**30))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    mesh = {k: _Mesh(n) for k, n in (("dp_replicate", 1), ("dp_shard", 2), ("tp", 1), ("pp", 1), ("cp", 1))}
    d = SimpleNamespace(world_size=2, device=torch.device("cuda"), mesh=mesh)
    plan = record.plan_run(cfg, from_gpt_config(preset("tiny"), 32), d)
    peak = CATALOG["H100-SXM"].bf16_tflops
    assert plan["peak_tflops"] == peak and plan["gpu"] == "H100-SXM"
    f = run_figures.figures(50_000.0, plan, {}, 3.0, 10, [])
    assert f["mfu"] == pytest.approx(50_000.0 * plan["flops_per_token"] / (2 * peak * 1e12), rel=1e-12)
    assert run_figures.lines(f)[0] == f"MFU {f['mfu']:.1%} of a {peak:.3g} TFLOPS peak per device (H100-SXM)"
    none = run_figures.figures(50_000.0, {**plan, "peak_tflops": None, "gpu": None}, {}, 3.0, 10, [])
    assert none["mfu"] is None
    assert run_figures.lines(none)[0].startswith("MFU n/a (no peak known for this device")


def test_moe_load_and_eval_trend_lines():
    rows = [{"moe_load_imbalance": v, "moe_dropped": n} for v, n in ((1.2, 3), (1.6, 0), (1.4, 5))]
    f = run_figures.figures(1.0, None, {10: 5.25, 20: 4.5}, 4.125, 30, rows)
    assert f["moe"] == {"load_imbalance": 1.4, "steps": 3, "dropped": 8}
    text = run_figures.lines(f)
    assert "MoE load: busiest expert 1.40× the mean (median of 3 steps), 8 tokens dropped in all" in text
    assert "eval loss: 5.2500 (step 10) → 4.1250 (step 30), 3 evals" in text


def test_report_renders_in_chromium(tmp_path):
    """The page in headless Chromium: not blank, and the tokens/s curve (which rises from the first
    step's value to the last's) drawn across the plot from its bottom-left to its top-right."""
    require("chromium", CHROMIUM.exists(), "apt-get install chromium (Debian's, as .ci/run installs it)")
    report = write_run_report(fixture_run(tmp_path, planned=False))
    shot = tmp_path / "shot.png"
    done = _chromium(report, tmp_path, f"--screenshot={shot}")
    assert done.returncode == 0 and shot.exists(), done.stderr[-2000:]
    width, height, bpp, px = read_png(shot.read_bytes())
    counts = Counter(px[i:i + 3] for i in range(0, len(px), bpp))
    assert max(counts.values()) < 0.95 * width * height and len(counts) > 50  # not blank
    green = bytes.fromhex(curves.SERIES["tokens_per_s"][2][1:])
    where = [(i // bpp % width, i // bpp // width) for i in range(0, len(px), bpp) if px[i:i + 3] == green]
    assert len(where) > 500
    (x_left, y_left), (x_right, y_right) = min(where), max(where)
    _, _, pw, ph = curves.PLOT
    assert abs((x_right - x_left) - pw) <= 6, (x_left, x_right)
    assert abs((y_left - y_right) - ph) <= 6, (y_left, y_right)  # the first step low, the last high
    assert counts[bytes.fromhex(curves.SERIES["loss"][2][1:])] > 500  # the loss curve drawn too
