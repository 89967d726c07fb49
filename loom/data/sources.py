"""What a `data.source` names: text files, a .bin token file, a `loom data prepare` folder, record
files (JSONL, Parquet, Arrow) or a Hugging Face dataset folder saved with `save_to_disk`.

An empty or blank spec names nothing (never the current directory); a directory or glob reads the
files inside it only: hidden files and folders are skipped, a link leaving it is refused
(corpus.py's `folder_files` / `glob_files`).
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path

from loom.checked import BadFile, read_json
from loom.data.corpus import check_spec, folder_files, glob_files, resolve_source, unreadable
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


def _prepared(index: Path) -> bool:
    """A folder's index.json is a prepared one: it says so, or `loom data prepare` left its job file
    beside it (then a damaged index is refused when it is read, not taken for records)."""
    if (index.parent / "prepare.json").is_file():
        return True
    try:
        doc = read_json(index, max_bytes=1 << 28)
    except BadFile:
        return False  # someone's own index.json, among their records or text
    return isinstance(doc, dict) and doc.get("format") == PREPARED_FORMAT


def _folder(spec: str, path: Path) -> Source:
    index = path / "index.json"
    if index.is_file() and _prepared(index):
        return Source(spec, "prepared", (index,), folder=path)
    if (path / "prepare.json").is_file():
        raise LoomError(f"data.source '{spec}' is an unfinished `loom data prepare` (no index.json yet); run "
                        f"the same `loom data prepare` again to finish it")
    if any((path / marker).is_file() for marker in _SAVED_MARKERS):
        return Source(spec, "saved", tuple(folder_files(path, spec)), folder=path)
    files = folder_files(path, spec)
    if any(record_format(f) for f in files):
        return _records(spec, files)
    return Source(spec, "text", tuple(resolve_source(spec)))


def resolve(spec: str, stdlib_max_bytes: int = 8_000_000) -> Source:
    """Classify a data.source; text sources keep corpus.py's rules (sorted files, stdlib's cap)."""
    try:
        return _resolve(spec, stdlib_max_bytes)
    except OSError as e:  # a folder loom may not list or enter: one line, not a traceback
        raise unreadable(Path(e.filename if isinstance(e.filename, str) else spec), e) from None


def _resolve(spec: str, stdlib_max_bytes: int) -> Source:
    if spec == "stdlib":
        return Source(spec, "text", tuple(resolve_source(spec, stdlib_max_bytes)))
    check_spec(spec)
    path = Path(spec).expanduser()
    if path.is_dir():
        os.listdir(path)  # a folder loom may not list is refused by its name, before what is inside
        return _folder(spec, path)
    if path.is_file():
        if path.suffix == ".bin":
            return Source(spec, "bin", (path,))
        if record_format(path):
            return _records(spec, [path])
        return Source(spec, "text", (path,))
    if glob.has_magic(spec):
        files = glob_files(spec)
        if any(record_format(f) for f in files):
            return _records(spec, files)
    resolved = resolve_source(spec)  # raises the one-line errors for missing paths and empty globs
    if isinstance(resolved, Path):
        return Source(spec, "bin", (resolved,))
    return Source(spec, "text", tuple(resolved))


def folder_holding(spec: str, place: Path) -> Path | None:
    """The folder of source `spec` that `place` (a run directory, `loom data prepare`'s OUT) lies
    inside, when what loom writes there would join the source: a directory read file by file (a
    prepared folder reads only its own shards). None when `place` is elsewhere."""
    if spec == "stdlib" or not spec.strip():
        return None
    folder = Path(spec).expanduser()
    try:
        if not folder.is_dir() or ((folder / "index.json").is_file() and _prepared(folder / "index.json")):
            return None
    except OSError:  # a folder loom may not read: reading the data says so, in its own line
        return None
    inside = Path(os.path.realpath(place)).is_relative_to(os.path.realpath(folder))
    return folder if inside else None
