"""bench/gpu_fit.py: the plan's step-time terms fitted to GPU rows, in-sample and held-out error apart."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_fit  # noqa: E402
import suite  # noqa: E402


def _rows(n: int, noise: float = 0.0, seed: int = 0) -> list[dict]:
    """Rows whose steps a known machine made: compute 1.3× the plan's, memory 2×, 20 ms fixed."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        parts = {"compute": rng.uniform(0.05, 0.3), "recompute": rng.uniform(0, 0.05) * (i % 2),
                 "bubble": 0.0, "comm_exposed": 0.0, "optimizer": rng.uniform(0.005, 0.05), "offload": 0.0}
        parts["total"] = sum(parts.values())
        step = 1.3 * (parts["compute"] + parts["recompute"]) + 2.0 * parts["optimizer"] + 0.02
        rows.append({"case": f"row {i}", "measured_step_s": step * (1 + noise * rng.standard_normal()),
                     "planned_breakdown": parts, "planned_fraction": 0.45})
    return rows


def test_the_fit_recovers_a_known_machine():
    result = gpu_fit.report(_rows(8))
    f = result["factors"]
    assert f["k_compute"] == pytest.approx(1.3) and f["k_memory"] == pytest.approx(2.0)
    assert f["t_fixed"] == pytest.approx(0.02) and f["k_comm"] is None  # no row has communication
    assert result["in_sample_error"] < 1e-9 and result["held_out_error"] < 1e-9
    assert result["plan_error"] > 0.2
    assert result["achievable_fraction"] == pytest.approx(0.45 / 1.3)


def test_few_rows_fit_few_unknowns():
    f = gpu_fit.fit(_rows(5))  # two rows an unknown: k_compute and t_fixed only
    assert f["k_compute"] is not None and f["t_fixed"] is not None and f["k_memory"] is None


def test_held_out_error_is_apart_from_in_sample():
    """With noise, a row the fit has not seen is predicted worse than the rows it was fitted to."""
    result = gpu_fit.report(_rows(10, noise=0.1))
    assert result["held_out_error"] > result["in_sample_error"] > 0.01
    for row in result["rows"]:
        assert row["held_out_s"] != pytest.approx(row["fit_s"], rel=1e-6)


def test_recorded_rows_are_planned_by_todays_planner():
    """bench/gpu_rows.json holds measurements only; each is planned here, as `loom train` plans its run."""
    rows = gpu_fit.gpu_rows([ROOT / "bench" / "gpu_rows.json"])
    assert len(rows) >= 5
    eager = rows[0]
    assert eager["planned_breakdown"]["total"] == pytest.approx(0.1532, rel=0.05)
    assert eager["planned_breakdown"]["compute"] > eager["planned_breakdown"]["optimizer"] > 0
    assert 0.3 < eager["planned_fraction"] < 0.6
    text = gpu_fit.render(gpu_fit.report(rows), "gpu_rows.json")
    assert "held out" in text and "in-sample" in text


def test_the_results_table_leaves_out_what_is_not_a_cell():
    rows = [{"case": "a", "measured": 1.0, "planned_breakdown": {"total": 1.0}, "command": "x"}]
    assert suite._table(rows)[0] == "| case | measured |"
