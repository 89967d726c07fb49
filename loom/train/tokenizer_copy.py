"""The tokenizer files a checkpoint carries, so that `loom export --layout hf` never copies a path
read from meta.json (a checkpoint someone hands you may name any file there).

At save, rank 0 copies the Hugging Face tokenizer files the run read — data.tokenizer's
tokenizer.json, or the model.init_from folder's under data.tokenizer = "auto", and the files of
these names beside it — into step_N/tokenizer/, and records each in meta.json by name and sha256.
Export copies exactly those files out of the checkpoint, each after its hash is checked.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from loom.checked import BadFile, Fields, inside
from loom.config import Config
from loom.data.hf_tokenizer import resolve_tokenizer
from loom.errors import LoomError
from loom.files import atomic_write

FOLDER = "tokenizer"  # inside step_N/
META_KEY = "tokenizer_files"  # in meta.json: {file name: sha256}
NAMES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def run_tokenizer_files(cfg: Config) -> list[Path]:
    """The Hugging Face tokenizer files this run reads (none for the byte or BPE tokenizers)."""
    folder = Path(cfg.model.init_from).expanduser() if cfg.model.init_from else None
    try:
        choice = resolve_tokenizer(cfg.data.tokenizer, folder if folder and folder.is_dir() else None)
    except LoomError:  # gone since the run started: this checkpoint carries no tokenizer
        return []
    if not isinstance(choice, Path):
        return []
    return [choice.parent / name for name in NAMES if (choice.parent / name).is_file()]


def save(cfg: Config, checkpoint: Path) -> dict[str, str]:
    """Copy the run's tokenizer files into `checkpoint`/tokenizer/; their names and hashes."""
    recorded = {}
    for file in run_tokenizer_files(cfg):
        try:
            data = file.read_bytes()
        except OSError:  # gone since the run started: not carried (a write failure is the checkpoint's)
            continue
        atomic_write(checkpoint / FOLDER / file.name, data)
        recorded[file.name] = sha256(data)
    return recorded


def carried(checkpoint: Path, meta: dict) -> dict[str, bytes]:
    """The tokenizer files `checkpoint` recorded, read from its own tokenizer/ folder and checked
    against their hashes: {name: content}. A checkpoint saved before loom recorded them has none."""
    source = checkpoint / "meta.json"
    record = Fields(meta, source).section(META_KEY, default={})
    files = {}
    for name in record.keys():
        digest = record.str(name, fix="it is not a file loom records")
        if name not in NAMES or not _SHA256.match(digest):
            raise BadFile(f"{source}: {META_KEY} names {name!r} with {digest!r}; loom records only "
                          f"{', '.join(NAMES)}, each with its sha256: this file was altered")
        path = inside(checkpoint / FOLDER, name, source, f"{META_KEY}.{name}")
        try:
            data = path.read_bytes()
        except OSError as e:
            raise LoomError(f"{path} could not be read ({e.strerror or type(e).__name__}); the checkpoint "
                            f"is incomplete: export with --layout loom (no tokenizer), or copy it whole "
                            f"again") from None
        if sha256(data) != digest:
            raise LoomError(f"{path} does not match the sha256 that {source} records for it; the checkpoint "
                            f"was altered or damaged: export from an intact copy")
        files[name] = data
    return files
