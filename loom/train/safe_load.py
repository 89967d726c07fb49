"""Reading a checkpoint that may come from anyone: nothing in it runs as code.

DCP keeps a checkpoint's index (`.metadata`) as a pickle, and reads a non-tensor entry's payload
with `torch.load(weights_only=False)`: either would run whatever a crafted file asks. loom writes
tensors only, so before any payload is read:

  1. `.metadata` is unpickled with an explicit allow-list of DCP's own metadata classes (plain
     names only: a dotted name such as `os.system` reached through an allowed module is refused);
  2. the index is checked: every entry a tensor entry, every payload in a plain file inside the
     checkpoint folder, no storage transforms, chunks inside their tensor, and, where the caller
     knows them, exactly the expected names with the expected dtypes and shapes;
  3. payloads are read by DCP's reader as tensors (`torch.load(weights_only=True)`); the reader
     and the planner below refuse a byte entry as well, should one ever reach them.

Anything else is one line naming the entry, and nothing from the file is executed.
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType

from loom.errors import LoomError

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


class _Forbidden(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
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
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return LoomError(f"checkpoint {path} could not be read ({type(e).__name__}: {first[:200]}); "
                     f"it is damaged or from another model: {hint}")


def read_metadata(path: Path) -> Metadata:
    """The checkpoint's index, unpickled with the allow-list and checked entry by entry."""
    try:
        raw = (path / ".metadata").read_bytes()
        metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
    except _Forbidden as e:
        raise refused(path, f"has an index (.metadata) whose pickle asks for {e}, which is not allowed in a "
                            f"checkpoint's metadata") from None
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, KeyError,
            IndexError) as e:
        raise unreadable(path, e) from None
    _check_index(path, metadata)
    return metadata


def _is_shape(value: Any, ndim: int | None = None) -> bool:
    return (isinstance(value, (torch.Size, tuple, list)) and all(type(x) is int and x >= 0 for x in value)
            and (ndim is None or len(value) == ndim))


def _check_index(path: Path, metadata: Any) -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict) \
            or not isinstance(metadata.storage_data, dict):
        raise refused(path, "has an index that is not DCP's metadata")
    for name, entry in metadata.state_dict_metadata.items():
        if not isinstance(name, str):
            raise refused(path, f"has an entry named {name!r}, not a string")
        if not isinstance(entry, TensorStorageMetadata):
            raise refused(path, f"holds a non-tensor entry {name!r} ({type(entry).__name__})")
        dtype = getattr(entry.properties, "dtype", None)
        if not isinstance(dtype, torch.dtype) or not _is_shape(entry.size):
            raise refused(path, f"describes entry {name!r} with an invalid dtype or size")
        for chunk in entry.chunks:
            if not (_is_shape(chunk.offsets, len(entry.size)) and _is_shape(chunk.sizes, len(entry.size))
                    and all(o + s <= n for o, s, n in zip(chunk.offsets, chunk.sizes, entry.size))):
                raise refused(path, f"describes a chunk of entry {name!r} outside its size "
                                    f"{list(entry.size)}")
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or index.fqn not in metadata.state_dict_metadata:
            raise refused(path, f"stores a payload for {getattr(index, 'fqn', index)!r}, which is no "
                                f"tensor entry")
        if not isinstance(info, _StorageInfo) or type(info.offset) is not int \
                or type(info.length) is not int or info.offset < 0 or info.length < 0:
            raise refused(path, f"stores entry {index.fqn!r} at an invalid place")
        rel = info.relative_path
        if not isinstance(rel, str) or not _PAYLOAD_FILE.match(rel) or (path / rel).is_symlink() \
                or not (path / rel).is_file():
            raise refused(path, f"stores entry {index.fqn!r} in {rel!r}, which is not a file in the "
                                f"checkpoint")
        if info.transform_descriptors:
            raise refused(path, f"stores entry {index.fqn!r} through transforms "
                                f"{list(info.transform_descriptors)}")


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


def adamw_entries(model: torch.nn.Module) -> Expected:
    """What loom's checkpoint of `model` trained with AdamW holds: `model.<name>` for every state
    dict entry and `optim.<name>.{step,exp_avg,exp_avg_sq}` for every trained parameter (a tied
    parameter's states under its first name). Works on a model built on the meta device."""
    out: Expected = {f"model.{k}": (v.dtype, tuple(v.shape)) for k, v in model.state_dict().items()}
    for name, p in model.named_parameters():
        if p.requires_grad:
            out[f"optim.{name}.step"] = (torch.float32, ())
            out[f"optim.{name}.exp_avg"] = out[f"optim.{name}.exp_avg_sq"] = (p.dtype, tuple(p.shape))
    return out


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader over a checked index: it never unpickles the index itself, and refuses
    byte entries (the only kind DCP reads with `weights_only=False`)."""

    def __init__(self, path: Path, metadata: Metadata | None = None):
        super().__init__(path)
        self.checked = metadata if metadata is not None else read_metadata(Path(path))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self.checked
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                raise refused(Path(self.path), f"holds a non-tensor entry {item.dest_index.fqn!r}")
        try:
            return super().read_data(plan, planner)
        except pickle.UnpicklingError as e:  # torch.load(weights_only=True) met something other than a tensor
            raise refused(Path(self.path), f"holds a payload that is not a plain tensor (torch's "
                                           f"weights-only loader: {_weights_only_reason(e)})") from None


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
