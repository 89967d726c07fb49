"""Supervised fine-tuning's loss is the mean over every completion token of the global batch,
whatever the layout: micro-batches holding different numbers of them are weighted by their share,
so data parallelism, accumulation, tensor and pipeline parallelism and DeepSpeed all give the
single process's losses."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from optional import DEEPSPEED, TEST_EXTRA, require_module

from loom.config import load_config
from loom.train.driver import train

require_module("datasets", TEST_EXTRA)


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory) -> Path:
    """Prompt/completion records of very different lengths: the completion tokens per window vary."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("sft") / "sft.jsonl"
    with open(path, "w") as f:
        for _ in range(300):
            prompt = "".join(rng.choice("abcdefgh ") for _ in range(rng.randrange(2, 40)))
            completion = "".join(rng.choice("xyz.") for _ in range(rng.randrange(1, 30)))
            f.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
    return path


def _config(data: Path, *extra: str):
    return load_config(None, [
        "model.preset=tiny", f'data.source="{data}"', "data.format=sft", "data.seq_len=32",
        "data.num_workers=0", "data.eval_fraction=0.05", "train.steps=3", "train.batch_size=8",
        "train.warmup_steps=1", "train.lr=1e-2", "train.seed=3", "train.eval_batches=1", *extra])


def _losses(cfg):
    return train(cfg, None, quiet=True).losses


@pytest.fixture(scope="module")
def reference(sft_data):
    return run_ranks(_losses, 1, _config(sft_data, "parallel.strategy=ddp"))[0]


LAYOUTS = [("zero3", 2, ("train.grad_accum=2",)), ("ddp", 2, ("parallel.tp=2",)),
           ("zero3", 2, ("parallel.pp=2", "parallel.microbatches=4")),
           ("zero2", 2, ("parallel.engine=deepspeed", "train.grad_accum=2"))]


@pytest.mark.parametrize("strategy,world,extra", LAYOUTS, ids=["zero3-accum2", "tp2", "pp2", "deepspeed"])
def test_sft_losses_do_not_depend_on_the_layout(sft_data, reference, strategy, world, extra):
    if "parallel.engine=deepspeed" in extra:
        require_module("deepspeed", DEEPSPEED)
    losses = run_ranks(_losses, world, _config(sft_data, f"parallel.strategy={strategy}", *extra))[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=2e-5, atol=0)
    assert reference[-1] < reference[0]
