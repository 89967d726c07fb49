"""Documents tokenized: each one's ids followed by the tokenizer's EOS, laid end to end (packing:
windows are later cut across document edges). For SFT, a loss mask beside the ids.

Tokenizing a source is cached on disk (cache_dir/tokens), keyed by what could change the ids, so
every rank memory-maps the arrays the launcher wrote instead of tokenizing again; a cache entry is
checked when it is read (its meta.json typed, the arrays' lengths as it says, every id below the
vocabulary), and a damaged one is one line saying to delete it.

A record refused here is named by its file and line (records.record_places), found only then.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loom.checked import BadFile, Fields, read_json
from loom.data import sft
from loom.data.cache_files import write_cache
from loom.data.chat_template import ChatTemplate
from loom.data.corpus import read_text
from loom.data.records import RecordFields, json_kind, open_records, record_batches, record_places
from loom.data.sources import Source
from loom.data.stream import TokenStream
from loom.data.token_files import check_ids, check_starts, open_npy
from loom.data.tokenizer import DocumentTokenizer, token_dtype
from loom.errors import LoomError

_CACHE_FORMAT = "loom-docs-v2"  # bump when the layout or the tokenizing rules change
TEXT_FILES_PER_BATCH = 64

Document = tuple[np.ndarray, np.ndarray | None]  # ids ending in EOS; SFT: 1 where the loss applies


@dataclass
class Documents:
    """One source's documents. Several pieces for a prepared folder (its shards), else one."""

    name: str
    pieces: list[np.ndarray]  # token ids
    doc_starts: list[np.ndarray]  # per piece: the offset where each of its documents starts
    masks: list[np.ndarray] | None = None  # SFT: per piece, uint8 1 where the loss applies
    vocab_size: int = 0
    tokenizer: str = ""  # the tokenizer's fingerprint

    @property
    def num_docs(self) -> int:
        return sum(len(s) for s in self.doc_starts)

    @property
    def num_tokens(self) -> int:
        return sum(len(p) for p in self.pieces)

    def table(self) -> np.ndarray:
        """Every document as a row (piece, start, stop), in order."""
        rows = []
        for p, (piece, starts) in enumerate(zip(self.pieces, self.doc_starts)):
            starts = np.asarray(starts, dtype=np.int64)
            stops = np.concatenate((starts[1:], [len(piece)])).astype(np.int64)
            rows.append(np.stack([np.full(len(starts), p, dtype=np.int64), starts, stops], axis=1))
        return np.concatenate(rows) if rows else np.zeros((0, 3), dtype=np.int64)

    def streams(self) -> tuple[TokenStream, TokenStream | None]:
        masks = TokenStream(self.masks) if self.masks is not None else None
        return TokenStream(self.pieces), masks


class _Where:
    """Record i's place (`…/a.jsonl line 7`), worked out only if a message says it."""

    def __init__(self, places: Callable[[int], str], i: int) -> None:
        self.places, self.i = places, i

    def __str__(self) -> str:
        return self.places(self.i)


def encode_batches(batches: Iterable[dict[str, list]], tokenizer: DocumentTokenizer, fields: RecordFields,
                   places: Callable[[int], str], template: ChatTemplate | None = None,
                   first: int = 0) -> Iterator[Document]:
    """Each record of each batch as a document: text + EOS, or an SFT example + EOS with its mask.

    `template` is the chat template (SFT messages); `places(i)` names record i in messages, the
    first batch's first record being record `first`."""
    eos = np.array([tokenizer.eos_id], dtype=token_dtype(tokenizer.vocab_size))
    index = first
    for batch in batches:
        n = len(next(iter(batch.values())))
        if fields.format == "text":
            texts = batch[fields.text]
            for i, text in enumerate(texts):
                if not isinstance(text, str):
                    what = "no" if text is None else f"{json_kind(text)} as its"
                    raise LoomError(f"{places(index + i)} has {what} '{fields.text}'; every record needs a "
                                    f"string there (or set data.text_field)")
            for ids in tokenizer.encode_batch(texts):
                yield np.concatenate((ids, eos)), None
        else:
            examples = [_segments(batch, i, fields, _Where(places, index + i), template) for i in range(n)]
            flat = [text for segments in examples for text, _ in segments]
            encoded = iter(tokenizer.encode_batch(flat))
            for segments in examples:
                ids_parts, mask_parts = [], []
                for _, loss in segments:
                    ids = next(encoded)
                    ids_parts.append(ids)
                    mask_parts.append(np.full(len(ids), loss, dtype=np.uint8))
                yield np.concatenate((*ids_parts, eos)), np.concatenate((*mask_parts, [1])).astype(np.uint8)
        index += n


class NonEmpty:
    """Documents of a text source without its empty ones: an empty text is a lone EOS, and 200 of
    them would train the model to stop at once. `skipped` counts them; if every one is empty, one
    line (a source of nothing but empty texts is a mistake, such as the wrong text_field).

    `part`: the documents are one shard of `loom data prepare`, which calls `check` once with the
    counts of every shard (a shard of empty texts alone is no mistake); `set_field` says how the
    text field is chosen where the source is read."""

    def __init__(self, docs: Iterable[Document], where: str, field: str, part: bool = False,
                 set_field: str = "set data.text_field") -> None:
        self.docs, self.where, self.field, self.part, self.set_field = docs, where, field, part, set_field
        self.kept = self.skipped = 0

    def __iter__(self) -> Iterator[Document]:
        for ids, mask in self.docs:
            if mask is None and len(ids) == 1:  # the EOS alone
                self.skipped += 1
                continue
            self.kept += 1
            yield ids, mask
        if not self.part:
            self.check()

    def check(self) -> None:
        if self.skipped and not self.kept:
            raise LoomError(f"data.source '{self.where}': all {self.skipped} records have an empty "
                            f"'{self.field}', nothing to train on; give records with text there (or "
                            f"{self.set_field})")

    def note(self) -> str | None:
        if not self.skipped:
            return None
        return f"data.source '{self.where}': skipped {self.skipped} records with an empty '{self.field}'"


def _segments(batch: dict[str, list], i: int, fields: RecordFields, where: _Where,
              template: ChatTemplate | None) -> sft.Segments:
    if fields.messages in batch:
        return sft.chat(batch[fields.messages][i], template, fields, where)
    prompt = batch[fields.prompt][i] if fields.prompt in batch else None
    return sft.prompt_completion(prompt, batch[fields.completion][i], fields, where)


def chat_template(tokenizer: DocumentTokenizer, fields: RecordFields) -> ChatTemplate | None:
    if fields.format != "sft" or tokenizer.chat_template is None:
        return None
    return ChatTemplate(tokenizer.chat_template, tokenizer.special_tokens, tokenizer.chat_template_file)


def text_file_batches(files: Iterable[Path], fields: RecordFields) -> Iterator[dict[str, list]]:
    """Text files as records: each file one document."""
    batch: list[str] = []
    for path in files:
        batch.append(read_text(path))
        if len(batch) == TEXT_FILES_PER_BATCH:
            yield {fields.text: batch}
            batch = []
    if batch:
        yield {fields.text: batch}


def source_batches(source: Source, fields: RecordFields, cache_dir: Path,
                   streaming: bool = False) -> Iterator[dict[str, list]]:
    """A text or records source read as batches of records, in order."""
    if source.kind == "text":
        if fields.format == "sft":
            raise LoomError(f"data.format = 'sft' needs records with prompt/completion or messages fields, "
                            f"but data.source '{source.spec}' is text; give JSONL, Parquet or Arrow records")
        return text_file_batches(source.files, RecordFields(text=fields.text))
    if source.is_records:
        return record_batches(open_records(source, cache_dir, streaming), fields, source)
    raise LoomError(f"data.source '{source.spec}' ({source.kind}) holds tokens, not documents to tokenize")


def collect(docs: Iterable[Document], vocab_size: int,
            where: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(ids end to end, each document's start, SFT mask or None)."""
    ids_parts, mask_parts, lengths = [], [], []
    for ids, mask in docs:
        ids_parts.append(ids)
        lengths.append(len(ids))
        if mask is not None:
            mask_parts.append(mask)
    if not ids_parts:
        raise LoomError(f"data.source '{where}' has no records; give a dataset with at least one")
    tokens = np.concatenate(ids_parts).astype(token_dtype(vocab_size), copy=False)
    starts = np.concatenate(([0], np.cumsum(lengths[:-1]))).astype(np.int64)
    mask = np.concatenate(mask_parts) if mask_parts else None
    return tokens, starts, mask


def cache_key(source: Source, tokenizer: DocumentTokenizer, fields: RecordFields) -> str:
    """Files by path, size and mtime (cheap); the tokenizer by its fingerprint; the fields read."""
    h = hashlib.sha256(f"{_CACHE_FORMAT}|{source.kind}|{tokenizer.fingerprint}|{fields}".encode())
    for f in source.files:
        st = f.stat()
        h.update(f"|{f.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:24]


def cache_folder(value: str | Path, name: str = "data.cache_dir") -> Path:
    """The folder loom keeps its data caches in, refused in one line if a file stands in its way
    (the cache itself, or a folder above it): writing there would fail deep inside as a traceback."""
    path = Path(value).expanduser()
    for folder in (path, *path.parents):
        if folder.exists():
            if not folder.is_dir():
                what = "is a file" if folder == path else f"is under {folder}, a file"
                raise LoomError(f"{name} '{value}' {what}, not a folder; set {name} to a folder loom may "
                                f"keep its caches in (e.g. ~/.cache/loom)")
            break
    return path


def _save_npy(path: Path, array: np.ndarray) -> None:
    buf = io.BytesIO()
    np.save(buf, array)
    write_cache(path, buf.getvalue())


def _cached(folder: Path, key: str, tokenizer: DocumentTokenizer,
            sft_mask: bool) -> tuple[list, list, list | None]:
    """A cache entry's arrays, memory-mapped, checked against its meta.json and the vocabulary."""
    meta_path = folder / f"{key}.json"
    fix = f"delete {folder / key}.* and loom tokenizes the source again"
    try:
        meta = Fields(read_json(meta_path, max_bytes=1 << 20), meta_path)
    except BadFile as e:
        raise BadFile(f"{e}; {fix}") from None
    num_docs, num_tokens = meta.int("docs", min=1, fix=fix), meta.int("tokens", min=1, fix=fix)
    tokens = open_npy(folder / f"{key}.tokens.npy", fix)
    starts = open_npy(folder / f"{key}.docs.npy", fix)
    mask = open_npy(folder / f"{key}.mask.npy", fix) if sft_mask else None
    if (len(tokens), len(starts)) != (num_tokens, num_docs) or (mask is not None and len(mask) != num_tokens):
        raise LoomError(f"{meta_path} says {num_tokens} tokens in {num_docs} documents, but the arrays "
                        f"beside it hold {len(tokens)} in {len(starts)}; {fix}")
    check_ids(tokens, tokenizer.vocab_size, str(folder / f"{key}.tokens.npy"), fix)
    check_starts(starts, num_tokens, str(folder / f"{key}.docs.npy"), fix)
    return [tokens], [starts], [mask] if mask is not None else None


def tokenize_source(source: Source, tokenizer: DocumentTokenizer, fields: RecordFields,
                    cache_dir: Path) -> Documents:
    """A text or records source as Documents, from the cache when this exact tokenizing was done."""
    folder = cache_dir / "tokens"
    key = cache_key(source, tokenizer, fields)
    meta_path = folder / f"{key}.json"
    name = source.spec
    if meta_path.is_file():  # written last, so the arrays beside it are complete
        tokens, starts, mask = _cached(folder, key, tokenizer, fields.format == "sft")
        return Documents(name, tokens, starts, mask, tokenizer.vocab_size, tokenizer.fingerprint)
    batches = source_batches(source, fields, cache_dir)
    docs = NonEmpty(encode_batches(batches, tokenizer, fields, record_places(source),
                                   chat_template(tokenizer, fields)), source.spec, fields.text)
    tokens, starts, mask = collect(docs, tokenizer.vocab_size, source.spec)
    if docs.note():
        print(f"note: {docs.note()}")  # on stdout, as the run's other news
    _save_npy(folder / f"{key}.docs.npy", starts)
    if mask is not None:
        _save_npy(folder / f"{key}.mask.npy", mask)
    _save_npy(folder / f"{key}.tokens.npy", tokens)
    write_cache(meta_path, json.dumps({"source": source.spec, "tokenizer": tokenizer.name,
                                        "docs": len(starts), "tokens": len(tokens)}).encode())
    return Documents(name, [tokens], [starts], [mask] if mask is not None else None, tokenizer.vocab_size,
                     tokenizer.fingerprint)
