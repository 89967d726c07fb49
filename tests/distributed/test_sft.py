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
           ("zero2", 2, ("parallel.engine=deepspeed", "train.grad_accum=2")),
           ("zero3", 2, ("parallel.cp=2", "train.grad_accum=2"))]


@pytest.mark.parametrize("strategy,world,extra", LAYOUTS,
                         ids=["zero3-accum2", "tp2", "pp2", "deepspeed", "cp2-ring-accum2"])
def test_sft_losses_do_not_depend_on_the_layout(sft_data, reference, strategy, world, extra):
    if "parallel.engine=deepspeed" in extra:
        require_module("deepspeed", DEEPSPEED)
    losses = run_ranks(_losses, world, _config(sft_data, f"parallel.strategy={strategy}", *extra))[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=2e-5, atol=0)
    assert reference[-1] < reference[0]


def test_packed_documents_train_alike_under_cp(sft_data):
    """data.packing = documents end to end (the records' EOS from the tokenizer, through the loader,
    into the model's mask): cp = 2 under both exchanges gives the single process's losses, and the
    mask changes them (the windows hold several examples)."""
    packed = _config(sft_data, "parallel.strategy=ddp", "data.packing=documents")
    alone = run_ranks(_losses, 1, packed)[0]
    concat = run_ranks(_losses, 1, _config(sft_data, "parallel.strategy=ddp"))[0]
    assert abs(alone[-1] - concat[-1]) > 1e-3, (alone, concat)  # (at init every context looks alike)
    for mode in ("ring", "alltoall"):
        cfg = _config(sft_data, "parallel.strategy=zero3", "data.packing=documents", "parallel.cp=2",
                      f"parallel.cp_mode={mode}")
        losses = run_ranks(_losses, 2, cfg)[0]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(alone), rtol=2e-5, atol=0)
