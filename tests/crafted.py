"""Crafted checkpoints: a real loom checkpoint altered the way an attacker (or a broken tool) would.

Every kind that could run code names a marker file its payload would create; a test asserts the
marker never appears. The source checkpoint is read with loom's own safe reader; the crafted one
is written with DCP itself (or by editing DCP's index), so it is exactly what DCP would load.
"""

from __future__ import annotations

import os
import pickle
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from loom.train import checkpoint


def _entry(metadata, name: str = "model.norm.weight"):
    return metadata.state_dict_metadata[name]


def _storage_key(metadata, name: str = "model.norm.weight"):
    return next(k for k in metadata.storage_data if k.fqn == name)


def _chunks(*rows: tuple[int, int]):
    """Chunks of tok_embeddings.weight [256, 64] holding rows [start, stop)."""
    return [ChunkStorageMetadata(torch.Size([a, 0]), torch.Size([b - a, 64])) for a, b in rows]


def _same_bytes(metadata) -> None:
    """norm.weight's payload pointed at the bytes of another entry of its dtype and shape."""
    other = metadata.storage_data[_storage_key(metadata, "model.layers.0.attention_norm.weight")]
    metadata.storage_data[_storage_key(metadata)] = other


# Edits of DCP's index that leave some element of a tensor without a payload, or a payload without
# its place: loading must refuse each, never fill a tensor from memory no payload wrote.
INDEX_EDITS = {
    "chunks-empty": lambda m: _entry(m).chunks.clear(),
    "chunks-overlap": lambda m: setattr(_entry(m, "model.tok_embeddings.weight"), "chunks",
                                        _chunks((0, 160), (96, 256))),
    "chunks-misplaced": lambda m: setattr(_entry(m, "model.tok_embeddings.weight"), "chunks",
                                          _chunks((0, 128), (64, 192))),  # as many rows, one gap, one overlap
    "chunk-outside": lambda m: setattr(_entry(m).chunks[0], "offsets", torch.Size([1])),
    "storage-missing": lambda m: m.storage_data.pop(_storage_key(m)),
    "entry-no-properties": lambda m: delattr(_entry(m), "properties"),
    "size-wrong-type": lambda m: setattr(_entry(m), "size", "64"),
    "payload-shared": _same_bytes,
    "payload-short": lambda m: m.storage_data.__setitem__(
        _storage_key(m), _StorageInfo("__0_0.distcp", m.storage_data[_storage_key(m)].offset, 100)),
}
KINDS = ("byte-entry", "wrong-dtype", "wrong-shape", "extra-entry", "pickled-payload", "metadata-global",
         "payload-outside", *INDEX_EDITS)


class RunsCommand:
    """Unpickling this runs `touch MARKER` (what a malicious checkpoint would do, harmlessly)."""

    def __init__(self, marker: Path, pad: int = 0):
        self.marker, self.pad = str(marker), pad

    def __reduce__(self):  # the padding (a shell comment) makes the payload as long as the tensor it replaces
        return (os.system, (f"touch {self.marker}" + (f" #{'x' * self.pad}" if self.pad else ""),))


def _global_through_allowed_module(marker: Path) -> bytes:
    """A pickle (protocol 4) whose global is `os.system`, named through a module the old allow-list
    admitted: `torch.distributed.checkpoint.filesystem` + the dotted name `os.system`."""
    def text(s: str) -> bytes:
        b = s.encode()
        return pickle.SHORT_BINUNICODE + bytes([len(b)]) + b

    return (pickle.PROTO + bytes([4]) + text("torch.distributed.checkpoint.filesystem") + text("os.system")
            + pickle.STACK_GLOBAL + text(f"touch {marker}") + pickle.TUPLE1 + pickle.REDUCE + pickle.STOP)


def _edit_index(step: Path, edit) -> None:
    """Rewrite DCP's index (our own test file, so plain pickle is fine here)."""
    with open(step / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    edit(metadata)
    with open(step / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def craft(kind: str, source: Path, dest: Path, marker: Path) -> Path:
    """`dest` (a step_N folder): the checkpoint at `source`, altered as `kind` says."""
    assert kind in KINDS, kind
    state = checkpoint.read_tensors(source, "")
    adam_step = next(k for k in state if k.startswith("optim.") and k.endswith(".step"))
    if kind == "byte-entry":  # a non-tensor entry in place of Adam's step: DCP would torch.load it unsafely
        state[adam_step] = RunsCommand(marker)
    elif kind == "wrong-dtype":
        state["model.norm.weight"] = state["model.norm.weight"].double()
    elif kind == "wrong-shape":
        state["model.norm.weight"] = torch.cat([state["model.norm.weight"]] * 2)
    elif kind == "extra-entry":
        state["model.extra.weight"] = torch.zeros(4)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=dest, no_dist=True)
    for f in source.glob("*.json"):
        shutil.copy(f, dest / f.name)
    if kind == "pickled-payload":  # a tensor entry whose bytes are a pickle of a callable
        (dest / "__9_0.distcp").write_bytes(pickle.dumps(RunsCommand(marker, pad=4096), protocol=2))
        _edit_index(dest, lambda m: _point_at(m, "model.norm.weight", "__9_0.distcp",
                                              (dest / "__9_0.distcp")))
    elif kind == "payload-outside":  # a payload file outside the checkpoint folder
        outside = dest.parent / "outside.distcp"
        shutil.copy(dest / "__0_0.distcp", outside)
        _edit_index(dest, lambda m: _point_at(m, "model.norm.weight", "../outside.distcp", None))
    elif kind == "metadata-global":
        (dest / ".metadata").write_bytes(_global_through_allowed_module(marker))
    elif kind in INDEX_EDITS:
        _edit_index(dest, INDEX_EDITS[kind])
    return dest


def _point_at(metadata, name: str, relative_path: str, whole: Path | None) -> None:
    for index, info in metadata.storage_data.items():
        if index.fqn == name:
            length = whole.stat().st_size if whole is not None else info.length
            offset = 0 if whole is not None else info.offset
            metadata.storage_data[index] = _StorageInfo(relative_path, offset, length)
