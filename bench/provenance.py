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
            "python": platform.python_version(), "torch": torch.__version__, **_gpu(torch)}


def _gpu(torch) -> dict:
    """The GPUs, their driver and CUDA (nothing on a machine without one)."""
    if not torch.cuda.is_available():
        return {}
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.split("\n")[0].strip()
    except (OSError, subprocess.SubprocessError):
        driver = ""
    return {"gpu": f"{torch.cuda.device_count()}× {torch.cuda.get_device_name(0)}",
            "driver": driver or "unknown", "cuda": torch.version.cuda}


def describe(p: dict) -> str:
    gpu = f" and {p['gpu']} (driver {p['driver']}, CUDA {p['cuda']})" if p.get("gpu") else ""
    return f"measured {p['measured_at']} at commit {p['commit']} on {p['machine']}{gpu}, torch {p['torch']}"
