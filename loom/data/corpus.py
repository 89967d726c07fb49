"""Corpus sources: the Python stdlib, text files/dirs/globs, or one pre-tokenized .bin file."""

from __future__ import annotations

import glob
import io
import itertools
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from loom.data.cache_files import write_cache
from loom.data.token_files import check_ids, open_npy
from loom.data.tokenizer import BPETokenizer, make_tokenizer
from loom.errors import ConfigError, LoomError
from loom.hf_config import MAX_VOCAB

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


def check_spec(source: str) -> None:
    """An empty or blank source names nothing: never the current directory (Path("") is ".")."""
    if not source.strip():
        raise LoomError(f"data.source = {source!r} names no file; {_WHAT_TO_GIVE} (an empty path is not "
                        f"read as the current directory)")


def _inside(files: list[Path], root: Path, source: str) -> list[Path]:
    """Files of a directory or glob source whose real path stays inside `root`: a folder someone
    gave you must not make loom read (and a model memorise) a file elsewhere, such as ~/.ssh/id_rsa.
    A Hugging Face cache snapshot (`datasets--org--name/snapshots/<rev>/`) links its files into the
    repository's `blobs/`: its bound is the repository folder."""
    bound = Path(os.path.realpath(root))
    if bound.parent.name == "snapshots" and bound.parent.parent.name.startswith(("datasets--", "models--")):
        bound = bound.parent.parent
    for path in files:
        target = Path(os.path.realpath(path))
        if not target.is_relative_to(bound):
            raise LoomError(f"data.source '{source}': {path} links outside {root} (to {target}); a directory "
                            f"or glob source reads only the files inside it: copy the file in, or name it in "
                            f"data.source (or a data.mix entry) itself")
    return files


def unreadable(path: Path, e: OSError) -> LoomError:
    """A source's file or folder loom may not read (its permissions, an I/O error) as one line naming
    it, not an OSError from deep inside a reader, or a rank."""
    what, mode = ("the folder ", "a+rx") if os.path.isdir(path) else ("", "a+r")
    return LoomError(f"{what}{path} cannot be read ({e.strerror or type(e).__name__}); make it readable "
                     f"(e.g. chmod {mode} '{path}'), or leave it out of the data source")


def _raise(e: OSError) -> None:
    raise e


def folder_files(root: Path, source: str) -> list[Path]:
    """A directory's files, sorted by path: hidden files and everything under hidden folders (.git,
    .ssh, .cache) skipped, linked folders not entered, linked files only if they stay inside. A folder
    it cannot list is refused (os.walk would skip it silently: training on part of the data)."""
    files = []
    try:
        for folder, dirs, names in os.walk(root, onerror=_raise):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            files += [Path(folder) / n for n in names
                      if not n.startswith(".") and (Path(folder) / n).is_file()]
    except OSError as e:
        raise unreadable(Path(e.filename or root), e) from None
    return _inside(sorted(files), root, source)


def glob_files(source: str) -> list[Path]:
    """The files a glob matches, sorted (glob skips hidden names), inside its fixed leading folder."""
    pattern = Path(os.path.expanduser(source))
    fixed = list(itertools.takewhile(lambda part: not glob.has_magic(part), pattern.parts))
    root = Path(*fixed) if fixed else Path(".")
    if "**" in pattern.parts:  # glob skips a folder it cannot list (training on part of the data)
        try:
            for _, dirs, _ in os.walk(root, onerror=_raise):
                dirs[:] = [d for d in dirs if not d.startswith(".")]
        except OSError as e:
            raise unreadable(Path(e.filename or root), e) from None
    files = sorted(Path(p) for p in glob.glob(str(pattern), recursive=True) if Path(p).is_file())
    return _inside(files, root, source)


def resolve_source(source: str, max_bytes: int = 8_000_000) -> list[Path] | Path:
    """Text sources resolve to a sorted list of files; a .bin token file resolves to its single Path.

    max_bytes caps only the "stdlib" corpus; the user's own files are never silently truncated.
    """
    if source == "stdlib":
        return stdlib_files(max_bytes)
    check_spec(source)
    path = Path(source).expanduser()
    if path.is_file():
        return path if path.suffix == ".bin" else [path]
    if path.is_dir():
        files = folder_files(path, source)
        if not files:
            raise LoomError(f"data.source '{source}' is a directory with no files; {_WHAT_TO_GIVE}")
    elif glob.has_magic(source):
        files = glob_files(source)
        if not files:
            raise LoomError(f"data.source '{source}' matched no files; {_WHAT_TO_GIVE}")
    elif path.exists():  # a FIFO would block the read forever, /dev/zero never end
        raise LoomError(f"data.source '{source}' is not a regular file (a pipe, device or socket); "
                        f"{_WHAT_TO_GIVE}")
    else:
        raise LoomError(f"data.source '{source}' does not exist; {_WHAT_TO_GIVE}")
    bins = [p for p in files if p.suffix == ".bin"]
    if bins:
        raise LoomError(f"data.source '{source}' includes .bin token files ({bins[0].name}); "
                        "give a single .bin file on its own, or only text files")
    return files


_BOMS = {b"\xff\xfe\x00\x00": "UTF-32", b"\x00\x00\xfe\xff": "UTF-32", b"\xff\xfe": "UTF-16",
         b"\xfe\xff": "UTF-16"}
_SAMPLE = 1 << 16  # bytes of a file looked at to tell text from binary


def _looks_utf16(sample: bytes) -> bool:
    """NUL bytes in every other place: ASCII text written as UTF-16 (without a byte-order mark)."""
    nuls = sorted((sample[0::2].count(0), sample[1::2].count(0)))
    return len(sample) >= 4 and nuls[1] > 0.4 * (len(sample) // 2) and nuls[0] < 0.05 * (len(sample) // 2)


def read_text(path: Path) -> str:
    """A text source's file as UTF-8 text. UTF-16 or binary bytes (an image, a .npy, random bytes)
    would train as byte soup, NUL being the byte tokenizer's EOS: refused in one line."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise unreadable(path, e) from None
    sample = data[:_SAMPLE]
    encoding = next((name for bom, name in _BOMS.items() if sample.startswith(bom)), None)
    if encoding is None and b"\0" in data and _looks_utf16(sample):
        encoding = "UTF-16"
    if encoding:
        raise LoomError(f"{path} is {encoding} text, which loom would train on as bytes with NULs between "
                        f"the letters; convert it to UTF-8 (e.g. iconv -f {encoding} -t UTF-8 FILE > NEW)")
    nul = data.find(b"\0")
    text = sample.decode("utf-8", errors="replace")
    if nul >= 0 or text.count("\ufffd") > 0.1 * max(len(text), 1):
        where = f"a NUL byte at byte {nul + 1}" if nul >= 0 else "most of its first bytes are not UTF-8"
        raise LoomError(f"{path} is not text ({where}): an image, an array or other binary file; a text "
                        f"source must be UTF-8 text: remove it, or name only the text files (a glob such as "
                        f"'*.txt')")
    return data.decode("utf-8", errors="replace")


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
    try:
        tokens = np.memmap(path, dtype=dtype, mode="r")
    except OSError as e:
        raise unreadable(path, e) from None
    top = int(tokens.max())
    if top >= MAX_VOCAB:  # no model has such a vocabulary: the bytes are not ids of this width
        raise LoomError(f"data.source '{path}' holds token id {top:,}, more than any model's vocabulary (at "
                        f"most {MAX_VOCAB:,}): it is likely not {bin_dtype} token ids; check data.bin_dtype "
                        f"(uint16 or uint32: the width it was written with) and that it holds token ids")
    if top >= vocab_size:
        raise LoomError(f"data.source '{path}' has token id {top} but the vocab size is {vocab_size}; "
                        f"set model.vocab_size to at least {top + 1} (or use the tokenizer, or model, the "
                        f"file's ids come from)")
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

    text = "\n".join(read_text(p) for p in resolved)
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
    A cache is derived data: one that is damaged (cut short, not an array, ids past the vocabulary,
    which would index out of the embedding mid-run) is a miss, made again and replaced atomically.
    """
    path = tokenizer.cache_path.with_suffix(".tokens.npy")
    if path.exists():
        again = "a damaged cache: loom tokenizes the corpus again"
        try:
            tokens = open_npy(path, again)
            check_ids(tokens, tokenizer.vocab_size, str(path), again)
            return tokens
        except LoomError as e:
            print(f"note: {e}", flush=True)  # on stdout, as the run's other news
    tokens = tokenizer.encode(text)
    buf = io.BytesIO()
    np.save(buf, tokens)
    write_cache(path, buf.getvalue())
    return tokens
