"""Writing loom's data caches (data.cache_dir, `loom data prepare --cache-dir`: trained BPE
tokenizers, token arrays, the `datasets` Arrow files): a cache folder loom may not write (read-only,
another user's, a full disk) is one line naming it and the setting, never an OSError from deep inside
a writer. The writes stay atomic (loom/files.py): a reader never sees half a cache file."""

from __future__ import annotations

import os
from pathlib import Path

from loom.errors import LoomError
from loom.files import atomic_write


def cache_unwritable(where: str | Path, e: OSError) -> LoomError:
    return LoomError(f"cannot write loom's data cache in {where} ({e.strerror or type(e).__name__}); set "
                     f"data.cache_dir (--cache-dir of loom data prepare) to a folder you can write to, e.g. "
                     f"--set data.cache_dir=~/.cache/loom")


def cache_error(e: BaseException, folder: Path) -> LoomError | None:
    """The cache message for an OSError about a path inside `folder`, raised by a library (`datasets`
    writes its Arrow cache there) or wrapped in another of its errors; None for any other error."""
    inside = folder.resolve()
    while e is not None:
        name = e.filename if isinstance(e, OSError) else None
        if isinstance(name, str | bytes) and Path(os.fsdecode(name)).resolve().is_relative_to(inside):
            return cache_unwritable(os.fsdecode(name), e)
        e = e.__cause__ or e.__context__
    return None


def write_cache(path: Path, data: bytes) -> None:
    try:
        atomic_write(path, data)
    except OSError as e:
        raise cache_unwritable(path.parent, e) from None
