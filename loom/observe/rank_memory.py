"""Measured memory per rank: model-state bytes held and the peak during a training step.

Bytes are counted per storage, each once: FSDP2 shards (with their padding), DDP's gradient
buckets, tied weights, ZeRO-1's local optimizer partition are all what this rank really holds.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from loom import heap
from loom.parallel.known_warnings import silence_module_hierarchy
from loom.parallel.mesh import local_view
from loom.parallel.zero1 import local_optimizer


@dataclass
class RankMemory:
    num_params: int  # the whole model's parameter count (not this rank's share)
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    peak_bytes: int | None = None  # live tensor bytes at the peak of one training step
    resident_bytes: int | None = None  # the process's resident memory (RSS) after that step
    nvme_bytes: int | None = None  # this rank's offload files on NVMe then (deepspeed engine)
    # CUDA: the caching allocator's reserved peak over the step (segments, rounded and fragmented),
    # which the plan's total (allocated + its fragmentation margin) prices; peak_bytes is allocated
    reserved_peak_bytes: int | None = None

    @property
    def model_state_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    def to_dict(self) -> dict:
        return {**asdict(self), "model_state_bytes": self.model_state_bytes}


def resident_bytes() -> int | None:
    """This process's resident set size now (Linux /proc; None elsewhere), after the allocator has
    returned its free pages: what the process holds, not what glibc keeps cached (which depends on
    the order of earlier frees and would hide, e.g., optimizer states moved to NVMe)."""
    heap.release_free_memory()
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def files_bytes(folder: Path) -> int:
    """Bytes of the regular files below `folder` (0 if it does not exist)."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else 0


def storage_bytes(tensors: Iterable[torch.Tensor | None], seen: set[int] | None = None) -> int:
    """Total bytes of the distinct storages behind `tensors` (views share one storage)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = local_view(t).untyped_storage()
        key = storage._cdata  # the StorageImpl: shared by views, and defined for fake tensors too
        if key not in seen and storage.nbytes() > 0:
            seen.add(key)
            total += storage.nbytes()
    return total


def optimizer_states(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    local = local_optimizer(optimizer)  # ZeRO-1 keeps this rank's states in its local optimizer
    for state in local.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value


def count_params(model: nn.Module, trainable: bool = False) -> int:
    """The whole model's parameter count, whatever the sharding (tied weights once); `trainable`:
    only those that train (LoRA's adapters)."""
    # DTensor.numel() is the global size; DeepSpeed's ZeRO-3 keeps a partitioned one's in ds_numel.
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()
               if p.requires_grad or not trainable)


def measure_model_states(model: nn.Module, optimizer: torch.optim.Optimizer,
                         masters: Iterable[torch.Tensor] = ()) -> RankMemory:
    """`masters`: copies of the parameters the optimizer steps (DeepSpeed's fp32 partitions), which
    count as optimizer state. A ZeRO-3 partitioned parameter holds its partition in ds_tensor."""
    params = list(model.parameters())
    return RankMemory(
        num_params=count_params(model),
        params_bytes=storage_bytes(getattr(p, "ds_tensor", p) for p in params),
        grads_bytes=storage_bytes(p.grad for p in params),
        optimizer_bytes=storage_bytes([*optimizer_states(optimizer), *masters]),
    )


class PeakMemory:
    """Peak bytes of live tensors over a region: CUDA allocator stats on GPU, MemTracker on CPU."""

    def __init__(self, device: torch.device, model: nn.Module, optimizer: torch.optim.Optimizer,
                 held: Callable[[], list[torch.Tensor]] = list):
        self.device, self.model, self.optimizer = device, model, optimizer
        self.held = held  # tensors made before the region and kept through it (a pipeline's receive buffers)
        self.peak_bytes: int | None = None
        self.reserved_bytes: int | None = None  # CUDA: the allocator's reserved peak

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            yield
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
            self.reserved_bytes = torch.cuda.max_memory_reserved(self.device)
            return
        tracker = global_peak_tracker()
        # states and buffers that already exist (on a GPU the allocator counts them anyway)
        tracker.track_external(self.model, local_optimizer(self.optimizer), *self.held())
        with tracker:
            yield
        peaks = tracker.get_tracker_snapshot("peak")
        self.peak_bytes = int(sum(v.get("Total", 0) for v in peaks.values()))


def global_peak_tracker():
    """A MemTracker that keeps only the global live-bytes peak.

    Its per-module statistics refuse a module whose forward runs more than once in the tracked
    region (grad-accumulation micro-steps, pipeline micro-batches), and their module tracker hooks
    every forward's outputs for backward, which autograd.grad refuses (the zero-bubble pipeline
    schedules' input-gradient pass); the peak needs neither: every storage is still counted through
    the dispatch mode, the optimizer hooks and resize_.
    """
    from torch._guards import active_fake_mode
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.tensor import DTensor

    silence_module_hierarchy()  # its ModTracker's advice about the module hierarchy, which this never reads

    class NoModules:
        """Stands in for MemTracker's ModTracker: no module hooks, never in backward."""
        parents: set = set()
        is_bw = False

        def register_user_hooks(self, *hooks): pass

        def clear_user_hooks(self): pass

        def __enter__(self): return self

        def __exit__(self, *args): pass

    class GlobalPeakTracker(MemTracker):
        def __init__(self):
            super().__init__()
            self._mod_tracker = NoModules()

        def _pre_fw_hook(self, module, inputs): pass

        def _post_fw_hook(self, module, inputs, outputs): pass

        def _pre_bw_hook(self, module, args): pass

        def _post_bw_hook(self, module, args): pass

        def __enter__(self):
            self._entry_fake_mode = active_fake_mode()
            return super().__enter__()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # DTensor finds an op's output shape by running it on global-shape fake tensors in a fake
            # mode of its own: not this rank's memory. torch 2.13's MemTracker skips those ops itself;
            # 2.11's counted them (a traced zero3 step's optimizer at 16Ψ, not 8Ψ/N).
            if active_fake_mode() is not self._entry_fake_mode and not any(t is DTensor for t in types):
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    return GlobalPeakTracker()
