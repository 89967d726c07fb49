"""`loom export`: a checkpoint, consolidated into one safetensors file.

A checkpoint holds the model's tensors under the full model's parameter names, sharded however
the run sharded them (see loom/train/checkpoint.py). Export reads them whole without a process
group and writes them as one `.safetensors` file:

  - layout "loom": the names and tensors exactly as the checkpoint holds them (any model);
  - layout "hf": loom's GPT as a Hugging Face Llama (`LlamaForCausalLM`): its parameter names,
    q/k projection rows reordered for Llama's rotate-half RoPE, a `config.json` beside the file,
    and the tokenizer files the checkpoint carries (loom/train/tokenizer_copy.py: recorded by
    hash at save; never a path read from meta.json).

Nothing is replaced without `overwrite`: not an existing output file, nor (layout "hf") a folder
that already holds a model. With it, an export replaces only files of the names it writes (an hf
export: config.json, generation_config.json, the tokenizer files loom carries, and the old model's
shard index and `model-NNNNN-of-NNNNN` shards, which would be read beside the new weights); any
other file in the folder is the user's and stays. The new files are written beside the old first,
then renamed into place, config.json last. A folder export (hf, a LoRA adapter) never writes into
the working or home directory. Each file is written to a temporary
name and renamed, so a crash never leaves half a file under the output's name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import safetensors.torch
import torch

from loom.checked import Fields
from loom.config import load_config_text, shape_overrides
from loom.data.hf_tokenizer import HFTokenizer
from loom.errors import ConfigError, LoomError
from loom.files import atomic_write, check_writable, fsync_dir
from loom.hf_config import hf_config_from
from loom.models.gpt.config import GPTConfig, preset
from loom.models.gpt.config import validate as validate_gpt
from loom.models.gpt.llama_layout import hf_config, hf_state_dict
from loom.models.gpt.model import build_model
from loom.models.hf.experts import split_experts
from loom.models.pretrained import SPECIAL_IDS, SPECIAL_TOKENS
from loom.train import checkpoint as ckpt
from loom.train import export_lora, safe_load, tokenizer_copy
from loom.train.checkpoint import CHECKPOINTS, latest_checkpoint, resolve_resume

LAYOUTS = ("loom", "hf")
HF_CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"  # generate()'s defaults: the ids it stops at
# loom's GPT, recognized by these names.
GPT_KEYS = ("tok_embeddings.weight", "layers.0.attention.wq.weight")
# The files of a Hugging Face model folder: what makes it hold a model, and what an hf export
# with --overwrite replaces, all together.
MODEL_FILES = (HF_CONFIG, GENERATION_CONFIG, "*.safetensors", "*.safetensors.index.json",
               "pytorch_model*.bin", "pytorch_model.bin.index.json", *tokenizer_copy.NAMES, "tokenizer.model",
               "vocab.json", "merges.txt", "added_tokens.json")


def export(checkpoint: Path | str, output: Path | str, layout: str = "loom",
           overwrite: bool = False, lora: str | None = None) -> list[Path]:
    """Write the model of `checkpoint` (a step_N folder, or a run directory: its latest) to
    `output` as one safetensors file (+ config.json and the tokenizer for layout "hf"). An
    existing output, or a folder holding a model (layout "hf"), is replaced only under
    `overwrite`. A LoRA run's checkpoint (adapters alone) needs `lora`: "adapter" writes the
    PEFT adapter folder `output`, "merged" the base with the adapters merged in
    (loom/train/export_lora.py). Returns the paths written."""
    if layout not in LAYOUTS:
        raise LoomError(f"unknown export layout {layout!r}; choose one of: {', '.join(LAYOUTS)}")
    output = Path(output)
    if lora == "adapter":
        _check_adapter_output(output, overwrite)
    else:
        _check_output(output, layout, overwrite)
    path = _resolve(Path(checkpoint))
    _outside_checkpoints(output, path)
    meta = ckpt.read_meta(path)
    export_lora.check_mode(meta, path, lora)
    tokenizer = tokenizer_copy.carried(path, meta) if layout == "hf" else {}
    stored = {k.removeprefix("model."): tuple(m.size) for k, m in
              safe_load.read_metadata(path).state_dict_metadata.items() if k.startswith("model.")}
    if not stored:
        raise LoomError(f"{path} holds no model tensors; pass a checkpoint written by `loom train`")
    hf_model = _saved_hf_config(meta, path)  # a Hugging Face decoder trained as itself (init_from)
    if lora is not None:
        gpt = _recorded_gpt(meta, path) if hf_model is None else None
        adapters = ckpt.read_tensors(path, "model.")
        if lora == "adapter":
            return _write_adapter(output, *export_lora.adapter_files(meta, path, adapters, gpt), overwrite)
        model = build_model(gpt, "meta") if gpt is not None else _hf_meta_model(hf_model)
        names = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        tensors = export_lora.merged_tensors(meta, path, adapters, names, gpt)
    else:
        # loom's GPT: exactly the entries its saved config gives, with their dtypes and shapes, checked
        # before any payload is read (another model: each entry is still checked to be a tensor).
        gpt = gpt_config(meta, stored, path) if (layout == "hf" and hf_model is None) or is_gpt(stored) \
            else None
        expected = None if gpt is None else {f"model.{k}": (v.dtype, tuple(v.shape))
                                             for k, v in build_model(gpt, "meta").state_dict().items()}
        tensors = ckpt.read_tensors(path, "model.", expected)
    if layout == "hf" and hf_model is not None:
        config = hf_model  # under its own names; a Qwen-MoE's experts apart again, as its folder held them
        tensors = split_experts(tensors)
    elif layout == "hf":
        gpt = untie_if_trained_apart(gpt, tensors)
        tensors = hf_state_dict(tensors, gpt)
        config = hf_config(gpt, tensors["model.embed_tokens.weight"].dtype)
    if layout == "hf":  # what generate() stops at, and what it starts and pads with
        special = special_token_ids(meta, path, tokenizer, config["vocab_size"], config)
        config = {**config, **special}
    metadata = {"format": "pt", "loom_step": str(meta.get("step", "")), "loom_layout": layout}
    if gpt is not None and layout == "loom":  # what model.init_from needs to rebuild the model
        metadata["loom_model"] = json.dumps(dataclasses.asdict(untie_if_trained_apart(gpt, tensors)))

    def write(tmp: Path) -> None:
        safetensors.torch.save_file(_standalone(tensors), str(tmp), metadata=metadata)

    if layout == "loom":
        atomic_write(output, write, durable=True)
        return [output]
    # A folder transformers (and model.init_from) can use whole; config.json last: it completes it.
    generation = {GENERATION_CONFIG: _json(special)} if "eos_token_id" in special else {}
    files = {output.name: write, **tokenizer, **generation, HF_CONFIG: _json(config)}
    replaced = _replaced_model_files(output.parent) if overwrite else []
    return _write_model_folder(output.parent, files, replaced)


def _write_adapter(folder: Path, tensors: dict[str, torch.Tensor], config: dict,
                   overwrite: bool) -> list[Path]:
    folder.mkdir(exist_ok=True)

    def write(tmp: Path) -> None:
        safetensors.torch.save_file(_standalone(tensors), str(tmp), metadata={"format": "pt"})

    files = {export_lora.ADAPTER_FILE: write, export_lora.ADAPTER_CONFIG: _json(config)}
    return _write_model_folder(folder, files, [])  # the adapter's two files replace their own names only


def _recorded_gpt(meta: dict, path: Path) -> GPTConfig:
    saved = meta.get("model_config")
    if not (isinstance(saved, dict) and isinstance(saved.get("gpt"), dict)):
        raise LoomError(f"{path / 'meta.json'} records no model config (model_config.gpt); it is damaged")
    try:
        gpt = GPTConfig(**saved["gpt"])
        validate_gpt(gpt)
    except (TypeError, ConfigError) as e:
        raise LoomError(f"{path / 'meta.json'} is damaged (its model_config: {e})") from None
    return gpt


def _hf_meta_model(raw: dict):
    import transformers

    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**raw))


def _json(doc: dict) -> bytes:
    return (json.dumps(doc, indent=2) + "\n").encode()


def _write_model_folder(folder: Path, files: dict, replaced: list[Path]) -> list[Path]:
    """`files` (name -> bytes, or a function writing a path) into `folder`, staged beside it first;
    the `replaced` files (an old model's, under --overwrite) go as the new ones take their place."""
    stage = Path(tempfile.mkdtemp(prefix=".tmp-export-", dir=folder))
    try:
        for name, data in files.items():
            atomic_write(stage / name, data, durable=True)
        for old in replaced:
            if old.name not in files:
                old.unlink()
        for name in files:
            os.replace(stage / name, folder / name)
        fsync_dir(folder)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return [folder / name for name in files]


def _replaced_model_files(folder: Path) -> list[Path]:
    """Of the model in `folder`, the files an hf export replaces: of the names it writes, and the
    old weights' index and shards (by Hugging Face's shard names); never another file."""
    return [p for p in _model_files(folder) if p.name in _HF_WRITES or _OLD_WEIGHTS.match(p.name)]


_HF_WRITES = (HF_CONFIG, GENERATION_CONFIG, *tokenizer_copy.NAMES)
_OLD_WEIGHTS = re.compile(r"^(model|pytorch_model)(-\d{5}-of-\d{5}\.(safetensors|bin)"
                          r"|\.safetensors\.index\.json|\.bin\.index\.json|\.bin)$")


def _model_files(folder: Path) -> list[Path]:
    found = {p for pattern in MODEL_FILES for p in folder.glob(pattern)}
    return sorted(p for p in found if p.is_file() or p.is_symlink())


# ---------------------------------------------------------------------------------------------
# Paths


def _not_a_shared_folder(folder: Path, writes: str) -> None:
    """A folder export writes several files (config.json, tokenizer.json …) that are everyday names:
    never into the working or home directory, where the user's own files of those names live."""
    places = [("the working directory", Path.cwd().resolve())]
    with contextlib.suppress(RuntimeError):  # no $HOME and no user entry
        places.append(("your home directory", Path.home().resolve()))
    for what, place in places:
        if folder.resolve() == place:
            raise LoomError(f"{writes} writes a whole folder of files (config.json and others), and {folder} "
                            f"is {what}; export into a folder of its own, e.g. {folder / 'model'}")


def _outside_checkpoints(output: Path, checkpoint: Path) -> None:
    """Never into the checkpoint being read (its files would be overwritten, even under --overwrite),
    nor into a run's checkpoints/ folder, whose old step_N folders training prunes."""
    read = checkpoint.resolve()
    target = output.resolve()
    for folder in (target, *target.parents):  # (an adapter's output is itself a folder)
        run = folder.parent if folder.name == CHECKPOINTS else None
        if folder != read and (run is None or latest_checkpoint(run) is None):
            continue
        run = run or folder.parent.parent
        what = "the checkpoint it reads" if folder == read else "a run's checkpoints folder"
        raise LoomError(f"{output} is inside {folder}, {what}, where loom replaces and prunes files; "
                        f"export outside it, e.g. {run / output.name}")


def _check_output(output: Path, layout: str, overwrite: bool) -> None:
    parent = output.parent
    if not parent.is_dir():
        raise LoomError(f"cannot write {output}: its folder {parent} does not exist; create it "
                        f"(mkdir -p {parent}) or choose an output path in an existing folder")
    if output.is_dir():
        raise LoomError(f"output {output} is a folder; pass a file path such as "
                        f"{output / 'model.safetensors'}")
    if layout == "hf" and output.name in (HF_CONFIG, *tokenizer_copy.NAMES):
        raise LoomError(f"output {output}: --layout hf writes {output.name} itself beside the weights; "
                        f"name the weights file model.safetensors")
    if layout == "hf":
        _not_a_shared_folder(parent, "--layout hf")
    check_writable(parent, "the output folder", "choose an output path in a folder you can write")
    if overwrite:
        return
    if output.exists() or output.is_symlink():
        raise LoomError(f"{output} already exists; loom export replaces a file only with --overwrite: pass "
                        f"it to replace this one, or choose another output path")
    held = _model_files(parent) if layout == "hf" else []
    if held:
        raise LoomError(f"{parent} already holds a model ({', '.join(p.name for p in held[:3])}"
                        f"{', …' if len(held) > 3 else ''}); --layout hf writes a whole model folder: export "
                        f"into an empty folder, or pass --overwrite to replace that model's files")


def _check_adapter_output(folder: Path, overwrite: bool) -> None:
    """--lora adapter writes a folder (PEFT loads adapter_model.safetensors + adapter_config.json)."""
    if not folder.parent.is_dir():
        raise LoomError(f"cannot write {folder}: its folder {folder.parent} does not exist; create it "
                        f"(mkdir -p {folder.parent}) or choose an output folder in an existing one")
    if folder.exists() and not folder.is_dir():
        raise LoomError(f"--lora adapter writes a folder (adapter_model.safetensors + adapter_config.json), "
                        f"and {folder} is a file; name a folder, e.g. {folder.with_suffix('')}-adapter")
    if folder.is_dir():
        _not_a_shared_folder(folder, "--lora adapter")
    check_writable(folder if folder.is_dir() else folder.parent, "the output folder",
                   "choose an output folder you can write")
    held = [p for p in (folder / export_lora.ADAPTER_FILE, folder / export_lora.ADAPTER_CONFIG) if p.exists()]
    if held and not overwrite:
        raise LoomError(f"{folder} already holds an adapter ({held[0].name}); pass --overwrite to replace "
                        f"it, or export into another folder")


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
    saved = meta.get("model_config")
    if isinstance(saved, dict) and isinstance(saved.get("gpt"), dict):  # resolved at the run's start
        try:
            gpt = GPTConfig(**saved["gpt"])
            validate_gpt(gpt)
            return gpt
        except (TypeError, ConfigError) as e:
            raise LoomError(f"{path / 'meta.json'} is damaged (its model_config: {e}); export with "
                            f"--layout loom") from None
    cfg = load_config_text(meta["config"], f"{path / 'meta.json'} config")
    overrides = shape_overrides(cfg.model)
    overrides["vocab_size"] = int(stored["tok_embeddings.weight"][0])
    try:
        return preset(cfg.model.preset, **overrides)
    except ConfigError as e:
        raise LoomError(f"{path}: its model config is not valid here ({e}); "
                        f"export with --layout loom") from None


def _saved_hf_config(meta: dict, path: Path) -> dict | None:
    """The Hugging Face config.json the run recorded, checked as model.init_from reads one (it is
    written out as the export's config.json)."""
    saved = meta.get("model_config")
    config = saved.get("hf_config") if isinstance(saved, dict) else None
    if config is not None and not isinstance(config, dict):
        raise LoomError(f"{path / 'meta.json'} is damaged (its model_config.hf_config is not an object)")
    if config is None:
        return None
    return hf_config_from(config, f"{path / 'meta.json'} model_config.hf_config").raw


def untie_if_trained_apart(gpt: GPTConfig, tensors: dict[str, torch.Tensor]) -> GPTConfig:
    if gpt.tie_embeddings and not torch.equal(tensors["output.weight"], tensors["tok_embeddings.weight"]):
        # Configured tied, trained with two matrices (the tie was lost when the run materialized the
        # model): export the model that was trained, an untied one.
        return dataclasses.replace(gpt, tie_embeddings=False)
    return gpt


def special_token_ids(meta: dict, path: Path, tokenizer: dict[str, bytes], vocab: int,
                      source_config: dict) -> dict:
    """bos/eos/pad ids for the export's config.json and generation_config.json: the source model's
    (model.init_from's config.json: recorded at the run's start, or the Hugging Face config the run
    trained as itself), each one it lacks from the tokenizer the checkpoint carries. Without them
    `generate()` never stops at EOS."""
    saved = meta.get("model_config")
    recorded = saved.get(SPECIAL_TOKENS) if isinstance(saved, dict) else None
    source = Fields(recorded if recorded is not None else source_config, path / "meta.json",
                    f"model_config.{SPECIAL_TOKENS if recorded is not None else 'hf_config'}")
    ids = {}
    for key in SPECIAL_IDS:
        value = source.raw.get(key)
        if isinstance(value, list) and key == "eos_token_id":  # chat models stop at any of several
            listed = Fields(dict(enumerate(source.list(key, of=int, max_len=64))), source.source, key)
            ids[key] = [listed.int(i, min=0, max=vocab - 1) for i in range(len(value))]
        elif value is not None:
            ids[key] = source.int(key, min=0, max=vocab - 1)
    if "tokenizer.json" in tokenizer:  # checked against its sha256 by tokenizer_copy.carried
        tok = HFTokenizer(path / tokenizer_copy.FOLDER / "tokenizer.json")
        named = tok.special_tokens.get
        found = {"eos_token_id": tok.eos_id, "bos_token_id": tok.token_id(named("bos_token")),
                 "pad_token_id": tok.token_id(named("pad_token"))}
        for key, token_id in found.items():
            if key not in ids and token_id is not None and token_id < vocab:
                ids[key] = token_id
    return ids
