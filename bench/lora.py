"""LoRA against a full fine-tune on 2 CPU ranks (gloo): the small preset's layout widened to d 512
(8 heads, 4 of them k/v, SwiGLU width 1536, 4 blocks, byte vocabulary: 12.8M parameters), 8 × 256
tokens per step, trained in full and with LoRA rank 16 (alpha 32) on every block linear
(lora.targets = all-linear: 0.62M fp32 adapter parameters, 4.8% of the base), under zero3 and ddp,
in fp32 and in bf16 (lora.base_dtype = auto: the frozen base is stored in the compute dtype).

Each case is `loom train` run as a user runs it (bench/suite.py's Context.train), full and LoRA
alternated (full, LoRA, full, LoRA, ...: --pairs of each) so drift of the machine hits both alike.
From each run's records:

  tokens/s      summary.json (the steady steps, after the first two); the LoRA ÷ full ratio is the
                median of the pairwise ratios, with their range
  model states  memory.json, measured per rank after the first optimizer step: the bytes of the
                parameters (frozen base included), gradients and optimizer states it holds
  peak          memory.json: the live tensor bytes at the peak of step 2 (MemTracker on CPU)
  fwd/bwd/opt   metrics.jsonl: the always-on ledger's forward, backward and optimizer time per step
  busy          memory.json: the share of the timed steps the ranks spent waiting for a core that
                other processes held (summed over the ranks, as loom's summary does); "own cores" is
                tokens/s ÷ (1 − busy), loom's estimate of the run on cores of its own. Above ~0.1
                the machine was loaded and both figures are noisy: more --pairs help

Goals (issue 29): LoRA's model states per rank ≤ 0.2 × the full fine-tune's; LoRA's tokens/s ≥ 1.2 ×.
A full fine-tune holds 16 bytes per parameter (fp32 weight, gradient, Adam's m and v; under bf16 too:
fp32 master weights), LoRA b per frozen parameter plus 16 per adapter parameter: with an fp32 base
(b = 4) the ratio is at least 0.25, so the states goal needs a 16-bit base (bf16: b = 2, about 0.17).

--profile also runs `loom profile` + `loom analyze` on the first strategy and precision, full and
LoRA (bench/context_parallel.py's profile_run), and prints where a step's time goes in each.

    python bench/lora.py [--pairs 2] [--strategies zero3 ddp] [--precisions fp32 bf16] [--profile]
                         [--json PATH (bench/lora_results.json)] [--table PATH] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from context_parallel import profile_run  # bench/context_parallel.py (run from bench/, its folder)
from harness import Context, Progress
from provenance import describe, provenance

HERE = Path(__file__).resolve().parent
MIB = 2**20
SEQ, BATCH, STEPS = 256, 8, 8
MODEL = ("model.preset=small", "model.d_model=512", "model.n_layers=4", "model.ffn_hidden=1536",
         f"model.max_seq_len={SEQ}")
WORKLOAD = (*MODEL, f"data.seq_len={SEQ}", f"train.batch_size={BATCH}", "data.num_workers=0",
            "train.eval_batches=0")
LORA = ("lora.rank=16", "lora.alpha=32")
STATES_GOAL, SPEED_GOAL = 0.2, 1.2
PHASES = ("forward", "backward", "optimizer")


def _sets(strategy: str, precision: str, lora: bool, steps: int) -> list[str]:
    return [*WORKLOAD, f"train.steps={steps}", f"parallel.strategy={strategy}",
            f"train.precision={precision}", *(LORA if lora else ())]


def _measures(run) -> dict:
    """What one run measured: tokens/s, per-rank memory (the largest rank's), the ledger's phases."""
    ranks = run.memory["ranks"].values()
    steady = run.metrics[2:] or run.metrics
    busy = min(sum(r.get("core_wait_share") or 0.0 for r in ranks), 0.9)
    return {"tokens_per_s": run.tokens_per_s, "own_cores_tokens_per_s": run.tokens_per_s / (1 - busy),
            "busy": busy,
            "model_states_mib": max(r["model_state_bytes"] for r in ranks) / MIB,
            "peak_mib": max(r["peak_bytes"] for r in ranks) / MIB,
            "step_ms": 1e3 * statistics.mean(m["step_time_s"] for m in steady),
            **{f"{p}_ms": 1e3 * statistics.mean(m.get(f"{p}_s", 0.0) for m in steady) for p in PHASES}}


def _ratios(lora: list[dict], full: list[dict], key: str) -> dict:
    """LoRA ÷ full of `key`, pair by pair: the median and the range."""
    r = [a[key] / b[key] for a, b in zip(lora, full)]
    return {"median": statistics.median(r), "min": min(r), "max": max(r)}


def run_case(ctx: Context, strategy: str, precision: str, pairs: int, steps: int) -> dict:
    """Full and LoRA alternated `pairs` times (LoRA first): each side's medians, every run's figures,
    the LoRA ÷ full ratios and the goals."""
    runs: dict[str, list[dict]] = {"full": [], "lora": []}
    commands: dict[str, str] = {}

    def side(kind: str):
        def run() -> float:
            done = ctx.train(_sets(strategy, precision, kind == "lora", steps),
                             label=f"{strategy} {precision} {kind}")
            runs[kind].append(_measures(done))
            commands[kind] = done.command
            return done.tokens_per_s
        return run

    ctx.alternate(side("lora"), side("full"), pairs)
    row: dict = {"strategy": strategy, "precision": precision}
    for kind, seen in runs.items():
        row[kind] = {**{k: statistics.median(r[k] for r in seen) for k in seen[0]},
                     "command": commands[kind], "runs": seen}
    row["speed_ratio"] = _ratios(runs["lora"], runs["full"], "tokens_per_s")
    row["own_cores_speed_ratio"] = _ratios(runs["lora"], runs["full"], "own_cores_tokens_per_s")
    row["states_ratio"] = row["lora"]["model_states_mib"] / row["full"]["model_states_mib"]
    row["peak_ratio"] = row["lora"]["peak_mib"] / row["full"]["peak_mib"]
    row["states_met"] = row["states_ratio"] <= STATES_GOAL
    row["speed_met"] = row["speed_ratio"]["median"] >= SPEED_GOAL
    return row


COLUMNS = (("tokens/s", "tokens_per_s", 9, 0), ("own cores", "own_cores_tokens_per_s", 9, 0),
           ("busy", "busy", 5, 2), ("step ms", "step_ms", 8, 0), ("fwd", "forward_ms", 6, 0),
           ("bwd", "backward_ms", 6, 0), ("opt", "optimizer_ms", 5, 0),
           ("states MiB", "model_states_mib", 11, 2), ("peak MiB", "peak_mib", 9, 1))


def print_table(rows: list[dict], where: dict, pairs: int) -> None:
    print(f"\nLoRA r=16 (alpha 32, all-linear) vs full fine-tune: d 512, 4 blocks, SwiGLU 1536, {BATCH} × "
          f"{SEQ} tokens per step, 2 gloo ranks (CPU); medians of {pairs} alternated run(s) of each")
    print(f"{'case':18}" + "".join(f" {title:>{w}}" for title, _, w, _ in COLUMNS))
    for r in rows:
        for kind in ("full", "lora"):
            cells = "".join(f" {r[kind][key]:{w}.{d}f}" for _, key, w, d in COLUMNS)
            print(f"{r['strategy'] + ' ' + r['precision'] + ' ' + kind:18}{cells}")
        speed, own = r["speed_ratio"], r["own_cores_speed_ratio"]
        gap = " " * sum(w + 1 for _, _, w, _ in COLUMNS[2:7])
        print(f"{'  LoRA ÷ full':18} {speed['median']:9.2f} {own['median']:9.2f}{gap} "
              f"{r['states_ratio']:11.3f} {r['peak_ratio']:9.3f}")
        print(f"{'':18} {speed['min']:4.2f}–{speed['max']:<4.2f} {own['min']:4.2f}–{own['max']:<4.2f}"
              f"  (tokens/s ratios over the pairs: the range)")
    print(f"\ngoals (issue 29): model states ≤ {STATES_GOAL} × full; tokens/s ≥ {SPEED_GOAL} × full "
          f"(judged on the measured tokens/s, the own-cores estimate beside it)")
    for r in rows:
        speed, own = r["speed_ratio"]["median"], r["own_cores_speed_ratio"]["median"]
        print(f"  {r['strategy']:5} {r['precision']}: model states {r['states_ratio']:.3f} × "
              f"{'met' if r['states_met'] else 'NOT met'}; tokens/s {speed:.2f} × "
              f"{'met' if r['speed_met'] else 'NOT met'} (own cores {own:.2f} ×)")
    if any(r["precision"] == "fp32" for r in rows):
        print("  (fp32: the frozen base alone is 4 of full's 16 bytes per parameter, 0.25: the states goal "
              "needs a 16-bit base)")
    busy = max(r[k]["busy"] for r in rows for k in ("full", "lora"))
    if busy > 0.1:
        print(f"  the machine was loaded (other processes held the cores up to {busy:.0%} of the time): "
              f"tokens/s are noisy; rerun with more --pairs on a quiet machine")
    print(describe(where))


# --profile: where a step's time goes, full vs LoRA ------------------------------------------------

def profile_pair(strategy: str, precision: str, root: Path) -> dict:
    """`loom profile` + `loom analyze` of full and LoRA (3 profiled steps each): the ledger's step
    phases and the operators that take the time, per profiled step."""
    out = {}
    for kind in ("full", "lora"):
        folder = root / f"profile_{kind}"
        profile_run(2, tuple(_sets(strategy, precision, kind == "lora", 6)), folder)
        rank0 = json.loads((folder / "ledger.json").read_text())["ranks"]["0"]
        steps = rank0["steps"]
        out[kind] = {"phases": {k: statistics.mean(s.get(k, 0.0) for s in steps)
                                for k in ("wall_ms", "forward_ms", "backward_ms", "optimizer_ms",
                                          "compute_ms", "comm_exposed_ms", "comm_hidden_ms")},
                     "ops": {o["name"]: [o["self_ms"] / len(steps), o["count"] / len(steps)]
                             for o in rank0["top_ops"]}}
    return out


def print_profile(prof: dict, strategy: str, precision: str, top: int = 12) -> None:
    print(f"\nprofile ({strategy} {precision}, rank 0, per profiled step of `loom profile`: 3 of 6 steps, "
          f"a unit per block)")
    print(f"{'':22} {'full':>9} {'lora':>9}")
    for key in prof["full"]["phases"]:
        print(f"{key:22} {prof['full']['phases'][key]:9.1f} {prof['lora']['phases'][key]:9.1f}")
    names = sorted({*prof["full"]["ops"], *prof["lora"]["ops"]},
                   key=lambda n: -max(prof[k]["ops"].get(n, [0, 0])[0] for k in ("full", "lora")))[:top]
    print(f"{'operator (self ms, calls)':58} {'full':>16} {'lora':>16}")
    for n in names:
        cells = []
        for kind in ("full", "lora"):
            ms, count = prof[kind]["ops"].get(n, [0.0, 0])
            cells.append(f"{ms:8.1f} ×{count:<6.0f}")
        print(f"  {n[:56]:56} {cells[0]:>16} {cells[1]:>16}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=2, help="full/LoRA runs alternated per case (2)")
    ap.add_argument("--steps", type=int, default=STEPS, help=f"steps per run, 2 untimed ({STEPS})")
    ap.add_argument("--strategies", nargs="+", default=["zero3", "ddp"], choices=["zero3", "ddp"])
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--profile", action="store_true",
                    help="also profile full vs LoRA (the first strategy and precision)")
    ap.add_argument("--json", type=Path, default=HERE / "lora_results.json")
    ap.add_argument("--table", type=Path, help="only print the table of a results file")
    ap.add_argument("--keep", type=Path, help="keep the run directories here")
    a = ap.parse_args()
    if a.table:
        saved = json.loads(a.table.read_text())
        print_table(saved["rows"], saved["provenance"], saved["pairs"])
        if saved.get("profile"):
            print_profile(saved["profile"], saved["rows"][0]["strategy"], saved["rows"][0]["precision"])
        return
    cases = [(s, p) for p in a.precisions for s in a.strategies]
    with tempfile.TemporaryDirectory(prefix="loom-lora-") as tmp:
        work = a.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        ctx = Context(False, work, {"benches": {}}, Progress(2 * a.pairs * len(cases) + 2 * a.profile), work)
        ctx.bench = "lora"
        rows = [run_case(ctx, s, p, a.pairs, a.steps) for s, p in cases]
        prof = profile_pair(*cases[0], work) if a.profile else None
    where = provenance()
    print_table(rows, where, a.pairs)
    if prof:
        print_profile(prof, *cases[0])
    a.json.write_text(json.dumps({"provenance": where, "pairs": a.pairs, "steps": a.steps,
                                  "workload": list(WORKLOAD), "lora": list(LORA), "rows": rows,
                                  "profile": prof}, indent=1))
    print(f"results: {a.json}")


if __name__ == "__main__":
    main()
