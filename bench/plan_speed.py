"""How fast `loom plan` searches: every candidate for a 70B model on 1024 GPUs (target < 2 s).

    python bench/plan_speed.py [--gpus-per-node 8] [--nodes 128] [--repeat 3]

Prints the candidate count, the search time (best of --repeat) in one process and over the worker
processes `loom plan` takes on this machine (one per core), and the recommendation.
"""

from __future__ import annotations

import argparse
import time

from loom.plan.candidate import Workload
from loom.plan.hardware import Cluster, lookup
from loom.plan.search import enumerate_candidates, search, search_workers
from loom.plan.shapes import from_preset


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="70b")
    ap.add_argument("--gpu", default="H100-SXM")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--nodes", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--global-batch", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    workload = Workload(from_preset(args.model), args.seq_len, args.global_batch)
    cluster = Cluster(lookup(args.gpu), args.gpus_per_node, args.nodes)
    workers = search_workers(len(list(enumerate_candidates(workload, cluster))))
    timed = {}
    for count in sorted({1, workers}):
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            plan = search(workload, cluster, workers=count)
            times.append(time.perf_counter() - start)
        timed[count] = min(times)
    print(f"{args.model} on {cluster.describe()} ({cluster.world_size} GPUs), "
          f"global batch {args.global_batch} × {args.seq_len}: {len(plan.candidates)} candidates "
          f"(best of {args.repeat}; target < 2 s)")
    for count, seconds in timed.items():
        print(f"  {count} process{'es' if count > 1 else ''}: {seconds:.3f} s, "
              f"{len(plan.candidates) / seconds:,.0f} candidates/s"
              + (f", {timed[1] / seconds:.2f}× one" if count > 1 else ""))
    best = plan.candidates[plan.recommended]
    print(f"recommended: {best['label']}, micro-batch {best['micro_batch']} × {best['grad_accum']}, "
          f"{best['memory_bytes']['total'] / 1e9:.1f} GB per GPU, {best['tokens_per_s']:,.0f} tokens/s, "
          f"MFU {best['mfu']:.0%}")


if __name__ == "__main__":
    main()
