"""Training from each data source, and the run directory a single-process run writes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from distributed import run_ranks

from loom.config import load_config
from loom.train.driver import train


def _train(overrides: list[str], run_dir: str | None, return_state: bool = False):
    r = train(load_config(None, overrides), Path(run_dir) if run_dir else None, quiet=True,
              return_state=return_state)
    return (r.losses, r.eval_loss, r.state_dict) if return_state else (r.losses, r.eval_loss)


BASE = ["model.preset=tiny", "train.steps=3", "train.batch_size=4", "data.seq_len=32",
        "data.num_workers=0", "train.warmup_steps=1", "parallel.strategy=ddp"]


def test_bpe_tokenizer_sets_the_model_vocabulary(tmp_path, corpus):
    # A varied corpus (stdlib sources): BPE finds all 300 − 256 merges. (On a few repeated lines it
    # stops short, and the model then takes the smaller vocabulary the tokenizer really has.)
    losses, eval_loss, state = run_ranks(_train, 1, BASE + [f'data.source="{corpus}"', "data.tokenizer=bpe",
                                                            "data.bpe_vocab_size=300",
                                                            f'data.cache_dir="{tmp_path}"'], None, True)[0]
    assert len(losses) == 3 and all(np.isfinite(losses))
    # The model's vocabulary is the tokenizer's: 300 rows in and out, not the byte default of 256.
    assert state["tok_embeddings.weight"].shape[0] == 300 and state["output.weight"].shape[0] == 300
    # A fresh model is about uniform over its 300 ids: ln 300 = 5.70 (ln 256 = 5.55, ln 512 = 6.24).
    assert abs(losses[0] - np.log(300)) < 0.05, losses[0]
    assert list(tmp_path.glob("bpe-300-*.json"))


def test_pretokenized_bin_file(tmp_path):
    tokens = (np.arange(20_000) * 7 % 251).astype(np.uint16)  # a learnable periodic stream
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    run_dir = tmp_path / "run"
    losses, eval_loss = run_ranks(_train, 1,
                                  BASE + [f'data.source="{path}"', "train.steps=6", "train.lr=1e-2"],
                                  str(run_dir))[0]
    assert losses[-1] < losses[0] - 0.3
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in records] == losses
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval_loss"] == eval_loss and eval_loss is not None
