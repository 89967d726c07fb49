"""What a run's data is, for a resume: each source (data.source, or each data.mix entry) by the
path it resolved to and a fingerprint of its content. A checkpoint's meta.json records them, and a
resume compares the fingerprints: the same file named by another (absolute or relative) path
continues, and a relative path that now, from another working folder, names other content is
refused instead of silently training on it.

The fingerprint reads no whole corpus: every file's name and size and its first and last 64 KiB,
the files in the order the source reads them (a moved folder is the same data).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from loom.config import DataConfig
from loom.data import sources
from loom.data.mix import parse_mix
from loom.errors import LoomError

SAMPLE = 64 << 10


def identity(d: DataConfig) -> list[dict]:
    """[{"spec", "path", "fingerprint"}] of each source, in the config's order."""
    listed = [spec for spec, _, _ in parse_mix(d.mix)] if d.mix else [d.source]
    return [_identity(spec, str(Path.cwd())) for spec in listed]


def check_out(d: DataConfig, run_dir: Path) -> None:
    """Before launch: a run directory inside a folder the run reads would add the run's own files
    (metrics.jsonl, checkpoints/) to its data, and every checkpoint's fingerprint would then fail."""
    listed = [(f"data.mix source '{spec}'", spec) for spec, _, _ in parse_mix(d.mix)] if d.mix else \
        [(f"data.source '{d.source}'", d.source)]
    for what, spec in listed:
        folder = sources.folder_holding(spec, run_dir)
        if folder is not None:
            raise LoomError(f"--out {run_dir} is inside {what}, a folder whose every file this run "
                            f"reads: the run's own files (metrics.jsonl, checkpoints) would join its data; "
                            f"pick an --out outside {folder}")


def _identity(spec: str, cwd: str) -> dict:
    files = sources.resolve(spec).files
    stamp = tuple((str(f), st.st_size, st.st_mtime_ns) for f in files for st in [f.stat()])
    return _fingerprinted(spec, cwd, stamp)


@functools.cache  # every checkpoint of a run records it: read the files once per place and content
def _fingerprinted(spec: str, cwd: str, stamp: tuple) -> dict:
    digest = hashlib.sha256()
    for name, size, _ in stamp:
        digest.update(f"{Path(name).name}:{size}\n".encode())
        with open(name, "rb") as fh:
            digest.update(fh.read(SAMPLE))
            fh.seek(max(size - SAMPLE, 0))
            digest.update(fh.read(SAMPLE))
    where = spec if spec == "stdlib" else str(Path(cwd, Path(spec).expanduser()))
    return {"spec": spec, "path": where, "fingerprint": digest.hexdigest()[:16]}


def check(saved: list[dict], now: list[dict], path: Path) -> None:
    """Refuse a resume whose sources hold other content than the checkpoint's (one line)."""
    if len(saved) != len(now):
        raise LoomError(f"cannot resume from {path}: it trained on {len(saved)} data source(s), this run "
                        f"gives {len(now)}; keep the checkpoint's data settings (its config is in "
                        f"{path / 'meta.json'}) or start a new run")
    for before, after in zip(saved, now):
        if before["fingerprint"] != after["fingerprint"]:
            now = f"'{after['spec']}'" + (f" ({after['path']})" if after["path"] != after["spec"] else "")
            raise LoomError(
                f"cannot resume from {path}: data source {now} holds other content (fingerprint "
                f"{after['fingerprint']}) than the checkpoint trained on, {before['path']} (fingerprint "
                f"{before['fingerprint']}); point data.source at the checkpoint's data (a relative path is "
                f"read from the working folder), or start a new run from its weights with "
                f"--set model.init_from={path}")
