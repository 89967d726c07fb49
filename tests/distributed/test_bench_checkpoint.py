"""bench/checkpoint_speed.py runs (a tiny model, one round): its figures are consistent with the
model it saved and with each other. No timing targets: those live in the bench's own output."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "checkpoint_speed.py"


def test_checkpoint_speed_smoke(tmp_path):
    out = tmp_path / "result.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--json", str(out)], check=False,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    s = json.loads(out.read_text())
    params = s["model"]["num_params"]
    # the tiny model: 2 layers d64, FFN 128, vocab 256, untied
    assert params == 2 * 256 * 64 + 2 * (2 * 64 + 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128) + 64
    # fp32 weights + Adam's m and v = 12 bytes a parameter, plus per-entry framing and the JSON files
    assert 12 * params < s["checkpoint_bytes"] < 12 * params * 1.5, s["checkpoint_bytes"]
    for key in ("sync_save_s", "load_s", "async_stall_s", "async_write_alone_s", "plain_step_s"):
        assert 0 < s[key] < 60 and math.isfinite(s[key]), (key, s[key])
    assert math.isclose(s["sync_save_mb_per_s"], s["checkpoint_bytes"] / 1e6 / s["sync_save_s"], rel_tol=1e-9)
    assert math.isclose(s["load_mb_per_s"], s["checkpoint_bytes"] / 1e6 / s["load_s"], rel_tol=1e-9)
    assert math.isclose(s["async_stall_vs_sync"], s["async_stall_s"] / s["sync_stall_s"], rel_tol=1e-9)
    assert s["steps_during_write"] >= 1
    # the printed table is the JSON's figures
    assert f"sync save   {s['sync_save_s']:5.2f} s  {s['sync_save_mb_per_s']:4.0f} MB/s" in done.stdout
    assert f"load        {s['load_s']:5.2f} s  {s['load_mb_per_s']:4.0f} MB/s" in done.stdout
    assert f"({params / 1e6:.1f}M params, 2L d64 vocab 256, zero3, 2 ranks" in done.stdout
