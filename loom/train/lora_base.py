"""The base model a LoRA run's adapters belong to. Its checkpoints hold the adapters alone, so the
base must be the same one when they are resumed or exported: meta.json records the base's path
and a fingerprint, checked against the base of the run that reads them.

The fingerprint hashes what identifies a model's files without reading all of a 140 GB model:
every weight file's name, size, safetensors header (tensor names, dtypes, shapes, offsets) and its
first and last MiB, and config.json whole. A base loom initialized itself (no model.init_from) is
its model config and seed.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import struct
from pathlib import Path

from loom.config import Config
from loom.errors import LoomError

WEIGHT_PATTERNS = ("config.json", "*.safetensors", "*.bin", "*.distcp", "meta.json")
SAMPLE = 1 << 20


def identity(cfg: Config) -> dict | None:
    """{"path", "fingerprint"} of this run's base; None without LoRA."""
    if cfg.lora.rank is None:
        return None
    if cfg.model.init_from:
        path = Path(cfg.model.init_from).expanduser().absolute()
        return {"path": str(path), "fingerprint": fingerprint(path)}
    doc = json.dumps({"model": dataclasses.asdict(cfg.model), "seed": cfg.train.seed}, sort_keys=True)
    return {"path": "", "fingerprint": hashlib.sha256(doc.encode()).hexdigest()[:16]}


def fingerprint(path: Path) -> str:
    return _fingerprint(path, path.stat().st_mtime_ns)


@functools.cache  # a run's checkpoints record it each time: read the files once
def _fingerprint(path: Path, mtime_ns: int) -> str:
    """The hash of a model file or folder's weights (see the module's docstring)."""
    files = [path] if path.is_file() else sorted({f for p in WEIGHT_PATTERNS for f in path.glob(p)
                                                  if f.is_file()})
    digest = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        digest.update(f"{f.name}:{size}\n".encode())
        with open(f, "rb") as fh:
            if f.name.endswith(".json"):
                digest.update(fh.read())
                continue
            head = fh.read(8)
            if f.suffix == ".safetensors" and len(head) == 8:
                (n,) = struct.unpack("<Q", head)
                digest.update(fh.read(min(n, size)))
            digest.update(fh.read(SAMPLE))
            fh.seek(max(size - SAMPLE, 0))
            digest.update(fh.read(SAMPLE))
    return digest.hexdigest()[:16]


def describe(base: dict) -> str:
    where = base.get("path") or "loom's own initialization"
    return f"{where} (fingerprint {base.get('fingerprint')})"


def check(saved: dict | None, now: dict | None, path: Path, what: str = "resume from") -> None:
    """Refuse adapters trained on another base, in one line (the same files moved are the same base)."""
    if saved == now or (saved is not None and now is not None
                        and saved.get("fingerprint") == now.get("fingerprint")):
        return
    if saved is None or now is None:
        lora = "holds adapters alone" if saved is not None else "holds a full model, not adapters"
        raise LoomError(f"cannot {what} {path}: it {lora}, and this run {'has no' if now is None else 'has'} "
                        f"lora.rank; keep the checkpoint's lora settings (its config is in "
                        f"{path / 'meta.json'}) or start a new run")
    raise LoomError(f"cannot {what} {path}: its adapters were trained on the base {describe(saved)}, and "
                    f"this run's base is {describe(now)}; set model.init_from to the checkpoint's base, or "
                    f"start a new run")
