"""Writing files so that a reader never sees half of one: a temporary file, then one rename."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

_UMASK = os.umask(0)  # read once (os.umask can only be read by setting it), then restored
os.umask(_UMASK)


def atomic_write(path: Path, data: bytes | Callable[[Path], None], durable: bool = False) -> None:
    """Write `data` (bytes, or a function that writes the given temporary path) to `path`.

    Concurrent readers see the old file or the new one, never a part. `durable` also flushes the
    file and the rename to disk (checkpoints, exports: a power loss must not leave a torn file).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".tmp-{path.name}.")
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as f:
            if isinstance(data, bytes):
                f.write(data)
        if callable(data):
            data(tmp)
        # mkstemp's file is private; the result is an ordinary file, as open() makes
        os.chmod(tmp, 0o666 & ~_UMASK)
        if durable:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (where the platform has directory handles)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
