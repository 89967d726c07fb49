"""Reading records (JSONL, Parquet, Arrow, a saved Hugging Face dataset) with the `datasets` library,
in batches of the fields a format needs, in file order."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    datasets.logging.set_verbosity_error()
    return datasets


def _innermost(exc: BaseException) -> str:
    """`datasets` wraps the useful message (e.g. pyarrow's JSON parse error) in its causes."""
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def _no_records(source: Source) -> bool:
    """Empty files, which `datasets` fails on with obscure errors instead of giving no records."""
    if all(f.stat().st_size == 0 for f in source.files):
        return True
    if source.record_format == "parquet":
        import pyarrow.parquet as pq

        return sum(pq.ParquetFile(f).metadata.num_rows for f in source.files) == 0
    return False


def open_records(source: Source, cache_dir: Path, streaming: bool = False) -> Any:
    """A `datasets.Dataset` (memory-mapped Arrow) or, streaming, an `IterableDataset`.

    `datasets` converts JSON and Parquet to Arrow under cache_dir/hf-datasets (never ~/.cache)."""
    datasets = _import_datasets()
    if source.kind == "records" and _no_records(source):
        raise LoomError(f"data.source '{source.spec}' is empty (its files hold no records); give a dataset "
                        f"with at least one record")
    try:
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
        raise LoomError(f"could not read the records of data.source '{source.spec}': {_innermost(e)}; "
                        f"check that the files are valid {source.record_format or 'Arrow'}") from None


def column_names(ds: Any) -> list[str] | None:
    names = getattr(ds, "column_names", None)
    return list(names) if names is not None else None


def record_batches(ds: Any, fields: RecordFields, where: str,
                   batch: int = BATCH) -> Iterator[dict[str, list]]:
    """Batches {field: [values]} of the fields the format reads, in order; checks they exist."""
    names = column_names(ds)
    if names is None:  # a stream whose schema is known only once a record is read
        first = next(iter(ds), None)
        names = list(first) if first is not None else []
    if not names:
        raise LoomError(f"data.source '{where}' has no records; give a dataset with at least one")
    wanted = fields.needed(names, where)
    try:
        for values in ds.select_columns(wanted).iter(batch_size=batch):
            yield values
    except LoomError:
        raise
    except Exception as e:
        raise LoomError(f"could not read the records of data.source '{where}': {_innermost(e)}") from None
