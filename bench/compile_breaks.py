"""Graph breaks of loom's compiled blocks, counted on a CPU (issue 39: compile pays only when each
block is one graph). The blocks are compiled as `train.compile` compiles them
(loom/parallel/apply.py `compile_blocks`) with AOT autograd but without inductor (the breaks are
dynamo's), and run forward and backward twice beside an eager copy.

    python bench/compile_breaks.py [--json FILE]   # every case: breaks, graphs, gradients vs eager

Used by `loom bench compile` (its rows) and tests/distributed/test_compile.py (zero breaks).
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's loom

CASES = [(name, ac, lora) for name in ("tiny", "tiny-moe") for ac in ("none", "full", "op")
         for lora in (False, True)]


def graph_breaks(name: str, ac: str, lora: bool) -> tuple[dict, int, list, float, int]:
    """(dynamo's graph breaks by reason, graphs compiled, each MoE block's routing tally (forward
    calls, choices counted), the largest relative gap of a gradient to eager's, parameters with a
    gradient). MoE experts run CUDA's grouped path as on a GPU, under bf16 autocast (the kernel's
    meta checks for bf16). Run it in a fresh process: dynamo's state is the process's."""
    import torch
    from torch._dynamo.utils import counters

    from loom.config import load_config
    from loom.models.gpt.config import preset
    from loom.models.gpt.model import build_model
    from loom.models.gpt.moe import Experts, moe_modules
    from loom.models.lora import apply_lora, blocks_of
    from loom.parallel.activation_checkpointing import apply_activation_checkpointing
    from loom.parallel.apply import compile_blocks

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model(preset(name), device="cpu")
    model.init_weights(0)
    moe = bool(model.cfg.moe_experts)
    for module in model.modules():
        if isinstance(module, Experts):
            module.grouped = torch.bfloat16
    if lora:
        apply_lora(model, blocks_of(model.layers), load_config(None, ["lora.rank=8"]).lora, torch.float32, 0)
    apply_activation_checkpointing(model.layers, ac, 1)
    eager = copy.deepcopy(model)
    counters.clear()
    compile_blocks(model.blocks(), backend="aot_eager")
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 33))
    for _ in range(2):
        for m in (model, eager):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=moe):
                loss = m(tokens[:, :-1], targets=tokens[:, 1:])
            loss.backward()
    breaks = {k.split("\n")[0]: v for k, v in counters["graph_break"].items()}
    tally = [(block.stats.calls, int(block.stats.load.sum())) for block in moe_modules(model)]
    want = dict(eager.named_parameters())
    # (a LoRA A's first gradient is zero: its B starts at zero)
    gaps = {n: ((p.grad - want[n].grad).norm() / (want[n].grad.norm() + 1e-30)).item()
            for n, p in model.named_parameters() if p.grad is not None}
    return breaks, counters["stats"]["unique_graphs"], tally, max(gaps.values()), len(gaps)


def label(name: str, ac: str, lora: bool) -> str:
    return f"{name}{', AC ' + ac if ac != 'none' else ''}{', LoRA' if lora else ''}"


def main() -> None:
    rows = []
    for case in CASES:
        breaks, graphs, _, gap, _ = graph_breaks(*case)
        rows.append({"case": label(*case), "graph_breaks": sum(breaks.values()), "graphs": graphs,
                     "gradient_gap": gap, "reasons": breaks})
        print(f"{label(*case):24s} breaks {sum(breaks.values())}  graphs {graphs}  gradient gap {gap:.1e}"
              + "".join(f"\n    {reason}: {n}" for reason, n in breaks.items()))
        sys.stdout.flush()
    if "--json" in sys.argv:
        Path(sys.argv[sys.argv.index("--json") + 1]).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
