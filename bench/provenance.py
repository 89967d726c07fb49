"""Where a benchmark figure comes from: when, which commit, which machine and software."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def provenance() -> dict:
    import torch

    commit = _git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no", "--", "loom", "bench",
                      "pyproject.toml"))
    return {"measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "commit": commit + (" (with uncommitted code changes)" if dirty else ""),
            "machine": f"{os.cpu_count()} cores, {platform.machine()}, {platform.system()}",
            "python": platform.python_version(), "torch": torch.__version__}


def describe(p: dict) -> str:
    return f"measured {p['measured_at']} at commit {p['commit']} on {p['machine']}, torch {p['torch']}"
