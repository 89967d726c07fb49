"""The run's data in one place: `build_run_data(cfg, model_dir)` turns the config's data section
into train and eval datasets and the tokenizer's vocabulary size, for every kind of source.

Items: text -> LongTensor[seq_len + 1]; SFT -> LongTensor[2, seq_len + 1] (row 0 the ids, row 1
the ids where the loss applies and -100 elsewhere; inputs = item[0, :-1], targets = item[1, 1:]).

The launcher calls it once before ranks start (tokenizing fills the cache in data.cache_dir);
each rank calls it again and memory-maps the cached arrays.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch.utils.data

from loom.config import Config, DataConfig
from loom.data import sources
from loom.data.corpus import load_bin, load_tokens
from loom.data.documents import (
    Document,
    Documents,
    NonEmpty,
    cache_folder,
    chat_template,
    encode_batches,
    source_batches,
    tokenize_source,
)
from loom.data.hf_tokenizer import load_document_tokenizer, resolve_tokenizer
from loom.data.loader import TokenWindows, split_train_eval
from loom.data.mix import mix_documents, mix_iterators, parse_mix
from loom.data.prepare import load_prepared
from loom.data.records import RecordFields, record_places
from loom.data.streaming import StreamingWindows
from loom.data.tokenizer import DocumentTokenizer
from loom.errors import ConfigError, LoomError
from loom.hf_config import read_hf_config


@dataclass
class RunData:
    train: torch.utils.data.Dataset  # map-style, or a StreamingWindows (IterableDataset) when streaming
    eval: torch.utils.data.Dataset | None  # held-out windows (data.eval_fraction)
    vocab_size: int  # the tokenizer's vocabulary: every id < vocab_size
    description: str  # one line: sources, format, tokens, tokenizer
    format: str = "text"  # "sft": items are LongTensor[2, seq_len + 1]
    eos_id: int | None = None  # the id that ends each document (documents' sources), else None


@dataclass
class _Entry:
    """One source of the run: data.source alone (weight 1), or a data.mix entry."""

    spec: str
    source: sources.Source
    weight: float
    fields: RecordFields


def _entries(d: DataConfig) -> list[_Entry]:
    def fields(text_field: str | None) -> RecordFields:
        return RecordFields(d.format, text_field or d.text_field, d.prompt_field, d.completion_field,
                            d.messages_field)
    listed = parse_mix(d.mix) if d.mix else [(d.source, 1.0, None)]
    return [_Entry(spec, sources.resolve(spec), weight, fields(tf)) for spec, weight, tf in listed]


def build_run_data(cfg: Config, model_dir: Path | None = None) -> RunData:
    """Train and eval datasets for the config's data section; `model_dir` is the Hugging Face model
    folder of model.init_from (its tokenizer.json is what data.tokenizer = "auto" uses), or None."""
    d = cfg.data
    entries = _entries(d)
    choice = resolve_tokenizer(d.tokenizer, model_dir)
    cache_dir = cache_folder(d.cache_dir)
    if d.streaming:
        return _packed(cfg, _streaming(cfg, entries, choice, cache_dir))
    only = entries[0].source if len(entries) == 1 else None
    if only is not None and d.format == "text":
        if only.kind == "bin":
            return _packed(cfg, _bin(cfg, only, choice, model_dir))
        if only.kind == "text" and choice in ("byte", "bpe"):
            return _packed(cfg, _classic_text(cfg, only, str(choice), cache_dir))
    return _packed(cfg, _documents(cfg, entries, choice, cache_dir))


def _packed(cfg: Config, data: RunData) -> RunData:
    """data.packing = documents masks attention at each document's EOS: the data must have one."""
    if cfg.data.packing == "documents" and data.eos_id is None:
        raise ConfigError(f"data.packing = 'documents' needs documents that each end with the tokenizer's "
                          f"EOS, but data.source '{cfg.data.source}' is read as one stream of tokens; give "
                          f"records (JSONL, Parquet, ...) or text with a tokenizer.json (data.tokenizer), or "
                          f"set data.packing=concat")
    return data


def _split(cfg: Config, tokens, mask, description: str, vocab: int) -> RunData:
    d = cfg.data
    train, evals = split_train_eval(tokens, d.seq_len, d.eval_fraction, mask)
    windows = f"{len(train):,} train + {len(evals):,} eval windows of {d.seq_len + 1}"
    return RunData(train, evals if len(evals) else None, vocab, f"{description}; {windows}", d.format)


def _classic_text(cfg: Config, source: sources.Source, kind: str, cache_dir: Path) -> RunData:
    """Text files with the byte or a self-trained BPE tokenizer: files joined by newlines (as ever)."""
    d = cfg.data
    tokens, vocab = load_tokens(source.spec, kind, d.bpe_vocab_size, d.bin_dtype, cache_dir)
    return _split(cfg, tokens, None, f"{source.spec}: {len(tokens):,} tokens (text), tokenizer {kind} "
                                     f"(vocab {vocab:,})", vocab)


def _model_vocab(cfg: Config, model_dir: Path | None) -> int | None:
    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    config = Path(model_dir) / "config.json" if model_dir is not None else None
    if config is not None and config.is_file():
        return read_hf_config(config).vocab_size
    return None


def _bin(cfg: Config, source: sources.Source, choice: str | Path, model_dir: Path | None) -> RunData:
    """A .bin token file, memory-mapped: its ids are below the tokenizer's vocabulary, or the
    model's; with neither known, below its largest id + 1."""
    d = cfg.data
    path = source.files[0]
    if isinstance(choice, Path):
        vocab = load_document_tokenizer(choice).vocab_size
    else:
        vocab = _model_vocab(cfg, model_dir) or 0
    if not vocab:
        vocab = int(load_bin(path, d.bin_dtype, 1 << 32).max()) + 1
    tokens = load_bin(path, d.bin_dtype, vocab)
    return _split(cfg, tokens, None, f"{source.spec}: {len(tokens):,} tokens (.bin, text), vocab {vocab:,}",
                  vocab)


def _documents(cfg: Config, entries: list[_Entry], choice: str | Path, cache_dir: Path) -> RunData:
    """Records, text files with a tokenizer.json, prepared folders, and mixes of them."""
    d = cfg.data
    tokenizer: DocumentTokenizer | None = None
    found: list[Documents] = []
    prepared_with = ""  # the tokenizer a prepared folder names, when no other is loaded
    for entry in entries:
        source = entry.source
        if source.kind == "bin":
            raise LoomError(f"data.source '{source.spec}' is a .bin file, which has no document boundaries "
                            f"to mix or to hold SFT examples; tokenize its text with `loom data prepare` "
                            f"instead")
        if source.kind == "prepared":
            if d.format == "sft":
                raise LoomError(f"data.source '{source.spec}' is a `loom data prepare` folder, which holds "
                                f"text only; SFT data is tokenized at the start of the run: give the records")
            docs, index = load_prepared(source.folder)
            prepared_with = index["tokenizer"]
            if d.tokenizer != "auto" or isinstance(choice, Path):
                tokenizer = tokenizer or load_document_tokenizer(choice)
                if tokenizer.fingerprint != docs.tokenizer:
                    raise ConfigError(f"data.source '{source.spec}' was prepared with the tokenizer "
                                      f"{index['tokenizer']}, but data.tokenizer gives {tokenizer.name}; set "
                                      f"data.tokenizer to the prepared one, or prepare again with this one")
        else:
            tokenizer = tokenizer or load_document_tokenizer(choice)
            docs = tokenize_source(source, tokenizer, entry.fields, cache_dir)
        found.append(docs)
    if len({docs.tokenizer for docs in found}) > 1:
        raise ConfigError("data.mix sources come from different tokenizers ("
                          + ", ".join(f"{e.spec}: {x.tokenizer}" for e, x in zip(entries, found))
                          + "); prepare them with one tokenizer")
    vocab = found[0].vocab_size
    name = tokenizer.name if tokenizer is not None else prepared_with
    if len(found) == 1:
        tokens, mask = found[0].streams()
        if len(tokens.pieces) == 1:  # one array: slice it directly
            tokens, mask = tokens.pieces[0], (mask.pieces[0] if mask is not None else None)
        what = f"{entries[0].spec}: {len(tokens):,} tokens in {found[0].num_docs:,} documents"
    else:
        tokens, mask, counts = mix_documents(found, [e.weight for e in entries], cfg.train.seed)
        parts = " + ".join(f"{e.spec} ×{e.weight:g} ({n:,} docs drawn, {x.num_docs:,} in it)"
                           for e, x, n in zip(entries, found, counts))
        what = f"mix of {parts}: {len(tokens):,} tokens"
    data = _split(cfg, tokens, mask, f"{what} ({d.format}), tokenizer {name} (vocab {vocab:,})", vocab)
    data.eos_id = (tokenizer or load_document_tokenizer(choice)).eos_id if d.packing == "documents" else None
    return data


def _stream_documents(source: sources.Source, tokenizer: DocumentTokenizer, fields: RecordFields,
                      cache_dir: Path) -> Iterator[Document]:
    batches = source_batches(source, fields, cache_dir, streaming=True)
    docs = encode_batches(batches, tokenizer, fields, record_places(source), chat_template(tokenizer, fields))
    return iter(NonEmpty(docs, source.spec, fields.text))


def _streaming(cfg: Config, entries: list[_Entry], choice: str | Path, cache_dir: Path) -> RunData:
    """Records read as a stream: the first eval_batches × batch_size windows are held out for eval
    (when data.eval_fraction > 0: a stream's length is unknown, so no fraction of it), and training
    starts after them."""
    d, t = cfg.data, cfg.train
    for entry in entries:
        if not entry.source.is_records:
            raise ConfigError(f"data.streaming reads records (JSONL, Parquet, Arrow, a saved dataset), but "
                              f"data.source '{entry.spec}' is {entry.source.kind}; set data.streaming = "
                              f"false (text and prepared folders are read without loading them whole)")
    tokenizer = load_document_tokenizer(choice)
    opens = [functools.partial(_stream_documents, e.source, tokenizer, e.fields, cache_dir) for e in entries]
    if len(entries) == 1:
        open_docs, endless, what = opens[0], False, entries[0].spec
    else:
        names = [e.spec for e in entries]
        open_docs = functools.partial(mix_iterators, opens, [e.weight for e in entries], t.seed, names)
        endless = True
        what = "mix of " + " + ".join(f"{e.spec} ×{e.weight:g}" for e in entries)
    n_eval = t.eval_batches * t.batch_size if d.eval_fraction > 0 else 0
    # The first windows: the eval set, and a first read that fails here (in the launcher) on bad data.
    whole = StreamingWindows(open_docs, d.seq_len, 0, what, endless)
    head = list(itertools.islice(whole.windows(), n_eval + 1))
    evals = None
    if n_eval:  # the stream's first windows, kept in memory
        ids = np.concatenate([w for w, _ in head[:n_eval]])
        mask = np.concatenate([m for _, m in head[:n_eval]]) if d.format == "sft" else None
        evals = TokenWindows(ids, d.seq_len, loss_mask=mask)
    train = StreamingWindows(open_docs, d.seq_len, n_eval, what, endless)
    held = f"{n_eval:,} eval windows of {d.seq_len + 1} held out at its start" if n_eval else "no eval"
    description = (f"{what} (streaming, {d.format}), tokenizer {tokenizer.name} "
                   f"(vocab {tokenizer.vocab_size:,}); {held}")
    return RunData(train, evals, tokenizer.vocab_size, description, d.format, tokenizer.eos_id)
