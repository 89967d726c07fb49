"""How fast the step ledger reads traces: 8 ranks × ~100 MB of CPU-style (gloo DDP) trace.

    python bench/analyze_speed.py [--ranks 8] [--mb 100] [--gzip] [--workers N]

Writes one rank's trace in Kineto's pretty-printed layout (a DataLoader fetch, a DDP forward,
backward ops with 4 bucket all-reduces run on gloo runloop threads, an AdamW step, a loss.item()
per step), copies it for the other ranks (rank from the file name) into a temporary directory,
runs `analyze_dir` and prints the wall time and peak memory (max RSS of this process plus that of
its largest child: the analyzing workers) against the targets (< 60 s, < 3 GB).
"""

from __future__ import annotations

import argparse
import gzip
import json
import resource
import shutil
import tempfile
import time
from pathlib import Path

from loom.observe.ledger import analyze_dir

PID, MAIN, GLOO = 4242, 4242, 4250
STEP_US = 10_000.0
_ARGS = '"External id": {i},"Record function id": 0, "Ev Idx": {i}'


def _event(name: str, cat: str, tid: int, ts: float, dur: float, i: int, extra: str = "") -> str:
    args = _ARGS.format(i=i) + extra
    return (f'  {{\n    "ph": "X", "cat": "{cat}", "name": "{name}", "pid": {PID}, "tid": {tid},\n'
            f'    "ts": {ts:.3f}, "dur": {dur:.3f},\n    "args": {{\n      {args}\n    }}\n  }}')


def _step(n: int, t0: float, i: int) -> list[str]:
    """One step's events (about 420), starting at t0 µs."""
    ev = [_event(f"ProfilerStep#{n}", "user_annotation", MAIN, t0, STEP_US - 20, i)]
    add = ev.append
    add(_event("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", "user_annotation", MAIN, t0,
               500, i))
    for k in range(20):  # collate
        add(_event("aten::stack", "cpu_op", MAIN, t0 + 10 + 24 * k, 20, i + k))
    add(_event("DistributedDataParallel.forward", "user_annotation", MAIN, t0 + 500, 2500, i))
    for k in range(40):
        s = t0 + 510 + 60 * k
        add(_event("aten::linear", "cpu_op", MAIN, s, 50, i + k))
        add(_event("aten::addmm", "cpu_op", MAIN, s + 5, 40, i + k))
    for k in range(80):
        s = t0 + 3000 + 50 * k
        add(_event("autograd::engine::evaluate_function: AddmmBackward0", "cpu_op", MAIN, s, 40, i + k))
        add(_event("aten::mm", "cpu_op", MAIN, s + 2, 30, i + k))
        if k % 20 == 19:  # a bucket is ready: enqueue its all-reduce; gloo runs it
            shapes = ', "Input Dims": [[[262144]], [], []], "Input type": ["TensorList", "", ""]'
            add(_event("c10d::allreduce_", "cpu_op", MAIN, s + 33, 5, i + k, shapes))
            add(_event("gloo:all_reduce", "user_annotation", GLOO + k % 2, s + 40, 400, i + k,
                       ', "Input Dims": [[262144]], "Input type": ["float"]'))
    add(_event("Optimizer.step#AdamW.step", "user_annotation", MAIN, t0 + 7200, 2000, i))
    for k in range(130):
        add(_event("aten::_foreach_lerp_" if k % 2 else "aten::add_", "cpu_op", MAIN, t0 + 7210 + 15 * k,
                   12, i + k))
    add(_event("Optimizer.zero_grad#AdamW.zero_grad", "user_annotation", MAIN, t0 + 9250, 100, i))
    add(_event("aten::item", "cpu_op", MAIN, t0 + 9400, 20, i))
    add(_event("aten::_local_scalar_dense", "cpu_op", MAIN, t0 + 9402, 15, i))
    return ev


def write_trace(path: Path, megabytes: float, compress: bool) -> int:
    """One rank's trace of about `megabytes`; returns its step count."""
    head = {"schemaVersion": 1, "deviceProperties": [],
            "distributedInfo": {"backend": "gloo", "rank": 0, "world_size": 8, "pg_count": 1},
            "displayTimeUnit": "ms", "baseTimeNanoseconds": 1_700_000_000_000_000_000}
    target = megabytes * 1e6
    written, n = 0, 0
    with gzip.open(path, "wt", compresslevel=1) if compress else open(path, "w") as f:
        text = json.dumps(head, indent=2)[:-2] + ',\n  "traceEvents": [\n'
        f.write(text)
        while written < target:
            chunk = ",\n".join(_step(n, 1e6 + n * STEP_US, n * 1000)) + ",\n"
            f.write(chunk)
            written += len(chunk)
            n += 1
        f.write(_event("aten::empty", "cpu_op", MAIN, 1e6 + n * STEP_US, 1, 0)
                + '\n  ],\n  "traceName": "bench"\n}\n')
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--mb", type=float, default=100.0, help="trace size per rank (uncompressed MB)")
    ap.add_argument("--gzip", action="store_true", help="write .json.gz traces")
    ap.add_argument("--workers", type=int, default=None, help="analysis processes (default: one per core)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        ext = ".json.gz" if args.gzip else ".json"
        first = Path(tmp) / f"trace_rank0{ext}"
        steps = write_trace(first, args.mb, args.gzip)
        for r in range(1, args.ranks):
            shutil.copyfile(first, Path(tmp) / f"trace_rank{r}{ext}")
        size = sum(p.stat().st_size for p in Path(tmp).iterdir())
        print(f"generated {args.ranks} ranks × {steps} steps, {size / 1e6:.0f} MB on disk "
              f"in {time.perf_counter() - start:.1f} s")
        self_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        start = time.perf_counter()
        out = analyze_dir(tmp, workers=args.workers)
        wall = time.perf_counter() - start
    peak_kb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
               + resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    led = out["ranks"]["0"]
    s = led["steps"][len(led["steps"]) // 2]
    print(f"analyze_dir: {wall:.1f} s (target < 60 s), peak RSS {peak_kb / 1e6:.2f} GB (target < 3 GB; "
          f"this process {self_before / 1e6:.2f} GB before analysis)")
    print(f"{len(out['ranks'])} ranks, {len(led['steps'])} steps and {len(led['collectives'])} collectives "
          f"per rank; a step: wall {s['wall_ms']:.2f} ms, shares {s['shares']}")


if __name__ == "__main__":
    main()
