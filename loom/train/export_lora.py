"""`loom export --lora`: a LoRA run's checkpoint (its adapters alone) as what people serve with.

  - "adapter": a PEFT LoRA adapter folder, adapter_model.safetensors + adapter_config.json, under
    the Hugging Face names of the base (`peft.PeftModel.from_pretrained(base, folder)` loads it);
  - "merged": the base with every adapter merged in, W + (alpha/r)·B A, as a whole model, then
    written in either layout like any checkpoint (loom/train/export.py).

The base is the one meta.json records (loom/train/lora_base.py), checked by its fingerprint before
it is read.
"""

from __future__ import annotations

from pathlib import Path

import torch

from loom.config import Config, load_config_text
from loom.errors import LoomError
from loom.models.gpt.config import GPTConfig
from loom.models.gpt.llama_layout import hf_name, rope_heads, to_halves
from loom.models.lora import is_adapter, merged
from loom.train import checkpoint as ckpt
from loom.train import lora_base

MODES = ("adapter", "merged")
ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"


def saved_config(meta: dict, path: Path) -> Config:
    return load_config_text(meta["config"], f"{path / 'meta.json'} config")


def check_mode(meta: dict, path: Path, mode: str | None) -> None:
    """A LoRA checkpoint needs --lora; --lora needs a LoRA checkpoint. One line each."""
    if mode is not None and mode not in MODES:
        raise LoomError(f"unknown --lora {mode!r}; choose adapter (a PEFT adapter folder) or merged")
    holds = meta.get("lora_base") is not None
    if holds and mode is None:
        raise LoomError(f"{path} holds LoRA adapters alone (lora.rank was set); pass --lora adapter (a PEFT "
                        f"adapter folder) or --lora merged (the base with the adapters merged in)")
    if mode is not None and not holds:
        raise LoomError(f"--lora {mode}: {path} holds a full model, not LoRA adapters; export it without "
                        f"--lora")


def _scale(cfg: Config) -> float:
    return cfg.lora.alpha / cfg.lora.rank


def _owner(name: str) -> tuple[str, str]:
    """(the adapted weight's name, 'lora_A' | 'lora_B') of an adapter: `...wq.lora_A` belongs to
    `...wq.weight`, loom's stacked experts' `...experts.w1_lora_A` to `...experts.w1`."""
    stem, suffix = name[:-len("lora_A")], name[-len("lora_A"):]
    return (stem[:-1] if stem.endswith("_") else stem + "weight"), suffix


def peft_holds(trained: list[str]) -> bool:
    """Whether a PEFT adapter can hold what a LoRA run trained (`trained`: its trained parameters'
    names): adapters of weights alone, no stacked experts' and nothing trained whole."""
    return all(is_adapter(n) and _owner(n)[0].endswith(".weight") for n in trained)


def merged_tensors(meta: dict, path: Path, tensors: dict[str, torch.Tensor],
                   names: dict[str, tuple[int, ...]], gpt: GPTConfig | None) -> dict[str, torch.Tensor]:
    """The whole model: the base's tensors (read by `names`: name -> shape), each adapted weight
    with its update merged in (in fp32, stored in the base's dtype), and what else trained
    (train_norms, train_embeddings) as the checkpoint holds it."""
    cfg = saved_config(meta, path)
    base = read_base(meta, path, names, gpt, cfg)
    scale = _scale(cfg)
    for name, t in tensors.items():
        if not is_adapter(name):
            base[name] = t.to(base[name].dtype)  # trained whole: its value replaces the base's
            continue
        weight, which = _owner(name)
        if which == "lora_A":
            base[weight] = merged(base[weight], t, tensors[name[:-1] + "B"], scale)
    return base


def read_base(meta: dict, path: Path, names: dict[str, tuple[int, ...]], gpt: GPTConfig | None,
              cfg: Config) -> dict[str, torch.Tensor]:
    """The base model's tensors, whole, after checking it is the one the adapters were trained on."""
    saved = meta["lora_base"]
    if not saved.get("path"):  # loom's own initialization of the GPT it records
        if gpt is None:
            raise LoomError(f"{path}: the base was initialized by loom but the checkpoint records no GPT "
                            f"config; export --lora adapter instead")
        from loom.models.gpt.model import RandomInit, build_model

        source = RandomInit(build_model(gpt, "meta"), cfg.train.seed)
        now = lora_base.identity(cfg)
    else:
        from loom.models.pretrained import CHECKPOINT, open_pretrained

        base_path = Path(saved["path"])
        if not base_path.exists():
            raise LoomError(f"the base model {base_path} that {path}'s adapters were trained on is gone; put "
                            f"it back at that path to export --lora merged (--lora adapter needs no base)")
        now = {"path": str(base_path), "fingerprint": lora_base.fingerprint(base_path)}
        pretrained = open_pretrained(str(base_path))
        if pretrained.kind == CHECKPOINT:
            whole = ckpt.read_tensors(base_path, "model.")
            return {k: whole[k] for k in names}
        source = pretrained.weights()
    lora_base.check(saved, now, path, what="export the adapters of")
    return {name: source.read(name, shape, (0,) * len(shape), shape) for name, shape in names.items()}


def adapter_files(meta: dict, path: Path, tensors: dict[str, torch.Tensor], gpt: GPTConfig | None
                  ) -> tuple[dict[str, torch.Tensor], dict]:
    """(adapter_model.safetensors' tensors, adapter_config.json) in PEFT's LoRA format: the adapters
    under `base_model.model.<the base's Hugging Face name>.lora_A.weight`, B's q/k rows in Llama's
    rotate-half order like the weights' (loom/models/gpt/llama_layout.py)."""
    cfg = saved_config(meta, path)
    for name, t in tensors.items():  # routing buffers, not trained weights: left out when zero
        if name.endswith("expert_bias") and t.any():
            raise LoomError(f"{name} is not zero (aux-loss-free balancing trained it); a PEFT adapter has no "
                            f"place for a routing bias: export the merged model with --lora merged")
    tensors = {n: t for n, t in tensors.items() if not n.endswith("expert_bias")}
    whole = [n for n in tensors if not is_adapter(n)]
    if whole:
        raise LoomError(f"{path} also trained {whole[0]} whole (lora.train_norms / train_embeddings), which "
                        f"a PEFT LoRA adapter does not hold; export --lora merged")
    out, targets = {}, set()
    for name, t in sorted(tensors.items()):
        weight, which = _owner(name)
        if not weight.endswith(".weight"):
            raise LoomError(f"{path} adapts MoE experts ({name}), which loom stacks and a PEFT LoRA adapter "
                            f"does not hold; export --lora merged")
        hf = hf_name(weight) if gpt is not None else weight
        heads = rope_heads(weight, gpt) if gpt is not None else 0
        if heads and which == "lora_B":
            t = to_halves(t, heads, gpt.head_dim)
        out[f"base_model.model.{hf.removesuffix('.weight')}.{which}.weight"] = t.float().contiguous()
        targets.add(hf.removesuffix(".weight").rsplit(".", 1)[-1])
    saved = meta["lora_base"]
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.lora.rank, "lora_alpha": cfg.lora.alpha,
        "lora_dropout": cfg.lora.dropout, "target_modules": sorted(targets), "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
        "modules_to_save": None, "inference_mode": True,
        "base_model_name_or_path": saved.get("path") or None,
    }
    return out, config
