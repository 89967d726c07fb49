"""Host reads in a steady training step (issue 39: each one is a device sync on a GPU, which stalls
the host until the device drains and leaves the device idle while the host catches up).

Counted with a dispatch mode (the ops that read a tensor's values on the host: item,
_local_scalar_dense, nonzero, is_nonzero) and `Tensor.tolist`, which reads without the dispatcher,
from the third step on, in the data, forward, backward and pipeline phases. The optimizer's phase
is apart: on CPU the foreach AdamW's step counters are read by the library; on CUDA loom runs the
fused one, which reads nothing.

    python bench/host_reads.py [--json FILE]   # one rank: dense, LoRA, MoE (CPU's loop, CUDA's grouped)

`steady_reads` is what tests/distributed/test_host_syncs.py runs on every layout; `host_reads`
counts a block's reads in tests/unit/test_grouped_experts.py.
"""

from __future__ import annotations

import contextlib
import json
import sys
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's loom

READS = ("_local_scalar_dense", "nonzero", "is_nonzero", "item")


def _site(package: str) -> str:
    """The innermost frame of loom's package that asked for the read (file:function)."""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename.startswith(package):
            return f"{Path(frame.filename).name}:{frame.name}"
    return "?"


@contextlib.contextmanager
def host_reads(note: Callable[[], None]) -> Iterator[None]:
    """Calls `note()` at every read of a tensor's values on the host within the block: the ops that
    read (a dispatch mode) and `Tensor.tolist`, which reads without the dispatcher."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    tolist = torch.Tensor.tolist

    def counted_tolist(tensor):
        note()
        return tolist(tensor)

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in READS:
                note()
            return func(*args, **(kwargs or {}))

    torch.Tensor.tolist = counted_tolist
    try:
        with Reads():
            yield
    finally:
        torch.Tensor.tolist = tolist


def steady_reads(cfg, grouped: bool) -> dict[str, float]:
    """Train `cfg`; the host reads per step of steps 3.. in the data, forward, backward and pipeline
    phases, by site. `grouped`: the experts as grouped GEMMs (CUDA's path, in its CPU form)."""
    import torch

    import loom
    from loom.models.gpt import moe
    from loom.train import meters
    from loom.train.driver import train

    package = str(Path(loom.__file__).parent) + "/"
    choose = moe.grouped_dtype
    if grouped:
        moe.grouped_dtype = lambda device, dtype, *widths: torch.float32
    state = {"phase": None, "steps": 0}
    reads: Counter = Counter()

    def note() -> None:
        if state["steps"] >= 2 and state["phase"] not in (None, "optimizer"):
            reads[_site(package)] += 1

    phase = meters.PhaseTimer.phase

    @contextlib.contextmanager
    def tracked(self, name):
        state["phase"] = name
        try:
            with phase(self, name):
                yield
        finally:
            state["phase"] = None
            state["steps"] += name == "optimizer"

    meters.PhaseTimer.phase = tracked
    try:
        with host_reads(note):
            r = train(cfg, None, quiet=True)
    finally:
        meters.PhaseTimer.phase = phase
        moe.grouped_dtype = choose
    steps = len(r.losses) - 2
    return {site: n / steps for site, n in reads.items()}


CASES = {  # one rank: (keys, experts grouped)
    "dense": ((), False),
    "LoRA rank 4": (("lora.rank=4",), False),
    "MoE, CPU's per-expert loop": (("model.preset=tiny-moe",), False),
    "MoE, CUDA's grouped GEMMs": (("model.preset=tiny-moe",), True),
}


def main() -> None:
    import inspect

    from loom.config import load_config

    corpus = Path(sys.argv[0]).resolve().parent / ".host_reads_corpus.txt"
    corpus.write_text(inspect.getsource(json) * 4)
    rows = []
    try:
        for name, (keys, grouped) in CASES.items():
            cfg = load_config(None, ["model.preset=tiny", f'data.source="{corpus}"', "data.seq_len=64",
                                     "data.num_workers=0", "train.steps=4", "train.batch_size=8",
                                     "train.eval_batches=0", *keys])
            reads = steady_reads(cfg, grouped)
            rows.append({"case": name, "host_reads_per_step": sum(reads.values()), "sites": reads})
            sites = "".join(f"  {s}: {n:g}" for s, n in reads.items())
            print(f"{name:28s} {sum(reads.values()):g} per step{sites}")
    finally:
        corpus.unlink(missing_ok=True)
    if "--json" in sys.argv:
        Path(sys.argv[sys.argv.index("--json") + 1]).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
