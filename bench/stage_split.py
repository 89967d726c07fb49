"""A pipeline's stages, split evenly and as the planner balances them (parallel.pp_stage_layers), side
by side on CPU ranks: the small preset with a 16,384-token vocabulary (its head is about five of its
blocks at 128 tokens), pp 2, 1f1b, 8 micro-batches of one 128-token sequence, ddp, fp32, gloo, a core
per rank.

Each runs `loom profile` then `loom analyze` (bench/context_parallel.py's profile_run) and reads the
ledger's compute per rank and step time, beside the plan's: the busiest rank's FLOPs per token under
each split (plan/shapes.stage_flops_per_token) and the split the even run's diagnosis names.

    python bench/stage_split.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from context_parallel import profile_run  # bench/context_parallel.py (run from bench/, its folder)
from provenance import provenance

from loom.config import stage_sizes
from loom.plan.shapes import balanced_split, from_preset, stage_flops_per_token, with_stage_split

PP, MICROBATCHES, SEQ, VOCAB = 2, 8, 128, 16384
SHAPE = ("model.preset=small", f"model.vocab_size={VOCAB}", "data.tokenizer=byte", f"data.seq_len={SEQ}",
         "parallel.strategy=ddp", f"parallel.pp={PP}", f"parallel.microbatches={MICROBATCHES}",
         f"train.batch_size={MICROBATCHES}")


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def run(split: tuple[int, ...], root: Path) -> dict:
    out = root / ("even" if not split else "-".join(map(str, split)))
    keys = (f"parallel.pp_stage_layers=[{', '.join(map(str, split))}]",) if split else ()
    profile_run(PP, (*SHAPE, *keys), out)
    ledger = json.loads((out / "ledger.json").read_text())
    ranks = ledger["ranks"]
    findings = [f for f in ledger.get("findings", []) if f["category"] == "stages"]
    summary = json.loads((out / "summary.json").read_text())
    return {"split": list(split), "tokens_per_s": summary["tokens_per_s"],
            "step_ms": _mean(_mean(s["wall_ms"] for s in r["steps"]) for r in ranks.values()),
            "compute_ms": [_mean(s["compute_ms"] for s in ranks[str(r)]["steps"]) for r in range(PP)],
            "suggested": findings[0]["value"] if findings else None}


def planned_busiest(split: tuple[int, ...]) -> float:
    """The busiest rank's FLOPs per token over the mean rank's, as the plan prices the split."""
    shape = with_stage_split(from_preset("small", vocab_size=VOCAB), split)
    flops = stage_flops_per_token(shape, SEQ, PP)
    return max(flops) * PP / sum(flops)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=Path(__file__).with_name("stage_split_results.json"))
    args = ap.parse_args()
    shape = from_preset("small", vocab_size=VOCAB)
    balanced = balanced_split(shape, SEQ, PP, "1f1b", 1)
    even = stage_sizes(shape.n_layers, PP)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run((), Path(tmp)), run(balanced, Path(tmp))]
    rows[0]["split"] = list(even)
    for row in rows:
        row["planned_busiest_over_mean"] = planned_busiest(tuple(row["split"]))
        compute = row["compute_ms"]
        row["measured_busiest_over_mean"] = max(compute) / _mean(compute)
    print(f"small preset, vocab {VOCAB}, pp {PP} 1f1b, {MICROBATCHES} micro-batches of {SEQ} tokens, ddp, "
          f"gloo; the planner's balanced split: {list(balanced)}")
    print(f"{'split':>8} {'tokens/s':>9} {'step ms':>8} {'compute ms by rank':>20} {'busiest/mean':>13} "
          f"{'planned':>8} {'diagnosis suggests':>19}")
    for row in rows:
        compute = " / ".join(f"{c:,.0f}" for c in row["compute_ms"])
        print(f"{'/'.join(map(str, row['split'])):>8} {row['tokens_per_s']:>9,.0f} {row['step_ms']:>8,.0f} "
              f"{compute:>20} {row['measured_busiest_over_mean']:>13.2f} "
              f"{row['planned_busiest_over_mean']:>8.2f} "
              f"{str(row['suggested']):>19}")
    speedup = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    print(f"balanced ÷ even tokens/s: {speedup:.2f}×")
    args.json.write_text(json.dumps({"provenance": provenance(), "rows": rows, "speedup": speedup}, indent=1)
                         + "\n")
    print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
