"""One token sequence made of slices of several arrays — the shards of a prepared folder, the
documents of mixed sources — read slice by slice, so memory-mapped pieces are never loaded whole.

TokenWindows only needs len() and [a:b], so it cuts windows across shard and document edges.
"""

from __future__ import annotations

import numpy as np


def coalesce(segments: np.ndarray) -> np.ndarray:
    """Merge rows (piece, start, stop) that continue the previous row in the same piece."""
    if len(segments) < 2:
        return segments
    continues = (segments[1:, 0] == segments[:-1, 0]) & (segments[1:, 1] == segments[:-1, 2])
    heads = np.flatnonzero(np.concatenate(([True], ~continues)))
    tails = np.concatenate((heads[1:], [len(segments)])) - 1
    merged = segments[heads].copy()
    merged[:, 2] = segments[tails, 2]
    return merged


class TokenStream:
    """pieces[p][start:stop] for each row (p, start, stop) of `segments`, end to end."""

    def __init__(self, pieces: list[np.ndarray], segments: np.ndarray | None = None) -> None:
        if segments is None:
            segments = np.array([(p, 0, len(a)) for p, a in enumerate(pieces)], dtype=np.int64).reshape(-1, 3)
        self.pieces = pieces
        self.segments = coalesce(np.asarray(segments, dtype=np.int64).reshape(-1, 3))
        lengths = self.segments[:, 2] - self.segments[:, 1]
        self.offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)  # where each row starts
        self.dtype = np.result_type(*(p.dtype for p in pieces)) if pieces else np.dtype(np.uint16)
        self.ndim = 1

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice):
            raise TypeError("TokenStream is read in slices, e.g. stream[a:b]")
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise ValueError("TokenStream slices take no step")
        parts = []
        row = int(np.searchsorted(self.offsets, start, side="right")) - 1
        while start < stop:
            piece, begin, end = self.segments[row]
            skip = start - self.offsets[row]
            take = min(stop - start, end - begin - skip)
            parts.append(self.pieces[piece][begin + skip:begin + skip + take])
            start += take
            row += 1
        if not parts:
            return np.zeros(0, dtype=self.dtype)
        return parts[0] if len(parts) == 1 else np.concatenate(parts).astype(self.dtype, copy=False)

    def __array__(self, dtype: np.dtype | None = None, copy: bool | None = None) -> np.ndarray:
        whole = self[0:len(self)]
        return whole.astype(dtype) if dtype is not None else whole
