"""Third-party warnings known to be harmless in loom's runs, silenced where the engine that causes
them is set up, each by its precise message: every other warning still shows.

  - DeepSpeed's ZeRO calls torch.distributed's collectives by their old names (the same operations),
    and torch warns at every call: 42 FutureWarnings in a 10-step zero3 run on 2 ranks.
  - DTensor, under TP × FSDP, all-reduces the gradient norm's partial sums over the dp and tp mesh
    dims one after the other, and every rank logs advice to flatten the mesh: the norm is one
    scalar per step, and every rank gets the same sum.
  - DeepSpeed, imported without DS_ACCELERATOR, probes for accelerators and warns when it settles
    on the CPU (loom.config.choose_deepspeed_accelerator names it first); its CPU communication
    backend prints "DeepSpeed … built successfully" on every rank where it builds its shared-memory
    op (loom marks that op unavailable: deepspeed_engine.join_process_group).
  - DeviceMesh warns that slicing a flattened dim (dp_shard_cp, and dp_shard under ep) from the
    root mesh "will be deprecated": FSDP2's 2-D meshes that pair a flattened dim with another
    (dp_replicate × dp_shard_cp) have no other construction in its API.
  - ModTracker (under MemTracker, loom's CPU peak-memory meter) warns that "the module hierarchy
    tracking maybe be messed up" when a module runs inside itself (HF Llama's rotary embedding):
    the peak is counted per storage, and loom reads no module hierarchy (rank_memory.py).
  - torch.profiler (2.11 at a trace's first cycle, 2.13 at a later one) warns that it "clears events
    at the end of each cycle": loom writes each cycle's trace as it ends (loom/observe/profiler.py).

(DDP under a pipeline needs no find_unused_parameters, and so prints no note about it: see
loom/parallel/ddp.py.)
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import sys
import warnings
from collections.abc import Iterator

RENAMED_COLLECTIVES = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"
DTENSOR_LOGGER = "torch.distributed.tensor._redistribute"
FLATTENED_DIM_SLICING = r"Slicing a flattened dim from root mesh will be deprecated"
MODULE_HIERARCHY = r"The module hierarchy tracking maybe be messed up"
PROFILER_CYCLES = r"Warning: Profiler clears events at the end of each cycle"
DEEPSPEED_BUILT = re.compile(r"^DeepSpeed \S+ built successfully$")
SEQUENTIAL_REDISTRIBUTE = "While redistributing from %s to %s, %d sequential %s operations will be performed"


class _DropMessage(logging.Filter):
    """Drops a logger's records of one message (its format string, before the arguments)."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def silence_deepspeed_collective_names() -> None:
    warnings.filterwarnings("ignore", message=RENAMED_COLLECTIVES, category=FutureWarning)


def silence_dtensor_sequential_redistribute() -> None:
    logger = logging.getLogger(DTENSOR_LOGGER)
    if not any(isinstance(f, _DropMessage) for f in logger.filters):
        logger.addFilter(_DropMessage(SEQUENTIAL_REDISTRIBUTE))


def silence_flattened_dim_slicing() -> None:
    warnings.filterwarnings("ignore", message=FLATTENED_DIM_SLICING, category=UserWarning)


def silence_module_hierarchy() -> None:
    warnings.filterwarnings("ignore", message=MODULE_HIERARCHY, category=UserWarning)


def silence_profiler_cycles() -> None:
    warnings.filterwarnings("ignore", message=PROFILER_CYCLES, category=UserWarning)


@contextlib.contextmanager
def deepspeed_build_notes_dropped() -> Iterator[None]:
    """What a block prints, less DeepSpeed's "DeepSpeed <op> built successfully" lines."""
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        yield
    sys.stdout.write("".join(line for line in said.getvalue().splitlines(keepends=True)
                             if not DEEPSPEED_BUILT.match(line.rstrip("\n"))))
