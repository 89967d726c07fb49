"""`model.init_from`: what a pretrained model folder, a loom export or a loom checkpoint holds — the
model's shape (loom's GPT when it expresses the model exactly, the Hugging Face decoder
otherwise), its tokenizer, and a source from which each rank reads the slices it owns.

A Hugging Face folder is config.json + one or many `*.safetensors` (with their
`model.safetensors.index.json`); safetensors files are read by slices of the memory-mapped file,
so a rank touches only the bytes of its shards. A loom checkpoint (DCP) is read by DCP itself
into the sharded model (loom/train/checkpoint.py), which reads only the overlapping chunks too.

What the files say is checked before any model is built (building is what costs time and memory):
config.json by loom/hf_config.py, the weight map and the safetensors headers by
loom/models/hf/weight_files.py, then the headers against the config (dtypes, layers, embedding);
`Pretrained.check` compares every tensor with the model built on the meta device.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from loom.checked import BadFile, Fields, inside, parse_json
from loom.errors import ConfigError, LoomError
from loom.hf_config import (
    MAX_FFN,
    MAX_LAYERS,
    MAX_POSITIONS,
    MAX_VOCAB,
    MAX_WIDTH,
    HFConfig,
    folder_root,
    read_hf_config,
)
from loom.models.gpt.config import GPTConfig
from loom.models.gpt.config import validate as validate_gpt
from loom.models.gpt.llama_layout import halves_row, hf_name, is_stacked, rope_heads
from loom.models.hf.adapter import HF_DECODERS
from loom.models.hf.experts import MOE_DECODERS, expert_name, fused_parts
from loom.models.hf.weight_files import FLOAT_DTYPES, Stored, folder_tensors, read_header

HF, EXPORT, CHECKPOINT = "hf", "export", "checkpoint"
_WHAT = ("give a Hugging Face model folder (config.json + *.safetensors), a loom checkpoint "
         "(RUN/checkpoints/step_N) or a loom export (.safetensors)")
# Tensors some checkpoints carry that are not parameters (recomputed at load).
_NOT_PARAMETERS = ("rotary_emb.inv_freq",)
# A decoder layer's tensors, by index: Hugging Face names (model.layers.N.…) and loom's (layers.N.…).
_HF_LAYER, _LOOM_LAYER = re.compile(r"model\.layers\.(\d+)\."), re.compile(r"layers\.(\d+)\.")
_HF_EMBEDDING, _HF_HEAD = "model.embed_tokens.weight", "lm_head.weight"
# The token ids a model's config.json names (generate() starts, pads and stops with them); a run
# records its source's under this key of meta.json's model_config, for `loom export --layout hf`.
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
SPECIAL_TOKENS = "special_token_ids"


@dataclass
class Pretrained:
    path: Path
    kind: str  # HF | EXPORT | CHECKPOINT
    gpt: GPTConfig | None = None  # loom's GPT, when it expresses the model
    hf_config: HFConfig | None = None  # a Hugging Face folder's config.json
    tensors: dict[str, Stored] = field(default_factory=dict)  # name -> (file, dtype, shape)
    note: str | None = None  # what loom did that the files' owner may not expect (said once, before launch)

    @property
    def tokenizer(self) -> Path | None:
        """The folder's tokenizer.json, if it has one (data.tokenizer = "auto" takes it)."""
        found = self.path / "tokenizer.json"
        return found if self.kind == HF and found.is_file() else None

    @property
    def model_dir(self) -> Path | None:
        return self.path if self.kind == HF else None

    def special_token_ids(self) -> dict:
        """The bos/eos/pad ids its config.json names (none for a loom checkpoint or export)."""
        raw = self.hf_config.raw if self.hf_config is not None else {}
        return {key: raw[key] for key in SPECIAL_IDS if raw.get(key) is not None}

    def describe(self) -> str:
        as_what = "loom's GPT" if self.gpt is not None else f"Hugging Face {self.hf_config.model_type}"
        return f"{self.path} ({as_what})"

    def weights(self) -> SafetensorsSource | None:
        """The source of the weights, by the names of the model loom builds (None for a loom
        checkpoint: DCP loads it after the model is built)."""
        if self.kind == CHECKPOINT:
            return None
        if self.kind == HF and self.gpt is not None:
            return LlamaAsGPT(self.tensors, self.gpt, self.path)
        if self.kind == HF and self.hf_config.model_type in MOE_DECODERS:
            return FusedExpertsSource(self.tensors, self.path)
        return SafetensorsSource(self.tensors, self.path)

    def hf_model(self, device: str = "meta") -> nn.Module:
        """The Hugging Face decoder itself (when loom's GPT cannot express it), built on `device`
        (meta: no memory; the weights are read into each rank's shards after parallelization)."""
        import transformers

        try:  # fields loom does not use are transformers' to judge: its refusal is one line too
            config = transformers.AutoConfig.for_model(**self.hf_config.raw)
            with torch.device(device):
                return transformers.AutoModelForCausalLM.from_config(config)
        except Exception as e:  # noqa: BLE001 - any fault of the config is the same advice
            said = (str(e).strip().splitlines() or [""])[0][:200]
            raise LoomError(f"{self.hf_config.source}: transformers cannot build the model from it "
                            f"({type(e).__name__}: {said}); fix or replace the file") from None

    def check(self, model: nn.Module) -> None:
        """Every parameter of `model` (built on meta) has a tensor of its shape in the files, and
        every tensor in the files is a parameter: one line naming the first that is not."""
        source = self.weights()
        if source is None:
            return
        wanted = {}
        for name, param in model.named_parameters():  # tied weights once
            for stored, shape in source.stored_parts(name, tuple(param.shape)):
                wanted[stored] = (name, shape)
        for stored, (name, shape) in wanted.items():
            if stored not in self.tensors:
                raise LoomError(f"model.init_from {self.path} has no tensor {stored} (the model's {name}); "
                                f"it holds a different model: check its config.json and weight files")
            have = self.tensors[stored].shape
            if have != shape:
                raise LoomError(f"model.init_from {self.path}: tensor {stored} has shape {list(have)}, the "
                                f"model's {name} needs {list(shape)}; the weights do not match config.json")
        tied = self.gpt.tie_embeddings if self.gpt is not None else self.hf_config.tie_word_embeddings
        ignored = _NOT_PARAMETERS + (("lm_head.weight",) if tied else ())
        extra = [n for n in self.tensors if n not in wanted and not n.endswith(ignored)]
        if extra:
            raise LoomError(f"model.init_from {self.path} holds tensor {extra[0]}, which the model built "
                            f"from its config has no parameter for; the weights do not match config.json")


def open_pretrained(given: str) -> Pretrained:
    """What `model.init_from` names, checked before any rank starts (and before any model is built:
    the files' headers against the config)."""
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
    root = folder_root(path)  # a Hub cache snapshot's files link into its repository's blobs/
    config = read_hf_config(inside(path, "config.json", source=path, field="a file", root=root))
    if config.model_type not in HF_DECODERS:
        raise ConfigError(f"model.init_from {path}: architecture {config.model_type or None!r} (config.json "
                          f"model_type) is not supported; loom loads {', '.join(HF_DECODERS)} decoders")
    tensors = folder_tensors(path, root)
    _check_files(path, tensors, config.num_hidden_layers, _HF_LAYER,
                 {_HF_EMBEDDING: (config.vocab_size, config.hidden_size)})
    config, note = _untie_if_stored_apart(path, config, tensors)
    gpt, why = config.gpt()
    if gpt is None and config.model_type == "mixtral":  # runs as loom's GPT only (its experts, EP)
        raise ConfigError(f"model.init_from {path}: this Mixtral has {why}, which loom's GPT does not "
                          f"express; remove it from config.json (e.g. router_jitter_noise = 0)")
    if gpt is not None:
        validate_gpt(gpt)
    return Pretrained(path, HF, gpt=gpt, hf_config=config, tensors=tensors, note=note)


def _untie_if_stored_apart(path: Path, config: HFConfig,
                           tensors: dict[str, Stored]) -> tuple[HFConfig, str | None]:
    """config.json ties the head to the embedding, but the files hold a head of other values: the
    weights are the truth (transformers keeps both too), so the model is loaded untied, with a note.
    A head equal to the embedding (a tied model saved with its head) stays tied, silently."""
    if not config.tie_word_embeddings or _HF_HEAD not in tensors or _HF_EMBEDDING not in tensors:
        return config, None
    if _same_values(tensors, _HF_HEAD, _HF_EMBEDDING):
        return config, None
    untied = dataclasses.replace(config, tie_word_embeddings=False,
                                 raw={**config.raw, "tie_word_embeddings": False})
    return untied, (f"model.init_from {path}: config.json says tie_word_embeddings = true, but its "
                    f"{_HF_HEAD} differs from {_HF_EMBEDDING}; loading both, untied, as transformers does "
                    f"(write tie_word_embeddings = false in config.json to say so)")


def _same_values(tensors: dict[str, Stored], a: str, b: str, rows: int = 4096) -> bool:
    """Whether two stored tensors hold the same values, compared a block of rows at a time (never
    a whole vocabulary-sized matrix in memory)."""
    if tensors[a].shape != tensors[b].shape:
        return False
    with safe_open(str(tensors[a].file), framework="pt") as fa, \
            safe_open(str(tensors[b].file), framework="pt") as fb:
        sa, sb = fa.get_slice(a), fb.get_slice(b)
        for first in range(0, tensors[a].shape[0], rows):
            pa, pb = sa[first:first + rows], sb[first:first + rows]
            if pa.dtype != pb.dtype:  # the same values stored in two dtypes: compared exactly in float64
                pa, pb = pa.double(), pb.double()
            if not torch.equal(pa, pb):
                return False
    return True


def _open_export(path: Path) -> Pretrained:
    if path.suffix != ".safetensors":
        raise ConfigError(f"model.init_from = '{path}' is a file but not a .safetensors export; {_WHAT}")
    tensors, metadata = read_header(path)
    if "loom_model" not in metadata and (path.parent / "config.json").is_file():
        raise ConfigError(f"model.init_from {path} is the weights of a model folder (config.json beside "
                          f"them); give the folder: model.init_from={path.parent}")
    if "loom_model" not in metadata:
        raise ConfigError(f"model.init_from {path} is a safetensors file without loom's model config (an "
                          f"export by an older loom, or not loom's); export again with `loom export`, or "
                          f"give its checkpoint or a Hugging Face folder (loom export --layout hf)")
    gpt = _loom_model(metadata["loom_model"], f"{path} (its loom_model metadata)")
    _check_files(path, tensors, gpt.n_layers, _LOOM_LAYER,
                 {"tok_embeddings.weight": (gpt.vocab_size, gpt.d_model)})
    return Pretrained(path, EXPORT, gpt=gpt, tensors=tensors)


MOE_NUMBERS = ("moe_route_scale", "moe_aux_loss_coef", "moe_bias_update_rate", "moe_capacity_factor")


def _loom_model(text: str, source: str) -> GPTConfig:
    """The GPTConfig a loom export records, every field typed and in range (one an older loom did
    not write takes its default)."""
    doc, default = Fields(parse_json(text, source), source), GPTConfig()
    known = [f.name for f in dataclasses.fields(GPTConfig)]
    unknown = [k for k in doc.keys() if k not in known]
    if unknown:
        raise BadFile(f"{source}: {unknown[0]!r} is not a field of loom's GPT; export the checkpoint again")
    sizes = {"vocab_size": MAX_VOCAB, "d_model": MAX_WIDTH, "n_layers": MAX_LAYERS, "n_heads": MAX_WIDTH,
             "n_kv_heads": MAX_WIDTH, "ffn_hidden": MAX_FFN, "max_seq_len": MAX_POSITIONS}
    counts = {"moe_experts": MAX_WIDTH, "moe_top_k": MAX_WIDTH, "moe_shared_experts": MAX_WIDTH,
              "moe_every": MAX_LAYERS, "moe_dense_first": MAX_LAYERS, "moe_ffn_hidden": MAX_FFN}
    gpt = GPTConfig(**{k: doc.int(k, getattr(default, k), min=1, max=most) for k, most in sizes.items()},
                    rope_theta=doc.float("rope_theta", default.rope_theta, min=0, min_open=True),
                    norm_eps=doc.float("norm_eps", default.norm_eps, min=0, min_open=True, max=1),
                    tie_embeddings=doc.bool("tie_embeddings", default.tie_embeddings),
                    **{k: doc.int(k, getattr(default, k), min=0, max=most) for k, most in counts.items()},
                    **{k: doc.float(k, getattr(default, k), min=0, max=1e6) for k in MOE_NUMBERS},
                    **{k: doc.bool(k, getattr(default, k)) for k in ("moe_norm_topk", "moe_shared_gate")},
                    moe_score=doc.str("moe_score", default.moe_score))
    validate_gpt(gpt)
    return gpt


def _check_files(path: Path, tensors: dict[str, Stored], n_layers: int, layer: re.Pattern,
                 shapes: dict[str, tuple[int, ...]]) -> None:
    """What the headers can say against the config before a model is built (building is what costs
    time and memory): weights present, floating point, the config's layers and embedding."""
    if not tensors:
        raise ConfigError(f"model.init_from {path} has no *.safetensors weights (loom reads safetensors "
                          f"only; convert .bin weights with transformers' save_pretrained)")
    for name, stored in tensors.items():
        if stored.dtype not in FLOAT_DTYPES and not name.endswith(_NOT_PARAMETERS):
            raise ConfigError(f"model.init_from {path}: tensor {name} in {stored.file.name} is "
                              f"{stored.dtype}, but a model's weights are floating point "
                              f"({', '.join(FLOAT_DTYPES)}); the file is not this model's weights")
    # Layers the files lack would be built for nothing (the cost of building grows with the layer
    # count); tensors beyond the config's layers are named by check() once the model is built.
    held = sorted({int(m.group(1)) for name in tensors if (m := layer.match(name))})
    lacking = sorted(set(range(n_layers)) - set(held))
    if lacking:
        what = f"{len(held)} layer(s), numbered {held[0]}–{held[-1]}" if held else "no decoder layer"
        raise ConfigError(f"model.init_from {path}: its config says {n_layers} layers, but the weights have "
                          f"no layer {lacking[0]} (they hold {what}); the weights do not match the config")
    for name, shape in shapes.items():
        if name in tensors and tensors[name].shape != shape:
            raise ConfigError(f"model.init_from {path}: tensor {name} has shape "
                              f"{list(tensors[name].shape)}, the config's vocabulary × width needs "
                              f"{list(shape)}; the weights do not match the config")


class SafetensorsSource:
    """Blocks of tensors stored in safetensors files, by the model's parameter names (the same
    names here). `bytes_read` counts what this process read."""

    def __init__(self, tensors: dict[str, Stored], path: Path):
        self.tensors, self.path = tensors, path
        self.bytes_read = 0
        self._open: dict[Path, object] = {}

    def file_name(self, name: str) -> str:
        return name

    def close(self) -> None:
        """Unmap the files (the weights are in the model now)."""
        self._open.clear()

    def stored_shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[self.file_name(name)].shape

    def stored_parts(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
        """The stored tensors that make up parameter `name`, with the shape each must have."""
        return [(self.file_name(name), shape)]

    def read(self, name: str, shape: tuple[int, ...], offset: tuple[int, ...],
             size: tuple[int, ...]) -> torch.Tensor:
        return self._read(self.file_name(name), shape, offset, size)

    def _read(self, stored: str, shape, offset, size) -> torch.Tensor:
        if stored not in self.tensors:
            raise LoomError(f"model.init_from {self.path} has no tensor {stored}; it holds a different model")
        file, have = self.tensors[stored].file, self.tensors[stored].shape
        if tuple(have) != tuple(shape):
            raise LoomError(f"model.init_from {self.path}: tensor {stored} has shape {list(have)}, the model "
                            f"needs {list(shape)}")
        if file not in self._open:
            self._open[file] = safe_open(str(file), framework="pt")
        part = self._open[file].get_slice(stored)[tuple(slice(o, o + s) for o, s in zip(offset, size))]
        self.bytes_read += part.numel() * part.element_size()
        if non_finite(part).any():  # one pass over what is read anyway: a NaN would skip every step
            count = int(non_finite(self._open[file].get_tensor(stored)).sum())  # the whole tensor's, to say
            raise LoomError(f"cannot load {file}: {stored!r} holds {count:,} non-finite value(s) (NaN/Inf); "
                            f"the file is damaged or the model diverged before it was saved: give weights "
                            f"saved before that, or download them again")
        return part


def non_finite(t: torch.Tensor) -> torch.Tensor:
    """Where `t` is NaN or ±Inf (float8 e4m3 has no infinity, and torch no isfinite for it)."""
    return t.isnan() if t.dtype == torch.float8_e4m3fn else ~t.isfinite()


class FusedExpertsSource(SafetensorsSource):
    """A Qwen-MoE folder's per-expert tensors read as transformers 5 fuses them in memory
    (loom/models/hf/experts.py): a block of a fused parameter reads its experts' rows only."""

    def stored_parts(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
        fused = fused_parts(name)
        if fused is None:
            return super().stored_parts(name, shape)
        prefix, parts = fused
        rows = shape[1] // len(parts)
        return [(expert_name(prefix, j, part), (rows, shape[2])) for j in range(shape[0]) for part in parts]

    def read(self, name, shape, offset, size) -> torch.Tensor:
        fused = fused_parts(name)
        if fused is None:
            return super().read(name, shape, offset, size)
        prefix, parts = fused
        rows = shape[1] // len(parts)
        experts = []
        for j in range(offset[0], offset[0] + size[0]):
            pieces = []
            for i, part in enumerate(parts):  # the rows of the block each per-expert tensor holds
                first, last = max(offset[1], i * rows), min(offset[1] + size[1], (i + 1) * rows)
                if first < last:
                    pieces.append(self._read(expert_name(prefix, j, part), (rows, shape[2]),
                                             (first - i * rows, offset[2]), (last - first, size[2])))
            experts.append(torch.cat(pieces))
        return torch.stack(experts) if experts else torch.empty(size)


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

    def stored_parts(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
        if is_stacked(name):  # Mixtral: one tensor per expert
            return [(self.file_name(name).format(expert=j), shape[1:]) for j in range(shape[0])]
        return super().stored_parts(name, shape)

    def read(self, name, shape, offset, size) -> torch.Tensor:
        if is_stacked(name):  # only the experts asked for: each rank's under expert parallelism
            if not size[0]:
                return torch.empty(size)
            return torch.stack([self._read(self.file_name(name).format(expert=j), shape[1:], offset[1:],
                                           size[1:]) for j in range(offset[0], offset[0] + size[0])])
        if not rope_heads(name, self.gpt):
            return super().read(name, shape, offset, size)
        hd = self.gpt.head_dim
        rows = [halves_row(r, hd) for r in range(offset[0], offset[0] + size[0])]
        first, last = min(rows), max(rows) + 1
        span = self._read(self.file_name(name), shape, (first, offset[1]), (last - first, size[1]))
        return span[torch.tensor(rows) - first]
