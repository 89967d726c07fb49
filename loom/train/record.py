"""The run's record: what a run writes to its directory besides checkpoints and per-step metrics,
and the report printed at its end.

  config.toml   the resolved config, at the start
  plan.json     the planner's prediction for this very run (bytes; time on GPUs), at the start
  deepspeed_config.json   the deepspeed engine's config, derived and merged, at the start
  memory.json   per rank: the model states it holds, its peak, its collectives, and the share of the
                timed steps it waited for a core other processes held, at the end
  summary.json  losses, tokens/s, eval, the last checkpoint, measured vs planned, at the end

Each is written whole through loom.files.atomic_write: a symbolic link planted under one of these
names is replaced, its target left as it was.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from loom.config import Config, to_toml
from loom.files import atomic_write
from loom.parallel.mesh import Dist
from loom.parallel.pipeline import weight_pass_takes_functions
from loom.plan import device
from loom.plan.comm import comm_per_step, loop_collectives, rank_sends, with_loop
from loom.plan.command import local_cluster
from loom.plan.efficiency import compute_fraction
from loom.plan.hardware import Cluster, detect
from loom.plan.memory import stage_memory
from loom.plan.search import config_candidate, config_workload, estimate
from loom.plan.shapes import ModelShape
from loom.plan.step import flops_per_token
from loom.train import muon
from loom.train.meters import format_duration


def write_start(run_dir: Path, cfg: Config, plan: dict | None, engine_config: dict | None = None,
                optimizers: dict | None = None) -> None:
    text = to_toml(cfg)
    if optimizers is not None:  # which parameters Muon steps and which AdamW: comments, read by people
        text += "\n".join(f"# {line}" for line in muon.assignment_lines(optimizers)) + "\n"
    atomic_write(run_dir / "config.toml", text.encode())
    if plan is not None:
        atomic_write(run_dir / "plan.json", json.dumps(plan, indent=1).encode())
    if engine_config is not None:  # the deepspeed engine's config, as it ran
        atomic_write(run_dir / "deepspeed_config.json", json.dumps(engine_config, indent=1).encode())


def write_end(run_dir: Path, strategy: str, formula: str, shard: int, expected: float, ranks: list[dict],
              summary: dict) -> None:
    atomic_write(run_dir / "memory.json", json.dumps(
        {"strategy": strategy, "formula": formula, "shard_size": shard,
         "expected_model_state_bytes": expected,
         "ranks": {str(r): m for r, m in enumerate(ranks)}}, indent=2).encode())
    atomic_write(run_dir / "summary.json", json.dumps(summary, indent=2).encode())


def plan_run(cfg: Config, shape: ModelShape, d: Dist, trained: list[torch.Tensor] = (),
             per_node: int | None = None) -> dict:
    """The planner's prediction for this very run (written as plan.json, printed beside the
    measurements). Time is priced on this machine's device profile (`loom plan --calibrate`) when
    one was measured on this kind of device, else on the catalog entry of a recognised GPU; without
    either (a CPU never calibrated) the plan has bytes only. `trained`: the parameters of this rank
    that train (the loop's gradient norm and DDP's bucket order carry one number per tensor).
    `per_node`: ranks per node, for a run not launched (a rank reads its launcher's LOCAL_WORLD_SIZE)."""
    per_node = per_node or int(os.environ.get("LOCAL_WORLD_SIZE", d.world_size))
    nodes = max(d.world_size // per_node, 1)
    profile = device.load(required=False)
    if profile is not None and profile.device == d.device.type:
        cluster = local_cluster(profile, per_node, nodes)
    else:
        gpu = None
        if d.device.type == "cuda":
            props = torch.cuda.get_device_properties(d.device)
            gpu = detect(props.name, props.total_memory)
        cluster = Cluster(gpu, per_node, nodes)
    m = d.mesh
    c = config_candidate(cfg, m["dp_replicate"].size(), m["dp_shard"].size(), m["tp"].size(), m["pp"].size())
    w = config_workload(cfg, shape, weight_pass_takes_functions=weight_pass_takes_functions())
    record = estimate(w, c, cluster)
    record["memory_bytes_by_stage"] = {s: stage_memory(w, c, s, cluster.fragmentation,
                                                       device=d.device.type).to_dict()
                                       for s in range(c.pp)}
    record.update(planned_collectives(cfg, w, c, cluster.gpus_per_node, len(trained),
                                      split_tensors(trained, "tp"), split_tensors(trained, "ep"),
                                      m["pp"].get_local_rank() if c.pp > 1 else 0,
                                      mesh_tensors(trained, "tp")))
    record["gpu"] = cluster.gpu.name if cluster.gpu else None
    # what the measured MFU is figured from (loom/train/run_figures.py): the planner's FLOPs per token
    record["peak_tflops"] = cluster.gpu.bf16_tflops if cluster.gpu else None
    record["flops_per_token"] = flops_per_token(w)
    record["device_profile"] = str(device.default_path()) if cluster.profile is not None else None
    # the catalog's fraction of the peak that compute was priced at (bench/gpu_fit.py fits it to GPU rows)
    catalog = cluster.gpu is not None and cluster.profile is None
    record["compute_fraction"] = (cluster.achievable_fraction or compute_fraction(cluster.gpu, shape)) \
        if catalog else None
    return record


def split_tensors(params: list[torch.Tensor], dim: str) -> int:
    """The parameters split over the ranks of mesh dimension `dim`: DTensors sharded on it ("tp": a
    matmul's weight, a norm's gain is replicated there; "ep": the routed experts, and their adapters)."""
    return sum(1 for q in params if isinstance(q, DTensor) and any(
        name == dim and placement.is_shard()
        for name, placement in zip(q.device_mesh.mesh_dim_names or (), q.placements)))


def mesh_tensors(params: list[torch.Tensor], dim: str) -> int:
    """The parameters on a mesh with dimension `dim`, whatever their placement there ("tp": the matmuls'
    weights, and under sequence parallel or LoRA the norms' gains and the adapters TP keeps whole; not an
    MoE block's feed-forward, which TP leaves whole on a mesh of its own)."""
    return sum(1 for q in params if isinstance(q, DTensor) and dim in (q.device_mesh.mesh_dim_names or ()))


# planned_collectives' keys: what a rank observes of the plan's collectives
PLANNED_COLLECTIVES = ("comm_payload_bytes_per_step", "comm_payload_bytes_by_kind", "comm_count_per_step",
                       "comm_count_by_kind", "comm_loop_by_kind")


def planned_collectives(cfg: Config, w, c, gpus_per_node: int, trained_tensors: int,
                        tp_split: int = 0, ep_split: int = 0, pp_rank: int = 0,
                        tp_mesh: int | None = None) -> dict:
    """What a rank can observe of the plan's collectives (payload bytes and counts per collective kind),
    for comparison with the run's CollectiveCounter; comm_bytes_per_step stays the ring model's wire
    bytes. Within a pipeline, those of pipeline rank `pp_rank` over its stages, its own loop's among
    them. The loop's own few-byte collectives (the control plane, of the rank's
    `trained_tensors`, `tp_split` and `ep_split` of them split over tp and ep, `tp_mesh` on a TP mesh:
    mesh_tensors) are added to their kinds and listed apart (comm_loop_by_kind), so that measured
    and planned count the same collectives."""
    payload = comm_per_step(w, c, gpus_per_node, stage=pp_rank if c.pp > 1 else None)[0].payload_dict()
    loop = loop_collectives(w, c, trained_tensors, cfg.parallel.ddp_bucket_mb * 2**20,
                            payload["payload_bytes_by_kind"].get("all_reduce", 0.0), cfg.data.format == "sft",
                            tp_split, ep_split, pp_rank, tp_mesh)
    payload = with_loop(payload, loop)
    return {"comm_payload_bytes_per_step": payload["payload_bytes"],
            "comm_payload_bytes_by_kind": payload["payload_bytes_by_kind"],
            "comm_count_per_step": payload["count"], "comm_count_by_kind": payload["count_by_kind"],
            "comm_loop_by_kind": payload["loop"]}


LOADED_SHARE = 0.05  # past this share of the time waiting for a core, the machine was not the run's alone


def step_time_vs_planned(measured_s: float, plan: dict, core_wait_share: float = 0.0) -> dict:
    """[measured, planned] seconds per optimizer step, the plan's parts, and the share of the timed
    steps the ranks spent waiting for a core other processes held (loom/observe/core_wait), added
    over the ranks: at every collective one rank's wait holds all of them (capped: waits that
    overlap are counted twice)."""
    return {"step_time_s": [measured_s, plan.get("step_time_s")],
            "planned_breakdown_s": plan.get("step_time_breakdown_s"),
            "core_wait_share": min(core_wait_share, 0.9)}


def print_step_time(entry: dict, device_type: str) -> None:
    measured, planned = entry["step_time_s"]
    share = entry.get("core_wait_share") or 0.0
    loaded = (f"; other processes held the cores: the ranks waited for one {share:.0%} of the time, "
              f"so the step on its own cores ≈ {measured * (1 - share):.3f} s"
              if share > LOADED_SHARE else "")
    if planned is None:
        hint = ("run `loom plan --calibrate` once to measure this machine" if device_type == "cpu"
                else "this GPU is not in the planner's catalog")
        print(f"step time: measured {measured:.3f} s, not planned ({hint}){loaded}")
        return
    parts = ", ".join(f"{k.replace('_', ' ')} {v:.3f}" for k, v in entry["planned_breakdown_s"].items()
                      if k != "total" and v > 0)
    print(f"step time: measured {measured:.3f} s / planned {planned:.3f} s = {measured / planned:.2f}  "
          f"(planned: {parts}){loaded}")


def _p2p_share(plan: dict, stage: int) -> float:
    """This pipeline rank's sends (and receives) as a share of the busiest rank's, which the plan
    prices: the two ends of a 1F1B pipeline send one direction only."""
    if plan.get("pp", 1) == 1:
        return 1.0
    pp, virtual, schedule = plan["pp"], plan["pp_virtual_stages"], plan["pp_schedule"]
    sends = [rank_sends(pp, virtual, schedule, r) for r in range(pp)]
    return sends[stage] / max(sends)


def _less_p2p(total, by_kind: dict, share: float):
    """A per-step total of the plan, its sends and receives scaled to this rank's `share` of them."""
    if total is None or share == 1.0:
        return total
    p2p = sum(by_kind.get(k) or 0 for k in ("send", "recv"))
    return total - (1 - share) * p2p if isinstance(total, float) else round(total - (1 - share) * p2p)


def measured_vs_planned(ranks: list[dict], plan: dict) -> list[dict]:
    """Per rank, [measured, planned] pairs: model-state bytes, the step's activation peak (peak
    minus model states) and the collectives of a step: payload bytes and counts (observed, in all
    and per kind; a planned count is None where the plan does not know it). Wire bytes are not
    observable: `comm_modelled_wire_bytes` is the ring model on the observed payloads beside the
    plan's (modelled) comm_bytes_per_step."""
    rows = []
    for rank, m in enumerate(ranks):
        # the rank's own planned collectives (a pipeline's stages differ), else the plan's (rank 0's)
        own = m.get("planned_collectives") or plan
        plan_payload = own.get("comm_payload_bytes_by_kind") or {}
        plan_count = own.get("comm_count_by_kind") or {}
        payload_total, count_total = own.get("comm_payload_bytes_per_step"), own.get("comm_count_per_step")
        planned = plan["memory_bytes_by_stage"][m["pp_stage"]]
        p2p = _p2p_share(plan, m["pp_stage"])
        activation = m["peak_bytes"] - m["model_state_bytes"] if m["peak_bytes"] is not None else None
        seen = m["comm_by_kind"]  # None: no step was counted (a run of one step)
        absent = {"payload_bytes": 0, "count": 0} if seen is not None else {}
        by_kind = {}
        for k in sorted({*(seen or {}), *plan_payload}):
            got = (seen or {}).get(k, absent)
            share = p2p if k in ("send", "recv") else 1.0
            count = plan_count.get(k, 0)
            by_kind[k] = {"payload_bytes": [got.get("payload_bytes"), plan_payload.get(k, 0) * share],
                          "count": [got.get("count"), round(count * share) if count is not None else None]}
        rows.append({
            "rank": rank,
            "model_state_bytes": [m["model_state_bytes"], planned["model_states"]],
            "activation_peak_bytes": [activation, planned["activations"] + planned["buffers"]],
            "comm_payload_bytes": [m["comm_payload_bytes"], _less_p2p(payload_total, plan_payload, p2p)],
            "comm_count": [m["comm_count"], _less_p2p(count_total, plan_count, p2p)],
            "comm_by_kind": by_kind,
            "comm_modelled_wire_bytes": [m["comm_modelled_wire_bytes"], plan["comm_bytes_per_step"]],
            "nvme_bytes": [m.get("nvme_bytes"), planned.get("nvme", 0.0)],  # offloaded (deepspeed engine)
            # offloaded to host memory: the process's resident memory beside the plan's host bytes
            "host_bytes": [m.get("resident_bytes"), planned.get("host", 0.0)],
        })
    return rows


def print_measured_vs_planned(rows: list[dict], offload: tuple[str, ...] = (),
                              loop: dict | None = None) -> None:
    """Each cell: measured MiB / planned MiB, then their ratio; `offload` as in print_summary; `loop`:
    the loop's own collectives the plan counts in their kinds (plan.json's comm_loop_by_kind)."""
    mib = 2**20

    def cell(got, want) -> str:
        ratio = f"{got / want:5.2f}" if got is not None and want else "  n/a"
        got_text = f"{got / mib:8.2f}" if got is not None else "     n/a"
        want_text = f"{want / mib:8.2f}" if want is not None else "     n/a"
        return f"{got_text} / {want_text} {ratio}"

    print("measured / planned (MiB)  model states           activation peak        "
          "collective payload per step (observed)")
    print("  (each: measured MiB / planned MiB, then measured ÷ planned"
          f"{OFFLOAD_NOTES['cpu'] if 'cpu' in offload else ''})")
    for row in rows:
        keys = ("model_state_bytes", "activation_peak_bytes", "comm_payload_bytes")
        print(f"  rank {row['rank']:<18}" + "   ".join(cell(*row[k]) for k in keys))
        if row["nvme_bytes"][0] or row["nvme_bytes"][1]:
            print(f"    {'on NVMe':<15} {'':>13}{cell(*row['nvme_bytes'])}")
        if (row.get("host_bytes") or [None, 0])[1]:  # states offloaded to host memory (measured: RSS)
            print(f"    {'in host memory':<15} {'':>13}{cell(*row['host_bytes'])}  (measured: resident)")
        for kind, pair in (row.get("comm_by_kind") or {}).items():
            got_n, want_n = pair["count"]
            counts = f"×{'n/a' if got_n is None else got_n} / {'?' if want_n is None else want_n}"
            print(f"    {kind:<15} {counts:>13}{'':48}{cell(*pair['payload_bytes'])}")
    # Wire bytes depend on the backend's algorithm and are not observed: say so beside the figure.
    wire = ", ".join(f"rank {r['rank']} {r['comm_modelled_wire_bytes'][0] / mib:.2f}"
                     for r in rows if r["comm_modelled_wire_bytes"][0] is not None)
    if rows:
        print(f"  wire bytes per step, modelled (ring model on the observed payloads, not measured): "
              f"{wire or 'n/a'} MiB; plan {rows[0]['comm_modelled_wire_bytes'][1] / mib:.2f} MiB")
    if loop:  # the control plane: a few bytes each, planned so that the counts compare
        print("  of those, the loop's own (planned): " + "; ".join(
            f"{kind} ×{v['count']} ({v['what']}, {v['payload_bytes']:,.0f} B)" for kind, v in loop.items()))




def timed_steps(steps: int) -> str:
    """Which steps the end-of-run tokens/s times (driver.train: the first two only when no others)."""
    return "warm-up excluded: steps 1-2 not timed" if steps > 2 else "every step timed, warm-up included"


# What offload does to the figures beside the formula and the plan.
OFFLOAD_NOTES = {
    "nvme": "; the formula counts every state, but those offloaded to NVMe are on disk, not in memory "
            "(see 'on NVMe' and the resident line), so measured/formula is below 1",
    "cpu": "; the plan counts states offloaded to cpu as off the device, but on a CPU device they are "
           "in this rank's memory, so model states measure above plan",
}


def build_summary(cfg: Config, r, expected: float, dp: int, shard: int) -> dict:
    return {
        "strategy": cfg.parallel.strategy, "steps": len(r.losses), "dp": dp, "shard_size": shard,
        "first_loss": r.losses[0], "final_loss": r.losses[-1], "eval_loss": r.eval_loss,
        "tokens_per_s": r.tokens_per_s, "elapsed_s": r.elapsed_s,
        "expected_model_state_bytes": expected,
    }


def print_summary(s: dict, ranks: list[dict], formula: str, expected: float, run_dir: Path | None,
                  offload: tuple[str, ...] = ()) -> None:
    """`offload`: where the deepspeed engine offloads states ("cpu", "nvme"), which the legend explains."""
    mib = 2**20
    eval_text = f", eval {s['eval_loss']:.4f}" if s["eval_loss"] is not None else ""
    print(f"\ndone: {s['steps']} steps in {format_duration(s['elapsed_s'])}, loss {s['first_loss']:.4f} → "
          f"{s['final_loss']:.4f}{eval_text}, {s['tokens_per_s']:,.0f} tokens/s ({timed_steps(s['steps'])})")
    print(f"memory per rank (MiB)   params    grads   optim   model states   formula "
          f"{formula} = {expected / mib:.2f}   peak in step")
    for rank, m in enumerate(ranks):
        peak = f"{m['peak_bytes'] / mib:8.2f}" if m["peak_bytes"] is not None else "     n/a"
        ratio = m["model_state_bytes"] / expected
        print(f"  rank {rank:<17} {m['params_bytes'] / mib:8.2f} {m['grads_bytes'] / mib:8.2f} "
              f"{m['optimizer_bytes'] / mib:7.2f} {m['model_state_bytes'] / mib:14.2f}   "
              f"measured/formula {ratio:.3f}        {peak}")
    nvme = OFFLOAD_NOTES["nvme"] if "nvme" in offload else ""
    print(f"  (model states: the params, grads and optimizer states this rank holds in memory; "
          f"measured/formula: them ÷ the formula's {expected / mib:.2f} MiB{nvme})")
    held = [(r, m["resident_bytes"], m.get("nvme_bytes")) for r, m in enumerate(ranks)
            if m.get("resident_bytes")]
    if held:  # where the rest of a rank's states live: process memory, and NVMe when offloaded there
        print("resident (RSS) after step 2 (MiB): " + ", ".join(
            f"rank {r} {rss / mib:.1f}" + (f" + {nvme / mib:.1f} on NVMe" if nvme else "")
            for r, rss, nvme in held))
    if run_dir is not None:
        print(f"run directory: {run_dir}")
