"""`model.init_from`: what a pretrained model folder, a loom export or a loom checkpoint holds — the
model's shape (loom's GPT when it expresses the model exactly, the Hugging Face decoder
otherwise), its tokenizer, and a source from which each rank reads the slices it owns.

A Hugging Face folder is config.json + one or many `*.safetensors` (with their
`model.safetensors.index.json`); safetensors files are read by slices of the memory-mapped file,
so a rank touches only the bytes of its shards. A loom checkpoint (DCP) is read by DCP itself
into the sharded model (loom/train/checkpoint.py), which reads only the overlapping chunks too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from loom.errors import ConfigError, LoomError
from loom.models.gpt.config import GPTConfig
from loom.models.gpt.config import validate as validate_gpt
from loom.models.gpt.llama_layout import gpt_from_hf, halves_row, hf_name, rope_heads
from loom.models.hf.adapter import HF_DECODERS

HF, EXPORT, CHECKPOINT = "hf", "export", "checkpoint"
_WHAT = ("give a Hugging Face model folder (config.json + *.safetensors), a loom checkpoint "
         "(RUN/checkpoints/step_N) or a loom export (.safetensors)")
# Tensors some checkpoints carry that are not parameters (recomputed at load).
_NOT_PARAMETERS = ("rotary_emb.inv_freq",)


@dataclass
class Pretrained:
    path: Path
    kind: str  # HF | EXPORT | CHECKPOINT
    gpt: GPTConfig | None = None  # loom's GPT, when it expresses the model
    hf_config: dict | None = None  # a Hugging Face folder's config.json
    tensors: dict[str, tuple[Path, tuple[int, ...]]] = field(default_factory=dict)  # name -> (file, shape)

    @property
    def tokenizer(self) -> Path | None:
        """The folder's tokenizer.json, if it has one (data.tokenizer = "auto" takes it)."""
        found = self.path / "tokenizer.json"
        return found if self.kind == HF and found.is_file() else None

    @property
    def model_dir(self) -> Path | None:
        return self.path if self.kind == HF else None

    def describe(self) -> str:
        as_what = "loom's GPT" if self.gpt is not None else f"Hugging Face {self.hf_config['model_type']}"
        return f"{self.path} ({as_what})"

    def weights(self) -> SafetensorsSource | None:
        """The source of the weights, by the names of the model loom builds (None for a loom
        checkpoint: DCP loads it after the model is built)."""
        if self.kind == CHECKPOINT:
            return None
        if self.kind == HF and self.gpt is not None:
            return LlamaAsGPT(self.tensors, self.gpt, self.path)
        return SafetensorsSource(self.tensors, self.path)

    def hf_model(self, device: str = "meta") -> nn.Module:
        """The Hugging Face decoder itself (when loom's GPT cannot express it), built on `device`
        (meta: no memory; the weights are read into each rank's shards after parallelization)."""
        import transformers

        config = transformers.AutoConfig.for_model(**self.hf_config)
        with torch.device(device):
            return transformers.AutoModelForCausalLM.from_config(config)

    def check(self, model: nn.Module) -> None:
        """Every parameter of `model` (built on meta) has a tensor of its shape in the files, and
        every tensor in the files is a parameter: one line naming the first that is not."""
        source = self.weights()
        if source is None:
            return
        wanted = {}
        for name, param in model.named_parameters():  # tied weights once
            wanted[source.file_name(name)] = (name, tuple(param.shape))
        for stored, (name, shape) in wanted.items():
            if stored not in self.tensors:
                raise LoomError(f"model.init_from {self.path} has no tensor {stored} (the model's {name}); "
                                f"it holds a different model: check its config.json and weight files")
            have = source.stored_shape(name)
            if have != shape:
                raise LoomError(f"model.init_from {self.path}: tensor {stored} has shape {list(have)}, the "
                                f"model's {name} needs {list(shape)}; the weights do not match config.json")
        tied = self.gpt.tie_embeddings if self.gpt is not None else self.hf_config.get("tie_word_embeddings")
        ignored = _NOT_PARAMETERS + (("lm_head.weight",) if tied else ())
        extra = [n for n in self.tensors if n not in wanted and not n.endswith(ignored)]
        if extra:
            raise LoomError(f"model.init_from {self.path} holds tensor {extra[0]}, which the model built "
                            f"from its config has no parameter for; the weights do not match config.json")


def open_pretrained(given: str) -> Pretrained:
    """What `model.init_from` names, checked before any rank starts."""
    path = Path(given).expanduser()
    if not path.exists():
        raise ConfigError(f"model.init_from = '{given}' does not exist; {_WHAT}")
    if path.is_file():
        return _open_export(path)
    if (path / "meta.json").is_file() or (path / "checkpoints").is_dir():
        return Pretrained(path, CHECKPOINT)
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.init_from = '{given}' is a folder without config.json; {_WHAT}")
    return _open_hf(path)


def _open_hf(path: Path) -> Pretrained:
    try:
        config = json.loads((path / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path / 'config.json'} is not valid JSON ({e}); fix or replace it") from None
    kind = config.get("model_type") if isinstance(config, dict) else None
    if kind not in HF_DECODERS:
        raise ConfigError(f"model.init_from {path}: architecture {kind!r} (config.json model_type) is not "
                          f"supported; loom loads {', '.join(HF_DECODERS)} decoders")
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size") if not isinstance(config.get(k), int)]
    if missing:
        raise ConfigError(f"{path / 'config.json'} lacks {', '.join(missing)}; it is not a decoder's config")
    gpt, _ = gpt_from_hf(config)
    if gpt is not None:
        validate_gpt(gpt)
    return Pretrained(path, HF, gpt=gpt, hf_config=config, tensors=_index(path))


def _open_export(path: Path) -> Pretrained:
    if path.suffix != ".safetensors":
        raise ConfigError(f"model.init_from = '{path}' is a file but not a .safetensors export; {_WHAT}")
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    if "loom_model" not in metadata:
        raise ConfigError(f"model.init_from {path} is a safetensors file without loom's model config (an "
                          f"export by an older loom, or not loom's); export again with `loom export`, or "
                          f"give its checkpoint or a Hugging Face folder (loom export --layout hf)")
    try:
        gpt = GPTConfig(**json.loads(metadata["loom_model"]))
    except (json.JSONDecodeError, TypeError) as e:
        raise ConfigError(f"model.init_from {path}: its loom_model metadata is damaged ({e})") from None
    validate_gpt(gpt)
    return Pretrained(path, EXPORT, gpt=gpt, tensors=_shapes(path))


def _index(folder: Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Every tensor's file and shape, from the headers alone."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConfigError(f"{index} is damaged ({type(e).__name__}: {e}); fix or replace it") from None
        files = sorted({folder / f for f in weight_map.values()})
        for f in files:
            if not f.resolve().is_relative_to(folder.resolve()) or not f.is_file():
                raise ConfigError(f"{index} names {f.name}, which is not a file in {folder}; the download is "
                                  f"incomplete")
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model.init_from {folder} has no *.safetensors weights (loom reads safetensors "
                          f"only; convert .bin weights with transformers' save_pretrained)")
    out: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for f in files:
        out.update(_shapes(f))
    return out


def _shapes(file: Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    try:
        with safe_open(str(file), framework="pt") as f:
            return {name: (file, tuple(f.get_slice(name).get_shape())) for name in f.keys()}
    except Exception as e:  # noqa: BLE001 - any unreadable header is the same advice
        raise ConfigError(f"{file} is not a readable safetensors file ({type(e).__name__}: {e}); "
                          f"download it again") from None


class SafetensorsSource:
    """Blocks of tensors stored in safetensors files, by the model's parameter names (the same
    names here). `bytes_read` counts what this process read."""

    def __init__(self, tensors: dict[str, tuple[Path, tuple[int, ...]]], path: Path):
        self.tensors, self.path = tensors, path
        self.bytes_read = 0
        self._open: dict[Path, object] = {}

    def file_name(self, name: str) -> str:
        return name

    def close(self) -> None:
        """Unmap the files (the weights are in the model now)."""
        self._open.clear()

    def stored_shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[self.file_name(name)][1]

    def read(self, name: str, shape: tuple[int, ...], offset: tuple[int, ...],
             size: tuple[int, ...]) -> torch.Tensor:
        return self._read(self.file_name(name), shape, offset, size)

    def _read(self, stored: str, shape, offset, size) -> torch.Tensor:
        if stored not in self.tensors:
            raise LoomError(f"model.init_from {self.path} has no tensor {stored}; it holds a different model")
        file, have = self.tensors[stored]
        if tuple(have) != tuple(shape):
            raise LoomError(f"model.init_from {self.path}: tensor {stored} has shape {list(have)}, the model "
                            f"needs {list(shape)}")
        if file not in self._open:
            self._open[file] = safe_open(str(file), framework="pt")
        part = self._open[file].get_slice(stored)[tuple(slice(o, o + s) for o, s in zip(offset, size))]
        self.bytes_read += part.numel() * part.element_size()
        return part


class LlamaAsGPT(SafetensorsSource):
    """A Hugging Face Llama's tensors read as loom's GPT: Llama names, and the q/k rows of each
    head reordered from Llama's rotate-half layout to loom's interleaved pairs (a block of rows
    reads the rows of the heads it spans)."""

    def __init__(self, tensors, gpt: GPTConfig, path: Path):
        super().__init__(tensors, path)
        self.gpt = gpt
        self.tied = gpt.tie_embeddings

    def file_name(self, name: str) -> str:
        return hf_name(name, tied=self.tied)

    def read(self, name, shape, offset, size) -> torch.Tensor:
        if not rope_heads(name, self.gpt):
            return super().read(name, shape, offset, size)
        hd = self.gpt.head_dim
        rows = [halves_row(r, hd) for r in range(offset[0], offset[0] + size[0])]
        first, last = min(rows), max(rows) + 1
        span = self._read(self.file_name(name), shape, (first, offset[1]), (last - first, size[1]))
        return span[torch.tensor(rows) - first]
