"""The smoke set (tests/smoke.txt) names tests that exist, and covers what the torch-version check
must cover: every strategy, TP, PP, CP, EP, LoRA, DeepSpeed, resume, export, plan, profile + analyze."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import smoke_set

ROOT = Path(__file__).resolve().parents[2]


def test_every_smoke_entry_names_a_test():
    files = sorted({entry.split("::")[0] for entry in smoke_set()})
    argv = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "smoke", *files]
    collected = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True).stdout.splitlines()
    ids = [line for line in collected if "::" in line]
    for entry in smoke_set():
        assert any(i == entry or i.startswith(entry + "::") or i.startswith(entry + "[") for i in ids), entry
    assert len(ids) >= len(smoke_set())


def test_the_smoke_set_covers_every_capability():
    text = "\n".join(smoke_set())
    for strategy in ("ddp", "zero1", "zero2", "zero3", "hsdp"):
        assert f"test_strategy_matches_single_process[{strategy}]" in text
    for piece in ("tensor_parallel", "pipeline_parallel", "context_parallel", "test_moe_ranks",
                  "test_lora_ranks", "test_deepspeed", "test_resume", "test_export", "test_plan",
                  "test_profile", "test_compile"):
        assert piece in text, piece


def test_every_extended_entry_names_a_test_and_no_smoke_test():
    """tests/extended.txt (left out of the default run) names tests that exist, none of the smoke set,
    and leaves every capability at least one test in the default run."""
    from conftest import extended_set

    entries = extended_set()
    if not entries:
        return
    files = sorted({entry.split("::")[0] for entry in entries})
    argv = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "", *files]
    collected = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True).stdout.splitlines()
    every = [line for line in collected if "::" in line]

    def left(i: str) -> bool:
        return not any(i == e or i.startswith(e + "::") or i.startswith(e + "[") for e in entries)

    for entry in entries:
        assert any(i == entry or i.startswith(entry + "[") for i in every), entry
        assert entry not in smoke_set(), entry
    for function in {i.split("[")[0] for i in every}:  # each test function keeps a case by default
        assert any(left(i) for i in every if i.split("[")[0] == function), function
