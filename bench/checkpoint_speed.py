"""Checkpoint speed: save and load time and MB/s on 2 CPU ranks, synchronous vs async saves.

    python bench/checkpoint_speed.py [--strategy zero3] [--rounds 3] [--d-model 512 --n-layers 6 --vocab 8192]
    python bench/checkpoint_speed.py --smoke      # a tiny model, one round: checks the script runs

Two gloo ranks (spawned, OMP_NUM_THREADS=1 each) build loom's GPT as `loom train` does
(parallelize, AdamW, schedule), take a real step so Adam's states exist, then each round:

  sync save   `Checkpointer(async_save=False).save()`: wall time (max over ranks), which is the
              training stall; the published checkpoint's size (sum of its files) → MB/s;
  load        `checkpoint.load()` of that checkpoint (max over ranks) → MB/s. The files were just
              written, so they are read from the page cache, not the disk;
  async save  `Checkpointer(async_save=True).save()`: the stall (`Checkpointer.stall_s`: staging to
              host memory), then
              - training steps go on, each followed by `poll()` as the loop does, until rank 0 sees
                the checkpoint published (from the save call to the poll that published it: whole
                steps); those steps' time against plain steps' (the median of the steps just
                before the save): the write competes with training for the cores;
              - once more with nothing to overlap: `save()` then `wait()`, the write alone.

Medians over the rounds are printed; `--json PATH` writes every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's loom, here and in the spawned ranks
sys.path.insert(0, str(ROOT / "bench"))
from provenance import describe, provenance  # noqa: E402

MB = 1e6


def _config(a):
    from loom.config import load_config

    return load_config(None, [
        f"model.preset={a.preset}", f"model.vocab_size={a.vocab}", f"model.d_model={a.d_model}",
        f"model.n_layers={a.n_layers}", f"model.n_heads={a.n_heads}", f"model.n_kv_heads={a.n_kv_heads}",
        f"model.ffn_hidden={a.ffn_hidden}", f"model.max_seq_len={max(a.seq_len, 8)}",
        f"data.seq_len={a.seq_len}", f"train.batch_size={a.batch_size}", "train.device=cpu",
        "train.steps=1000000",  # a checkpoint at step k loads only while k < train.steps
        "train.warmup_steps=1", "train.lr=1e-4", f"parallel.strategy={a.strategy}",
    ])


def _rank(rank: int, world: int, port: int, a, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # the ranks share the machine's cores
    from loom.config import validate
    from loom.launch import exit_rank
    from loom.models.gpt.model import build_model
    from loom.parallel.mesh import init_distributed
    from loom.train import checkpoint
    from loom.train.checkpoint import checkpoint_meta
    from loom.train.driver import build_training
    from loom.train.step import train_step
    from loom.train.task import Task, model_config, next_token_loss

    cfg = _config(a)
    d = init_distributed(lambda w: validate(cfg, w), "cpu")
    try:
        torch.manual_seed(cfg.train.seed)
        gpt = model_config(cfg, 256)
        # loom train's own model, optimizer and schedule, on random tokens (no corpus needed)
        task = Task(model_fn=lambda: build_model(gpt, "meta"), loss_fn=next_token_loss, train_data=None,
                    tokens_per_sample=cfg.data.seq_len, description=f"GPT {gpt.n_layers}L d{gpt.d_model}")
        built = build_training(cfg, d, task)
        model, optimizer, scheduler, params = built.model, built.optimizer, built.scheduler, built.params
        num_params = built.num_params
        micro = cfg.train.batch_size // d.dp_mesh.size()
        gen = torch.Generator().manual_seed(1000 + rank)

        def batches():
            while True:
                yield torch.randint(0, gpt.vocab_size, (micro, cfg.data.seq_len + 1), generator=gen)

        stream = batches()
        root = Path(out_dir)
        step = 0

        def meta() -> dict:
            return checkpoint_meta(cfg, step, d, task)

        def one_step(ckpt, published: Path | None) -> tuple[float, bool]:
            """A training step, then poll() as the loop does; whether rank 0 sees `published`
            (shared with every rank, so all take the same number of steps)."""
            nonlocal step
            start = time.perf_counter()
            train_step(model, optimizer, scheduler, None, stream, params, cfg, d, None, task.loss_fn,
                       step=step)
            step += 1
            ckpt.poll()
            flag = torch.tensor([float(d.is_main and published is not None and published.is_dir())])
            dist.all_reduce(flag)  # the same tiny collective in plain steps and steps during a write
            return time.perf_counter() - start, bool(flag.item())

        sync = checkpoint.Checkpointer(root / "sync", cfg, d, keep_last=1, async_save=False)
        background = checkpoint.Checkpointer(root / "async", cfg, d, keep_last=1, async_save=True)
        one_step(background, None)  # Adam's states exist from here on
        rounds = []
        for _ in range(a.rounds):
            r: dict = {}
            # Synchronous save: the whole write stalls training.
            dist.barrier()
            start = time.perf_counter()
            sync.save(step, model, optimizer, scheduler, meta())
            r["sync_save_s"] = time.perf_counter() - start
            r["sync_stall_s"] = sync.stall_s[-1]
            dist.barrier()  # rank 0 has published it
            path = root / "sync" / checkpoint.CHECKPOINTS / checkpoint.step_name(step)
            r["bytes"] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            # Load it back (the same layout).
            dist.barrier()
            start = time.perf_counter()
            checkpoint.load(path, model, optimizer, scheduler, cfg, d)
            r["load_s"] = time.perf_counter() - start
            # Plain steps (the first after the load is dropped: warm-up), then an async save and
            # training steps until the checkpoint is published.
            plain = [one_step(background, None)[0] for _ in range(a.plain_steps + 1)][1:]
            dist.barrier()
            save_step = step
            target = root / "async" / checkpoint.CHECKPOINTS / checkpoint.step_name(save_step)
            start = time.perf_counter()
            background.save(save_step, model, optimizer, scheduler, meta())
            r["async_stall_s"] = background.stall_s[-1]
            during = []
            for _ in range(a.max_steps):
                seconds, done = one_step(background, target)
                during.append(seconds)
                if done:
                    break
            else:  # not published within max_steps: finish it (the figure is then a lower bound)
                background.wait()
                dist.barrier()
            r["async_published_s"] = time.perf_counter() - start
            r["plain_step_s"] = plain
            r["steps_during_write_s"] = during
            # The same async save with nothing to overlap: save() then wait() (the write alone).
            dist.barrier()
            start = time.perf_counter()
            background.save(step, model, optimizer, scheduler, meta())
            background.wait()
            r["async_write_alone_s"] = time.perf_counter() - start
            rounds.append(r)
        sync.close()
        background.close()
        result = {"rank": rank, "num_params": num_params, "rounds": rounds}
        (root / f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_rank(0)  # as loom's ranks end: no interpreter teardown of the DeviceMesh's gloo groups


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(ranks: list[dict], a) -> dict:
    """Times: the slowest rank's (the group waits for it); step times: per step, the max over ranks."""
    out = []
    for i in range(a.rounds):
        rs = [rk["rounds"][i] for rk in ranks]
        slowest = {k: max(r[k] for r in rs) for k in ("sync_save_s", "sync_stall_s", "load_s",
                                                      "async_stall_s", "async_published_s",
                                                      "async_write_alone_s")}
        plain = [max(s) for s in zip(*(r["plain_step_s"] for r in rs))]
        during = [max(s) for s in zip(*(r["steps_during_write_s"] for r in rs))]
        out.append({**slowest, "bytes": rs[0]["bytes"], "plain_step_s": _median(plain),
                    "step_during_write_s": _median(during), "steps_during_write": len(during),
                    "step_slowdown_during_write": _median(during) / _median(plain)})
    med = {k: _median([r[k] for r in out]) for k in out[0]}
    size = med["bytes"]
    return {
        "model": {"num_params": ranks[0]["num_params"], "vocab_size": a.vocab, "d_model": a.d_model,
                  "n_layers": a.n_layers, "ffn_hidden": a.ffn_hidden},
        "strategy": a.strategy, "ranks": len(ranks), "seq_len": a.seq_len, "batch_size": a.batch_size,
        "checkpoint_bytes": size,
        "sync_save_s": med["sync_save_s"], "sync_stall_s": med["sync_stall_s"],
        "sync_save_mb_per_s": size / MB / med["sync_save_s"],
        "load_s": med["load_s"], "load_mb_per_s": size / MB / med["load_s"],
        "async_stall_s": med["async_stall_s"], "async_published_s": med["async_published_s"],
        "async_write_alone_s": med["async_write_alone_s"],
        "async_stall_vs_sync": med["async_stall_s"] / med["sync_stall_s"],
        "plain_step_s": med["plain_step_s"], "step_during_write_s": med["step_during_write_s"],
        "step_slowdown_during_write": med["step_slowdown_during_write"],  # the median of each round's ratio
        "steps_during_write": med["steps_during_write"],
        "rounds": out,
    }


def report(s: dict) -> str:
    m = s["model"]
    model = (f"model {s['checkpoint_bytes'] / MB:.0f} MB on disk ({m['num_params'] / 1e6:.1f}M params, "
             f"{m['n_layers']}L d{m['d_model']} vocab {m['vocab_size']}, {s['strategy']}, "
             f"{s['ranks']} ranks, "
             f"cpu/gloo)")
    sync = (f"sync save   {s['sync_save_s']:5.2f} s  {s['sync_save_mb_per_s']:4.0f} MB/s   "
            f"(training stalled {s['sync_stall_s']:.2f} s)")
    background = (f"async save  stall {s['async_stall_s']:.2f} s ({s['async_stall_vs_sync']:.0%} of sync), "
                  f"published after {s['async_write_alone_s']:.2f} s (save() then wait(), no training)")
    overlap = (f"            training on: published at the poll after {s['steps_during_write']:.0f} step(s), "
               f"{s['async_published_s']:.2f} s; steps during the write "
               f"{s['step_slowdown_during_write']:.2f}× "
               f"slower (the rounds' median ratio; steps {s['step_during_write_s']:.3f} s vs "
               f"{s['plain_step_s']:.3f} s)")
    load = (f"load        {s['load_s']:5.2f} s  {s['load_mb_per_s']:4.0f} MB/s   "
            f"(from the page cache: just written)")
    return f"{model}\n{sync}\n{background}\n{overlap}\n{load}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategy", default="zero3", choices=["ddp", "zero1", "zero2", "zero3"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--n-layers", type=int, default=6)
    ap.add_argument("--n-heads", type=int, default=8)
    ap.add_argument("--n-kv-heads", type=int, default=4)
    ap.add_argument("--ffn-hidden", type=int, default=1536)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4, help="global batch (sequences per step)")
    ap.add_argument("--plain-steps", type=int, default=4, help="plain steps timed before each async save")
    ap.add_argument("--max-steps", type=int, default=200,
                    help="at most this many steps wait for an async write")
    ap.add_argument("--smoke", action="store_true", help="a tiny model, one round (checks the script runs)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args()
    if a.smoke:
        a.vocab, a.d_model, a.n_layers, a.n_heads, a.n_kv_heads, a.ffn_hidden = 256, 64, 2, 4, 2, 128
        a.seq_len, a.rounds, a.plain_steps = 16, 1, 2

    import torch.multiprocessing as mp

    from loom.launch import free_port

    world = 2
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the ranks, before they import torch
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix="loom-ckpt-bench-") as tmp:
        mp.spawn(_rank, args=(world, free_port(), a, tmp), nprocs=world, join=True)
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world)]
    s = summarize(ranks, a)
    for i, r in enumerate(s["rounds"]):
        print(f"round {i + 1}: sync save {r['sync_save_s']:.2f} s, load {r['load_s']:.2f} s, async stall "
              f"{r['async_stall_s']:.2f} s, published after {r['async_write_alone_s']:.2f} s alone / "
              f"{r['async_published_s']:.2f} s training on, step "
              f"{r['step_during_write_s']:.3f} s during the write vs {r['plain_step_s']:.3f} s", flush=True)
    s["provenance"] = provenance()
    print(f"\n{report(s)}\n{describe(s['provenance'])}")
    if a.json:
        a.json.write_text(json.dumps(s, indent=2))


if __name__ == "__main__":
    sys.exit(main())
