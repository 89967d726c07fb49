"""What is trained: a model factory, its loss and its data (a Task). `loom train` trains
`config_task(cfg)`: loom's GPT, or the pretrained model of `model.init_from`, on the config's
data; the Python API takes any Task.
"""

from __future__ import annotations

import dataclasses
import functools
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from loom.config import Config, load_config_text, shape_overrides
from loom.data.corpus import load_tokens
from loom.data.run_data import build_run_data
from loom.errors import ConfigError
from loom.layout import check_experts, check_layout
from loom.models.chunked_loss import IGNORE, cross_entropy  # noqa: F401 (IGNORE: a supervised prompt)
from loom.models.gpt.config import GPTConfig, preset
from loom.models.gpt.model import build_model
from loom.models.hf.experts import MOE_DECODERS
from loom.models.pretrained import CHECKPOINT, SPECIAL_TOKENS, Pretrained, open_pretrained
from loom.parallel.weights import WeightSource
from loom.plan.shapes import ModelShape, from_gpt_config, from_hf
from loom.train import checkpoint as ckpt
from loom.train import safe_load, tokenizer_copy


@dataclass
class Task:
    """What `train` trains. Any nn.Module works for the data-parallel strategies; TP/PP need a
    plan (an adapter: loom/parallel/adapter.py)."""

    # Called on every rank with the same seed: model_fn(), or model_fn(device="cpu") by the deepspeed
    # engine's ZeRO-3, which partitions the model as it is built (loom's GPT: the meta device by default).
    model_fn: Callable[..., nn.Module]
    loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor]  # (model, batch) -> mean loss
    train_data: Dataset  # items of equal shape; the default collate stacks them
    eval_data: Dataset | None = None
    tokens_per_sample: int = 1  # for tokens/s
    description: str = "model"
    shape: ModelShape | None = None  # known to the planner: plan.json and measured-vs-planned
    # Pretrained weights: each rank reads the blocks it holds after parallelization (a meta-device
    # model), or a loom checkpoint that DCP loads into the built model (model.init_from).
    weights: WeightSource | None = None
    init_checkpoint: Path | None = None
    # What rebuilds the model from a checkpoint (`loom export`): {"gpt": GPTConfig fields} or
    # {"hf_config": a Hugging Face config.json}; None: the saved config's preset says it.
    model_record: dict | None = None
    from_config: bool = False  # the config's own model (`loom train` can rebuild it to continue)
    # data.packing = documents: the id that ends each document (attention stops there); None: windows
    # are attended whole
    document_eos: int | None = None




def split_batch(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of a batch: token windows [B, T + 1] predict their next token; supervised
    windows [B, 2, T + 1] hold the tokens in row 0 and, in row 1, the same tokens where the loss
    applies and IGNORE elsewhere."""
    if batch.dim() == 3:
        return batch[:, 0, :-1], batch[:, 1, 1:]
    return batch[:, :-1], batch[:, 1:]


def next_token_loss(model: nn.Module, batch: torch.Tensor, loss_chunk: int = 0) -> torch.Tensor:
    """A language model's loss on a batch (see split_batch); the model returns logits, or an output
    holding them (Hugging Face models). `loss_chunk` > 0: loom's GPT computes the loss itself,
    that many tokens at a time (loom/models/chunked_loss.py), never holding the full logits."""
    inputs, targets = split_batch(batch)
    masked = batch.dim() == 3
    if loss_chunk > 0:
        return model(inputs, targets, loss_chunk=loss_chunk, masked=masked)
    out = model(inputs)
    split = getattr(getattr(model, "module", model), "sequence_split", None)  # (DDP wraps the model)
    if split is not None:  # under context parallelism the logits are this rank's tokens'
        targets = split.shard(targets)
    return cross_entropy(getattr(out, "logits", out), targets, masked=masked)


def config_loss_fn(cfg: Config, gpt: bool) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    """The config's loss: chunked (train.loss_chunk) for loom's GPT under every layout (TP: on each
    rank's vocabulary shard; PP: the schedule's loss, loom.train.step.build_pipeline, chunks the
    same way); Hugging Face models return logits."""
    chunk = cfg.train.loss_chunk if gpt else 0
    return functools.partial(next_token_loss, loss_chunk=chunk) if chunk else next_token_loss


def config_task(cfg: Config) -> Task:
    """What `loom train` trains: the config's model (loom's GPT from a preset, or the pretrained
    model `model.init_from` names) on the config's data."""
    pretrained = open_pretrained(cfg.model.init_from) if cfg.model.init_from else None
    data = build_run_data(cfg, pretrained.model_dir if pretrained is not None else None)
    model = resolve_model(cfg, data.vocab_size, pretrained)
    return Task(model_fn=model.build, loss_fn=config_loss_fn(cfg, model.gpt is not None),
                train_data=data.train, eval_data=data.eval,
                tokens_per_sample=cfg.data.seq_len, description=f"{model.description}; {data.description}",
                shape=model.shape, weights=model.weights(), init_checkpoint=model.checkpoint,
                model_record=model.record(), from_config=True,
                document_eos=data.eos_id if cfg.data.packing == "documents" else None)


@dataclass
class ConfigModel:
    """The model of a config: loom's GPT (`gpt`: a preset, or a pretrained model it expresses
    exactly) or a pretrained Hugging Face decoder (`pretrained` alone)."""

    gpt: GPTConfig | None
    pretrained: Pretrained | None
    shape: ModelShape
    description: str
    checkpoint: Path | None = None  # a loom checkpoint to start from (read by DCP once built)

    def build(self, device: str = "meta") -> nn.Module:
        if self.gpt is not None:
            return build_model(self.gpt, device=device)
        return self.pretrained.hf_model(device)

    def weights(self) -> WeightSource | None:
        return self.pretrained.weights() if self.pretrained is not None else None

    def record(self) -> dict | None:
        if self.gpt is not None:  # (+ a pretrained folder's bos/eos/pad ids: export writes them out)
            special = self.pretrained.special_token_ids() if self.pretrained is not None else {}
            return {"gpt": dataclasses.asdict(self.gpt), **({SPECIAL_TOKENS: special} if special else {})}
        return {"hf_config": self.pretrained.hf_config.raw}


def resolve_model(cfg: Config, data_vocab: int, pretrained: Pretrained | None = None) -> ConfigModel:
    """The config's model, checked against the data's vocabulary and the parallel layout (and a
    pretrained model's files against the model they must fill)."""
    if not cfg.model.init_from:
        gpt = model_config(cfg, data_vocab)
        check_lora_targets(cfg, build_model(gpt, device="meta"))
        return ConfigModel(gpt, None, from_gpt_config(gpt, cfg.model.preset),
                           f"GPT {gpt.n_layers}L d{gpt.d_model}")
    pretrained = pretrained or open_pretrained(cfg.model.init_from)
    checkpoint = None
    if pretrained.kind == CHECKPOINT:
        checkpoint = ckpt.resolve_resume(str(pretrained.path.absolute()), None)
        meta = ckpt.read_meta(checkpoint)
        if meta.get("lora_base") is not None:
            raise ConfigError(f"model.init_from {checkpoint} holds a LoRA run's adapters alone; start "
                              f"from the merged model: loom export {shlex.quote(str(checkpoint))} "
                              f"merged.safetensors --lora merged, then model.init_from=merged.safetensors")
        _check_same_tokenizer(cfg, meta, checkpoint)
        pretrained.gpt = checkpoint_gpt(checkpoint)
    if pretrained.gpt is not None:
        gpt = model_config(cfg, data_vocab, pretrained.gpt)
        model = build_model(gpt, device="meta")
        pretrained.check(model)
        check_lora_targets(cfg, model)  # (adds adapters to the meta model: after the files' check)
        return ConfigModel(gpt, pretrained if checkpoint is None else None,
                           from_gpt_config(gpt, pretrained.path.name),
                           f"GPT {gpt.n_layers}L d{gpt.d_model} from {pretrained.path}", checkpoint)
    hf = pretrained.hf_config  # checked when it was read (loom/hf_config.py)
    if cfg.parallel.cp > 1 or cfg.data.packing == "documents":
        what = f"parallel.cp = {cfg.parallel.cp}" if cfg.parallel.cp > 1 else "data.packing = 'documents'"
        raise ConfigError(f"{what} runs on loom's GPT, and model.init_from {pretrained.path} is a "
                          f"{hf.model_type} model loom runs through Hugging Face's modules; set "
                          f"parallel.cp=1 and data.packing=concat, or start from a Llama-layout model")
    _check_vocab(hf.vocab_size, data_vocab, f" (model.init_from {pretrained.path})")
    if hf.model_type in MOE_DECODERS:  # transformers' own MoE blocks: no TP, EP or pipeline plan for them
        p = cfg.parallel
        split = [f"parallel.{k} = {v}" for k, v in (("tp", p.tp), ("pp", p.pp), ("ep", p.ep)) if v > 1]
        if split:
            raise ConfigError(f"{split[0]} needs a plan for {hf.model_type}'s experts, which runs through "
                              f"transformers' modules (data parallel only); set it to 1 (zero3 shards the "
                              f"experts with the rest)")
    else:
        check_experts(cfg, 0, f"the {hf.model_type} model of model.init_from")
    check_layout(cfg, hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads,
                 hf.intermediate_size, hf.vocab_size, hf.max_position_embeddings or cfg.data.seq_len,
                 hf.tie_word_embeddings)
    model = pretrained.hf_model("meta")
    pretrained.check(model)
    check_lora_targets(cfg, model)
    description = f"{hf.model_type} {hf.num_hidden_layers}L d{hf.hidden_size} from {pretrained.path}"
    return ConfigModel(None, pretrained, from_hf(hf, hf.model_type), description)


def check_lora_targets(cfg: Config, model: nn.Module) -> None:
    """Every lora.targets entry names a linear of the model's blocks (one line if not), before launch."""
    if cfg.lora.rank is None:
        return
    from loom.models.lora import LoRASpec, add_lora, blocks_of
    from loom.models.registry import adapter_for

    add_lora(model, blocks_of(adapter_for(model).layers(model)), LoRASpec(cfg.lora.rank, cfg.lora.alpha),
             cfg.lora.targets)


def _check_same_tokenizer(cfg: Config, meta: dict, path: Path) -> None:
    """A checkpoint's weights learnt its run's token ids: loom's byte ids and its corpus-trained BPE's
    name other tokens, so a run that tokenizes the other way would train them on what they never
    meant. (A tokenizer.json is carried in the checkpoint and checked where it is used.)"""
    saved = load_config_text(meta.get("config", ""), f"{path}/meta.json").data
    byte = {"byte"} | ({"auto"} if not meta.get(tokenizer_copy.META_KEY) else set())
    then, now = saved.tokenizer, cfg.data.tokenizer
    if then == "bpe" and (now != "bpe" or saved.bpe_vocab_size != cfg.data.bpe_vocab_size):
        want = f"data.tokenizer=bpe with data.bpe_vocab_size={saved.bpe_vocab_size} on the same corpus"
    elif then in byte and now == "bpe":
        want = "data.tokenizer=byte"
    else:
        return
    raise ConfigError(f"model.init_from {path} was trained on the token ids of data.tokenizer = "
                      f"{_tokenizer_named(then, saved.bpe_vocab_size)}, and this run tokenizes with "
                      f"{_tokenizer_named(now, cfg.data.bpe_vocab_size)}, whose ids name other tokens; "
                      f"set {want}")


def _tokenizer_named(tokenizer: str, vocab: int) -> str:
    return f"{tokenizer!r}" + (f" (bpe_vocab_size {vocab})" if tokenizer == "bpe" else "")


def checkpoint_gpt(path: Path) -> GPTConfig:
    """The GPT a loom checkpoint holds (its saved config, the vocabulary of its embedding)."""
    from loom.train.export import gpt_config

    stored = {k.removeprefix("model."): tuple(m.size) for k, m in
              safe_load.read_metadata(path).state_dict_metadata.items() if k.startswith("model.")}
    return gpt_config(ckpt.read_meta(path), stored, path)


def model_config(cfg: Config, data_vocab: int, base: GPTConfig | None = None) -> GPTConfig:
    """The preset (or `base`, a pretrained model's shape) with the config's overrides; the
    vocabulary must cover the data's token ids, and the parallel layout must be able to split the
    model."""
    m = cfg.model
    overrides = shape_overrides(m)
    if base is not None:
        gpt = dataclasses.replace(base, **overrides)  # validate() allows only max_seq_len here
    else:
        # bpe or a tokenizer.json: the model's vocabulary is the tokenizer's unless the config sets one
        if "vocab_size" not in overrides and cfg.data.tokenizer not in ("auto", "byte"):
            overrides["vocab_size"] = data_vocab
        gpt = preset(m.preset, **overrides)
    _check_vocab(gpt.vocab_size, data_vocab, "" if base is None else f" (model.init_from {m.init_from})")
    check_layout(cfg, gpt.n_layers, gpt.n_heads, gpt.n_kv_heads, gpt.ffn_hidden, gpt.vocab_size,
                 gpt.max_seq_len, gpt.tie_embeddings)
    check_experts(cfg, gpt.moe_experts)
    return gpt


def _check_vocab(model_vocab: int, data_vocab: int, pretrained: str) -> None:
    if model_vocab >= data_vocab:
        return
    if pretrained:
        raise ConfigError(f"the tokenizer has {data_vocab} tokens but the model's embedding has {model_vocab}"
                          f"{pretrained}; use the model's own tokenizer (data.tokenizer = auto, its "
                          f"folder's tokenizer.json)")
    raise ConfigError(f"model vocab_size {model_vocab} is smaller than the tokenizer's {data_vocab}; "
                      f"set model.vocab_size={data_vocab}")


def load_data(cfg: Config) -> tuple[Any, int]:
    """A text corpus's token stream and its vocabulary size (a .bin file's vocab is the model's),
    for scripts that bring their own model (examples/); `loom train` reads every kind of source
    through loom.data.run_data."""
    d = cfg.data
    vocab = d.bpe_vocab_size
    if d.source.endswith(".bin"):
        vocab = cfg.model.vocab_size or preset(cfg.model.preset).vocab_size
    kind = "byte" if d.tokenizer == "auto" else d.tokenizer
    return load_tokens(d.source, kind, vocab, d.bin_dtype, Path(d.cache_dir).expanduser())
