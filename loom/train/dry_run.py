"""`loom train --dry-run`: what the run would be, printed once every pre-launch check has passed,
with no process started and nothing written: the layout line the ranks would print and the plan
they would write as plan.json (record.plan_run, priced on the layout the ranks would build).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loom.config import Config, resolve_dims
from loom.data.loader import micro_batch_size
from loom.parallel.mesh import MESH_DIMS, pick_device
from loom.plan.report import params_text
from loom.plan.step import pipeline_text
from loom.train import record
from loom.train.driver import layout_text

MIB = 2**20


@dataclass(frozen=True)
class _Dim:
    """One mesh dimension, as a DeviceMesh reports its size (and rank 0's place in it)."""

    n: int

    def size(self) -> int:
        return self.n

    def get_local_rank(self) -> int:
        return 0


@dataclass(frozen=True)
class PlannedLayout:
    """What record.plan_run reads of a rank's Dist, for ranks not started: the world, the device
    type they would take and the sizes of their mesh's dimensions."""

    world_size: int
    device: torch.device
    mesh: dict[str, _Dim]


def planned_layout(cfg: Config, world_size: int) -> PlannedLayout:
    dims = resolve_dims(cfg.parallel, world_size)
    device = torch.device(pick_device(cfg.train.device).type)
    return PlannedLayout(world_size, device, {name: _Dim(getattr(dims, name)) for name in MESH_DIMS})


def print_dry_run(cfg: Config, model, world_size: int, per_node: int | None = None) -> None:
    """The layout line, the plan's memory per pipeline stage and step time, and that nothing ran.
    `model`: the config's model (loom.train.task.ConfigModel), as the pre-launch checks resolved it;
    `per_node`: ranks per node (--nproc), so that a run of several nodes is planned across them."""
    per_node = per_node or world_size
    nodes = world_size // per_node
    t, p = cfg.train, cfg.parallel
    layout = planned_layout(cfg, world_size)
    dims = resolve_dims(p, world_size)
    micro = micro_batch_size(t.batch_size, dims.dp, t.grad_accum)
    where = f"{nodes} node(s) × {per_node}" if nodes > 1 else f"{world_size}"
    print(f"loom: dry run: {p.strategy} on {where} rank(s) ({layout.device.type}), "
          f"{layout_text(p, dims.dp_replicate, dims.dp_shard)}, {model.description} = "
          f"{params_text(model.shape.num_params)} params, global batch {t.batch_size} = micro-batch "
          f"{micro} × grad_accum {t.grad_accum} × dp {dims.dp}, {cfg.data.seq_len} tokens each"
          f"{f' split over cp {dims.cp} ranks' if dims.cp > 1 else ''}, precision {t.precision}", flush=True)
    if p.pp > 1:
        print(pipeline_text(cfg, model.shape), flush=True)
    plan = record.plan_run(cfg, model.shape, layout, per_node=per_node)
    for stage, m in sorted(plan["memory_bytes_by_stage"].items()):
        where = f"stage {stage}" if len(plan["memory_bytes_by_stage"]) > 1 else "each rank"
        print(f"plan: {where}: model states {m['model_states'] / MIB:.2f} MiB, activation peak "
              f"{(m['activations'] + m['buffers']) / MIB:.2f} MiB", flush=True)
    counts = plan.get("comm_count_by_kind") or {}
    if counts:
        # None: a count the engine chooses (DDP's buckets, ZeRO-1's per-parameter broadcasts)
        kinds = ", ".join(f"{kind} ×{n}" if n is not None else f"{kind} (a count the engine chooses)"
                          for kind, n in sorted(counts.items()))
        print(f"plan: collectives per step: {kinds}", flush=True)
    if plan.get("step_time_s"):
        print(f"plan: step time {plan['step_time_s']:.3f} s, {plan['tokens_per_s']:,.0f} tokens/s",
              flush=True)
    else:
        hint = ("run `loom plan --calibrate` once to measure this machine" if layout.device.type == "cpu"
                else "this GPU is not in the planner's catalog")
        print(f"plan: step time not planned ({hint})", flush=True)
    print("loom: dry run: every check passed; nothing was started and nothing written "
          "(drop --dry-run to train)", flush=True)
