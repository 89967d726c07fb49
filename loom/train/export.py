"""`loom export`: a checkpoint, consolidated into one safetensors file.

A checkpoint holds the model's tensors under the full model's parameter names, sharded however
the run sharded them (see loom/train/checkpoint.py). Export reads them whole without a process
group and writes them as one `.safetensors` file:

  - layout "loom": the names and tensors exactly as the checkpoint holds them (any model);
  - layout "hf": loom's GPT as a Hugging Face Llama (`LlamaForCausalLM`): its parameter names,
    q/k projection rows reordered for Llama's rotate-half RoPE, and a `config.json` beside the file.

Each file is written to a temporary name in the output's folder and renamed over the output in
one step, so a crash never leaves half a file under the output's name.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import safetensors.torch
import torch

from loom.config import load_config_text
from loom.errors import ConfigError, LoomError
from loom.files import atomic_write
from loom.models.gpt.config import GPTConfig, preset
from loom.models.gpt.model import build_model
from loom.train import checkpoint as ckpt
from loom.train import safe_load
from loom.train.checkpoint import CHECKPOINTS, latest_checkpoint, resolve_resume

LAYOUTS = ("loom", "hf")
HF_CONFIG = "config.json"
# loom's GPT, recognized by these names; loom name -> Hugging Face Llama name per decoder layer.
GPT_KEYS = ("tok_embeddings.weight", "layers.0.attention.wq.weight")
_HF_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}


def export(checkpoint: Path | str, output: Path | str, layout: str = "loom") -> list[Path]:
    """Write the model of `checkpoint` (a step_N folder, or a run directory: its latest) to
    `output` as one safetensors file (+ config.json for layout "hf"). Returns the paths written."""
    if layout not in LAYOUTS:
        raise LoomError(f"unknown export layout {layout!r}; choose one of: {', '.join(LAYOUTS)}")
    output = Path(output)
    _check_output(output)
    path = _resolve(Path(checkpoint))
    meta = ckpt.read_meta(path)
    stored = {k.removeprefix("model."): tuple(m.size) for k, m in
              safe_load.read_metadata(path).state_dict_metadata.items() if k.startswith("model.")}
    if not stored:
        raise LoomError(f"{path} holds no model tensors; pass a checkpoint written by `loom train`")
    # loom's GPT: exactly the entries its saved config gives, with their dtypes and shapes, checked
    # before any payload is read (another model: each entry is still checked to be a tensor).
    gpt = gpt_config(meta, stored, path) if layout == "hf" or is_gpt(stored) else None
    expected = None if gpt is None else {f"model.{k}": (v.dtype, tuple(v.shape))
                                         for k, v in build_model(gpt, "meta").state_dict().items()}
    tensors = ckpt.read_tensors(path, "model.", expected)
    written = []
    if layout == "hf":
        gpt = untie_if_trained_apart(gpt, tensors)
        tensors = hf_state_dict(tensors, gpt)
        config = hf_config(gpt, tensors["model.embed_tokens.weight"].dtype)
    metadata = {"format": "pt", "loom_step": str(meta.get("step", "")), "loom_layout": layout}

    def write(tmp: Path) -> None:
        safetensors.torch.save_file(_standalone(tensors), str(tmp), metadata=metadata)

    atomic_write(output, write, durable=True)
    written.append(output)
    if layout == "hf":
        beside = output.parent / HF_CONFIG
        atomic_write(beside, (json.dumps(config, indent=2) + "\n").encode(), durable=True)
        written.append(beside)
    return written


# ---------------------------------------------------------------------------------------------
# Paths


def _check_output(output: Path) -> None:
    parent = output.parent
    if not parent.is_dir():
        raise LoomError(f"cannot write {output}: its folder {parent} does not exist; create it "
                        f"(mkdir -p {parent}) or choose an output path in an existing folder")
    if output.is_dir():
        raise LoomError(f"output {output} is a folder; pass a file path such as "
                        f"{output / 'model.safetensors'}")


def _resolve(given: Path) -> Path:
    """The step_N folder to read: `given` itself, or a run directory's latest complete checkpoint."""
    if not given.exists():
        raise LoomError(f"checkpoint {given} does not exist; pass RUN_DIR/checkpoints/step_N or a run "
                        f"directory (its latest checkpoint)")
    path = given.absolute()  # never the literal "auto", which resolve_resume reads as a keyword
    run_dir = path if (path / CHECKPOINTS).is_dir() else path.parent if path.name == CHECKPOINTS else None
    if run_dir is not None and latest_checkpoint(run_dir) is None:
        raise LoomError(f"run directory {run_dir} has no complete checkpoint yet (a run writes one at its "
                        f"end and every train.ckpt_every steps); export a run that has one")
    return resolve_resume(str(path), None)


def _standalone(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors, none sharing memory with another (safetensors refuses shared storage)."""
    out, seen = {}, set()
    for name, t in tensors.items():
        t = t.detach().contiguous()
        if t.numel() and t.untyped_storage().data_ptr() in seen:
            t = t.clone()
        if t.numel():
            seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


# ---------------------------------------------------------------------------------------------
# Hugging Face Llama layout


def is_gpt(names) -> bool:
    return all(k in names for k in GPT_KEYS)


def gpt_config(meta: dict, stored: dict[str, tuple[int, ...]], path: Path) -> GPTConfig:
    """The GPT shape the checkpoint was trained with: its saved config's preset and model fields,
    the vocabulary from the embedding (a BPE tokenizer sets it). `stored`: name -> shape, from the
    checkpoint's index; the caller checks every entry against the model this config builds."""
    if not is_gpt(stored):
        raise LoomError(f"{path} holds a model other than loom's GPT (no {' or '.join(GPT_KEYS)}); "
                        f"--layout hf maps only loom's GPT: export it with --layout loom "
                        f"(its own parameter names)")
    cfg = load_config_text(meta["config"], f"{path / 'meta.json'} config")
    overrides = {k: v for k, v in vars(cfg.model).items() if k != "preset" and v is not None}
    overrides["vocab_size"] = int(stored["tok_embeddings.weight"][0])
    try:
        return preset(cfg.model.preset, **overrides)
    except ConfigError as e:
        raise LoomError(f"{path}: its model config is not valid here ({e}); "
                        f"export with --layout loom") from None


def untie_if_trained_apart(gpt: GPTConfig, tensors: dict[str, torch.Tensor]) -> GPTConfig:
    if gpt.tie_embeddings and not torch.equal(tensors["output.weight"], tensors["tok_embeddings.weight"]):
        # Configured tied, trained with two matrices (the tie was lost when the run materialized the
        # model): export the model that was trained, an untied one.
        return dataclasses.replace(gpt, tie_embeddings=False)
    return gpt


def _rope_halves(w: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """Reorder each head's output rows from loom's interleaved RoPE pairs (2i, 2i+1) to Llama's
    halves (i, i + head_dim/2): the row for rotation pair i's first element goes to i, the second to
    i + head_dim/2. (Meta's Llama → Hugging Face permutation.)"""
    return (w.reshape(n_heads, head_dim // 2, 2, w.shape[1]).transpose(1, 2)
            .reshape(n_heads * head_dim, w.shape[1]))


def hf_state_dict(tensors: dict[str, torch.Tensor], gpt: GPTConfig) -> dict[str, torch.Tensor]:
    """loom's GPT weights under Hugging Face `LlamaForCausalLM` names (lm_head omitted when tied)."""
    out = {"model.embed_tokens.weight": tensors["tok_embeddings.weight"]}
    for i in range(gpt.n_layers):
        for loom_name, hf_name in _HF_LAYER.items():
            t = tensors[f"layers.{i}.{loom_name}"]
            if loom_name == "attention.wq.weight":
                t = _rope_halves(t, gpt.n_heads, gpt.head_dim)
            elif loom_name == "attention.wk.weight":
                t = _rope_halves(t, gpt.n_kv_heads, gpt.head_dim)
            out[f"model.layers.{i}.{hf_name}"] = t
    out["model.norm.weight"] = tensors["norm.weight"]
    if not gpt.tie_embeddings:
        out["lm_head.weight"] = tensors["output.weight"]
    return out


def hf_config(gpt: GPTConfig, dtype: torch.dtype = torch.float32) -> dict:
    """A `LlamaConfig` (config.json) for the same model."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": gpt.vocab_size,
        "hidden_size": gpt.d_model,
        "intermediate_size": gpt.ffn_hidden,
        "num_hidden_layers": gpt.n_layers,
        "num_attention_heads": gpt.n_heads,
        "num_key_value_heads": gpt.n_kv_heads,
        "head_dim": gpt.head_dim,
        "max_position_embeddings": gpt.max_seq_len,
        "rope_theta": float(gpt.rope_theta),
        "rope_scaling": None,
        "rms_norm_eps": float(gpt.norm_eps),
        "tie_word_embeddings": gpt.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
