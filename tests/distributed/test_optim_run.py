"""A real run logs (and trains with) the closed-form LR at every step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from distributed import run_ranks
from test_optim import closed_form_lr

from loom.config import load_config


def _run_lrs(corpus: str, run_dir: str) -> list[float]:
    from loom.train.driver import train

    cfg = load_config(None, ["model.preset=tiny", f'data.source="{corpus}"', "data.seq_len=32",
                             "train.batch_size=4", "data.num_workers=0", "parallel.strategy=ddp",
                             "train.steps=7", "train.warmup_steps=3",
                             "train.lr=2e-3", "train.min_lr_ratio=0.25", "train.log_every=1"])
    train(cfg, Path(run_dir), quiet=True)
    return [json.loads(line)["lr"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_a_run_logs_and_trains_with_the_closed_form_lr(corpus, tmp_path):
    lrs = run_ranks(_run_lrs, 1, str(corpus), str(tmp_path / "run"))[0]
    assert lrs == pytest.approx([closed_form_lr(k, 2e-3, 3, 7, 0.25) for k in range(1, 8)], rel=1e-12)
