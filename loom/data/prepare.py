"""`loom data prepare SOURCE OUT`: tokenize a corpus once into sharded token files, in parallel.

OUT holds, for shard i, `shard_<i>.tokens.npy` (the documents' ids end to end, each followed by
the EOS; uint16 when the vocabulary fits, else uint32) and `shard_<i>.docs.npy` (where each of
its documents starts), then `index.json`, written last. Shard i is records [i·D, (i+1)·D) of the
source, D fixed in `prepare.json` when the job starts (from --shard-docs, or from --shard-tokens
and the first documents' length), so a rerun after a kill makes the same shards: the complete ones
are kept, the rest are made again. Records with an empty text are skipped, as training skips them
(documents.NonEmpty), so a shard may hold fewer documents, or none; a note counts them, and a
source of nothing else is refused. Every file is written atomically. Training memory-maps the
shards (`load_prepared`) and reads them as one stream, once the index is checked (typed fields,
every shard a plain name inside OUT, counts that add up and match the files) and each shard's ids
are (one vectorised min/max pass over its memmap when it is opened: every id below vocab_size).
"""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from loom.checked import BadFile, Fields, inside, read_json
from loom.data import sources
from loom.data.documents import (
    Document,
    Documents,
    NonEmpty,
    cache_folder,
    cache_key,
    encode_batches,
    text_file_batches,
)
from loom.data.hf_tokenizer import load_document_tokenizer, resolve_tokenizer
from loom.data.records import BATCH, RecordFields, open_records, record_places
from loom.data.token_files import check_ids, check_starts, open_npy
from loom.data.tokenizer import DocumentTokenizer, token_dtype
from loom.errors import ConfigError, LoomError
from loom.files import atomic_write
from loom.hf_config import MAX_VOCAB

JOB_FILE = "prepare.json"
INDEX_FILE = "index.json"
DTYPES = ("uint16", "uint32")  # what prepare writes (token_dtype)
_MAX_INDEX_BYTES = 1 << 28  # an index is ~150 bytes a shard
_DAMAGED = "run `loom data prepare` into a new folder"
DEFAULT_SHARD_TOKENS = 20_000_000  # ~40 MB of uint16 a shard; a worker holds one shard in memory
_SAMPLE_DOCS = 256  # documents tokenized to turn --shard-tokens into documents per shard
_PROGRESS_EVERY_S = 0.5
# Tests only: seconds to sleep after each shard is written, so a test can kill the run mid-way.
_SHARD_DELAY_ENV = "LOOM_TEST_PREPARE_SHARD_DELAY_S"


@dataclass
class Job:
    """What determines the shards; a rerun with the same job keeps the complete ones."""

    source: str
    key: str  # the source's files (paths, sizes, mtimes), the tokenizer's fingerprint, the field
    tokenizer: str
    text_field: str
    shard_tokens: int | None
    shard_docs: int | None
    docs_per_shard: int
    num_docs: int  # the source's records, empty ones included (index.json: those kept)
    vocab_size: int
    eos_id: int
    dtype: str

    @staticmethod
    def read(path: Path) -> Job:
        """prepare.json, checked field by field (a damaged one is one line, not another job)."""
        doc = Fields(read_json(path, max_bytes=1 << 20), path)
        fix = f"delete {path.parent} or pick another OUT"
        texts = {k: doc.str(k, fix=fix) for k in ("source", "key", "tokenizer", "text_field")}
        sizes = {k: None if doc.raw.get(k, 0) is None else doc.int(k, min=1, fix=fix)
                 for k in ("shard_tokens", "shard_docs")}
        vocab = doc.int("vocab_size", min=1, max=MAX_VOCAB, fix=fix)
        return Job(**texts, **sizes, docs_per_shard=doc.int("docs_per_shard", min=1, fix=fix),
                   num_docs=doc.int("num_docs", min=1, fix=fix), vocab_size=vocab,
                   eos_id=doc.int("eos_id", min=0, max=vocab - 1, fix=fix),
                   dtype=doc.str("dtype", choices=DTYPES, fix=fix))

    @property
    def num_shards(self) -> int:
        return -(-self.num_docs // self.docs_per_shard)

    def shard_range(self, shard: int) -> tuple[int, int]:
        start = shard * self.docs_per_shard
        return start, min(self.num_docs, start + self.docs_per_shard)


def shard_files(out: Path, shard: int) -> tuple[Path, Path]:
    return out / f"shard_{shard:05d}.tokens.npy", out / f"shard_{shard:05d}.docs.npy"


def _write(path: Path, data: bytes) -> None:
    """A file of OUT, atomically; a folder loom may not write (or a full disk) is one line."""
    try:
        atomic_write(path, data)
    except OSError as e:
        raise LoomError(f"cannot write {e.filename or path} ({e.strerror or type(e).__name__}); pick an OUT "
                        f"you can write to (a rerun keeps the shards already made)") from None


def _make_out(out: Path) -> None:
    """OUT made before the source is read, so that one loom may not write fails now, not once the
    documents are counted; an existing OUT is _plan's to judge."""
    if not (out.exists() or out.is_symlink()):
        try:
            out.mkdir(parents=True)
        except OSError as e:
            raise LoomError(f"cannot make OUT {out} ({e.strerror or type(e).__name__}: {e.filename}); pick "
                            f"an OUT you can write to") from None


def _write_npy(path: Path, array: np.ndarray) -> None:
    buf = io.BytesIO()
    np.save(buf, array)
    _write(path, buf.getvalue())


# ---------------------------------------------------------------------------------------------
# One shard (in a worker process, or inline with one worker)

@dataclass
class _Worker:
    job: Job
    source: sources.Source
    tokenizer: DocumentTokenizer
    fields: RecordFields
    cache_dir: Path
    out: Path
    counters: Any  # (docs, tokens) as multiprocessing Values, or plain lists inline
    tick: Any = None  # inline: called after each batch of documents (the progress line)
    records: Any = None  # the opened dataset, once per process

    def batches(self, start: int, stop: int) -> Iterator[dict[str, list]]:
        if self.source.kind == "text":
            return text_file_batches(self.source.files[start:stop], self.fields)
        if self.records is None:  # opened once per process
            self.records = open_records(self.source, self.cache_dir).select_columns([self.fields.text])
        return (self.records[i:min(stop, i + BATCH)] for i in range(start, stop, BATCH))

    def make_shard(self, shard: int) -> int:
        start, stop = self.job.shard_range(shard)
        parts, lengths = [], []
        docs = encode_batches(self.batches(start, stop), self.tokenizer, self.fields,
                              record_places(self.source), first=start)
        # Empty texts are skipped as training skips them; prepare() checks and counts them over all shards.
        for ids, _ in NonEmpty(self._counted(docs), self.source.spec, self.fields.text, part=True):
            parts.append(ids)
            lengths.append(len(ids))
        tokens = (np.concatenate(parts) if parts else np.zeros(0)).astype(self.job.dtype, copy=False)
        starts = np.cumsum([0, *lengths], dtype=np.int64)[:-1]  # none in a shard of empty records
        tokens_path, docs_path = shard_files(self.out, shard)
        _write_npy(docs_path, starts)
        _write_npy(tokens_path, tokens)  # last: a shard is complete once its tokens file exists
        delay = float(os.environ.get(_SHARD_DELAY_ENV, "0") or 0)
        if delay:
            time.sleep(delay)
        return shard

    def _counted(self, docs: Iterator[Document]) -> Iterator[Document]:
        """The documents, added to the progress every BATCH records (empty ones too: it counts records)."""
        records = tokens = 0
        for ids, mask in docs:
            yield ids, mask
            records, tokens = records + 1, tokens + len(ids)
            if records == BATCH:
                self._count(records, tokens)
                records = tokens = 0
        self._count(records, tokens)

    def _count(self, docs: int, tokens: int) -> None:
        done_docs, done_tokens = self.counters
        if isinstance(done_docs, list):
            done_docs[0] += docs
            done_tokens[0] += tokens
            if self.tick is not None:
                self.tick()
            return
        with done_docs.get_lock():
            done_docs.value += docs
        with done_tokens.get_lock():
            done_tokens.value += tokens


_WORKER: _Worker | None = None


def _start_worker(job: Job, source: sources.Source, choice: str | Path, cache_dir: Path, out: Path,
                  counters: tuple) -> None:
    global _WORKER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    _WORKER = _Worker(job, source, load_document_tokenizer(choice), RecordFields(text=job.text_field),
                      cache_dir, out, counters)


def _make_shard(shard: int) -> int:
    assert _WORKER is not None
    return _WORKER.make_shard(shard)


# ---------------------------------------------------------------------------------------------
# The job

def _doc_batches(source: sources.Source, fields: RecordFields, cache_dir: Path, start: int,
                 stop: int) -> Iterator[dict[str, list]]:
    """Documents [start, stop) of the source, in batches."""
    if source.kind == "text":
        return text_file_batches(source.files[start:stop], fields)
    records = open_records(source, cache_dir).select_columns([fields.text])
    return (records[i:min(stop, i + BATCH)] for i in range(start, stop, BATCH))

def _count_docs(source: sources.Source, fields: RecordFields, cache_dir: Path) -> int:
    if source.kind == "text":
        return len(source.files)
    ds = open_records(source, cache_dir)
    fields.needed(list(ds.column_names), source.spec)
    if len(ds) == 0:
        raise LoomError(f"data source '{source.spec}' has no records; give a dataset with at least one")
    return len(ds)


def _docs_per_shard(source: sources.Source, tokenizer: DocumentTokenizer, fields: RecordFields,
                    cache_dir: Path, num_docs: int, shard_tokens: int) -> int:
    """--shard-tokens as documents per shard, from the mean length of the first documents."""
    sample = _doc_batches(source, fields, cache_dir, 0, min(num_docs, _SAMPLE_DOCS))
    lengths = [len(ids) for ids, _ in encode_batches(sample, tokenizer, fields, record_places(source))]
    return max(1, round(shard_tokens / (sum(lengths) / len(lengths))))


def _plan(out: Path, source: sources.Source, tokenizer: DocumentTokenizer, choice: str | Path,
          fields: RecordFields, cache_dir: Path, shard_tokens: int | None, shard_docs: int | None) -> Job:
    """The job of this OUT: the one an earlier run started (same source, tokenizer, field and shard
    size), or a new one in an empty OUT."""
    key = cache_key(source, tokenizer, fields)
    job_path = out / JOB_FILE
    if job_path.is_file():
        job = Job.read(job_path)
        if (job.key, job.shard_tokens, job.shard_docs) != (key, shard_tokens, shard_docs):
            raise LoomError(f"{out} holds a `loom data prepare` of another source, tokenizer, text field or "
                            f"shard size; delete {out} or pick another OUT")
        num_docs = _count_docs(source, fields, cache_dir)
        if job.num_docs != num_docs:  # the shards to make are counted from it
            raise LoomError(f"{job_path}: num_docs = {job.num_docs}, but the source has {num_docs} "
                            f"documents; delete {out} or pick another OUT")
        return job
    if out.exists() and (not out.is_dir() or any(not p.name.startswith(".tmp-") for p in out.iterdir())):
        raise LoomError(f"{out} exists and is not a `loom data prepare` folder; delete it or pick another "
                        f"OUT")
    num_docs = _count_docs(source, fields, cache_dir)
    per_shard = shard_docs or _docs_per_shard(source, tokenizer, fields, cache_dir, num_docs,
                                              shard_tokens or DEFAULT_SHARD_TOKENS)
    job = Job(source.spec, key, str(choice), fields.text, shard_tokens, shard_docs, per_shard, num_docs,
              tokenizer.vocab_size, tokenizer.eos_id, token_dtype(tokenizer.vocab_size).name)
    _write(job_path, json.dumps(asdict(job), indent=1).encode())
    return job


def _complete(out: Path, job: Job, shard: int) -> bool:
    tokens_path, docs_path = shard_files(out, shard)
    if not (tokens_path.is_file() and docs_path.is_file()):
        return False
    try:
        starts = np.load(docs_path, mmap_mode="r")
        tokens = np.load(tokens_path, mmap_mode="r")
    except (OSError, ValueError):
        return False
    start, stop = job.shard_range(shard)  # its empty records are not in it
    return len(starts) <= stop - start and tokens.dtype == np.dtype(job.dtype)


class _Progress:
    """One line on stderr, rewritten: documents, docs/s, tokens/s, ETA."""

    def __init__(self, stream: TextIO | None, job: Job, docs_before: int) -> None:
        self.stream, self.job, self.docs_before = stream, job, docs_before
        self.start = self.last = time.perf_counter()

    def show(self, docs: int, tokens: int, shards_done: int, force: bool = False) -> None:
        now = time.perf_counter()
        if self.stream is None or (not force and now - self.last < _PROGRESS_EVERY_S):
            return
        self.last = now
        elapsed = max(now - self.start, 1e-9)
        rate = docs / elapsed
        left = self.job.num_docs - self.docs_before - docs
        eta = time.strftime("%H:%M:%S", time.gmtime(left / rate)) if rate > 0 else "?"
        self.stream.write(f"\rloom data prepare: {self.docs_before + docs:,}/{self.job.num_docs:,} "
                          f"documents, shard {shards_done}/{self.job.num_shards} · {rate:,.0f} docs/s · "
                          f"{tokens / elapsed:,.0f} tokens/s · ETA {eta} ")
        self.stream.flush()


def _run(todo: list[int], job: Job, source: sources.Source, choice: str | Path, tokenizer: DocumentTokenizer,
         cache_dir: Path, out: Path, workers: int, progress: _Progress) -> None:
    done_before = job.num_shards - len(todo)
    if workers <= 1 or len(todo) <= 1:
        counters = ([0], [0])
        shards_done = [done_before]
        worker = _Worker(job, source, tokenizer, RecordFields(text=job.text_field), cache_dir, out, counters,
                         tick=lambda: progress.show(counters[0][0], counters[1][0], shards_done[0]))
        for shard in todo:
            worker.make_shard(shard)
            shards_done[0] += 1
        progress.show(counters[0][0], counters[1][0], job.num_shards, force=True)
        return
    # spawn, not fork: the parent may hold threads (the tokenizer's) that a fork would copy broken.
    ctx = multiprocessing.get_context("spawn")
    counters = (ctx.Value("q", 0), ctx.Value("q", 0))
    pool = ctx.Pool(min(workers, len(todo)), _start_worker, (job, source, choice, cache_dir, out, counters))
    try:
        finished = 0
        results = pool.imap_unordered(_make_shard, todo)
        while finished < len(todo):
            try:
                results.next(timeout=_PROGRESS_EVERY_S)
                finished += 1
            except multiprocessing.TimeoutError:
                pass
            progress.show(counters[0].value, counters[1].value, done_before + finished)
        progress.show(counters[0].value, counters[1].value, job.num_shards, force=True)
    except BaseException:
        pool.terminate()
        raise
    finally:
        pool.close()  # on success the workers exit on their own, releasing what they hold
        pool.join()


def prepare(source: str, out: Path, tokenizer: str = "byte", text_field: str = "text",
            shard_tokens: int | None = None, shard_docs: int | None = None, workers: int | None = None,
            cache_dir: Path = Path("~/.cache/loom"), progress: TextIO | None = sys.stderr) -> dict:
    """Tokenize `source` into shards in `out`; returns the index (also written as out/index.json).

    `tokenizer`: byte, a tokenizer.json, or a model folder holding one. Interrupted and rerun with
    the same arguments, it keeps the complete shards and makes the rest."""
    if shard_tokens is not None and shard_docs is not None:
        raise ConfigError("give --shard-tokens or --shard-docs, not both")
    for name, value in (("--shard-tokens", shard_tokens), ("--shard-docs", shard_docs),
                        ("--workers", workers)):
        if value is not None and value < 1:
            raise ConfigError(f"{name} = {value} must be at least 1")
    out, cache_dir = Path(out).expanduser(), cache_folder(cache_dir, "--cache-dir")
    choice = resolve_tokenizer(tokenizer)
    tok = load_document_tokenizer(choice)
    src = sources.resolve(source)
    if src.kind in ("bin", "prepared"):
        raise LoomError(f"'{source}' is already tokens ({src.kind}); give text files or records to prepare")
    holder = sources.folder_holding(source, out)
    if holder is not None:  # its shards would join the source: a rerun, or training on it, would fail
        raise LoomError(f"OUT {out} is inside the source folder {holder}, whose every file is read as data: "
                        f"its shards and index.json would join the source; pick an OUT outside {holder}")
    _make_out(out)
    fields = RecordFields(text=text_field)
    job = _plan(out, src, tok, choice, fields, cache_dir, shard_tokens, shard_docs)
    index_path = out / INDEX_FILE
    if index_path.is_file():
        return read_index(out)[0]
    for stale in out.glob(".tmp-*"):  # what a killed run was writing
        stale.unlink(missing_ok=True)
    todo = [s for s in range(job.num_shards) if not _complete(out, job, s)]
    docs_before = sum(b - a for a, b in map(job.shard_range, set(range(job.num_shards)) - set(todo)))
    _run(todo, job, src, choice, tok, cache_dir, out, workers or os.cpu_count() or 1,
         _Progress(progress, job, docs_before))
    if progress is not None:
        progress.write("\n")
    shards = []
    for s in range(job.num_shards):
        tokens_path, docs_path = shard_files(out, s)
        shards.append({"tokens": tokens_path.name, "docs": docs_path.name,
                       "num_tokens": len(np.load(tokens_path, mmap_mode="r")),
                       "num_docs": len(np.load(docs_path, mmap_mode="r"))})
    texts = NonEmpty((), src.spec, fields.text, set_field="pass --text-field")
    texts.kept = sum(s["num_docs"] for s in shards)
    texts.skipped = job.num_docs - texts.kept
    texts.check()  # before index.json: a folder without a document is no data to train on
    index = {"format": sources.PREPARED_FORMAT, **asdict(job), "num_docs": texts.kept,
             "tokenizer_fingerprint": tok.fingerprint, "num_tokens": sum(s["num_tokens"] for s in shards),
             "shards": shards}
    _write(index_path, json.dumps(index, indent=1).encode())
    if texts.note():
        print(f"note: {texts.note()}")  # on stdout, as training's note of the same
    return index


@dataclass(frozen=True)
class Shard:
    tokens: Path
    docs: Path
    num_tokens: int
    num_docs: int


def read_index(folder: Path) -> tuple[dict, list[Shard]]:
    """A prepared folder's index.json, checked: typed fields, every shard file a plain name inside
    the folder, counts that add up; (the index, its shards)."""
    path = folder / INDEX_FILE
    doc = Fields(read_json(path, max_bytes=_MAX_INDEX_BYTES), path)
    fix = f"it is damaged: {_DAMAGED}"
    doc.str("format", choices=(sources.PREPARED_FORMAT,), fix=fix)
    vocab = doc.int("vocab_size", min=1, max=MAX_VOCAB, fix=fix)
    doc.int("eos_id", min=0, max=vocab - 1, fix=fix)
    dtype = doc.str("dtype", choices=DTYPES, fix=fix)
    if token_dtype(vocab).itemsize > np.dtype(dtype).itemsize:
        raise doc.error("dtype", f"wide enough for vocab_size {vocab}", dtype, fix)
    for key in ("tokenizer", "tokenizer_fingerprint"):
        doc.str(key, nonempty=True, fix=fix)
    shards = []
    for i, raw in enumerate(doc.list("shards", of=dict)):
        entry = Fields(raw, path, f"shards[{i}]")
        tokens, docs = (inside(folder, entry.str(k, fix=fix), path, entry.name(k))
                        for k in ("tokens", "docs"))
        shards.append(Shard(tokens, docs, entry.int("num_tokens", min=0, fix=fix),
                            entry.int("num_docs", min=0, fix=fix)))
    for key, counted in (("num_tokens", sum(s.num_tokens for s in shards)),
                         ("num_docs", sum(s.num_docs for s in shards))):
        if doc.int(key, min=0, fix=fix) != counted:
            raise BadFile(f"{path}: {key} = {doc.raw[key]}, but its shards hold {counted}; {fix}")
    return doc.raw, shards


def _open_shard(shard: Shard, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """A shard's ids and document starts, memory-mapped, as index.json describes them."""
    fix = f"the shard is damaged or from another `loom data prepare`: {_DAMAGED}"
    tokens = open_npy(shard.tokens, fix)
    if len(tokens) != shard.num_tokens:
        raise LoomError(f"{shard.tokens} has {len(tokens)} tokens but index.json says {shard.num_tokens}; "
                        f"{_DAMAGED}")
    check_ids(tokens, vocab, str(shard.tokens), fix)
    starts = open_npy(shard.docs, fix)
    if len(starts) != shard.num_docs:
        raise LoomError(f"{shard.docs} has {len(starts)} documents but index.json says {shard.num_docs}; "
                        f"{_DAMAGED}")
    check_starts(starts, len(tokens), str(shard.docs), fix)
    return tokens, starts


def load_prepared(folder: Path) -> tuple[Documents, dict]:
    """A prepared folder's shards, memory-mapped (never read whole), and its index."""
    index, shards = read_index(folder)
    opened = [_open_shard(shard, index["vocab_size"]) for shard in shards]
    docs = Documents(str(folder), [t for t, _ in opened], [s for _, s in opened], None, index["vocab_size"],
                     index["tokenizer_fingerprint"])
    return docs, index
