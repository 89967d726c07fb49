"""Token windows, and a sampler whose global batches are the same whatever the parallel layout.

Step k always trains on global batch k of a seeded permutation; data-parallel ranks and
gradient-accumulation micro-steps only decide who takes which part of it. `build_loaders` gives a
rank its DataLoaders (workers, prefetch, pinned memory) for training and eval; a LoomError raised in
a worker reaches the user as the one line it was, and a stop signal leaves the workers to the trainer
(`Loader`).
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.utils.data

from loom.config import PREEMPT_SIGNALS, Config, pipeline_microbatches
from loom.errors import ConfigError, LoomError

IGNORE_INDEX = -100  # SFT labels where the loss does not apply (cross entropy's ignore_index)


class TokenWindows(torch.utils.data.Dataset):
    """Non-overlapping windows of seq_len+1 tokens; item i -> LongTensor[seq_len+1]
    (inputs = [:-1], targets = [1:]).

    With a loss mask (SFT), item i -> LongTensor[2, seq_len+1]: row 0 the ids, row 1 the same ids
    where the mask is set and -100 where the loss does not apply (inputs = [0, :-1], targets =
    [1, 1:]). `tokens` (and the mask) may be anything with len() and slicing: an array, a memmap,
    a TokenStream over shards."""

    def __init__(self, tokens: np.ndarray, seq_len: int, start_window: int = 0,
                 num_windows: int | None = None, loss_mask: np.ndarray | None = None) -> None:
        if seq_len < 1:
            raise ConfigError(f"data.seq_len={seq_len} must be at least 1; use e.g. 256")
        if loss_mask is not None and len(loss_mask) != len(tokens):
            raise LoomError(f"the loss mask has {len(loss_mask)} entries for {len(tokens)} tokens; they must "
                            f"match")
        self.tokens = tokens
        self.loss_mask = loss_mask
        self.seq_len = seq_len
        self.window = seq_len + 1
        total = len(tokens) // self.window
        if num_windows is None:
            num_windows = total - start_window
        if start_window < 0 or num_windows < 0 or start_window + num_windows > total:
            raise LoomError(f"windows {start_window}..{start_window + num_windows} are outside the {total} "
                            f"windows of {self.window} tokens in the corpus; pick a range inside 0..{total}")
        self.start_window = start_window
        self.num_windows = num_windows

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.num_windows:
            raise IndexError(f"window {i} out of range 0..{self.num_windows - 1}")
        start = (self.start_window + i) * self.window
        # int64 copy: memmapped uint16/uint32 tokens cannot become a LongTensor in place.
        ids = torch.from_numpy(np.asarray(self.tokens[start:start + self.window], dtype=np.int64))
        if self.loss_mask is None:
            return ids
        applies = torch.from_numpy(np.asarray(self.loss_mask[start:start + self.window], dtype=np.bool_))
        return torch.stack((ids, torch.where(applies, ids, IGNORE_INDEX)))


def split_train_eval(tokens: np.ndarray, seq_len: int, eval_fraction: float,
                     loss_mask: np.ndarray | None = None) -> tuple[TokenWindows, TokenWindows]:
    """Hold out the last windows for eval (at least one when eval_fraction > 0)."""
    if not 0.0 <= eval_fraction < 1.0:
        raise ConfigError(f"data.eval_fraction={eval_fraction} must be in [0, 1); use e.g. 0.05, "
                          f"or 0 for no eval")
    if seq_len < 1:
        raise ConfigError(f"data.seq_len={seq_len} must be at least 1; use e.g. 256")
    window = seq_len + 1
    total = len(tokens) // window
    n_eval = max(1, int(total * eval_fraction)) if eval_fraction > 0 else 0
    if total - n_eval < 1:
        raise LoomError(f"the corpus has {len(tokens)} tokens = {total} windows of {window} tokens, too few "
                        f"to train on with {n_eval} held out for eval; use a bigger corpus or smaller "
                        f"data.seq_len")
    train = TokenWindows(tokens, seq_len, 0, total - n_eval, loss_mask)
    evals = TokenWindows(tokens, seq_len, total - n_eval, n_eval, loss_mask)
    return train, evals


def _nearby_multiples(value: int, unit: int) -> str:
    """Two valid values near the invalid one, for the error message."""
    below = value // unit * unit
    options = [below, below + unit] if below > 0 else [unit, 2 * unit]
    return f"{options[0]} or {options[1]}"


def micro_batch_size(global_batch: int, dp_size: int, grad_accum: int) -> int:
    """Sequences per micro-batch on one rank; global_batch must split evenly over ranks and micro-steps."""
    if dp_size < 1 or grad_accum < 1:
        raise ConfigError(f"data-parallel size ({dp_size}) and train.grad_accum ({grad_accum}) must both be "
                          f"at least 1")
    unit = dp_size * grad_accum
    if global_batch < 1 or global_batch % unit:
        raise ConfigError(f"train.batch_size={global_batch} is not divisible by grad_accum({grad_accum}) × "
                          f"data-parallel size({dp_size}) = {unit}; use a multiple of {unit} such as "
                          f"{_nearby_multiples(global_batch, unit)}")
    return global_batch // unit


class GlobalBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Yields this rank's micro-batches (lists of window indices), step after step.

    Global batch k = the k-th block of `global_batch` indices of a seeded permutation of all windows
    (a new permutation each epoch: seed + epoch), so step k sees the same sequences whatever the layout.
    Within the global batch, data-parallel rank r takes the contiguous slice r of dp_size equal parts,
    and splits it into grad_accum micro-batches in order. The tail of each epoch that does not fill a
    global batch is skipped (it is a different tail next epoch).
    """

    def __init__(self, num_windows: int, global_batch: int, dp_rank: int, dp_size: int, grad_accum: int,
                 seed: int, start_step: int = 0, num_steps: int | None = None,
                 seq_len: int | None = None, held_out: int = 0) -> None:
        self.micro_batch = micro_batch_size(global_batch, dp_size, grad_accum)
        if not 0 <= dp_rank < dp_size:
            raise ConfigError(f"data-parallel rank {dp_rank} is outside 0..{dp_size - 1}")
        if num_windows < global_batch <= num_windows + held_out:  # the corpus alone was big enough
            total = num_windows + held_out
            raise ConfigError(f"data.eval_fraction holds out {held_out} of the corpus's {total} windows for "
                              f"eval, leaving {num_windows} to train on, but one global batch needs "
                              f"{global_batch}; lower data.eval_fraction (0 holds none out, e.g. --set "
                              f"data.eval_fraction=0.02) or use a bigger corpus")
        if num_windows < global_batch:
            of_len = f" of {seq_len + 1} tokens" if seq_len is not None else ""
            raise ConfigError(f"the corpus has {num_windows} windows{of_len} but one global batch needs "
                              f"{global_batch}; "
                              "use a bigger corpus or smaller train.batch_size / data.seq_len")
        if start_step < 0 or (num_steps is not None and num_steps < 0):
            raise ConfigError(f"start_step ({start_step}) and num_steps ({num_steps}) must not be negative")
        self.num_windows = num_windows
        self.global_batch = global_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.grad_accum = grad_accum
        self.seed = seed
        self.start_step = start_step
        self.num_steps = num_steps
        self.steps_per_epoch = num_windows // global_batch

    def _permutation(self, epoch: int) -> np.ndarray:
        # numpy's PCG64 stream is stable across versions and platforms, unlike some global RNGs.
        return np.random.default_rng(self.seed + epoch).permutation(self.num_windows)

    def global_batch_indices(self, step: int) -> list[int]:
        """All window indices of global batch `step`, in order (every rank and micro-step together)."""
        epoch, k = divmod(step, self.steps_per_epoch)
        perm = self._permutation(epoch)
        return perm[k * self.global_batch:(k + 1) * self.global_batch].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        steps = itertools.count(self.start_step) if self.num_steps is None \
            else range(self.start_step, self.start_step + self.num_steps)
        per_rank = self.global_batch // self.dp_size
        epoch, perm = -1, np.empty(0, dtype=np.int64)
        for step in steps:
            step_epoch, k = divmod(step, self.steps_per_epoch)
            if step_epoch != epoch:  # one permutation per epoch, not per step
                epoch, perm = step_epoch, self._permutation(step_epoch)
            start = k * self.global_batch + self.dp_rank * per_rank
            mine = perm[start:start + per_rank]
            for m in range(self.grad_accum):
                yield mine[m * self.micro_batch:(m + 1) * self.micro_batch].tolist()

    def __len__(self) -> int:
        """Number of micro-batches yielded (num_steps × grad_accum); only when finite."""
        if self.num_steps is None:
            raise TypeError("GlobalBatchSampler with num_steps=None is infinite and has no length")
        return self.num_steps * self.grad_accum


def own_generator() -> torch.Generator:
    """A DataLoader's own RNG: each of its iterators draws the workers' base seed from it, not from
    the global torch RNG that a checkpoint restores (which would leave a resumed run one draw
    ahead of the run never stopped: different dropout from the first resumed step)."""
    return torch.Generator()


def _one_line(error: LoomError) -> LoomError:
    """A worker's LoomError as it was raised: torch re-raises it in the main process as the same
    type with "Caught … in DataLoader worker process N." and the worker's traceback as its
    message, whose last line is `module.Type: <the one line>`."""
    text = str(error)
    if "\n" not in text:
        return error
    last = text.rstrip().splitlines()[-1]
    return type(error)(last.split(": ", 1)[1] if ": " in last else last)


class _OneLineErrors:
    def __init__(self, batches: Iterator) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.batches)
        except LoomError as e:
            raise _one_line(e) from None

    def __len__(self) -> int:
        return len(self.batches)


# The stop signals a trainer handles (loom/train/stop.py): Ctrl-C, a scheduler's warning; and SIGTERM,
# which is also how a worker is ended (the loader's shutdown, Python's exit ending daemonic children).
WORKER_IGNORES = (signal.SIGINT, *(signal.Signals[f"SIG{s}"] for s in PREEMPT_SIGNALS))


def _sigterm_watch() -> None:
    """A worker's SIGTERM, read with its sender: from the trainer (the loader's shutdown, Python's exit
    ending daemonic children) it ends the worker, as torch's own handler does; from anyone else it
    was sent to the whole process group or cgroup (`timeout`, `kill -- -PGID`, systemd), which the
    trainer got too and stops at a step and saves: the worker lives on to serve that step."""
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == os.getppid():
            os._exit(0)


def leave_stops_to_the_trainer(worker_id: int) -> None:
    """A worker's start: a stop signal sent to the process group (a terminal's Ctrl-C, `timeout`,
    `kill -- -PGID`) or to the cgroup (systemd) reaches the workers too. Dying of it, a worker would
    crash its trainer before the trainer saves; it goes on serving batches until the trainer,
    stopped with its checkpoint, ends it."""
    for sig in WORKER_IGNORES:
        signal.signal(sig, signal.SIG_IGN)
    # SIGTERM stays pending (blocked here and in every thread started from here on, not ignored,
    # which would discard it) until the watch reads who sent it.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(target=_sigterm_watch, name="loom-sigterm", daemon=True).start()


class Loader(torch.utils.data.DataLoader):
    """A DataLoader whose workers' LoomErrors reach the user as one line, not as a traceback, and
    whose workers leave the stop signals to the trainer."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("worker_init_fn", leave_stops_to_the_trainer)
        super().__init__(*args, **kwargs)

    def __iter__(self) -> Iterator:
        return _OneLineErrors(super().__iter__())


def make_loader(dataset: torch.utils.data.Dataset, sampler: torch.utils.data.Sampler[list[int]],
                num_workers: int, prefetch_factor: int | None,
                pin_memory: bool) -> torch.utils.data.DataLoader:
    """A DataLoader over the sampler's micro-batches; items stack into LongTensor[micro_batch, seq_len+1]."""
    if num_workers < 0:
        raise ConfigError(f"data.num_workers={num_workers} must be 0 (load in the training process) or more")
    if num_workers > 0 and prefetch_factor is not None and prefetch_factor < 1:
        raise ConfigError(f"data.prefetch_factor={prefetch_factor} must be at least 1; use e.g. 2")
    return Loader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        # DataLoader rejects prefetch_factor without workers; pinning needs an accelerator.
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
        persistent_workers=num_workers > 0,
        pin_memory=pin_memory and torch.cuda.is_available(),
        generator=own_generator(),
    )


@dataclass
class Loaders:
    train: torch.utils.data.DataLoader  # this rank's micro-batches, step after step
    eval: torch.utils.data.DataLoader | None  # this rank's slice of the held-out batches
    micro_batch: int


def build_loaders(cfg: Config, train_set: torch.utils.data.Dataset, eval_set: torch.utils.data.Dataset | None,
                  dp_rank: int, dp_size: int, pin_memory: bool, start_step: int = 0) -> Loaders:
    """Every data-parallel rank reads its own disjoint slice of each global batch, from global
    batch `start_step` on (a resumed run continues where the checkpoint stopped).

    A streaming train set (an IterableDataset with `rank_batches`, loom/data/streaming.py) gives
    each rank its micro-batches itself; the eval set is always map-style."""
    t = cfg.train
    if isinstance(train_set, torch.utils.data.IterableDataset):
        train_loader, micro = _stream_loader(cfg, train_set, dp_rank, dp_size, pin_memory, start_step)
    else:
        sampler = GlobalBatchSampler(len(train_set), t.batch_size, dp_rank, dp_size, t.grad_accum, t.seed,
                                     start_step=start_step, num_steps=t.steps - start_step)
        train_loader = make_loader(train_set, sampler, cfg.data.num_workers, cfg.data.prefetch_factor,
                                   pin_memory)
        micro = sampler.micro_batch
    eval_loader = None
    # Whole batches for every dp rank (and, under a pipeline, for each of its micro-batches).
    unit = dp_size * (pipeline_microbatches(cfg.parallel) if cfg.parallel.pp > 1 else 1)
    eval_batch = min(t.batch_size, len(eval_set) // unit * unit) if eval_set else 0
    accum = 1
    if cfg.parallel.pp > 1:
        # A pipeline's stages keep the shapes of the first micro-batch they ran (the later stages'
        # receive buffers; torch 2.11 also refuses first-stage inputs of any other): eval batches
        # are whole global batches in training's micro-steps, or there is no eval.
        eval_batch = t.batch_size if eval_set is not None and len(eval_set) >= t.batch_size else 0
        accum = t.grad_accum
    if eval_batch >= unit and t.eval_batches > 0:
        eval_sampler = GlobalBatchSampler(len(eval_set), eval_batch, dp_rank, dp_size, accum, t.seed,
                                          num_steps=min(t.eval_batches, len(eval_set) // eval_batch))
        eval_loader = make_loader(eval_set, eval_sampler, 0, None, pin_memory)
    return Loaders(train_loader, eval_loader, micro)


def _stream_loader(cfg: Config, train_set: torch.utils.data.IterableDataset, dp_rank: int, dp_size: int,
                   pin_memory: bool, start_step: int) -> tuple[torch.utils.data.DataLoader, int]:
    t, d = cfg.train, cfg.data
    if not hasattr(train_set, "rank_batches"):
        raise LoomError(f"the train set {type(train_set).__name__} is an IterableDataset without "
                        f"rank_batches(global_batch, dp_rank, dp_size, grad_accum, start_step, num_steps); "
                        f"give a map-style Dataset or a loom.data.streaming.StreamingWindows")
    if d.num_workers < 0:
        raise ConfigError(f"data.num_workers={d.num_workers} must be 0 (load in the training process) or "
                          f"more")
    batches = train_set.rank_batches(t.batch_size, dp_rank, dp_size, t.grad_accum, start_step,
                                     t.steps - start_step)
    loader = Loader(
        batches, batch_size=None,  # the stream yields whole micro-batches
        num_workers=d.num_workers,
        prefetch_factor=d.prefetch_factor if d.num_workers > 0 else None,
        persistent_workers=d.num_workers > 0,
        pin_memory=pin_memory and torch.cuda.is_available(),
        generator=own_generator(),
    )
    return loader, batches.micro_batch
