"""The Mistral and Qwen2 adapters, as test_hf_llama.py checks Llama: a tiny HF model built from a
config (no download) trained by loom under tp=2 and under pp=2 equals its single-process run (losses
within 1e-5 relative, final weights within 1e-4; see assert_matches_reference).

What each family adds over Llama is switched on, so a plan that ignored it fails: Qwen2's q/k/v
biases (split with their columns under TP) and an attention window shorter than the sequence
(Mistral: every layer; Qwen2: the layers from `max_window_layers` on), which a pipeline stage must
mask as the whole model does.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from optional import TEST_EXTRA, require_module

require_module("transformers", TEST_EXTRA)  # before test_hf_llama, which needs it too

import test_strategies as S  # noqa: E402
from distributed import run_ranks  # noqa: E402
from test_hf_llama import _example  # noqa: E402

from loom.train.driver import train  # noqa: E402

WINDOW = 8  # attention window, shorter than the 31 input positions of test_strategies.SEQ
WEIGHT_RTOL = 1e-4


def hf_model_fn(family: str, vocab_size: int):
    """A factory for a tiny 2-layer decoder: d 64, GQA 4 heads / 2 KV heads, SwiGLU 128; "qwen2-tied": its
    head tied to its embedding, as in the small Qwen2 models."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                 tie_word_embeddings=family == "qwen2-tied")
    if family == "mistral":
        config = MistralConfig(**shape, sliding_window=WINDOW)
        return lambda: MistralForCausalLM(config)
    # layer 0 attends to everything, layer 1 within the window: one mask kind per pipeline stage
    config = Qwen2Config(**shape, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    assert config.layer_types == ["full_attention", "sliding_attention"]
    return lambda: Qwen2ForCausalLM(config)


def make_task(cfg, family: str):
    """examples/hf_llama.py's task (corpus, loss) with this family's model."""
    from dataclasses import replace

    from loom.train.task import load_data

    task = _example().make_task(cfg)
    _, vocab = load_data(cfg)
    return replace(task, model_fn=hf_model_fn(family, vocab), description=f"HF {family} 2L d64")


def _rank_train(cfg, family: str):
    r = train(cfg, None, return_state=True, quiet=True, task=make_task(cfg, family))
    return r.losses, r.state_dict, r.memory


@functools.cache
def _reference(corpus: Path, family: str):
    cfg = S.make_config(corpus, "ddp")
    return S.reference(cfg, make_task(cfg, family))


def assert_matches_reference(results, ref_losses, ref_state) -> None:
    """test_strategies' check with weights within 1e-4: TP and PP reduce in another order than one
    process, and AdamW turns near-zero gradients' roundoff into visible updates (Qwen2's MLP weights
    reach 1.5e-5 under tp=2); a wrong plan errs by 1e-1 or fails outright. A k_proj bias only gets
    roundoff (softmax ignores a shift shared by every key), so its updates are noise: compared in
    absolute terms."""
    for rank, (losses, state, _) in enumerate(results):
        rel = [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)]
        assert len(losses) == S.STEPS and max(rel) < S.RTOL, f"rank {rank} losses {losses} vs {ref_losses}"
        assert state.keys() == ref_state.keys()
        for name, ref in ref_state.items():
            if name.endswith("k_proj.bias"):
                err = (state[name] - ref).abs().max()
                assert err < 1e-5, f"rank {rank} {name}: absolute error {err:.2e}"
            else:
                err = (state[name] - ref).norm() / ref.norm()
                assert err < WEIGHT_RTOL, f"rank {rank} {name}: relative error {err:.2e}"
    assert ref_losses[-1] < ref_losses[0]  # the weights moved: a no-op run would match trivially


CASES = [(family, extra) for family in ("mistral", "qwen2") for extra in ("parallel.tp=2", "parallel.pp=2")]
# TP distributes the embedding's and the head's weights apart: a tied pair must be tied again, or it
# trains as two (pipelines refuse tied embeddings)
CASES.append(("qwen2-tied", "parallel.tp=2"))
IDS = [f"{family}-{extra.removeprefix('parallel.').replace('=', '')}" for family, extra in CASES]


@pytest.mark.parametrize("family,extra", CASES, ids=IDS)
def test_hf_family_matches_single_process(corpus, family, extra):
    ref_losses, ref_state = _reference(corpus, family)
    results = run_ranks(_rank_train, 2, S.make_config(corpus, "zero3", extra), family)
    merged = {}  # pipeline ranks each return their stage's weights
    for _, state, _ in results:
        merged.update(state)
    assert_matches_reference([(losses, merged, mem) for losses, _, mem in results], ref_losses, ref_state)
    biases = [name for name in merged if name.endswith("_proj.bias")]
    # q/k/v biases of 2 layers, compared above
    assert len(biases) == (6 if family.startswith("qwen2") else 0), biases
