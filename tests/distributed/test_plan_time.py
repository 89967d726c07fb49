"""`loom plan --calibrate` measures this machine; `loom train` then prices its own step on that
profile (plan.json) and prints measured vs planned step time. The bound here is loose (a shared
CI machine); bench/plan_time.py holds the ±25% goal per strategy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The profile and the step it prices are timed on a machine no other test loads (tests/conftest.py).
pytestmark = pytest.mark.alone


def loom(*args: str, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loom.cli", *args], capture_output=True, text=True,
                          env={**env, "PYTHONPATH": str(ROOT)}, timeout=timeout)


def test_calibrate_then_train_prints_measured_vs_planned_step_time(tmp_path):
    env = {**os.environ, "LOOM_DEVICE_PROFILE": str(tmp_path / "device.json")}
    r = loom("plan", "--calibrate", "--quick", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    profile = json.loads((tmp_path / "device.json").read_text())
    assert profile["device"] == "cpu" and {"1", "2"} <= set(profile["by_ranks"])
    two = profile["by_ranks"]["2"]
    assert min(two["linear_flops"].values()) > 0 and two["collectives"]["all_reduce"]["bytes_per_s"] > 0
    # the block run whole is within a factor of 2 of its parts' sum; AdamW + clipping: 1-100 ns/param
    assert all(0.5 < f < 2.0 for f in two["block_in_situ"].values()), two["block_in_situ"]
    assert 1e-9 < two["optimizer_s_per_param"] < 1e-7
    assert "recommended (*)" in r.stdout  # then it plans the config on this machine

    out = tmp_path / "run"
    r = loom("train", "--nproc", "2", "--out", str(out), "--set", "train.steps=8",
             "--set", "train.eval_batches=0", "--set", "data.num_workers=0", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    plan = json.loads((out / "plan.json").read_text())
    assert plan["step_time_s"] > 0 and plan["device_profile"] == str(tmp_path / "device.json")
    summary = json.loads((out / "summary.json").read_text())
    versus = summary["step_time_vs_planned"]
    (measured, planned), parts = versus["step_time_s"], versus["planned_breakdown_s"]
    assert planned == plan["step_time_s"] and parts["compute"] > 0
    assert 0.5 <= measured / planned <= 2.0, (measured, planned)
    assert "step time: measured" in r.stdout and "planned" in r.stdout
