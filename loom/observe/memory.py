"""Measured memory per rank: model-state bytes held and the peak during a training step.

Bytes are counted per storage, each once: FSDP2 shards (with their padding), DDP's gradient
buckets, tied weights, ZeRO-1's local optimizer partition are all what this rank really holds.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from typing import Iterable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor


@dataclass
class RankMemory:
    num_params: int  # the whole model's parameter count (not this rank's share)
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    peak_bytes: int | None = None  # live tensor bytes at the peak of one training step

    @property
    def model_state_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    def to_dict(self) -> dict:
        return {**asdict(self), "model_state_bytes": self.model_state_bytes}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def storage_bytes(tensors: Iterable[torch.Tensor | None], seen: set[int] | None = None) -> int:
    """Total bytes of the distinct storages behind `tensors` (views share one storage)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = _local(t).untyped_storage()
        key = storage.data_ptr()
        if key not in seen and storage.nbytes() > 0:
            seen.add(key)
            total += storage.nbytes()
    return total


def optimizer_states(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    # ZeroRedundancyOptimizer keeps this rank's states in its local optimizer.
    local = getattr(optimizer, "optim", optimizer)
    for state in local.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value


def count_params(model: nn.Module) -> int:
    """The whole model's parameter count, whatever the sharding (tied weights once)."""
    return sum(p.numel() for p in model.parameters())  # DTensor.numel() is the global size


def measure_model_states(model: nn.Module, optimizer: torch.optim.Optimizer) -> RankMemory:
    params = list(model.parameters())
    return RankMemory(
        num_params=count_params(model),
        params_bytes=storage_bytes(params),
        grads_bytes=storage_bytes(p.grad for p in params),
        optimizer_bytes=storage_bytes(optimizer_states(optimizer)),
    )


class PeakMemory:
    """Peak bytes of live tensors over a region: CUDA allocator stats on GPU, MemTracker on CPU."""

    def __init__(self, device: torch.device, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.device, self.model, self.optimizer = device, model, optimizer
        self.peak_bytes: int | None = None
        self._tracker = None

    def new_micro_step(self) -> None:
        """MemTracker follows one forward per module; gradient accumulation runs several."""
        if self._tracker is not None:
            self._tracker.reset_mod_stats()  # keeps the peak, forgets per-module stats

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            yield
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
            return
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = self._tracker = MemTracker()
        tracker.track_external(self.model, self.optimizer)  # states that already exist
        try:
            with tracker:
                yield
        finally:
            self._tracker = None
        peaks = tracker.get_tracker_snapshot("peak")
        self.peak_bytes = int(sum(v.get("Total", 0) for v in peaks.values()))
