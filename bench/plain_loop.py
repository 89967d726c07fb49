"""The hand-written PyTorch loop loom is measured against (`loom bench`'s overhead, under torchrun).

Same model, data order, optimizer, schedule and clipping as `loom train`, written the way one would
without a framework, one strategy per branch:

    ddp    DistributedDataParallel, AdamW(foreach)
    zero1  DDP + torch's ZeroRedundancyOptimizer around the same AdamW (optimizer states sharded)
    zero2  FSDP2 `fully_shard(..., reshard_after_forward=False)` (params stay gathered to backward)
    zero3  FSDP2 `fully_shard` (params re-gathered in backward)
    hsdp   FSDP2 over a 2-D (replicate, shard) mesh: --replicate groups of world/replicate ranks

With --tp (FSDP strategies) the same DTensor plan (loom's, for loom's model) and `loss_parallel`;
with --pp the model's layers split in two and torch's Schedule1F1B. The batches come from loom's
GlobalBatchSampler (step k trains on global batch k of a seeded permutation, each dp rank its
slice), so the per-step losses written to --out can be compared with loom's metrics.jsonl.
Gradient clipping over TP/PP-split grads reuses loom's `clip_grad_norm` (torch's cannot mix
meshes or add across pipeline ranks).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from loom.data.corpus import load_tokens
from loom.data.loader import GlobalBatchSampler, split_train_eval
from loom.launch import exit_rank
from loom.models.gpt.config import preset
from loom.models.gpt.model import build_model
from loom.models.gpt.pipeline import build_stage
from loom.models.gpt.tensor_parallel import apply_tensor_parallel
from loom.parallel.pipeline import stage_layers
from loom.train.optim import clip_grad_norm

FSDP = ("zero2", "zero3", "hsdp")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", choices=["ddp", "zero1", *FSDP], required=True)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--num-workers", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--replicate", type=int, default=1,
                    help="hsdp: replica groups (loom's parallel.dp_replicate), each sharding over "
                         "dp / replicate ranks")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.tp > 1 and a.strategy in ("ddp", "zero1"):
        ap.error("DDP takes no DTensor parameters: use --tp with zero2, zero3 or hsdp")
    if a.replicate > 1 and a.strategy != "hsdp":
        ap.error("--replicate is for --strategy hsdp")

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dp = world // (a.tp * a.pp)
    if dp % a.replicate:
        ap.error(f"--replicate {a.replicate} does not divide the {dp} data-parallel ranks")
    mesh = init_device_mesh("cpu", (a.pp, a.replicate, dp // a.replicate, a.tp),
                            mesh_dim_names=("pp", "replicate", "shard", "tp"))
    dp_mesh = mesh["replicate", "shard"]._flatten("dp")  # all data-parallel ranks: DDP, ZeRO-1, data
    torch.manual_seed(0)
    tokens, _ = load_tokens("stdlib")
    train_set, _ = split_train_eval(tokens, a.seq_len, 0.02)
    sampler = GlobalBatchSampler(len(train_set), a.batch_size, dp_mesh.get_local_rank(), dp, 1, seed=0,
                                 num_steps=a.steps)
    loader = DataLoader(train_set, batch_sampler=sampler, num_workers=a.num_workers,
                        persistent_workers=a.num_workers > 0, prefetch_factor=4 if a.num_workers else None)

    model = build_model(preset(a.preset), device="meta")
    pp_rank = mesh["pp"].get_local_rank()
    if a.pp > 1:
        model = build_stage(model, pp_rank, a.pp, stage_layers(model.cfg.n_layers, a.pp)[pp_rank])
    if a.tp > 1:
        apply_tensor_parallel(model, mesh["tp"], sequence_parallel=False)
    if a.strategy in FSDP:
        fsdp_mesh = mesh["replicate", "shard"] if a.strategy == "hsdp" else mesh["shard"]
        reshard = a.strategy != "zero2"
        for block in model.blocks():
            fully_shard(block, mesh=fsdp_mesh, reshard_after_forward=reshard)
        if model.tok_embeddings is not None:
            fully_shard(model.tok_embeddings, mesh=fsdp_mesh, reshard_after_forward=reshard)
        if model.output is not None:
            fully_shard([model.norm, model.output], mesh=fsdp_mesh, reshard_after_forward=False)
        fully_shard(model, mesh=fsdp_mesh, reshard_after_forward=reshard)
        model.to_empty(device="cpu")
        model.init_weights(0)
    else:
        model.to_empty(device="cpu")
        model.init_weights(0)
        model = DDP(model, process_group=dp_mesh.get_group(), gradient_as_bucket_view=True,
                    broadcast_buffers=False, find_unused_parameters=a.pp > 1)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    other = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}]
    adamw = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, foreach=True)
    if a.strategy == "zero1":
        opt = ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW,
                                      process_group=dp_mesh.get_group(), **adamw)
    else:
        opt = torch.optim.AdamW(groups, **adamw)
    # Linear warmup to the peak at step `warmup`, then cosine down to 0.1 × peak at the last step.
    warmup = min(10, a.steps)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warmup if s < warmup
        else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min((s + 1 - warmup) / max(a.steps - warmup, 1), 1))))

    first, last = pp_rank == 0, pp_rank == a.pp - 1
    if a.pp > 1:
        schedule = Schedule1F1B(PipelineStage(model, pp_rank, a.pp, torch.device("cpu"),
                                              group=mesh["pp"].get_group()),
                                n_microbatches=a.pp, scale_grads=False,
                                loss_fn=lambda out, tgt: F.cross_entropy(out.float().flatten(0, 1),
                                                                         tgt.flatten()) / a.pp)
    step_times, losses = [], []
    batches = iter(loader)
    for _ in range(a.steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        batch = next(batches)
        with loss_parallel() if a.tp > 1 else contextlib.nullcontext():
            if a.pp > 1:
                stage_losses = [] if last else None
                schedule.step(*((batch[:, :-1],) if first else ()), target=batch[:, 1:] if last else None,
                              losses=stage_losses, return_outputs=False)
                loss = torch.stack(stage_losses).sum() if last else torch.zeros(())
            else:
                logits = model(batch[:, :-1])
                loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
                loss.backward()
        if a.tp > 1 or a.pp > 1:
            clip_grad_norm(list(model.parameters()), 1.0, mesh["pp"].get_group() if a.pp > 1 else None)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss = (loss.to_local() if hasattr(loss, "to_local") else loss).detach()
        dist.all_reduce(loss)  # report the global loss like any real loop (read after the run)
        losses.append(loss)
        step_times.append(time.perf_counter() - start)
    timed = step_times[2:] or step_times
    if rank == 0:
        # The mean over the global batch: each of the dp × tp ranks of the last stage holds its
        # dp slice's loss (the other pipeline stages add 0).
        with open(a.out, "w") as f:
            json.dump({"tokens_per_s": a.batch_size * a.seq_len * len(timed) / sum(timed),
                       "losses": [x.item() / (dp * a.tp) for x in losses]}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    exit_rank(0)  # as loom's ranks end: no interpreter teardown of the DeviceMesh's gloo groups
