"""What a `data.source` names: text files, a .bin token file, a `loom data prepare` folder, record
files (JSONL, Parquet, Arrow) or a Hugging Face dataset folder saved with `save_to_disk`."""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from pathlib import Path

from loom.data.corpus import resolve_source
from loom.errors import LoomError

# A record file's suffix -> the `datasets` builder that reads it (compressed JSON too).
RECORD_SUFFIXES = {".jsonl": "json", ".json": "json", ".jsonl.gz": "json", ".json.gz": "json",
                   ".parquet": "parquet", ".arrow": "arrow"}
PREPARED_FORMAT = "loom-prepared-v1"  # index.json's "format" in a `loom data prepare` folder
# save_to_disk writes these beside its .arrow files (dataset_dict.json for a DatasetDict).
_SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


@dataclass(frozen=True)
class Source:
    spec: str  # as the config wrote it
    kind: str  # text | bin | prepared | records | saved
    files: tuple[Path, ...]  # text / record files, the .bin, or every file of the folder (cache keys)
    folder: Path | None = None  # prepared and saved folders
    record_format: str = ""  # json | parquet | arrow (kind records)

    @property
    def is_records(self) -> bool:
        return self.kind in ("records", "saved")


def record_format(path: Path) -> str | None:
    name = path.name.lower()
    for suffix, fmt in RECORD_SUFFIXES.items():
        if name.endswith(suffix):
            return fmt
    return None


def _listed(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))


def _records(spec: str, files: list[Path]) -> Source:
    """Record files of one format; anything else among them is a mistake worth one line."""
    formats = {f: record_format(f) for f in files}
    first = next(f for f, fmt in formats.items() if fmt)
    for f, fmt in formats.items():
        if fmt is None:
            raise LoomError(f"data.source '{spec}' holds record files ({first.name}) and {f.name}, which is "
                            f"not one (.jsonl, .json, .parquet, .arrow); remove it, or name the files to "
                            f"read with a glob such as '{spec.rstrip('/')}/*{first.suffix}' (or '*.txt' for "
                            f"text)")
        if fmt != formats[first]:
            raise LoomError(f"data.source '{spec}' mixes {formats[first]} ({first.name}) and {fmt} "
                            f"({f.name}) files; give each format as its own data.mix entry")
    return Source(spec, "records", tuple(files), record_format=formats[first])


def _folder(spec: str, path: Path) -> Source:
    index = path / "index.json"
    if index.is_file():
        try:
            fmt = json.loads(index.read_text(encoding="utf-8")).get("format")
        except (OSError, ValueError, AttributeError):
            fmt = None
        if fmt == PREPARED_FORMAT:
            return Source(spec, "prepared", (index,), folder=path)
    if (path / "prepare.json").is_file():
        raise LoomError(f"data.source '{spec}' is an unfinished `loom data prepare` (no index.json yet); run "
                        f"the same `loom data prepare` again to finish it")
    if any((path / marker).is_file() for marker in _SAVED_MARKERS):
        return Source(spec, "saved", tuple(_listed(path)), folder=path)
    files = _listed(path)
    if any(record_format(f) for f in files):
        return _records(spec, files)
    return Source(spec, "text", tuple(resolve_source(spec)))


def resolve(spec: str, stdlib_max_bytes: int = 8_000_000) -> Source:
    """Classify a data.source; text sources keep corpus.py's rules (sorted files, stdlib's cap)."""
    if spec == "stdlib":
        return Source(spec, "text", tuple(resolve_source(spec, stdlib_max_bytes)))
    path = Path(spec).expanduser()
    if path.is_dir():
        return _folder(spec, path)
    if path.is_file():
        if path.suffix == ".bin":
            return Source(spec, "bin", (path,))
        if record_format(path):
            return _records(spec, [path])
        return Source(spec, "text", (path,))
    if glob.has_magic(spec):
        matches = glob.glob(os.path.expanduser(spec), recursive=True)
        files = sorted(Path(p) for p in matches if Path(p).is_file())
        if any(record_format(f) for f in files):
            return _records(spec, files)
    resolved = resolve_source(spec)  # raises the one-line errors for missing paths and empty globs
    if isinstance(resolved, Path):
        return Source(spec, "bin", (resolved,))
    return Source(spec, "text", tuple(resolved))
