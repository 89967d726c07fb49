"""Bad-input cases of model folders (docs/bad-input.md, "Model folders"): a Hugging Face
config.json, the weight map of model.safetensors.index.json, safetensors headers, a Hub cache
snapshot's links, a loom export's metadata, and `loom plan --model config.json`."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from bad_input import Ctx, case, cli

INDEX = "model.safetensors.index.json"


def llama_folder(folder: Path, shards: bool = False, **changes) -> Path:
    """A 2-layer Llama saved as transformers does (config.json + safetensors; `shards`: seven files
    and their index), with `changes` written into its config.json."""
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="20KB" if shards else "5GB")
    if changes:
        saved = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**saved, **changes}))
    return folder


def _train_from(c: Ctx, folder: Path) -> str:
    return c.train("--set", f'model.init_from="{folder}"')


def _edit_map(folder: Path, edit) -> Path:
    index = json.loads((folder / INDEX).read_text())
    index["weight_map"] = edit(index["weight_map"])
    (folder / INDEX).write_text(json.dumps(index))
    return folder


# ---------------------------------------------------------------------------------------------
# config.json


@case("model-config-eps-nan")
def _(c: Ctx) -> str:
    return _train_from(c, llama_folder(c.tmp / "m", rms_norm_eps=float("nan")))


@case("model-config-tie-string")
def _(c: Ctx) -> str:
    return _train_from(c, llama_folder(c.tmp / "m", tie_word_embeddings="false"))


@case("model-config-kv-heads-string")
def _(c: Ctx) -> str:
    return _train_from(c, llama_folder(c.tmp / "m", num_key_value_heads="8"))


@case("model-config-layers-huge")
def _(c: Ctx) -> str:
    return _train_from(c, llama_folder(c.tmp / "m", num_hidden_layers=20000))


@case("model-config-rope-type")
def _(c: Ctx) -> str:
    return _train_from(c, llama_folder(c.tmp / "m", rope_parameters={"rope_type": "yarn", "factor": "4"}))


@case("model-config-transformers-refuses")
def _(c: Ctx) -> str:
    return _train_from(c, llama_folder(c.tmp / "m", hidden_act="swishy"))  # not loom's GPT: transformers


@case("model-plan-config")
def _(c: Ctx) -> str:
    config = llama_folder(c.tmp / "m", num_key_value_heads="8") / "config.json"
    return cli("plan", "--gpu", "H100-SXM", "--model", str(config), capsys=c.capsys)


# ---------------------------------------------------------------------------------------------
# the weights against the config, before a model is built


@case("model-layers-over-weights")
def _(c: Ctx) -> str:
    return _train_from(c, llama_folder(c.tmp / "m", num_hidden_layers=40))


@case("model-safetensors-dtype")
def _(c: Ctx) -> str:
    import safetensors.torch
    import torch

    folder = llama_folder(c.tmp / "m")
    tensors = safetensors.torch.load_file(folder / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int32)  # a float weight as int
    safetensors.torch.save_file(tensors, folder / "model.safetensors")
    return _train_from(c, folder)


# ---------------------------------------------------------------------------------------------
# the weight map


@case("model-weight-map-list")
def _(c: Ctx) -> str:
    def as_list(weight_map):
        return sorted(set(weight_map.values()))
    return _train_from(c, _edit_map(llama_folder(c.tmp / "m", shards=True), as_list))


@case("model-weight-map-escapes")
def _(c: Ctx) -> str:
    def escape(weight_map):
        return {**weight_map, "model.norm.weight": "../elsewhere/model.safetensors"}
    return _train_from(c, _edit_map(llama_folder(c.tmp / "m", shards=True), escape))


@case("model-weight-map-missing-file")
def _(c: Ctx) -> str:
    folder = llama_folder(c.tmp / "m", shards=True)
    (folder / "model-00003-of-00007.safetensors").unlink()
    return _train_from(c, folder)


@case("model-weight-map-wrong-file")
def _(c: Ctx) -> str:
    def elsewhere(weight_map):
        other = next(f for f in sorted(set(weight_map.values())) if f != weight_map["model.norm.weight"])
        return {**weight_map, "model.norm.weight": other}
    return _train_from(c, _edit_map(llama_folder(c.tmp / "m", shards=True), elsewhere))


@case("model-weights-duplicate-name")
def _(c: Ctx) -> str:
    import safetensors.torch
    import torch

    folder = llama_folder(c.tmp / "m")  # one file, no index: a stray second file must not win
    safetensors.torch.save_file({"model.norm.weight": torch.zeros(32)}, folder / "stray.safetensors")
    return _train_from(c, folder)


@case("model-weight-link-escapes")
def _(c: Ctx) -> str:
    folder = llama_folder(c.tmp / "m")
    outside = c.tmp / "outside.safetensors"
    (folder / "model.safetensors").rename(outside)
    os.symlink(outside, folder / "model.safetensors")
    return _train_from(c, folder)


@case("model-hub-link-escapes")
def _(c: Ctx) -> str:
    """A Hub cache snapshot whose config.json links outside the repository's folder."""
    saved = llama_folder(c.tmp / "saved")
    snapshot = c.tmp / "hub" / "models--org--tiny" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    for file in saved.iterdir():
        os.symlink(file, snapshot / file.name)  # saved/ is outside models--org--tiny/
    return _train_from(c, snapshot)


# ---------------------------------------------------------------------------------------------
# safetensors headers


@case("model-safetensors-header")
def _(c: Ctx) -> str:
    folder = llama_folder(c.tmp / "m")
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[:8] = struct.pack("<Q", 2**62)
    (folder / "model.safetensors").write_bytes(data)
    return _train_from(c, folder)


@case("model-safetensors-truncated")
def _(c: Ctx) -> str:
    folder = llama_folder(c.tmp / "m")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    return _train_from(c, folder)


@case("model-export-metadata")
def _(c: Ctx) -> str:
    """A loom export (layout loom) whose loom_model metadata holds a NaN epsilon."""
    import dataclasses

    import safetensors.torch

    from loom.models.gpt.config import preset
    from loom.models.gpt.model import build_model

    gpt = preset("tiny")
    tensors = {k: v.contiguous() for k, v in build_model(gpt, device="cpu").state_dict().items()}
    record = json.dumps({**dataclasses.asdict(gpt), "norm_eps": float("nan")})
    safetensors.torch.save_file(tensors, c.tmp / "model.safetensors", metadata={"loom_model": record})
    return _train_from(c, c.tmp / "model.safetensors")


@case("model-export-recorded-config")
def _(c: Ctx) -> str:
    """A checkpoint whose meta.json records a Hugging Face config with a NaN epsilon, exported with
    --layout hf (which writes that config as the export's config.json)."""
    import shutil

    step = c.tmp / "step_2"
    shutil.copytree(c.step_2, step)
    meta = json.loads((step / "meta.json").read_text())
    hf = json.loads((llama_folder(c.tmp / "m") / "config.json").read_text())
    meta["model_config"] = {"hf_config": {**hf, "rms_norm_eps": float("nan")}}
    (step / "meta.json").write_text(json.dumps(meta))
    out = c.tmp / "out" / "model.safetensors"
    out.parent.mkdir()
    return cli("export", str(step), str(out), "--layout", "hf", capsys=c.capsys)
