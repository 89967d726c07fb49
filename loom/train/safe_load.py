"""Reading a checkpoint that may come from anyone: nothing in it runs as code, and every element
of every tensor comes from the file.

DCP keeps a checkpoint's index (`.metadata`) as a pickle, and reads a non-tensor entry's payload
with `torch.load(weights_only=False)`: either would run whatever a crafted file asks. loom writes
tensors only, so before any payload is read:

  1. `.metadata` is unpickled with an explicit allow-list of DCP's own metadata classes (plain
     names only: a dotted name such as `os.system` reached through an allowed module is refused);
  2. the index is checked and rebuilt from typed values (`_check_index`): every entry a tensor
     entry with a dtype and a size; its chunks inside it and covering it exactly once (no gap a
     load would leave uninitialised, no overlap); each chunk's payload a byte range of a plain
     file inside the checkpoint folder, long enough for the chunk, apart from every other
     payload; no storage transforms; and, where the caller knows them, exactly the expected
     names with the expected dtypes and shapes;
  3. payloads are read by `SafeReader` as tensors (`torch.load(weights_only=True)`), each of the
     dtype and shape its chunk says; byte entries are refused by the reader and the planner.

Anything else is one line naming the entry, and nothing from the file is executed.
"""

from __future__ import annotations

import enum
import io
import itertools
import math
import os
import pickle
import re
import stat
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from loom.errors import LoomError
from loom.train.muon import is_muon_matrix

# Entry name -> (dtype, shape) that a load expects.
Expected = dict[str, tuple[torch.dtype, tuple[int, ...]]]

# Everything DCP's metadata pickle is made of, by (module, plain name).
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size", "device"},
    "torch.serialization": {"_get_layout"},
    "collections": {"OrderedDict"},
    "builtins": {"slice"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
}
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)
_PAYLOAD_FILE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")  # a plain name in the folder, never ../
# The exact-cover check costs 2^k per chunk for a tensor split along k dimensions; loom's layouts
# split along at most two (FSDP's dim 0, TP's), DCP's along as many as its sharding has.
_MAX_SPLIT_DIMS = 8


class _Forbidden(pickle.UnpicklingError):
    pass


def _enum_member(cls: Any, name: Any) -> enum.Enum:
    """`getattr(cls, name)` as Python 3.11 pickles an enum member (DCP's `_MEM_FORMAT_ENCODING`):
    a member of an allowed enum class, never any other attribute."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) \
            and name in cls.__members__:
        return cls[name]
    raise _Forbidden(f"getattr({str(cls)[:60]}, {str(name)[:60]!r})")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if "." not in name:
            if name in _ALLOWED.get(module, ()):
                return super().find_class(module, name)
            if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_CONSTANTS):
                return getattr(torch, name)
        raise _Forbidden(f"{module}.{name}")


def refused(path: Path, what: str) -> LoomError:
    return LoomError(f"checkpoint {path} {what}; refusing to load it (loom writes only the model's and "
                     f"optimizer's tensors: this file was altered or is not a loom checkpoint)")


def unreadable(path: Path, e: BaseException,
               hint: str = "resume from an earlier checkpoint or start without --resume") -> LoomError:
    if isinstance(e, PermissionError):  # intact, but not this user's to read: no other checkpoint needed
        return LoomError(f"checkpoint {path} could not be read: {e.strerror} ({e.filename}); make its files "
                         f"readable (chmod -R u+r {path})")
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return LoomError(f"checkpoint {path} could not be read ({type(e).__name__}: {first[:200]}); "
                     f"it is damaged or from another model: {hint}")


def read_metadata(path: Path) -> Metadata:
    """The checkpoint's index: unpickled with the allow-list, checked, and rebuilt from the checked
    values alone (whatever else the pickle held is dropped)."""
    try:
        raw = (path / ".metadata").read_bytes()
        metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
    except _Forbidden as e:
        raise refused(path, f"has an index (.metadata) whose pickle asks for {e}, which is not allowed in a "
                            f"checkpoint's metadata") from None
    except Exception as e:  # noqa: BLE001 - DCP's own classes, fed hostile state, raise anything
        raise unreadable(path, e) from None
    return _check_index(path, metadata)


def _is_shape(value: Any, ndim: int | None = None) -> bool:
    return (isinstance(value, (torch.Size, tuple, list)) and all(type(x) is int and x >= 0 for x in value)
            and (ndim is None or len(value) == ndim))


def _shown(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _listed(value: Any) -> Any:
    return list(value) if isinstance(value, (torch.Size, tuple)) else value


Chunk = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def _check_index(path: Path, metadata: Any) -> Metadata:
    entries, storage = getattr(metadata, "state_dict_metadata", None), getattr(metadata, "storage_data", None)
    if not isinstance(metadata, Metadata) or not isinstance(entries, dict) or not isinstance(storage, dict):
        raise refused(path, "has an index that is not DCP's metadata")
    tensors = {}
    for name, entry in entries.items():
        tensors[name] = dtype, size, chunks = _tensor_entry(path, name, entry)
        wrong = _cover_error(size, chunks)
        if wrong:
            raise refused(path, f"describes entry {_shown(name)} of size {list(size)} with chunks that "
                                f"{wrong}")
    stored: dict[tuple[str, tuple[int, ...]], Any] = {}
    for index, info in storage.items():
        fqn, offset = getattr(index, "fqn", None), getattr(index, "offset", None)
        if not isinstance(index, MetadataIndex) or not isinstance(fqn, str) or not _is_shape(offset):
            raise refused(path, f"stores a payload under {_shown(index)}, not an entry's name and offsets")
        stored[fqn, tuple(offset)] = info
    files = _PayloadFiles(path)
    checked_entries, checked_storage = {}, {}
    for name, (dtype, size, chunks) in tensors.items():
        for offsets, sizes in chunks:
            info = stored.pop((name, offsets), None)
            if info is None:
                raise refused(path, f"stores no payload for the chunk of entry {_shown(name)} at offsets "
                                    f"{list(offsets)}")
            needed = math.prod(sizes) * dtype.itemsize
            checked_storage[MetadataIndex(name, offsets)] = files.place(name, info, needed)
        checked_entries[name] = TensorStorageMetadata(
            TensorProperties(dtype=dtype), torch.Size(size),
            [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])
    for fqn, offset in stored:  # a payload no chunk reads
        if fqn not in entries:
            raise refused(path, f"stores a payload for {_shown(fqn)}, which is no tensor entry")
        raise refused(path, f"stores a payload for entry {_shown(fqn)} at offsets {list(offset)}, which is "
                            f"no chunk of it")
    files.check_apart()
    version = getattr(metadata, "version", None)
    return Metadata(state_dict_metadata=checked_entries, storage_data=checked_storage,
                    version=version if isinstance(version, str) else None)


def _tensor_entry(path: Path, name: Any, entry: Any) -> tuple[torch.dtype, tuple[int, ...], list[Chunk]]:
    """An entry's dtype, size and chunks (offsets and sizes of its rank, inside it), checked."""
    if not isinstance(name, str):
        raise refused(path, f"has an entry named {_shown(name)}, not a string")
    if not isinstance(entry, TensorStorageMetadata):
        raise refused(path, f"holds a non-tensor entry {_shown(name)} ({type(entry).__name__})")
    properties = getattr(entry, "properties", None)
    dtype, size = getattr(properties, "dtype", None), getattr(entry, "size", None)
    if not isinstance(properties, TensorProperties) or not isinstance(dtype, torch.dtype):
        raise refused(path, f"describes entry {_shown(name)} without a tensor dtype (its properties: "
                            f"{_shown(properties, 60)})")
    if not _is_shape(size):
        raise refused(path, f"describes entry {_shown(name)} with size {_shown(size, 60)}, not a list of "
                            f"non-negative integers")
    chunks = getattr(entry, "chunks", None)
    if not isinstance(chunks, list):
        raise refused(path, f"describes entry {_shown(name)} with chunks {_shown(chunks, 60)}, not a list")
    out = []
    for chunk in chunks:
        offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
        if not (isinstance(chunk, ChunkStorageMetadata) and _is_shape(offsets, len(size))
                and _is_shape(sizes, len(size))
                and all(o + s <= n for o, s, n in zip(offsets, sizes, size))):
            raise refused(path, f"describes a chunk of entry {_shown(name)} outside its size {list(size)} "
                                f"(offsets {_shown(_listed(offsets), 40)}, "
                                f"sizes {_shown(_listed(sizes), 40)})")
        out.append((tuple(offsets), tuple(sizes)))
    return dtype, tuple(size), out


def _cover_error(size: tuple[int, ...], chunks: list[Chunk]) -> str | None:
    """None when the chunks (each inside the tensor) hold every element exactly once; else what is
    wrong, in words. Nothing of the tensor's size is allocated.

    Why the corners decide it: let Δ be the mixed difference along the split dimensions, which is
    invertible on functions of finite support (prefix sums undo it). Σ 1_chunk = 1_tensor (every
    element covered exactly once) ⟺ Σ Δ1_chunk = Δ1_tensor, and Δ1_box is ±1 at the box's 2^k
    corners and 0 elsewhere. A dimension that every chunk spans whole is a common factor, left out."""
    total, held = math.prod(size), sum(math.prod(s) for _, s in chunks)
    if held < total:
        return f"leave {total - held} of its {total} elements unwritten"
    if held > total:
        return f"overlap (they hold {held} elements for its {total})"
    if total == 0:  # an empty tensor: nothing to write (every chunk is inside it, so empty too)
        return None
    boxes = [(o, s) for o, s in chunks if math.prod(s)]
    split = [d for d in range(len(size)) if any(o[d] != 0 or s[d] != size[d] for o, s in boxes)]
    if len(split) > _MAX_SPLIT_DIMS:
        return f"split it along {len(split)} dimensions (loom reads checkpoints split along at most " \
               f"{_MAX_SPLIT_DIMS})"
    corners: Counter = Counter()
    for (offsets, sizes), sign in [*((box, 1) for box in boxes), (((0,) * len(size), size), -1)]:
        ends = [((offsets[d], 1), (offsets[d] + sizes[d], -1)) for d in split]
        for corner in itertools.product(*ends):
            corners[tuple(x for x, _ in corner)] += sign * math.prod(e for _, e in corner)
    if any(corners.values()):
        return "overlap and leave a gap"
    return None


class _PayloadFiles:
    """Where the index places each chunk's payload: a byte range of a plain, regular file inside the
    checkpoint folder, long enough for the chunk's bytes, and (check_apart) no two ranges sharing
    a byte. So whatever a load allocates from the index is bounded by the bytes on disk."""

    def __init__(self, path: Path):
        self.path = path
        self.sizes: dict[str, int] = {}
        self.ranges: dict[str, list[tuple[int, int, str]]] = {}

    def place(self, name: str, info: Any, needed: int) -> _StorageInfo:
        rel, offset, length = (getattr(info, k, None) for k in ("relative_path", "offset", "length"))
        if not isinstance(info, _StorageInfo) or type(offset) is not int or type(length) is not int \
                or offset < 0 or length < 0:
            raise refused(self.path, f"stores entry {_shown(name)} at an invalid place "
                                     f"(offset {_shown(offset, 30)}, length {_shown(length, 30)})")
        if not isinstance(rel, str) or not _PAYLOAD_FILE.match(rel) or self._size(rel) is None:
            raise refused(self.path, f"stores entry {_shown(name)} in {_shown(rel, 60)}, which is not a file "
                                     f"in the checkpoint")
        if getattr(info, "transform_descriptors", None):
            raise refused(self.path, f"stores entry {_shown(name)} through transforms "
                                     f"{_shown(info.transform_descriptors, 60)}")
        if offset + length > self.sizes[rel]:
            raise LoomError(f"checkpoint {self.path} is damaged: its index places {_shown(name)} in bytes "
                            f"{offset}..{offset + length} of {rel}, which has {self.sizes[rel]} bytes (cut "
                            f"short); resume from an earlier checkpoint or start without --resume")
        if length < needed:
            raise refused(self.path, f"stores entry {_shown(name)} in {length} bytes, fewer than the "
                                     f"{needed} its chunk holds")
        self.ranges.setdefault(rel, []).append((offset, length, name))
        return _StorageInfo(rel, offset, length)

    def _size(self, rel: str) -> int | None:
        if rel not in self.sizes:
            try:
                st = os.lstat(self.path / rel)  # a symlink is not a file in the checkpoint
            except OSError:
                return None
            if not stat.S_ISREG(st.st_mode):
                return None
            self.sizes[rel] = st.st_size
        return self.sizes[rel]

    def check_apart(self) -> None:
        for rel, ranges in self.ranges.items():
            ranges.sort()
            for (a, n, first), (b, _, second) in zip(ranges, ranges[1:]):
                if b < a + n:
                    raise refused(self.path, f"stores entries {_shown(first)} and {_shown(second)} in the "
                                             f"same bytes of {rel}")


def check_entries(path: Path, metadata: Metadata, expected: Expected, prefix: str = "") -> None:
    """Every expected entry is there with its dtype and shape, and no other entry under `prefix`."""
    stored = metadata.state_dict_metadata
    for name, (dtype, shape) in expected.items():
        entry = stored.get(name)
        if entry is None:
            raise LoomError(f"cannot load {path}: it lacks {name!r} of this model (it holds a different "
                            f"model); use the checkpoint's model settings")
        if entry.properties.dtype != dtype or tuple(entry.size) != tuple(shape):
            raise refused(path, f"holds {name!r} as {_describe(entry.properties.dtype, entry.size)} "
                                f"where this model has {_describe(dtype, shape)}")
    extra = sorted(k for k in stored if k.startswith(prefix) and k not in expected)
    if extra:
        raise refused(path, f"holds an entry this model does not have ({extra[0]!r}"
                            f"{f' and {len(extra) - 1} more' if len(extra) > 1 else ''})")


def _describe(dtype: torch.dtype, shape) -> str:
    return f"{str(dtype).removeprefix('torch.')} {list(shape)}"


def trained_entries(model: torch.nn.Module, optimizer: str = "adamw") -> Expected:
    """What loom's checkpoint of `model` holds: `model.<name>` for every state dict entry and, for
    every trained parameter (a tied one's states under its first name), AdamW's
    `optim.<name>.{step,exp_avg,exp_avg_sq}`, or with optimizer = "muon" Muon's
    `optim.<name>.momentum_buffer` for the matrices it steps (loom/train/muon.py). Works on a model
    built on the meta device. With a frozen base (LoRA), the frozen parameters are left out as the
    checkpoint leaves them out (torch's ignore_frozen_params: each by its first name); the buffers
    stay."""
    out: Expected = {f"model.{k}": (v.dtype, tuple(v.shape)) for k, v in model.state_dict().items()}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            out.pop(f"model.{name}", None)
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if optimizer == "muon" and is_muon_matrix(name, p):
            out[f"optim.{name}.momentum_buffer"] = (p.dtype, tuple(p.shape))
        else:
            out[f"optim.{name}.step"] = (torch.float32, ())
            out[f"optim.{name}.exp_avg"] = out[f"optim.{name}.exp_avg_sq"] = (p.dtype, tuple(p.shape))
    return out


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader over a checked index (`read_metadata`'s): it never unpickles the index
    itself, refuses byte entries (the only kind DCP reads with `weights_only=False`), and takes a
    payload only if it is a tensor of its chunk's dtype and shape."""

    def __init__(self, path: Path, metadata: Metadata | None = None):
        super().__init__(path)
        self.checked = metadata if metadata is not None else read_metadata(Path(path))
        self.chunks = {(name, tuple(c.offsets)): (entry.properties.dtype, tuple(c.sizes))
                       for name, entry in self.checked.state_dict_metadata.items() for c in entry.chunks}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self.checked
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner) -> Future:
        """DCP's FileSystemReader.read_data (torch 2.11-2.13) with each payload checked before it
        is copied into the state."""
        by_file: dict[str, list] = {}
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                raise refused(Path(self.path), f"holds a non-tensor entry {item.dest_index.fqn!r}")
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for rel, items in by_file.items():
            with open(Path(self.path) / rel, "rb") as stream:
                for item in items:
                    tensor = self._payload(stream, item.storage_index)
                    for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                        tensor = tensor.narrow(dim, start, length)
                    target = planner.resolve_tensor(item).detach()
                    if target.shape != tensor.shape:
                        raise refused(Path(self.path), f"holds a chunk of {item.dest_index.fqn!r} that "
                                                       f"does not fit this model's tensor")
                    target.copy_(tensor)
                    planner.commit_tensor(item, target)
        done: Future = Future()
        done.set_result(None)
        return done

    def _payload(self, stream, index: MetadataIndex) -> torch.Tensor:
        try:
            tensor = torch.load(self._slice_file(stream, self.storage_data[index]), map_location="cpu",
                                weights_only=True)
        except pickle.UnpicklingError as e:  # torch.load(weights_only=True) met something other than a tensor
            raise refused(Path(self.path), f"holds a payload that is not a plain tensor (torch's "
                                           f"weights-only loader: {_weights_only_reason(e)})") from None
        dtype, sizes = self.chunks[index.fqn, tuple(index.offset)]
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != dtype or tuple(tensor.shape) != sizes:
            found = _describe(tensor.dtype, tensor.shape) if isinstance(tensor, torch.Tensor) \
                else type(tensor).__name__
            raise refused(Path(self.path), f"holds a payload for {index.fqn!r} at offsets "
                                           f"{list(index.offset)} that is {found}, where its index says "
                                           f"{_describe(dtype, sizes)}")
        return tensor


def _weights_only_reason(e: Exception) -> str:
    """The reason inside torch's long weights-only error (its first paragraph is generic advice)."""
    lines = [x.strip() for x in str(e).splitlines()[1:]
             if x.strip() and not x.startswith("Check the documentation")]
    reason = " ".join(lines).rpartition("WeightsUnpickler error:")[2].strip()
    return reason[:160] or "not a tensor"


class SafePlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value) -> None:
        raise LoomError(f"refusing to unpickle checkpoint entry {read_item.dest_index.fqn!r}: "
                        f"loom loads tensors only")
