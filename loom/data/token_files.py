"""Token arrays read from disk (prepared shards, the tokenizing caches): memory-mapped `.npy` files,
checked to be 1-D integer ids below the vocabulary before anything trains on them, so that a
damaged or foreign file is one line naming it, never an embedding lookup out of range mid-run."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from loom.checked import cause
from loom.errors import LoomError

_CHECK_CHUNK = 1 << 24  # ids a pass: the chunk's max reads it from memory the min already brought in


def open_npy(path: Path, fix: str) -> np.ndarray:
    """A 1-D integer `.npy` array, memory-mapped (never a pickle); one line if it is not one."""
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except Exception as e:  # a damaged header: OSError, ValueError, SyntaxError, tokenize's TokenError…
        raise LoomError(f"{path} is not a readable .npy array ({cause(e)}); {fix}") from None
    if not isinstance(array, np.ndarray):  # a zip (.npz) opens as an archive of arrays
        raise LoomError(f"{path} is an archive, not one .npy array; {fix}")
    if array.ndim != 1 or array.dtype.kind not in "ui":
        raise LoomError(f"{path} holds a {array.dtype} array of shape {list(array.shape)}, not a list of "
                        f"integer ids; {fix}")
    return array


def check_ids(tokens: np.ndarray, vocab_size: int, where: str, fix: str) -> None:
    """Every id of a token array in 0..vocab_size - 1: one vectorised pass, chunk by chunk (a memmap
    is read once, never loaded whole); one line naming `where` otherwise."""
    if tokens.dtype.kind not in "ui":
        raise LoomError(f"{where} holds {tokens.dtype} values, not integer token ids; {fix}")
    for start in range(0, len(tokens), _CHECK_CHUNK):
        chunk = tokens[start:start + _CHECK_CHUNK]
        low, high = int(chunk.min()), int(chunk.max())
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            at = start + int(np.flatnonzero(chunk == bad)[0])
            raise LoomError(f"{where} holds token id {bad} (at position {at:,}), outside the vocabulary "
                            f"0..{vocab_size - 1}; {fix}")


def check_starts(starts: np.ndarray, num_tokens: int, where: str, fix: str) -> None:
    """Document starts over `num_tokens` ids: from 0, rising (a document is at least its EOS), inside."""
    if len(starts) and (starts[0] != 0 or int(starts[-1]) >= num_tokens
                        or (len(starts) > 1 and int(np.diff(starts).min()) < 1)):
        raise LoomError(f"{where} does not hold rising document starts inside its {num_tokens} tokens; {fix}")
