"""The README's "Fine-tune a Hugging Face model" walk-through, command by command: a local Llama
folder and datasets (examples/make_tiny_llama.py), `loom data prepare`, supervised fine-tuning
from the pretrained weights with TensorBoard on 2 ranks, a resume that continues the same data,
and an export transformers loads with its tokenizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from optional import TEST_EXTRA, require_module

transformers = require_module("transformers", TEST_EXTRA)
require_module("datasets", TEST_EXTRA)

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ["--set", "model.init_from=models/tiny-llama", "--set", "data.source=data/sft.jsonl",
         "--set", "data.format=sft", "--set", "data.seq_len=64", "--set", "train.lr=1e-3",
         "--set", "train.ckpt_every=3", "--set", "data.num_workers=0"]


def _loom(cwd: Path, *args: str, faults: str = "") -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOOM_FAULTS": faults}
    done = subprocess.run([sys.executable, "-m", "loom.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)
    ok = done.returncode != 0 if faults else done.returncode == 0
    assert ok, (f"loom {' '.join(args)} returned {done.returncode}:\n{done.stdout[-3000:]}\n"
                f"{done.stderr[-3000:]}")
    return done.stdout + done.stderr


def _losses(run: Path) -> dict[int, float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {e["step"]: e["loss"] for e in map(json.loads, lines)}


def test_walkthrough(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "examples" / "make_tiny_llama.py"), "models/tiny-llama",
                    "data"], cwd=tmp_path, check=True, capture_output=True, timeout=300)

    # Tokenize a corpus once into shards; train on them (continued pre-training).
    _loom(tmp_path, "data", "prepare", "data/corpus.jsonl", "data/prepared", "--tokenizer",
          "models/tiny-llama", "--workers", "2")
    index = json.loads((tmp_path / "data" / "prepared" / "index.json").read_text())
    assert index["vocab_size"] == 1024
    _loom(tmp_path, "train", "--nproc", "2", "--out", "runs/pretrain", "--set",
          "model.init_from=models/tiny-llama", "--set", "data.source=data/prepared", "--set", "train.steps=2",
          "--set", "data.seq_len=64")

    # Fine-tune on prompt/completion records, tracked in TensorBoard.
    out = _loom(tmp_path, "train", "--nproc", "2", "--out", "runs/sft", *TRAIN, "--set", "train.steps=6",
                "--set", 'train.log_to=["tensorboard"]')
    assert "GPT 4L d128 from models/tiny-llama" in out and "(sft)" in out
    full = _losses(tmp_path / "runs" / "sft")
    assert full[6] < full[1]
    assert list((tmp_path / "runs" / "sft" / "tensorboard").glob("events.out.tfevents.*"))

    # Killed at step 5, resumed from checkpoint 3: steps 4-6 see the same batches, so the same losses.
    _loom(tmp_path, "train", "--nproc", "2", "--out", "runs/resumed", *TRAIN, "--set", "train.steps=6",
          faults="kill@5:1")
    _loom(tmp_path, "train", "--nproc", "2", "--out", "runs/resumed", *TRAIN, "--set", "train.steps=6",
          "--resume", "auto")
    resumed = _losses(tmp_path / "runs" / "resumed")
    np.testing.assert_allclose([resumed[s] for s in (4, 5, 6)], [full[s] for s in (4, 5, 6)], rtol=1e-5)

    # Back to a Hugging Face folder: weights, config.json and the tokenizer.
    (tmp_path / "tiny-llama-sft").mkdir()
    _loom(tmp_path, "export", "runs/sft", "tiny-llama-sft/model.safetensors", "--layout", "hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "tiny-llama-sft")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tiny-llama-sft")
    ids = tokenizer("What is 3 plus 4? ", return_tensors="pt").input_ids
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert model.generation_config.eos_token_id == eos  # the export's generation_config.json
    new = model.generate(ids, max_new_tokens=3, do_sample=False)[0, ids.shape[1]:].tolist()
    assert len(new) == 3 or (new and new[-1] == eos), new  # runs to the limit, or stops at EOS
