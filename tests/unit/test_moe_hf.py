"""Hugging Face MoE folders. Mixtral as loom's GPT: its logits, each rank reading only its experts, the
export back to Mixtral's layout unchanged, and what Mixtral's layout cannot hold refused in one line.
Qwen2-MoE / Qwen3-MoE through transformers' modules: their fused experts read from the per-expert
tensors, and split apart again for the export."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from optional import TEST_EXTRA, require_module
from safetensors.torch import load_file

from loom.errors import ConfigError, LoomError
from loom.models.gpt.config import preset
from loom.models.gpt.llama_layout import hf_config, hf_state_dict
from loom.models.gpt.model import build_model
from loom.models.pretrained import open_pretrained

require_module("transformers", TEST_EXTRA)


def make_mixtral(folder, **extra):
    """A tiny random Mixtral (4 experts, top 2) saved as transformers saves one; returns the model."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=32,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
                                     **extra)
    model = transformers.MixtralForCausalLM(cfg).eval()
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mixtral")
    return folder, make_mixtral(folder)


def _loom(folder):
    pretrained = open_pretrained(str(folder))
    model = build_model(pretrained.gpt, "cpu")
    pretrained.check(build_model(pretrained.gpt, "meta"))
    model.init_weights(0, pretrained.weights())
    return pretrained, model.eval()


def test_mixtral_reads_as_loom_gpt_with_its_logits(mixtral):
    folder, hf = mixtral
    pretrained, model = _loom(folder)
    g = pretrained.gpt
    routing = (g.moe_experts, g.moe_top_k, g.moe_norm_topk, g.moe_score, g.moe_layers)
    assert routing == (4, 2, True, "softmax", 2)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(model(tokens), hf(tokens).logits, atol=1e-5)


def test_each_rank_reads_only_its_experts(mixtral):
    folder, _ = mixtral
    pretrained = open_pretrained(str(folder))
    source = pretrained.weights()
    name, shape = "layers.1.feed_forward.experts.w2", (4, 64, 32)
    block = source.read(name, shape, (2, 0, 0), (2, 64, 32))  # ep rank 1 of 2: experts 2 and 3
    stored = load_file(str(folder / "model.safetensors"))
    assert torch.equal(block, torch.stack([stored[f"model.layers.1.block_sparse_moe.experts.{j}.w2.weight"]
                                           for j in (2, 3)]))
    assert source.bytes_read == 2 * 64 * 32 * 4  # two experts' bytes, no more


def test_exports_back_to_mixtrals_layout_unchanged(mixtral):
    folder, _ = mixtral
    pretrained, model = _loom(folder)
    exported = hf_state_dict(dict(model.state_dict()), pretrained.gpt)
    stored = load_file(str(folder / "model.safetensors"))
    assert exported.keys() == stored.keys()
    for name, tensor in stored.items():
        assert torch.equal(exported[name], tensor), name
    config = hf_config(pretrained.gpt)
    original = json.loads((folder / "config.json").read_text())
    for key in ("model_type", "num_local_experts", "num_experts_per_tok", "intermediate_size", "hidden_size"):
        assert config[key] == original[key], key


def test_what_mixtrals_layout_cannot_hold_is_refused():
    shared = dataclasses.replace(preset("tiny-moe"), moe_ffn_hidden=0)
    with pytest.raises(LoomError, match="shared experts.*Mixtral's layout cannot hold"):
        hf_config(shared)
    gpt = dataclasses.replace(preset("tiny-moe"), moe_shared_experts=0, moe_ffn_hidden=0, moe_norm_topk=True)
    tensors = dict(build_model(gpt, "cpu").state_dict())
    tensors["layers.0.feed_forward.expert_bias"] = torch.ones(8)
    with pytest.raises(LoomError, match="expert_bias is not zero"):
        hf_state_dict(tensors, gpt)


def test_router_jitter_is_refused_in_one_line(tmp_path):
    make_mixtral(tmp_path, router_jitter_noise=0.1)
    with pytest.raises(ConfigError, match="router jitter"):
        open_pretrained(str(tmp_path))


def make_qwen_moe(folder, kind: str):
    """A tiny random Qwen2-MoE (shared expert and its gate) or Qwen3-MoE saved as transformers saves it."""
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
    if kind == "qwen2_moe":
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            shared_expert_intermediate_size=32, **common))
    else:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**common))
    model.save_pretrained(folder)
    return model.eval()


@pytest.mark.parametrize("kind", ["qwen2_moe", "qwen3_moe"])
def test_qwen_moe_folders_read_fused_and_export_apart(tmp_path, kind):
    """transformers' fused experts read block by block from the per-expert tensors (as from_pretrained
    fuses them), and split back apart exactly for `loom export --layout hf`."""
    import transformers

    from loom.models.hf.experts import split_experts

    make_qwen_moe(tmp_path, kind)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    pretrained = open_pretrained(str(tmp_path))
    pretrained.check(pretrained.hf_model("meta"))
    source = pretrained.weights()
    fused = {n: p.detach() for n, p in loaded.named_parameters()}
    name = "model.layers.1.mlp.experts.gate_up_proj"
    shape = tuple(fused[name].shape)  # [4, 2 × 16, 64]
    block = source.read(name, shape, (1, 8, 0), (2, 16, 64))  # experts 1-2, gate rows 8.. and up rows ..7
    assert torch.equal(block, fused[name][1:3, 8:24])
    down = "model.layers.0.mlp.experts.down_proj"
    whole = tuple(fused[down].shape)
    assert torch.equal(source.read(down, whole, (0, 0, 0), whole), fused[down])
    stored = load_file(str(tmp_path / "model.safetensors"))
    apart = split_experts(dict(loaded.state_dict()))
    assert set(apart) - {"lm_head.weight"} == set(stored) - {"lm_head.weight"}
    for key, tensor in stored.items():
        assert torch.equal(apart[key], tensor), key
