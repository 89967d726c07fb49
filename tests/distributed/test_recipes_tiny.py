"""Each recipe of examples/recipes/ trains: loaded as a user copies it, with the model made tiny
(tiny-moe for Mixtral), the data a small corpus with the byte tokenizer (as SFT records or documents
where the recipe reads those), 2 steps, and its layout scaled down to 1-4 gloo ranks of the same
kind (ZeRO-3; pp2 × tp2 with sequence parallel; cp2; ep2; LoRA under cp2; the optimizer and
parameters offloaded to the host). The losses are finite and every step is written.
(The recipes' full-size layouts are checked by the planner: tests/unit/test_first_hour2_recipes.py.)"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from distributed import run_ranks

from loom.config import load_config
from loom.train.driver import train

RECIPES = Path(__file__).resolve().parents[2] / "examples" / "recipes"
# What every recipe shares at the tiny size: the recipes' own LR, schedule, precision (bf16 runs on
# CPU ranks) and parallel keys stay, unless the recipe's line below scales them down.
SMALL = ("model.preset=tiny", "data.tokenizer=byte", "data.seq_len=64", "data.num_workers=0",
         "train.steps=2", "train.batch_size=4", "train.grad_accum=1", "train.warmup_steps=1",
         "train.eval_every=0", "train.eval_batches=1", "train.ckpt_every=0", "train.log_every=1")
# recipe -> (ranks, its layout scaled down)
SCALED = {
    "llama3-8b-fsdp": (2, ()),
    "llama3-70b-3d": (4, ("parallel.tp=2", "parallel.pp=2", "parallel.microbatches=2")),
    "llama3-8b-128k-context": (2, ("parallel.cp=2", "model.max_seq_len=128")),
    "mixtral-8x7b-ep": (2, ("model.preset=tiny-moe", "parallel.ep=2")),
    # the base is tiny and random (no init_from)
    "llama3-70b-lora": (2, ('model.init_from=""', "parallel.cp=2", "lora.rank=4")),
    # FSDP2's CPUOffloadPolicy needs a GPU; DeepSpeed's ZeRO-3 offload of the same states runs on CPU
    "llama3-8b-offload-1gpu": (1, ("parallel.engine=deepspeed", "parallel.offload=none",
                                   "parallel.offload_optimizer=cpu", "parallel.offload_params=cpu")),
}


def _rank(cfg, out: str) -> None:
    train(cfg, Path(out), quiet=True)


def _data(recipe: Path, corpus: Path, folder: Path) -> Path:
    """The corpus in the form the recipe reads: prompt/completion records for a fine-tune on SFT data,
    documents (records, each ending with an EOS) for one that packs documents, else plain text."""
    data, text = load_config(recipe, []).data, corpus.read_text()
    if data.format == "sft":
        records = [{"prompt": text[i:i + 200], "completion": text[i + 200:i + 400]}
                   for i in range(0, len(text) - 400, 400)]
    elif data.packing == "documents":
        records = [{"text": text[i:i + 2000]} for i in range(0, len(text), 2000)]
    else:
        return corpus
    path = folder / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("name", sorted(SCALED))
def test_recipe_trains_tiny(name, corpus, tmp_path):
    world, scaled = SCALED[name]
    recipe = RECIPES / f"{name}.toml"
    source = _data(recipe, corpus, tmp_path)
    cfg = load_config(recipe, [*SMALL, f'data.source="{source}"', *scaled])
    run_dir = tmp_path / "run"
    run_ranks(_rank, world, cfg, str(run_dir))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2], records
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in steps), steps
    assert (run_dir / "checkpoints" / "step_2").is_dir()
    run = load_config(run_dir / "config.toml", [])  # the run kept the recipe's layout, scaled
    assert (run.parallel.strategy, run.train.precision, run.train.lr) == (
        cfg.parallel.strategy, "bf16", cfg.train.lr)
    assert (run.parallel.tp, run.parallel.pp, run.parallel.cp, run.parallel.ep) == (
        cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.cp, cfg.parallel.ep)
    assert run.lora.rank == cfg.lora.rank and run.model.preset == cfg.model.preset
    if run.parallel.engine == "deepspeed":  # the states were on the host
        zero = json.loads((run_dir / "deepspeed_config.json").read_text())["zero_optimization"]
        assert zero["offload_optimizer"]["device"] == zero["offload_param"]["device"] == "cpu", zero
