"""bench/checkpoint_speed.py runs (a tiny model, one round) and prints its table; no timing asserts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "checkpoint_speed.py"


def test_checkpoint_speed_smoke(tmp_path):
    out = tmp_path / "result.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--json", str(out)], check=False,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    for line in ("MB on disk", "sync save", "async save  stall", "training on: published", "load "):
        assert line in done.stdout, done.stdout
    assert out.is_file()
