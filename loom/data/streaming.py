"""Streaming: corpora larger than memory, tokenized on the fly and packed into windows.

The window stream is the documents' ids (each ending in EOS) end to end, cut every seq_len + 1
tokens — the windows TokenWindows cuts from the same documents, in the same order. There is no
global shuffle: global batch k is windows k·B … k·B + B − 1 of the stream, and data-parallel
rank r takes its contiguous slice r of it, split into grad_accum micro-batches in order (the
slicing GlobalBatchSampler applies to its permutation), so step k's batch does not depend on the
layout. When the records end they are read again from the start (the next epoch).

Every rank (and every DataLoader worker) reads the whole stream and keeps its own part: simple
and layout-independent, at the price of tokenizing everything on each reader. A resumed run at
start_step re-reads and re-tokenizes the stream from its start and skips the windows already
trained, without building them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch
import torch.utils.data

from loom.data.documents import Document
from loom.data.loader import IGNORE_INDEX, micro_batch_size
from loom.errors import ConfigError, LoomError


def window_item(ids: np.ndarray, mask: np.ndarray | None) -> torch.Tensor:
    """LongTensor[seq_len+1] (text), or LongTensor[2, seq_len+1]: ids, and ids where the loss
    applies / -100 where it does not (SFT)."""
    ids64 = torch.from_numpy(np.asarray(ids, dtype=np.int64))
    if mask is None:
        return ids64
    labels = torch.where(torch.from_numpy(np.asarray(mask, dtype=np.bool_)), ids64, IGNORE_INDEX)
    return torch.stack((ids64, labels))


Window = tuple[np.ndarray, np.ndarray | None]  # ids, and the SFT loss mask or None


def pack(docs: Iterable[Document], window: int, skip_tokens: int = 0) -> Iterator[Window]:
    """Windows of `window` tokens cut from the documents end to end, after the first skip_tokens
    (skipped documents are dropped whole, never copied)."""
    ids_parts: list[np.ndarray] = []
    mask_parts: list[np.ndarray] = []
    have = 0
    for ids, mask in docs:
        if skip_tokens:
            if len(ids) <= skip_tokens:
                skip_tokens -= len(ids)
                continue
            ids, mask = ids[skip_tokens:], (mask[skip_tokens:] if mask is not None else None)
            skip_tokens = 0
        ids_parts.append(ids)
        if mask is not None:
            mask_parts.append(mask)
        have += len(ids)
        if have < window:
            continue
        flat = np.concatenate(ids_parts)
        flat_mask = np.concatenate(mask_parts) if mask_parts else None
        full = have // window * window
        for start in range(0, full, window):
            end = start + window
            yield flat[start:end], (flat_mask[start:end] if flat_mask is not None else None)
        ids_parts = [flat[full:]]
        mask_parts = [flat_mask[full:]] if flat_mask is not None else []
        have -= full


def _epochs(open_docs: Callable[[], Iterable[Document]], name: str) -> Iterator[Document]:
    """The documents again and again; an empty stream is an error, not a hang."""
    while True:
        empty = True
        for doc in open_docs():
            empty = False
            yield doc
        if empty:
            raise LoomError(f"data.source '{name}' has no records; give a dataset with at least one")


class StreamingWindows(torch.utils.data.IterableDataset):
    """The window stream of a document stream; iterating it yields every window in order (tests,
    inspection); training reads `rank_batches`. `open_docs()` starts the documents from the first;
    `endless` says it never ends by itself (a streaming mix), else it is read again each epoch."""

    def __init__(self, open_docs: Callable[[], Iterable[Document]], seq_len: int, skip_windows: int = 0,
                 name: str = "stream", endless: bool = False) -> None:
        if seq_len < 1:
            raise ConfigError(f"data.seq_len={seq_len} must be at least 1; use e.g. 256")
        self.open_docs = open_docs
        self.seq_len = seq_len
        self.window = seq_len + 1
        self.skip_windows = skip_windows  # held out for eval at the stream's start
        self.name = name
        self.endless = endless

    def windows(self, skip: int = 0) -> Iterator[Window]:
        docs = iter(self.open_docs()) if self.endless else _epochs(self.open_docs, self.name)
        return pack(docs, self.window, (self.skip_windows + skip) * self.window)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for ids, mask in self.windows():
            yield window_item(ids, mask)

    def rank_batches(self, global_batch: int, dp_rank: int, dp_size: int, grad_accum: int, start_step: int,
                     num_steps: int) -> RankBatches:
        return RankBatches(self, global_batch, dp_rank, dp_size, grad_accum, start_step, num_steps)


class RankBatches(torch.utils.data.IterableDataset):
    """One data-parallel rank's micro-batches (stacked items) for steps start_step … start_step +
    num_steps − 1. DataLoader workers share them round-robin (worker w: micro-batches w, w + W, …),
    which is the order the DataLoader returns them in."""

    def __init__(self, windows: StreamingWindows, global_batch: int, dp_rank: int, dp_size: int,
                 grad_accum: int, start_step: int, num_steps: int) -> None:
        self.micro_batch = micro_batch_size(global_batch, dp_size, grad_accum)
        if not 0 <= dp_rank < dp_size:
            raise ConfigError(f"data-parallel rank {dp_rank} is outside 0..{dp_size - 1}")
        if start_step < 0 or num_steps < 0:
            raise ConfigError(f"start_step ({start_step}) and num_steps ({num_steps}) must not be negative")
        self.windows = windows
        self.global_batch = global_batch
        self.dp_rank = dp_rank
        self.per_rank = global_batch // dp_size
        self.grad_accum = grad_accum
        self.start_step = start_step
        self.num_steps = num_steps

    def __len__(self) -> int:
        return self.num_steps * self.grad_accum

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        stream = self.windows.windows(skip=self.start_step * self.global_batch)
        mine_from = self.dp_rank * self.per_rank
        for step in range(self.num_steps):
            batch = [next(stream) for _ in range(self.global_batch)]
            mine = batch[mine_from:mine_from + self.per_rank]
            for m in range(self.grad_accum):
                if (step * self.grad_accum + m) % workers == worker:
                    part = mine[m * self.micro_batch:(m + 1) * self.micro_batch]
                    yield torch.stack([window_item(ids, mask) for ids, mask in part])
