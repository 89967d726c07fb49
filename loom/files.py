"""Writing files without losing anyone's: a reader never sees half of one (a temporary file,
then one rename, which replaces a symbolic link at the path instead of writing through it), appends
that refuse a link, and the marker by which loom knows a run directory is its own (the only kind
`--overwrite` may remove)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

from loom.errors import LoomError

# In every run directory loom makes: `--overwrite` replaces only a directory that carries it.
RUN_MARKER = ".loom-run"
# Locked (flock) by the launcher of the run training there, for as long as it trains (run_dir_lock)
RUN_LOCK = ".loom-lock"
# What a run directory holds besides the marker: every entry `loom train` writes there.
RUN_ENTRIES = frozenset({RUN_LOCK, "checkpoints", "config.toml", "memory.json", "metrics.jsonl", "plan.json",
                         "summary.json", "stopped.json", "logs", "traces", "tensorboard",
                         "deepspeed_config.json"})

_UMASK = os.umask(0)  # read once (os.umask can only be read by setting it), then restored
os.umask(_UMASK)


def atomic_write(path: Path, data: bytes | Callable[[Path], None], durable: bool = False,
                 inside: Path | None = None) -> None:
    """Write `data` (bytes, or a function that writes the given temporary path) to `path`.

    Concurrent readers see the old file or the new one, never a part; a symbolic link at `path` is
    replaced, its target untouched. `durable` also flushes the file and the rename to disk
    (checkpoints, exports: a power loss must not leave a torn file). `inside`: the folder (a run
    directory) below which no directory on the way to `path` may be a link.
    """
    path = Path(path)
    if inside is not None:
        _no_link_below(Path(inside), path)
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


def open_append(path: Path, inside: Path | None = None) -> IO[str]:
    """`path` opened to append text, line-buffered; a symbolic link there is refused, not followed."""
    path = Path(path)
    if inside is not None:
        _no_link_below(Path(inside), path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    except OSError:
        if os.path.islink(path):
            raise LoomError(f"{path} is a symbolic link; loom appends only to a file of its own: remove the "
                            f"link") from None
        raise
    return os.fdopen(fd, "a", buffering=1, encoding="utf-8")


def _no_link_below(folder: Path, path: Path) -> None:
    """No directory between `folder` and `path` is a symbolic link (a planted one would send the
    write elsewhere)."""
    try:
        parts = path.parent.relative_to(folder).parts
    except ValueError:
        return
    at = folder
    for part in parts:
        at = at / part
        if at.is_symlink():
            raise LoomError(f"{at} is a symbolic link; loom writes into {folder} only, never through a link: "
                            f"remove the link")


# The run directory's entries that are folders; every other entry of RUN_ENTRIES is a file
RUN_FOLDERS = frozenset({"checkpoints", "logs", "traces", "tensorboard"})


def check_run_entries(run_dir: Path) -> None:
    """Each entry loom writes into an existing run directory is of its kind: a metrics.jsonl (or
    summary.json …) that is a folder, or a traces that is a file, would fail the run at its end."""
    for name in sorted(RUN_ENTRIES):
        path = Path(run_dir) / name
        folder = name in RUN_FOLDERS
        if (path.exists() or path.is_symlink()) and path.is_dir() != folder:
            kind = "a file" if path.is_file() else "a folder" if path.is_dir() else "not a regular file"
            raise LoomError(f"{path} is {kind}, where loom writes the run's {name} "
                            f"({'a folder' if folder else 'a file'}); move it aside, or pick another --out")


def check_writable(folder: Path, what: str, other: str = "pick another --out") -> None:
    """`folder` takes a new file (made and removed at once): learnt before the work, not when its
    first checkpoint, record or output is written."""
    try:
        fd, name = tempfile.mkstemp(dir=folder, prefix=".tmp-probe.")
    except OSError as e:
        raise LoomError(f"cannot write into {what} {folder}: {e.strerror}; make it writable "
                        f"(chmod u+w {folder}), or {other}") from None
    os.close(fd)
    os.unlink(name)


def lock_run_dir(run_dir: Path) -> int:
    """Lock `run_dir` for this process's run (an exclusive flock of its RUN_LOCK file, freed by
    release_run_dir or when the process ends, however it ends): a second `loom train` there would
    delete this run's checkpoint in progress with the stale writes it cleans up, and interleave its
    records with this run's. Returns the lock's file descriptor."""
    import fcntl

    fd = os.open(Path(run_dir) / RUN_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise LoomError(f"run directory {run_dir} is in use: another loom train (process {holder}) is "
                        f"training there; wait for it to end, or pick another --out") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def release_run_dir(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)  # (closing the descriptor frees its flock)


def is_loom_run(run_dir: Path) -> bool:
    """Whether `run_dir` is a directory loom made (it carries the run marker as a plain file)."""
    marker = Path(run_dir) / RUN_MARKER
    return marker.is_file() and not marker.is_symlink()


def claim_run_dir(run_dir: Path) -> None:
    """Make `run_dir` (if need be) and mark it as loom's, when it is new or empty: a folder that
    already holds files loom did not mark stays unmarked, so --overwrite will never remove it."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not is_loom_run(run_dir) and not any(run_dir.iterdir()):
        atomic_write(run_dir / RUN_MARKER, b"a loom run directory: loom train --overwrite may replace it\n")
