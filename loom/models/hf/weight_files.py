"""The tensors of a model folder's safetensors files, from their headers, checked before any model
is built: `model.safetensors.index.json`'s weight map (each tensor name → a file inside the
folder; a tensor is read from the file the map names, not from whichever file holds that name),
and each file's header (its length against the file's, then safetensors' own parse: dtype
names, shapes, offsets inside the file, consistent with dtype × shape and not overlapping).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from loom.checked import BadFile, Fields, inside, read_json

INDEX = "model.safetensors.index.json"
MAX_INDEX_BYTES = 64 << 20  # a weight map of a few thousand tensors is a few hundred KB
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
# What a model's parameters can be read from (copied into the parameter's dtype).
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
_AGAIN = "it is truncated or damaged: download it again"


@dataclass(frozen=True)
class Stored:
    """One tensor in a safetensors file: the file, its safetensors dtype name (F32, BF16, …), its shape."""

    file: Path
    dtype: str
    shape: tuple[int, ...]


def read_header(file: Path) -> tuple[dict[str, Stored], dict[str, str]]:
    """Every tensor of a safetensors file (name → Stored) and its `__metadata__`, from the header
    alone; a file that is truncated, damaged or not safetensors is one line."""
    try:
        with open(file, "rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            head = f.read(8)
    except OSError as e:
        raise BadFile(f"{file} could not be read ({e.strerror or type(e).__name__})") from None
    if len(head) < 8:
        raise BadFile(f"{file} is {size} bytes, too short for a safetensors file; {_AGAIN}")
    (length,) = struct.unpack("<Q", head)
    if length > min(size - 8, MAX_HEADER_BYTES):
        raise BadFile(f"{file} declares a header of {length:,} bytes, but the file holds {size - 8:,} after "
                      f"that length (and safetensors allows at most {MAX_HEADER_BYTES:,}); {_AGAIN}")
    try:  # safetensors' parse checks dtype names, shapes and every tensor's bytes against the file
        with safe_open(str(file), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {name: Stored(file, f.get_slice(name).get_dtype(), tuple(f.get_slice(name).get_shape()))
                       for name in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error type for every fault
        raise BadFile(f"{file} is not a readable safetensors file ({str(e).strip().splitlines()[0][:200]}); "
                      f"{_AGAIN}") from None
    return tensors, metadata


def folder_tensors(folder: Path, root: Path) -> dict[str, Stored]:
    """Every tensor of a Hugging Face model folder: those its weight map names, each from the
    file it names, or, without an index, those of its *.safetensors files (a name in two of them
    is refused). Files may be links that stay inside `root` (a Hub cache's repository folder)."""
    if (folder / INDEX).exists():
        return _mapped(folder, root)
    files = sorted(folder.glob("*.safetensors"))
    out: dict[str, Stored] = {}
    for file in files:
        checked = inside(folder, file.name, source=folder, field="a file", root=root)
        for name, stored in read_header(checked)[0].items():
            if name in out:
                raise BadFile(f"{folder} holds tensor {name} in both {out[name].file.name} and {file.name}; "
                              f"remove the stray file, or give the folder its {INDEX}")
            out[name] = stored
    return out


def _mapped(folder: Path, root: Path) -> dict[str, Stored]:
    index = inside(folder, INDEX, source=folder, field="a file", root=root)
    doc = Fields(read_json(index, max_bytes=MAX_INDEX_BYTES), source=index)
    weight_map = doc.section("weight_map")
    files = {name: inside(folder, weight_map.str(name, nonempty=True), source=index,
                          field=weight_map.name(name), root=root) for name in weight_map.keys()}
    headers = {}
    for file in sorted(set(files.values())):
        if not _is_file(file):
            raise BadFile(f"{index} names {file.relative_to(folder)}, which is not a file in {folder}; the "
                          f"download is incomplete")
        headers[file] = read_header(file)[0]
    out = {}
    for name, file in files.items():
        if name not in headers[file]:
            raise BadFile(f"{index}: weight_map puts {name} in {file.relative_to(folder)}, which does not "
                          f"hold it; the index and the files disagree: download the model again")
        out[name] = headers[file][name]
    return out


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a name the file system cannot hold (too long): no such file either
        return False
