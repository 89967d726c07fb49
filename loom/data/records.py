"""Reading records (JSONL, Parquet, Arrow, a saved Hugging Face dataset) with the `datasets` library,
in batches of the fields a format needs, in file order.

The library's errors are translated where they enter: when it cannot read a JSON file, loom reads
the file itself to name the first bad line (not UTF-8, not JSON, not an object, a field whose type
changes); a record refused later is named by its file and line (`record_places`).
"""

from __future__ import annotations

import functools
import gzip
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loom.checked import cause
from loom.data.cache_files import cache_error
from loom.data.sources import Source
from loom.errors import ConfigError, LoomError

BATCH = 1000  # records per batch: large enough for batch encoding, small enough to stay in memory


@dataclass(frozen=True)
class RecordFields:
    """Which fields of a record hold the text (format text) or the example (format sft)."""

    format: str = "text"
    text: str = "text"
    prompt: str = "prompt"
    completion: str = "completion"
    messages: str = "messages"

    def needed(self, available: list[str], where: str) -> list[str]:
        """The fields this format reads from records that have `available`; one line if they lack them."""
        have = ", ".join(available) or "none"
        if self.format == "text":
            if self.text not in available:
                raise ConfigError(f"the records of {where} have no field '{self.text}' (they have: {have}); "
                                  f"set data.text_field (or the data.mix entry's text_field) to the text's "
                                  f"field")
            return [self.text]
        if self.messages in available:
            return [self.messages]
        if self.completion in available:
            return [self.prompt, self.completion] if self.prompt in available else [self.completion]
        raise ConfigError(f"data.format = 'sft' needs records with a '{self.completion}' field (and "
                          f"'{self.prompt}') or a '{self.messages}' list, but the records of {where} have: "
                          f"{have}; set data.completion_field / data.prompt_field / data.messages_field")


def _import_datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise LoomError("reading JSONL, Parquet or Arrow records needs the datasets package; run "
                        "`pip install datasets` (or `pip install loom[data]`)") from None
    datasets.disable_progress_bars()  # loom prints its own progress; theirs would flood the log
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors reach the user translated, once
    return datasets


def json_kind(value: Any) -> str:
    """A value's kind in a record, as JSON names it: "a string", "a number", "an object", …"""
    kinds = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list",
             dict: "an object", type(None): "null"}
    return kinds.get(type(value), f"a {type(value).__name__}")


def _no_records(source: Source) -> bool:
    """Empty files, which `datasets` fails on with obscure errors instead of giving no records."""
    if all(f.stat().st_size == 0 for f in source.files):
        return True
    if source.record_format == "parquet":
        import pyarrow.parquet as pq

        return sum(pq.ParquetFile(f).metadata.num_rows for f in source.files) == 0
    return False


# A line holding only `null`: pyarrow's JSON reader (26) crashes the process (a segfault, no
# exception) on a block that starts with one, so JSON files are searched for it first (~300 MB/s,
# once a process and file version).
_BARE_NULL = re.compile(rb"(?:^|\n)[ \t\r]*null[ \t\r]*(?=\n|$)")


def _open(path: Path) -> Any:
    return gzip.open(path) if path.name.endswith(".gz") else path.open("rb")


@functools.lru_cache(maxsize=4096)
def _bare_null_in(path: Path, size: int, mtime_ns: int) -> int | None:
    """The number of the first line of a JSON file that holds a bare `null`, or None."""
    before, carry = 0, b""
    with _open(path) as f:
        while True:
            chunk = f.read(1 << 24)
            data = carry + chunk
            cut = data.rfind(b"\n") + 1 if chunk else len(data)  # whole lines; at the end, the rest
            head, carry = data[:cut], data[cut:]
            found = _BARE_NULL.search(head)
            if found:
                start = found.start() + (head[found.start():found.start() + 1] == b"\n")
                return before + head.count(b"\n", 0, start) + 1
            before += head.count(b"\n")
            if not chunk:
                return None


# pyarrow's JSON reader (26) overflows its stack (a segfault) on a record nested ~20,000 deep; real
# records nest a few levels.
MAX_DEPTH = 1000
_STRING = re.compile(rb'"(?:[^"\\\n]|\\.)*"')  # a JSON string, whose brackets are text


def _depth(line: bytes) -> int:
    """How deep a JSON line nests lists and objects (brackets inside strings left out)."""
    codes = np.frombuffer(_STRING.sub(b"", line), dtype=np.uint8)
    steps = np.isin(codes, (ord("["), ord("{"))).astype(np.int64) - np.isin(codes, (ord("]"), ord("}")))
    return int(np.cumsum(steps).max(initial=0))


def _whole_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(lines before, a chunk of whole lines) of a file, 16 MiB at a time."""
    before, carry = 0, b""
    with _open(path) as f:
        while True:
            chunk = f.read(1 << 24)
            data = carry + chunk
            cut = data.rfind(b"\n") + 1 if chunk else len(data)
            head, carry = data[:cut], data[cut:]
            yield before, head
            before += head.count(b"\n")
            if not chunk:
                return


@functools.lru_cache(maxsize=4096)
def _too_deep_in(path: Path, size: int, mtime_ns: int) -> int | None:
    """The number of the first line of a JSON file nested deeper than MAX_DEPTH, or None; only a
    line with that many brackets is measured (a chunk with fewer is passed over at once)."""
    for before, head in _whole_lines(path):
        if head.count(b"[") + head.count(b"{") < MAX_DEPTH:
            continue
        for number, line in enumerate(head.split(b"\n"), before + 1):
            if line.count(b"[") + line.count(b"{") > MAX_DEPTH and _depth(line) > MAX_DEPTH:
                return number
    return None


def _check_json(source: Source) -> None:
    for path in source.files:
        try:
            st = path.stat()
            line = _bare_null_in(path, st.st_size, st.st_mtime_ns)
            deep = _too_deep_in(path, st.st_size, st.st_mtime_ns) if line is None else None
        except (OSError, EOFError) as e:  # gzip's BadGzipFile is an OSError
            raise LoomError(f"{path} is not a readable json file ({cause(e)}); fix or remove it") from None
        if line is not None:
            raise LoomError(f"{path} line {line} is null, not a JSON object (a record); fix or remove it")
        if deep is not None:
            raise LoomError(f"{path} line {deep} nests lists or objects more than {MAX_DEPTH} deep, which "
                            f"the JSON reader cannot take (it would crash); fix or remove the record")


def _check_parquet(source: Source) -> None:
    """Every file of a Parquet source gives each column one type: `datasets` would cast another
    file's integers to the first file's strings and train on them as text."""
    import pyarrow.parquet as pq

    first: dict[str, tuple[Any, Path]] = {}
    for path in source.files:
        for column in pq.read_schema(path):
            seen = first.setdefault(column.name, (column.type, path))
            if seen[0] != column.type:
                raise LoomError(f"{path}: column '{column.name}' is {column.type}, but {seen[1]} has it as "
                                f"{seen[0]}; every file of a source must give a column one type: fix or "
                                f"remove {path.name}")


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of a JSON Lines file's non-blank lines (the library skips blank ones)."""
    with _open(path) as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                yield number, line


def _is_array(path: Path) -> bool:
    with _open(path) as f:
        return f.read(64).lstrip()[:1] == b"["


def _bad_line(path: Path) -> str | None:
    """The first line of a JSON Lines file the library cannot take as a record, said in words."""
    if _is_array(path):
        return None  # one JSON document: the library's own message says where
    kinds: dict[str, tuple[str, int]] = {}  # a field's first type, and where it was seen
    for number, line in _lines(path):
        try:
            record = json.loads(line.decode("utf-8").rstrip("\r\n"))
        except UnicodeDecodeError as e:
            return f"{path} line {number} is not UTF-8 text (byte {e.start + 1} of the line)"
        except ValueError as e:
            return f"{path} line {number} is not valid JSON ({e})"
        if not isinstance(record, dict):
            return f"{path} line {number} is {json_kind(record)}, not a JSON object (a record)"
        for key, value in record.items():
            kind = json_kind(value)
            first = kinds.setdefault(key, (kind, number))
            if value is not None and first[0] not in (kind, "null"):
                return (f"{path} line {number}: '{key}' is {kind}, but line {first[1]} has {first[0]}; a "
                        f"field must have one type in every record")
    return None


def _what_is_broken(source: Source) -> str | None:
    """Which file (and line) of a source the library could not read, found by reading it here."""
    import pyarrow.parquet as pq

    for path in source.files:
        try:
            if source.record_format == "json":
                found = _bad_line(path)
                if found:
                    return found
            elif source.record_format == "parquet":
                pq.ParquetFile(path).read()
        except Exception as e:  # OSError, gzip's BadGzipFile, pyarrow's ArrowInvalid, …
            return f"{path} is not a readable {source.record_format} file ({cause(e)})"
    return None


def _unreadable(source: Source, error: BaseException) -> LoomError:
    found = _what_is_broken(source) if source.kind == "records" else None
    if found:
        return LoomError(f"{found}; fix or remove it")
    return LoomError(f"could not read the records of data.source '{source.spec}' ({cause(error)}); check "
                     f"that the files are valid {source.record_format or 'Arrow'}")


def open_records(source: Source, cache_dir: Path, streaming: bool = False) -> Any:
    """A `datasets.Dataset` (memory-mapped Arrow) or, streaming, an `IterableDataset`.

    `datasets` converts JSON and Parquet to Arrow under cache_dir/hf-datasets (never ~/.cache)."""
    datasets = _import_datasets()
    try:
        if source.record_format == "json":
            _check_json(source)
        if source.record_format == "parquet" and source.kind == "records":
            _check_parquet(source)
        if source.kind == "records" and _no_records(source):
            raise LoomError(f"data.source '{source.spec}' is empty (its files hold no records); give a "
                            f"dataset with at least one record")
        if source.kind == "saved":
            ds = datasets.load_from_disk(str(source.folder))
            if isinstance(ds, datasets.DatasetDict):
                if "train" not in ds:
                    raise LoomError(f"data.source '{source.spec}' is a saved DatasetDict without a 'train' "
                                    f"split (it has {', '.join(ds)}); save the split to train on")
                ds = ds["train"]
            return ds.to_iterable_dataset() if streaming else ds
        return datasets.load_dataset(source.record_format, data_files=[str(f) for f in source.files],
                                     split="train", cache_dir=str(cache_dir / "hf-datasets"),
                                     streaming=streaming)
    except LoomError:
        raise
    except Exception as e:  # malformed files surface as many exception types
        failed = e
    # A cache folder loom may not write is not the records' fault (outside the handler: no chained context).
    raise cache_error(failed, cache_dir) or _unreadable(source, failed) from None


def record_places(source: Source) -> Callable[[int], str]:
    """Where record i (from 0) of a source is, for messages (`…/a.jsonl line 7`, `row 7 of
    …/b.parquet`); found only when asked, by counting the records of its files in order."""
    def place(index: int) -> str:
        i = index
        try:
            for path in source.files:
                if source.kind == "text":
                    count = 1
                elif source.record_format == "parquet":
                    import pyarrow.parquet as pq

                    count = pq.ParquetFile(path).metadata.num_rows
                elif source.record_format == "json" and not _is_array(path):
                    for number, _ in _lines(path):
                        if i == 0:
                            return f"{path} line {number}"
                        i -= 1
                    continue
                else:
                    break
                if i < count:
                    return str(path) if source.kind == "text" else f"row {i + 1} of {path}"
                i -= count
        except Exception:  # noqa: BLE001 - only a message is being made: say less
            pass
        return f"record {index + 1} of {source.spec}"
    return place


def column_names(ds: Any) -> list[str] | None:
    names = getattr(ds, "column_names", None)
    return list(names) if names is not None else None


def record_batches(ds: Any, fields: RecordFields, source: Source,
                   batch: int = BATCH) -> Iterator[dict[str, list]]:
    """Batches {field: [values]} of the fields the format reads, in order; checks they exist."""
    try:
        names = column_names(ds)
        if names is None:  # a stream whose schema is known only once a record is read
            first = next(iter(ds), None)
            names = list(first) if first is not None else []
        if not names:
            raise LoomError(f"data.source '{source.spec}' has no records; give a dataset with at least one")
        wanted = fields.needed(names, source.spec)
        for values in ds.select_columns(wanted).iter(batch_size=batch):
            yield values
        return
    except LoomError:
        raise
    except Exception as e:  # a stream meets a damaged file only when it reaches it
        failed = e
    raise _unreadable(source, failed) from None
