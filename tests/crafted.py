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

from loom.train import checkpoint

KINDS = ("byte-entry", "wrong-dtype", "wrong-shape", "extra-entry", "pickled-payload", "metadata-global",
         "payload-outside")


class RunsCommand:
    """Unpickling this runs `touch MARKER` (what a malicious checkpoint would do, harmlessly)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


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
        (dest / "__9_0.distcp").write_bytes(pickle.dumps(RunsCommand(marker), protocol=2))
        _edit_index(dest, lambda m: _point_at(m, "model.norm.weight", "__9_0.distcp",
                                              (dest / "__9_0.distcp")))
    elif kind == "payload-outside":  # a payload file outside the checkpoint folder
        outside = dest.parent / "outside.distcp"
        shutil.copy(dest / "__0_0.distcp", outside)
        _edit_index(dest, lambda m: _point_at(m, "model.norm.weight", "../outside.distcp", None))
    elif kind == "metadata-global":
        (dest / ".metadata").write_bytes(_global_through_allowed_module(marker))
    return dest


def _point_at(metadata, name: str, relative_path: str, whole: Path | None) -> None:
    for index, info in metadata.storage_data.items():
        if index.fqn == name:
            length = whole.stat().st_size if whole is not None else info.length
            offset = 0 if whole is not None else info.offset
            metadata.storage_data[index] = _StorageInfo(relative_path, offset, length)
