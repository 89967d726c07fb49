"""Third-party warnings known to be harmless in loom's runs, silenced where the engine that causes
them is set up, each by its precise message: every other warning still shows.

  - DeepSpeed's ZeRO calls torch.distributed's collectives by their old names (the same operations),
    and torch warns at every call: 42 FutureWarnings in a 10-step zero3 run on 2 ranks.
  - DTensor, under TP × FSDP, all-reduces the gradient norm's partial sums over the dp and tp mesh
    dims one after the other, and every rank logs advice to flatten the mesh: the norm is one
    scalar per step, and every rank gets the same sum.

(DDP under a pipeline needs no find_unused_parameters, and so prints no note about it: see
loom/parallel/ddp.py.)
"""

from __future__ import annotations

import logging
import warnings

RENAMED_COLLECTIVES = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"
DTENSOR_LOGGER = "torch.distributed.tensor._redistribute"
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
