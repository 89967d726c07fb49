"""Mixing sources by weight (`data.mix`), deterministically from the seed.

Each document of the mixed stream comes from source i with probability weight_i / Σ weights,
drawn with numpy's PCG64 from (seed, "mix"); each source gives its documents in order. A source
that runs out starts again from its first document (so a small source with a large weight is
repeated, and the weights stay the documents' proportions throughout). The map-style mix is as
many documents as the sources hold together (one epoch of the mix; a large source with a small
weight is cut short, a small one with a large weight repeats); the streaming mix is the same
sequence of documents, never ending.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from loom.data.documents import Document, Documents
from loom.data.stream import TokenStream
from loom.errors import ConfigError, LoomError

_MIX_STREAM = 0x6D6978  # "mix": keeps these draws apart from the batch permutation's seeds
_DRAWS_PER_CHUNK = 4096
MIX_KEYS = ("source", "weight", "text_field")


def parse_mix(mix: list[dict]) -> list[tuple[str, float, str | None]]:
    """(source, weight, text_field or None) of each data.mix entry, checked."""
    entries = []
    for i, entry in enumerate(mix):
        unknown = sorted(set(entry) - set(MIX_KEYS))
        if unknown:
            raise ConfigError(f"data.mix[{i}] has unknown key '{unknown[0]}'; an entry takes "
                              f"{', '.join(MIX_KEYS)}, e.g. {{source = \"a.jsonl\", weight = 3}}")
        source = entry.get("source")
        if not isinstance(source, str) or not source:
            raise ConfigError(f"data.mix[{i}] has no source; e.g. {{source = \"a.jsonl\", weight = 3}}")
        weight = entry.get("weight", 1)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise ConfigError(f"data.mix[{i}] weight = {weight!r} must be a number > 0, e.g. weight = 3")
        text_field = entry.get("text_field")
        if text_field is not None and not isinstance(text_field, str):
            raise ConfigError(f"data.mix[{i}] text_field = {text_field!r} must be a string")
        entries.append((source, float(weight), text_field))
    return entries


def _cdf(weights: Sequence[float]) -> np.ndarray:
    scaled = np.asarray(weights, dtype=np.float64)
    scaled /= scaled.max()  # weights near float64's top would sum to inf (and a source never be drawn)
    cdf = np.cumsum(scaled)
    cdf /= cdf[-1]
    cdf[-1] = 1.0  # so that a draw just below 1.0 never falls past the last source
    return cdf


def draw_sources(weights: Sequence[float], seed: int) -> Iterator[np.ndarray]:
    """Chunks of source indices, the same sequence however many are taken."""
    rng = np.random.default_rng([seed, _MIX_STREAM])
    cdf = _cdf(weights)
    while True:
        yield np.searchsorted(cdf, rng.random(_DRAWS_PER_CHUNK), side="right")


def mix_order(doc_counts: Sequence[int], weights: Sequence[float], seed: int,
              num_docs: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(source, document index in it) of the first num_docs (default Σ doc_counts) mixed documents."""
    if any(c < 1 for c in doc_counts):
        raise LoomError("every data.mix source needs at least one document")
    n = sum(doc_counts) if num_docs is None else num_docs
    chunks, have = [], 0
    for chunk in draw_sources(weights, seed):
        chunks.append(chunk)
        have += len(chunk)
        if have >= n:
            break
    sources = np.concatenate(chunks)[:n]
    docs = np.empty(n, dtype=np.int64)
    for s, count in enumerate(doc_counts):
        picked = sources == s
        docs[picked] = np.arange(int(picked.sum())) % count  # in order; from the start again when run out
    return sources, docs


def mix_documents(sources: list[Documents], weights: Sequence[float],
                  seed: int) -> tuple[TokenStream, TokenStream | None, np.ndarray]:
    """The mixed token stream (and SFT masks) over the sources' arrays, without copying them;
    also how many documents each source gave."""
    order_src, order_doc = mix_order([s.num_docs for s in sources], weights, seed)
    pieces, masks, tables, first_piece = [], [], [], []
    for s in sources:
        first_piece.append(len(pieces))
        pieces += s.pieces
        masks += s.masks or []
        tables.append(s.table())
    rows = np.empty((len(order_src), 3), dtype=np.int64)
    for i, table in enumerate(tables):
        picked = order_src == i
        rows[picked] = table[order_doc[picked]]
        rows[picked, 0] += first_piece[i]
    mask_stream = TokenStream(masks, rows) if masks else None
    counts = np.bincount(order_src, minlength=len(sources))
    return TokenStream(pieces, rows), mask_stream, counts


def mix_iterators(open_sources: Sequence[Callable[[], Iterable[Document]]], weights: Sequence[float],
                  seed: int, names: Sequence[str]) -> Iterator[Document]:
    """The streaming mix: documents drawn as mix_order draws them, each source restarting when it ends."""
    iterators: list[Any] = [iter(open_source()) for open_source in open_sources]
    for chunk in draw_sources(weights, seed):
        for s in chunk.tolist():
            doc = next(iterators[s], None)
            if doc is None:
                iterators[s] = iter(open_sources[s]())
                doc = next(iterators[s], None)
                if doc is None:
                    raise LoomError(f"data.source '{names[s]}' has no records; give a dataset with at least "
                                    f"one")
            yield doc
