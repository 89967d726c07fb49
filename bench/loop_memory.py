"""One rank's step peak, `loom train` against a hand-written loop over the same model (issue 39's
memory goal, CPU form: within 5% of the loop).

Both are measured by the same tracker (torch's MemTracker, as loom's memory.json measures a CPU
step) over the second step, when the optimizer's states exist: loom's reported peak_bytes, and the
loop's peak. The loop is what one writes without a framework: forward with the chunked loss,
backward, clip, foreach AdamW, zero_grad(set_to_none=True).

    python bench/loop_memory.py [--json FILE]

`loom bench --only memory` prints its row; tests/unit/test_memory_vs_plain_loop.py asserts it.
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's loom

BATCH, SEQ, CHUNK = 8, 128, 512
# Parameters heavy beside the activations, so that the gradients' 4Ψ are an eighth of the peak: a
# copy of them held across the step (DDP's buckets) cannot hide in the band.
PRESET, LAYERS = "small", 2


def loom_keys(corpus: Path) -> list[str]:
    return [f"model.preset={PRESET}", f"model.n_layers={LAYERS}", f'data.source="{corpus}"',
            f"data.seq_len={SEQ}", "data.num_workers=0", "data.eval_fraction=0.05", "train.steps=3",
            f"train.batch_size={BATCH}", f"train.loss_chunk={CHUNK}", "train.eval_batches=0",
            "parallel.strategy=ddp", "train.optimizer_impl=foreach"]


def loom_peak(corpus: Path) -> int:
    """`loom train` on one rank (ddp, the default strategy): rank 0's step peak."""
    from loom.config import load_config
    from loom.train.driver import train

    return train(load_config(None, loom_keys(corpus)), None, quiet=True).memory[0]["peak_bytes"]


def plain_loop_peak() -> int:
    import torch

    from loom.models.gpt.config import preset
    from loom.models.gpt.model import build_model
    from loom.observe.rank_memory import global_peak_tracker

    cfg = preset(PRESET, n_layers=LAYERS)
    model = build_model(cfg, "cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def step() -> None:
        tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ))
        model(tokens, targets=tokens, loss_chunk=CHUNK).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the optimizer's states exist from here on, as in loom's tracked second step
    tracker = global_peak_tracker()
    tracker.track_external(model, optimizer)
    with tracker:
        step()
    return int(sum(v.get("Total", 0) for v in tracker.get_tracker_snapshot("peak").values()))


def gradient_bytes() -> int:
    """The model's fp32 gradients, 4Ψ: what a copy held across the step would add."""
    from loom.models.gpt.config import preset
    from loom.models.gpt.model import build_model

    return 4 * sum(p.numel() for p in build_model(preset(PRESET, n_layers=LAYERS)).parameters())


def main() -> None:
    corpus = Path(__file__).resolve().parent / ".loop_memory_corpus.txt"
    corpus.write_text(inspect.getsource(json) * 4)
    try:
        loom = loom_peak(corpus)
    finally:
        corpus.unlink(missing_ok=True)
    plain = plain_loop_peak()
    row = {"loom_mib": loom / 2**20, "loop_mib": plain / 2**20, "ratio": loom / plain,
           "gradients_mib": gradient_bytes() / 2**20,
           "shape": f"{PRESET} preset, {LAYERS} layers, {BATCH} × {SEQ} tokens, fp32, loss_chunk {CHUNK}"}
    print(f"one rank's step peak: loom {row['loom_mib']:.1f} MiB, hand-written loop "
          f"{row['loop_mib']:.1f} MiB ({row['ratio']:.3f}×; the gradients are {row['gradients_mib']:.1f} MiB)"
          f" — {row['shape']}")
    if "--json" in sys.argv:
        Path(sys.argv[sys.argv.index("--json") + 1]).write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
