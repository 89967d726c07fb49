"""Bring your own model: the examples/ Hugging Face Llama under zero3, tp=2, pp=2 and pp2×tp2
equals its single-process run (losses and final weights within 1e-5 relative)."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import pytest
import test_strategies as S
import torch
from distributed import run_ranks
from optional import TEST_EXTRA, require_module

from loom.train.driver import train

require_module("transformers", TEST_EXTRA)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_llama.py"


def _example():
    spec = importlib.util.spec_from_file_location("hf_llama_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rank_train(cfg):
    r = train(cfg, None, return_state=True, quiet=True, task=_example().make_task(cfg))
    return r.losses, r.state_dict, r.memory


@functools.cache
def _reference(corpus: Path):
    cfg = S.make_config(corpus, "ddp")
    return S.reference(cfg, _example().make_task(cfg))


HF_CASES = [("zero3", 2, ()), ("zero3", 2, ("parallel.tp=2",)), ("zero3", 2, ("parallel.pp=2",)),
            ("zero3", 4, ("parallel.pp=2", "parallel.tp=2"))]


@pytest.mark.parametrize("strategy,world,extra", HF_CASES, ids=["zero3", "tp2", "pp2", "pp2xtp2"])
def test_hf_llama_matches_single_process(corpus, strategy, world, extra):
    ref_losses, ref_state = _reference(corpus)
    results = run_ranks(_rank_train, world, S.make_config(corpus, strategy, *extra))
    merged = {}  # pipeline ranks each return their stage's weights
    for _, state, _ in results:
        merged.update(state)
    S.assert_matches_reference([(losses, merged, mem) for losses, _, mem in results], ref_losses, ref_state)


def test_model_without_a_plan_gets_a_clear_error():
    from torch import nn

    from loom.errors import ConfigError
    from loom.models.registry import adapter_for

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    with pytest.raises(ConfigError, match="no tensor-parallel plan for Sequential"):
        adapter_for(model).apply_tensor_parallel(model, None, False)
    with pytest.raises(ConfigError, match="cannot find the repeated blocks of Sequential"):
        adapter_for(model).layers(model)
    stack = nn.Sequential(nn.ModuleList([nn.Linear(4, 4) for _ in range(3)]))
    assert len(adapter_for(stack).layers(stack)) == 3


class TinyMLPLM(torch.nn.Module):
    """A model loom has never seen: no plan, just a stack of identical blocks (the wrap policy)."""

    def __init__(self, vocab: int = 256, dim: int = 32):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(dim), torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(),
                                torch.nn.Linear(2 * dim, dim)) for _ in range(3))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def _custom_task(cfg):
    from loom.data.loader import split_train_eval
    from loom.train.task import Task, load_data

    tokens, _ = load_data(cfg)
    train_set, _ = split_train_eval(tokens, cfg.data.seq_len, cfg.data.eval_fraction)
    return Task(model_fn=TinyMLPLM, loss_fn=S._next_token_loss, train_data=train_set,
                tokens_per_sample=cfg.data.seq_len)


def _rank_train_custom(cfg):
    r = train(cfg, None, return_state=True, quiet=True, task=_custom_task(cfg))
    return r.losses, r.state_dict, r.memory


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_any_module_trains_under_data_parallel(corpus, strategy):
    cfg = S.make_config(corpus, "ddp")
    ref_losses, ref_state = S.reference(cfg, _custom_task(cfg))
    results = run_ranks(_rank_train_custom, 2, S.make_config(corpus, strategy))
    S.assert_matches_reference(results, ref_losses, ref_state)
