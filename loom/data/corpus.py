"""Corpus sources: the Python stdlib, text files/dirs/globs, or one pre-tokenized .bin file."""

from __future__ import annotations

import glob
import io
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from loom.data.tokenizer import BPETokenizer, make_tokenizer
from loom.errors import ConfigError, LoomError
from loom.files import atomic_write

_WHAT_TO_GIVE = 'give a text file, a directory, a glob, a .bin token file or "stdlib"'
# Stdlib folders that are not representative source (tests, IDE, third-party packages).
_STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
_BIN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def _walk_sorted(root: Path) -> Iterator[Path]:
    """Depth-first, entries sorted by name at every level, so the order never depends on the filesystem."""
    with os.scandir(root) as it:
        entries = sorted(it, key=lambda e: e.name)
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            if entry.name not in _STDLIB_SKIP:
                yield from _walk_sorted(Path(entry.path))
        elif entry.name.endswith(".py") and entry.is_file():
            yield Path(entry.path)


def stdlib_files(max_bytes: int = 8_000_000) -> list[Path]:
    """The stdlib's own .py files in sorted order, stopping before the total would pass max_bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    total = 0
    for path in _walk_sorted(root):
        size = path.stat().st_size
        if files and total + size > max_bytes:
            break  # stop (not skip) so the cut is simple and fast
        files.append(path)
        total += size
    if not files:
        raise LoomError(f"data.source 'stdlib' found no .py files under {root}; "
                        "give a text file, a directory, a glob or a .bin token file instead")
    return files


def resolve_source(source: str, max_bytes: int = 8_000_000) -> list[Path] | Path:
    """Text sources resolve to a sorted list of files; a .bin token file resolves to its single Path.

    max_bytes caps only the "stdlib" corpus; the user's own files are never silently truncated.
    """
    if source == "stdlib":
        return stdlib_files(max_bytes)
    path = Path(source).expanduser()
    if path.is_file():
        return path if path.suffix == ".bin" else [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        if not files:
            raise LoomError(f"data.source '{source}' is a directory with no files; {_WHAT_TO_GIVE}")
    elif glob.has_magic(source):
        files = sorted(Path(p) for p in glob.glob(os.path.expanduser(source), recursive=True)
                       if Path(p).is_file())
        if not files:
            raise LoomError(f"data.source '{source}' matched no files; {_WHAT_TO_GIVE}")
    else:
        raise LoomError(f"data.source '{source}' does not exist; {_WHAT_TO_GIVE}")
    bins = [p for p in files if p.suffix == ".bin"]
    if bins:
        raise LoomError(f"data.source '{source}' includes .bin token files ({bins[0].name}); "
                        "give a single .bin file on its own, or only text files")
    return files


def load_bin(path: Path, bin_dtype: str, vocab_size: int) -> np.ndarray:
    """A .bin file of token ids, memory-mapped, checked to hold only ids below vocab_size."""
    if bin_dtype not in _BIN_DTYPES:
        raise ConfigError(f"data.bin_dtype '{bin_dtype}' is not supported; use 'uint16' or 'uint32'")
    dtype = np.dtype(_BIN_DTYPES[bin_dtype])
    size = path.stat().st_size
    if size == 0:
        raise LoomError(f"data.source '{path}' is empty (0 bytes); give a .bin file of {bin_dtype} token ids")
    if size % dtype.itemsize:
        raise LoomError(f"data.source '{path}' has {size} bytes, not a multiple of {dtype.itemsize} "
                        f"for {bin_dtype}; check data.bin_dtype")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    top = int(tokens.max())
    if top >= vocab_size:
        raise LoomError(f"data.source '{path}' has token id {top} but the vocab size is {vocab_size}; "
                        f"set data.bpe_vocab_size (the vocab of .bin tokens) and model.vocab_size "
                        f"to at least {top + 1}")
    return tokens


def load_tokens(source: str, tokenizer_kind: str = "byte", vocab_size: int = 256, bin_dtype: str = "uint16",
                cache_dir: Path | None = None, max_bytes: int = 8_000_000) -> tuple[np.ndarray, int]:
    """Return (1-D token array, vocab size of the tokenizer that made it).

    A .bin source is memory-mapped as is, and the given vocab_size is trusted (after a range check).
    "auto" is byte here (no model folder); records, tokenizer.json files and mixes are
    loom/data/run_data.py's build_run_data.
    """
    if tokenizer_kind == "auto":
        tokenizer_kind = "byte"
    if tokenizer_kind not in ("byte", "bpe"):
        raise ConfigError(f"data.tokenizer '{tokenizer_kind}' is unknown; use 'byte' or 'bpe'")
    resolved = resolve_source(source, max_bytes)
    if isinstance(resolved, Path):
        return load_bin(resolved, bin_dtype, vocab_size), vocab_size

    text = "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in resolved)
    if not text.strip():
        raise LoomError(f"data.source '{source}' is empty (no text in {len(resolved)} file(s)); "
                        f"{_WHAT_TO_GIVE} with some content")
    tokenizer = make_tokenizer(tokenizer_kind, resolved, vocab_size, cache_dir)
    if isinstance(tokenizer, BPETokenizer):
        return _encode_cached(tokenizer, text), tokenizer.vocab_size
    return tokenizer.encode(text), tokenizer.vocab_size


def _encode_cached(tokenizer: BPETokenizer, text: str) -> np.ndarray:
    """BPE-encoding a corpus takes seconds per rank, so the ids are cached next to the tokenizer.

    The tokenizer's cache key already covers the file list, sizes and mtimes, so it keys the ids too.
    """
    path = tokenizer.cache_path.with_suffix(".tokens.npy")
    if path.exists():
        return np.load(path, mmap_mode="r", allow_pickle=False)
    tokens = tokenizer.encode(text)
    buf = io.BytesIO()
    np.save(buf, tokens)
    atomic_write(path, buf.getvalue())
    return tokens
