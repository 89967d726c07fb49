"""Pretrained weights are taken as the files hold them (issue 38, third pass).

A folder whose config.json ties the head to the embedding but whose lm_head.weight holds other
values loads untied, as transformers loads it — its logits equal transformers' — and says so once
in a note; a head equal to the embedding (a tied model saved with its head) stays tied, silently.
A weight holding NaN or Inf is refused in one line as it is read (before step 1), naming the file,
the tensor and how many of its values are not finite, whichever block of it a rank reads. The
refusals of `loom train` are catalogue cases (tests/unit/bad_input_cases_hf3.py).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from optional import TEST_EXTRA, require_module
from safetensors.torch import load_file, save_file

import loom.cli
from loom.config import load_config
from loom.errors import LoomError
from loom.models.gpt.config import preset
from loom.models.gpt.model import build_model
from loom.models.hf.adapter import HFDecoderAdapter
from loom.models.pretrained import open_pretrained

transformers = require_module("transformers", TEST_EXTRA)

SHAPE = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def saved_folder(folder: Path, kind: str = "llama", tie: bool = True, head: str = "distinct") -> Path:
    """A tiny decoder saved by transformers (untied, so lm_head.weight is in the file), then
    config.json says `tie_word_embeddings = tie`; `head`: "distinct" (its own values), "equal"
    (a copy of the embedding) or "absent"."""
    config_class, model_class = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                                 "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[kind]
    torch.manual_seed(0)
    model_class(config_class(**SHAPE, tie_word_embeddings=False)).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": tie}))
    tensors = load_file(folder / "model.safetensors")
    if head == "equal":
        tensors[HEAD] = tensors[EMBED].clone()
    elif head == "absent":
        del tensors[HEAD]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def transformers_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def loaded_gpt(folder: Path):
    pretrained = open_pretrained(str(folder))
    model = build_model(pretrained.gpt, device="cpu")
    model.init_weights(0, pretrained.weights())
    return pretrained, model.eval()


TOKENS = torch.arange(0, 240, 15).reshape(1, 16)


def test_a_distinct_head_under_tie_loads_untied_as_transformers_does(tmp_path):
    folder = saved_folder(tmp_path / "m")
    stored = load_file(folder / "model.safetensors")
    assert not torch.equal(stored[HEAD], stored[EMBED])
    pretrained, model = loaded_gpt(folder)
    assert pretrained.gpt.tie_embeddings is False
    assert pretrained.hf_config.tie_word_embeddings is False
    assert pretrained.hf_config.raw["tie_word_embeddings"] is False  # what the run records and exports
    assert pretrained.note == (
        f"model.init_from {folder}: config.json says tie_word_embeddings = true, but its lm_head.weight "
        f"differs from model.embed_tokens.weight; loading both, untied, as transformers does (write "
        f"tie_word_embeddings = false in config.json to say so)")
    assert model.output.weight is not model.tok_embeddings.weight
    assert torch.equal(model.output.weight, stored[HEAD])
    assert torch.equal(model.tok_embeddings.weight, stored[EMBED])
    with torch.no_grad():
        logits = model(TOKENS)
    torch.testing.assert_close(logits, transformers_logits(folder, TOKENS), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head", ["equal", "absent"])
def test_a_head_equal_to_the_embedding_or_none_stays_tied_silently(tmp_path, head):
    folder = saved_folder(tmp_path / "m", head=head)
    embedding = load_file(folder / "model.safetensors")[EMBED]
    pretrained, model = loaded_gpt(folder)
    assert pretrained.note is None
    assert pretrained.gpt.tie_embeddings is True and pretrained.hf_config.raw["tie_word_embeddings"] is True
    assert model.output.weight is model.tok_embeddings.weight
    assert torch.equal(model.output.weight, embedding)
    with torch.no_grad():
        logits = model(TOKENS)
    torch.testing.assert_close(logits, transformers_logits(folder, TOKENS), rtol=1e-5, atol=1e-5)


def test_a_distinct_head_under_tie_loads_untied_through_transformers_modules(tmp_path):
    """Qwen2 (biases: not loom's GPT) is built by transformers from the recorded config: untied too."""
    folder = saved_folder(tmp_path / "q", kind="qwen2")
    stored = load_file(folder / "model.safetensors")
    pretrained = open_pretrained(str(folder))
    assert pretrained.gpt is None and pretrained.note is not None
    model = pretrained.hf_model("meta")
    pretrained.check(model)
    model.to_empty(device="cpu")
    HFDecoderAdapter(meta_init=True).init_weights(model, 0, pretrained.weights())
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, stored[HEAD])
    with torch.no_grad():
        logits = model.eval()(TOKENS).logits
    torch.testing.assert_close(logits, transformers_logits(folder, TOKENS), rtol=1e-5, atol=1e-5)


def test_the_untie_note_is_said_once_before_launch(tmp_path, corpus, capsys):
    folder = saved_folder(tmp_path / "m")
    cfg = load_config(None, [f'model.init_from="{folder}"', f'data.source="{corpus}"', "data.seq_len=32",
                             "train.batch_size=4", "data.num_workers=0", "train.device=cpu"])
    capsys.readouterr()
    model = loom.cli._preflight_data(cfg, 1)
    out = capsys.readouterr().out
    assert out.count("loom: note: model.init_from") == 1, out
    assert "loading both, untied, as transformers does" in out
    assert model.gpt.tie_embeddings is False


# ---------------------------------------------------------------------------------------------
# non-finite weights


def damaged_folder(folder: Path, name: str, where: list[tuple[int, int]], value: float,
                   dtype: torch.dtype = torch.float32) -> Path:
    """A tiny Llama (untied) whose tensor `name`, stored in `dtype`, holds `value` at `where`."""
    saved_folder(folder, tie=False)
    tensors = load_file(folder / "model.safetensors")
    for row, col in where:
        tensors[name][row, col] = value
    tensors[name] = tensors[name].to(dtype)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def nan_message(file: Path, name: str, count: int) -> str:
    return (f"cannot load {file}: {name!r} holds {count} non-finite value(s) (NaN/Inf); the file is "
            f"damaged or the model diverged before it was saved: give weights saved before that, or download "
            f"them again")


def test_a_nan_weight_is_refused_naming_file_tensor_and_count(tmp_path):
    name = "model.layers.0.mlp.up_proj.weight"  # [64, 32]: 3 NaN in row 0, an Inf in row 40
    folder = damaged_folder(tmp_path / "m", name, [(0, 0), (0, 5), (0, 9), (40, 1)], float("nan"))
    tensors = load_file(folder / "model.safetensors")
    tensors[name][40, 1] = float("inf")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    source = open_pretrained(str(folder)).weights()
    w1 = "layers.0.feed_forward.w3.weight"  # loom's name of up_proj
    assert source.file_name(w1) == name
    for offset, size in (((0, 0), (64, 32)), ((0, 0), (32, 32)), ((32, 0), (32, 32))):
        with pytest.raises(LoomError) as e:  # the block a rank reads: the whole tensor's count
            source.read(w1, (64, 32), offset, size)
        assert str(e.value) == nan_message(folder / "model.safetensors", name, 4)
    assert torch.isfinite(source.read(w1, (64, 32), (1, 0), (39, 32))).all()  # a finite block is read


@pytest.mark.parametrize("dtype,value", [(torch.bfloat16, float("inf")), (torch.float16, float("-inf")),
                                         (torch.float8_e4m3fn, float("nan"))], ids=["bf16-inf", "f16-ninf",
                                                                                    "f8e4m3-nan"])
def test_a_non_finite_weight_is_refused_in_every_stored_dtype(tmp_path, dtype, value):
    name = "model.layers.1.self_attn.q_proj.weight"  # q: rows reordered per head as they are read
    folder = damaged_folder(tmp_path / "m", name, [(7, 3)], value, dtype)
    pretrained = open_pretrained(str(folder))
    model = build_model(pretrained.gpt, device="cpu")
    with pytest.raises(LoomError) as e:
        model.init_weights(0, pretrained.weights())
    assert str(e.value) == nan_message(folder / "model.safetensors", name, 1)


def test_a_nan_in_a_loom_export_is_refused(tmp_path):
    gpt = preset("tiny")
    tensors = {k: v.contiguous() for k, v in build_model(gpt, device="cpu").state_dict().items()}
    tensors["norm.weight"][3] = float("nan")
    file = tmp_path / "model.safetensors"
    save_file(tensors, file, metadata={"loom_model": json.dumps(dataclasses.asdict(gpt))})
    pretrained = open_pretrained(str(file))
    with pytest.raises(LoomError) as e:
        build_model(pretrained.gpt, device="cpu").init_weights(0, pretrained.weights())
    assert str(e.value) == nan_message(file, "norm.weight", 1)
