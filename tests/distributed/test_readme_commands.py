"""The README's command blocks, run as a reader pastes them into a shell — in a scratch folder, with
`loom` and `python` on the PATH, and tiny sizes substituted (a few steps per `loom train`): the quick
start, the fine-tune walk-through, continued pre-training. tests/unit/test_readme.py checks that
every block is run here, read as a synopsis, or covered elsewhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import readme
from optional import TEST_EXTRA, require_module
from stray import stray_lines

ROOT = Path(__file__).resolve().parents[2]
# Appended to every `loom train` (`loom profile`): what makes a README run a test's size (a profile's
# schedule skips a step, warms up one, records three).
TINY = {"loom train": " --set train.steps=2 --set data.num_workers=0",
        "loom profile": " --set train.steps=5 --set data.num_workers=0"}
SKIP = {"bash install.sh"}  # CI ran it before the tests
PRETRAIN = "loom data prepare data/corpus.jsonl data/prepared --tokenizer models/tiny-llama"
# The worked examples of docs/long-context.md and docs/observability.md, by their first command.
LONG_CONTEXT = "loom plan --model 8b --gpu H100-SXM --set data.seq_len=131072 --set train.batch_size=8"
PROFILE = "loom profile --out runs/zero3"


def _shell(tmp: Path) -> dict:
    """A scratch folder where `loom` and `python` are this checkout's, as after install.sh."""
    bin_dir = tmp / ".bin"
    bin_dir.mkdir()
    (bin_dir / "loom").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m loom.cli "$@"\n')
    (bin_dir / "loom").chmod(0o755)
    (bin_dir / "python").symlink_to(sys.executable)
    (tmp / "examples").symlink_to(ROOT / "examples")
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1"}


def _tiny(command: str) -> str:
    parts = [p for p in command.split(" && ") if p not in SKIP]
    return " && ".join(p + next((t for c, t in TINY.items() if p.startswith(c)), "") for p in parts)


def _run_block(first: str, tmp: Path, env: dict) -> list[str]:
    """Each command of the block run in turn: it exits 0 and prints no stray line (tests/stray.py)."""
    block = next(b for b in readme.blocks() if b.commands[0] == first)
    outputs = []
    for command in block.commands:
        done = subprocess.run(["bash", "-c", _tiny(command)], cwd=tmp, env=env, capture_output=True,
                              text=True, timeout=600)
        where = f"{block.page.name} line {block.line}: `{command}`"
        assert done.returncode == 0, (f"{where} exited {done.returncode}:\n"
                                      f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
        stray = stray_lines(done.stdout, done.stderr)
        assert stray == [], f"{where} printed {len(stray)} stray line(s):\n" + "\n".join(stray[:20])
        outputs.append(done.stdout + done.stderr)
    return outputs


def _steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_quick_start(tmp_path):
    env = _shell(tmp_path)
    (out,) = _run_block("bash install.sh && loom train", tmp_path, env)
    (run,) = (tmp_path / "runs").iterdir()
    assert run.name.endswith("-zero3") and _steps(run) == [1, 2]
    assert "zero3 on 2 rank(s)" in out


def test_fine_tune_walkthrough_and_continued_pretraining(tmp_path):
    require_module("transformers", TEST_EXTRA)
    env = _shell(tmp_path)
    _run_block("python examples/make_tiny_llama.py models/tiny-llama data", tmp_path, env)
    assert _steps(tmp_path / "runs" / "sft") == [1, 2]
    assert (tmp_path / "tiny-llama-sft" / "config.json").is_file()
    _run_block(PRETRAIN, tmp_path, env)
    assert _steps(tmp_path / "runs" / "pretrain") == [1, 2]
    _run_block(readme.LORA_BLOCK, tmp_path, env)
    assert _steps(tmp_path / "runs" / "lora") == [1, 2]
    adapter = json.loads((tmp_path / "tiny-llama-lora" / "adapter_config.json").read_text())
    assert adapter["r"] == 16 and adapter["peft_type"] == "LORA"
    assert (tmp_path / "merged" / "config.json").is_file()



def test_long_context_and_profile_examples(tmp_path):
    """Plan 8B at 128k tokens, train the default model with cp 2; profile two layouts and compare."""
    env = _shell(tmp_path)
    plan, train = _run_block(LONG_CONTEXT, tmp_path, env)
    assert "recommended (*): zero3 cp8 ring" in plan
    assert "× cp=2 (ring)" in train and _steps(tmp_path / "runs" / "long") == [1, 2]
    *_, compare = _run_block(PROFILE, tmp_path, env)
    for run in ("zero3", "ddp"):
        assert (tmp_path / "runs" / run / "traces" / "rank1.json.gz").is_file()
        assert (tmp_path / "runs" / run / "ledger.json").is_file()
    assert "A: runs/zero3" in compare and "B: runs/ddp" in compare and "B/A" in compare
