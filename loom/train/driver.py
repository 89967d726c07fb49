"""`loom train` on one rank, in order: join the group, build what trains (model, optimizer, data),
resume, run the steps (metrics, checkpoints, eval, profiler), then finish (final eval, records).

Every rank runs this. A step's values are read back to the host one step late (StepLog), so on
a GPU the host never waits for the step it has just queued.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import statistics
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from loom import strategies
from loom.config import Config, lora_base_dtype, splits_backward, validate
from loom.data.loader import build_loaders
from loom.errors import AgreedError
from loom.files import atomic_write, claim_run_dir
from loom.launch import srun_tasks
from loom.models.gpt.lean_ops import use_plain_ops
from loom.models.gpt.moe import moe_modules
from loom.models.lora import WithAdapters, apply_lora, blocks_of
from loom.models.registry import adapter_for
from loom.observe import core_wait, flight
from loom.observe.collectives import CollectiveCounter
from loom.observe.profiler import StepProfiler
from loom.observe.rank_memory import (
    PeakMemory,
    RankMemory,
    count_params,
    measure_model_states,
    resident_bytes,
)
from loom.observe.run_report import write_run_report
from loom.parallel import deepspeed_engine, fb_overlap, precision
from loom.parallel.apply import parallelize, sequence_split, uses_fsdp
from loom.parallel.context_parallel import sequence_share, take_tally
from loom.parallel.expert_parallel import take_tally as take_ep_tally
from loom.parallel.mesh import Dist, group_of_this_call, init_distributed
from loom.parallel.pipeline import receive_buffers, weight_pass_takes_functions
from loom.parallel.weights import TensorsSource
from loom.plan.memory import deepspeed_states, lora_state_bytes, model_state_bytes
from loom.plan.step import pipeline_text
from loom.train import checkpoint, faults, moe_step, muon, record, run_figures
from loom.train.export_lora import peft_holds
from loom.train.meters import LateRead, MetricsFile, PhaseTimer, Progress, phase_share
from loom.train.optim import build_optimizer, build_scheduler
from loom.train.step import Pipeline, build_pipeline, deepspeed_train_step, evaluate, train_step
from loom.train.stop import Stopped, StopRequest, preempt_signal, slurm_requeue
from loom.train.task import Task, config_task
from loom.train.tracking import Trackers, require_trackers

# Set by each node's loom launcher for its ranks: rank 0 writes every node's id into stopped.json,
# so that a launcher trusts only a stop record of its own launch (loom/cli.py, _stop_record).
LAUNCH_ENV = "LOOM_LAUNCH_ID"

# The root module returns logits from a Linear (a view); the loss never edits them in place.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


@dataclass
class RunResult:
    losses: list[float]  # mean loss over each step's whole global batch
    grad_norms: list[float]
    eval_loss: float | None
    memory: list[dict]  # one entry per rank (RankMemory.to_dict)
    tokens_per_s: float
    elapsed_s: float
    state_dict: dict[str, torch.Tensor] | None = None  # full (gathered) weights, if asked for
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Built:
    """One rank's share of the model and what trains it."""

    parts: list[nn.Module]  # the whole model, or this rank's pipeline stage(s)
    model: nn.Module  # parts[0], or an nn.ModuleList of several stages
    pipe: Pipeline | None
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: Any
    params: list[torch.Tensor]  # trainable parameters of this rank
    num_params: int  # of the whole model, tied weights once
    engine_config: dict | None = None  # the deepspeed engine's final config (written to the run directory)
    engine: str = "torch"  # "deepspeed": model is a DeepSpeedEngine, optimizer the AdamW it wraps
    lora: str = ""  # what LoRA adapted, for the start line ("" without LoRA)
    optimizers: dict | None = None  # train.optimizer = "muon": which parameters each optimizer steps


def build_training(cfg: Config, d: Dist, task: Task, swap_dir: Path | None = None) -> Built:
    """The parallelized model, pipeline schedule, optimizer and LR schedule for this rank.
    `swap_dir`: where the deepspeed engine's NVMe offload swaps (a folder of this run's own)."""
    t, p = cfg.train, cfg.parallel
    if p.engine == "deepspeed":
        return _build_deepspeed(cfg, d, task, swap_dir)
    # The same seed on every rank gives every rank the same model (loom's GPT: on meta, initialized
    # per parameter after sharding).
    with torch.random.fork_rng():
        torch.manual_seed(t.seed)
        user_model = task.model_fn()
    num_params = count_params(user_model)
    adapter = adapter_for(user_model)
    weights, lora = task.weights, ""
    if cfg.lora.rank is not None:  # the base frozen, adapters added (loom/models/lora.py)
        adapted = apply_lora(user_model, blocks_of(adapter.layers(user_model)), cfg.lora,
                             precision.DTYPES[lora_base_dtype(cfg)], t.seed)
        trains = count_params(user_model, trainable=True)
        lora = (f"lora: rank {cfg.lora.rank}, alpha {cfg.lora.alpha:g} on {len(adapted)} modules "
                f"({', '.join(cfg.lora.targets)}): {trains / 1e6:.3f}M trainable params, "
                f"{100 * trains / num_params:.2f}% of the model; the base frozen in {lora_base_dtype(cfg)}")
        if adapter.meta_init:  # written after sharding: the adapters' own init, the base as it was
            base = weights if weights is not None else adapter.weight_source(user_model, t.seed)
            weights = WithAdapters(base, t.seed)
    sides = muon.assignment(user_model) if t.optimizer == "muon" else None
    split = sequence_split(d, task.document_eos)
    # loom's GPT: plain ops where this torch's weight pass cannot start at its Functions (pipeline.py)
    use_plain_ops(splits_backward(cfg.parallel) and not weight_pass_takes_functions())
    parts = parallelize(user_model, cfg, d, adapter, weights, split)
    del user_model  # a pipeline stage keeps only its layers
    _release(task)
    model = parts[0] if len(parts) == 1 else nn.ModuleList(parts)  # interleaved: several stages
    if task.init_checkpoint is not None:  # model.init_from a loom checkpoint: DCP reads our chunks
        checkpoint.load_weights(task.init_checkpoint, model, d)
    pipe = build_pipeline(parts, cfg, d, split) if p.pp > 1 else None
    moe_step.configure(parts, cfg)
    optimizer = build_optimizer(model, t, p.strategy, d, muon=cfg.muon)
    scheduler = build_scheduler(optimizer, t)
    params = [q for q in model.parameters() if q.requires_grad]
    scaler = precision.grad_scaler(t.precision, uses_fsdp(p), d.device)
    return Built(parts, model, pipe, optimizer, scheduler, scaler, params, num_params, lora=lora,
                 optimizers=sides)


def _build_deepspeed(cfg: Config, d: Dist, task: Task, swap_dir: Path | None) -> Built:
    """The same model, optimizer and schedule, run by DeepSpeed's engine
    (loom/parallel/deepspeed_engine.py)."""
    t, p = cfg.train, cfg.parallel
    ds = deepspeed_engine.deepspeed_config(cfg, t.batch_size // (d.dp_mesh.size() * t.grad_accum), swap_dir)
    building = deepspeed_engine.ops_to_build(ds)
    if building and d.is_main:
        print(f"deepspeed: compiling its {', '.join(building)} op(s) on first use (a minute or more; "
              f"cached in ~/.cache/torch_extensions afterwards)", flush=True)
    with torch.random.fork_rng():
        torch.manual_seed(t.seed)
        with deepspeed_engine.model_context(ds):
            try:
                model = task.model_fn(device="cpu")  # loom's GPT: built here, partitioned as it is built
            except TypeError:  # a factory without a device builds on CPU itself
                model = task.model_fn()
    stage = ds["zero_optimization"]["stage"]
    source = task.weights
    if task.init_checkpoint is not None:  # whole tensors on every rank: the engine's checkpoint reading too
        source = TensorsSource(checkpoint.read_tensors(task.init_checkpoint))
    deepspeed_engine.initialize_weights(model, adapter_for(model), t.seed, partitioned=stage == 3,
                                        source=source)
    _release(task)
    moe_step.configure([model], cfg)
    optimizer = build_optimizer(model, t, p.strategy, d, engine="deepspeed",
                                offloaded=ds["zero_optimization"].get("offload_optimizer") is not None)
    scheduler = build_scheduler(optimizer, t)  # DeepSpeed's optimizer steps these param groups' lr
    engine = deepspeed_engine.initialize(model, optimizer, ds, d)
    params = [q for q in engine.module.parameters() if q.requires_grad]
    return Built([engine], engine, None, optimizer, scheduler, None, params, count_params(model), ds,
                 engine="deepspeed")


def _release(task: Task) -> None:
    """The pretrained files are read: unmap them."""
    close = getattr(task.weights, "close", None)
    if close is not None:
        close()


def train(cfg: Config, run_dir: Path | None = None, return_state: bool = False, quiet: bool = False,
          task: Task | None = None, resume: str | Path | None = None) -> RunResult:
    """Run `cfg` on this rank (joining the torchrun group, or as a world of one).

    `task` brings your own model, loss and data; the default is loom's GPT on the config's corpus.
    `resume` is "auto" (the run directory's latest checkpoint, if any) or a checkpoint path; a
    group that torchrun restarted after a failure resumes "auto" by itself.
    """
    t = cfg.train
    if resume is None and run_dir is not None and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        resume = "auto"
    flight.enable(run_dir)
    with group_of_this_call():  # the process group this call starts ends with it (its threads joined)
        d = init_distributed(lambda world: validate(cfg, world), t.device, timeout_s=t.collective_timeout_s,
                             cp_mode=cfg.parallel.cp_mode, host_collectives=cfg.parallel.offload == "cpu")
        watcher = flight.Watcher(run_dir, d) if run_dir is not None and d.world_size > 1 else None
        try:
            return _train(cfg, d, run_dir, return_state, quiet, task or config_task(cfg), resume)
        except (RuntimeError, dist.DistError) as e:
            if flight.is_timeout(e) and run_dir is not None:
                raise flight.timeout_error(e, run_dir, d, t.collective_timeout_s) from None
            raise
        finally:
            Trackers.close_current(failed=True)  # after an error (a finished run has closed them)
            StopRequest.close_current()
            if watcher is not None:
                watcher.stop()
            d = watcher = None  # nothing here holds the group when it ends


def _train(cfg: Config, d: Dist, run_dir: Path | None, return_state: bool, quiet: bool, task: Task,
           resume: str | Path | None) -> RunResult:
    t = cfg.train
    main, say = d.is_main, d.is_main and not quiet
    torch.manual_seed(t.seed)

    # Setup: the model and what trains it, the resumed state, the data from the resumed step on.
    if run_dir is not None and main:  # before anything is written into it (`loom train` made it already)
        claim_run_dir(run_dir)
    swap = _swap_folder(cfg, run_dir, d)
    built = build_training(cfg, d, task, swap)
    start_step = _resume(resume, run_dir, built, cfg, d, say)
    loaders = build_loaders(cfg, task.train_data, task.eval_data, d.dp_mesh.get_local_rank(),
                            d.dp_mesh.size(), cfg.data.pin_memory and d.device.type == "cuda", start_step)
    ckpt = (checkpoint.Checkpointer(run_dir, cfg, d, t.keep_last, t.ckpt_async) if run_dir is not None
            else None)
    plan = record.plan_run(cfg, task.shape, d, built.params) if task.shape is not None else None
    if run_dir is not None and main:
        record.write_start(run_dir, cfg, plan, built.engine_config, built.optimizers)
    log = StepLog(cfg, run_dir, start_step, t.batch_size * task.tokens_per_sample, main, say, plan)
    if say:
        _print_layout(cfg, d, task, built, loaders.micro_batch)

    # The steps.
    b = built
    memory: RankMemory | None = None
    peak = PeakMemory(d.device, b.model, b.optimizer,
                      (lambda: receive_buffers(b.pipe.schedule)) if b.pipe is not None else list)
    comm_seen: dict | None = None  # the collectives of the second step (CollectiveCounter.summary)
    timer = PhaseTimer(d.device)
    profiler = _start_profiler(cfg, run_dir, d)
    batches = iter(loaders.train)
    stop = StopRequest(d.world_size, preempt_signal(cfg))  # a signal, or the launcher's stop file
    start = last_save = time.perf_counter()
    waits = None  # the timed steps' wait for a core (other processes on this machine): from the third step
    final_eval = not_yet = object()
    for step in range(start_step + 1, t.steps + 1):
        step_start = time.perf_counter()
        if step == start_step + 3:
            waits, waits_start = core_wait.snapshot(), step_start
        faults.at_step_start(step, d.rank)
        # The first step creates the gradients and optimizer states; the second is the steady-state peak.
        steady = step == start_step + 2
        with peak.track() if steady else contextlib.nullcontext(), \
                CollectiveCounter() if steady else contextlib.nullcontext() as comm:
            if b.engine == "deepspeed":
                out = deepspeed_train_step(b.model, b.scheduler, batches, cfg, d, task.loss_fn, timer, step)
            else:
                out = train_step(b.model, b.optimizer, b.scheduler, b.scaler, batches, b.params, cfg, d,
                                 b.pipe, task.loss_fn, timer, step)
        phases = timer.end_step()
        if comm is not None:
            comm_seen = comm.summary()
        if step == start_step + 1:
            masters = deepspeed_engine.master_weights(b.model) if b.engine == "deepspeed" else ()
            memory = measure_model_states(b.model, b.optimizer, masters)
            memory.num_params = b.num_params
        if steady:  # what the process holds in the steady state: in memory, and swapped to NVMe
            memory.resident_bytes = resident_bytes()
            memory.nvme_bytes = deepspeed_engine.rank_swap_bytes(swap, d.rank) if swap is not None else None
        exchange = {**(take_tally() if d.cp is not None else {}),
                    **(take_ep_tally() if d.ep is not None else {})}
        log.queued(step, out, phases, step_start, exchange)
        if profiler is not None:
            profiler.step()
        if step == t.steps:  # the final eval: in the last step's metrics, before its checkpoint
            final_eval = evaluate(b.model, loaders.eval, d, cfg, task.loss_fn, b.pipe)
            log.eval(step, final_eval, final=True)
        elif t.eval_every and step % t.eval_every == 0:
            log.eval(step, evaluate(b.model, loaders.eval, d, cfg, task.loss_fn, b.pipe))
        timed = ckpt is not None and t.ckpt_every_min > 0 and \
            time.perf_counter() - last_save >= 60 * t.ckpt_every_min
        failed = ckpt is not None and ckpt.write_failed()
        signum, timed, failed = stop.agreed(timed, failed)  # every rank decides alike
        if ckpt is not None:
            if failed:  # a background write failed on some rank: all handle it now
                ckpt.wait()
            ckpt.poll()
            if (t.ckpt_every and step % t.ckpt_every == 0) or step == t.steps or timed or signum:
                log.flush()  # the metrics reach step k before checkpoint k exists (saving syncs anyway)
                ckpt.save(step, b.model, b.optimizer, b.scheduler,
                          checkpoint.checkpoint_meta(cfg, step, d, task))
                last_save = time.perf_counter()
        if signum:  # asked to stop: every rank is here at the same step, its checkpoint saved
            log.flush()
            _stop_here(signum, step, ckpt, run_dir, d, profiler, stop, cfg)
    stop.close()
    log.flush()
    core_wait_share = (core_wait.waited_s(waits) / max(time.perf_counter() - waits_start, 1e-9)
                       if waits is not None else 0.0)
    if profiler is not None:
        profiler.__exit__(None, None, None)
    elapsed = time.perf_counter() - start
    if ckpt is not None:
        ckpt.close()

    # Finish: the final eval, every rank's measurements, the records.
    eval_loss = (evaluate(b.model, loaders.eval, d, cfg, task.loss_fn, b.pipe) if final_eval is not_yet
                 else final_eval)  # not_yet: a resumed run with no step left to train
    memory.peak_bytes, memory.reserved_peak_bytes = peak.peak_bytes, peak.reserved_bytes
    rank_memory: list[dict] = [None] * d.world_size  # type: ignore[list-item]
    # Observed: count and payload of the collectives of step 2; wire bytes only as the ring model.
    measured = {**memory.to_dict(), "pp_stage": d.mesh["pp"].get_local_rank(),
                "core_wait_share": core_wait_share, **sequence_share(cfg.data.seq_len, d.cp),
                **({"ep": d.ep.size, "ep_rank": d.ep.rank} if d.ep is not None else {}),
                # this rank's own planned collectives (a pipeline's stages differ): measured_vs_planned
                "planned_collectives": {k: plan[k] for k in record.PLANNED_COLLECTIVES} if plan is not None
                else None,
                **{f"comm_{k}": comm_seen[k] if comm_seen else None
                   for k in ("count", "payload_bytes", "modelled_wire_bytes", "by_kind")}}
    dist.all_gather_object(rank_memory, measured)
    # the trackers get memory.json's ranks, and the final eval unless the last step's metrics carried it
    log.close(eval_loss if final_eval is not_yet else None, rank_memory)
    # The first step pays for warm-up and the second for memory tracking: time the steady state after them.
    timed = log.step_times[2:] or log.step_times
    tokens_per_s = log.tokens_per_step * len(timed) / sum(timed)
    state = None
    if return_state:
        deepspeed = b.engine == "deepspeed"
        state = deepspeed_engine.full_weights(b.model) if deepspeed else _full_state_dict(b.parts)
    if swap is not None:
        dist.barrier()  # every rank is done with its swap files
        if main:
            shutil.rmtree(swap, ignore_errors=True)
    result = RunResult(log.losses, log.grad_norms, eval_loss, rank_memory, tokens_per_s, elapsed, state,
                       extra={"start_step": start_step, "skipped_steps": log.skipped_steps,
                              "evals": log.evals, "moe_rows": log.moe_rows,
                              "step_time_s": statistics.median(timed),
                              "checkpoint_stall_s": ckpt.stall_s if ckpt is not None else []})
    if main:
        _finish_records(cfg, d, b, result, plan, run_dir, quiet, task.from_config)
    return result


def _swap_folder(cfg: Config, run_dir: Path | None, d: Dist) -> Path | None:
    """The deepspeed engine's NVMe offload folder for this run, empty at the start (a killed run's
    leftovers removed)."""
    p = cfg.parallel
    if p.engine != "deepspeed" or "nvme" not in (p.offload_optimizer, p.offload_params):
        return None
    swap = deepspeed_engine.swap_folder(p.nvme_path, run_dir)
    if d.is_main:
        shutil.rmtree(swap, ignore_errors=True)
        swap.mkdir(parents=True)
    dist.barrier()
    return swap


def _resume(resume: str | Path | None, run_dir: Path | None, b: Built, cfg: Config, d: Dist,
            say: bool) -> int:
    """Load the checkpoint `resume` names into the built model and optimizer; the step it reached."""
    path = checkpoint.resolve_resume(str(resume), run_dir) if resume is not None else None
    if path is None:
        if resume is not None and say:
            print(f"no checkpoint in {run_dir} yet: starting from step 1", flush=True)
        return 0
    meta = checkpoint.load(path, b.model, b.optimizer, b.scheduler, cfg, d)
    if say:
        print(f"resumed from {path} (step {meta['step']}, saved by "
              f"{meta.get('layout', {}).get('strategy', '?')} on {meta['world_size']} rank(s)); "
              f"training steps {meta['step'] + 1}..{cfg.train.steps}", flush=True)
    return meta["step"]


def layout_text(p, replicate: int, shard: int) -> str:
    """The mesh of the layout line, pp and tp named when above 1: "pp=2 × dp=2 [...] × tp=2"."""
    dp = f"dp={replicate * shard} [replicate {replicate} × shard {shard}]"
    pp = [f"pp={p.pp}"] if p.pp > 1 else []
    tp = [f"tp={p.tp}" + (" (sequence parallel)" if p.sequence_parallel else "")] if p.tp > 1 else []
    cp = [f"cp={p.cp} ({p.cp_mode})"] if p.cp > 1 else []
    ep = f", experts split over ep={p.ep} of the dp ranks" if p.ep > 1 else ""
    return " × ".join([*pp, dp, *cp, *tp]) + ep


def _print_layout(cfg: Config, d: Dist, task: Task, b: Built, micro_batch: int) -> None:
    t, p = cfg.train, cfg.parallel
    dp = d.dp_mesh.size()
    print(f"loom: {p.strategy} on {d.world_size} rank(s) ({d.device.type}), "
          f"{layout_text(p, d.mesh['dp_replicate'].size(), d.mesh['dp_shard'].size())}, "
          f"{task.description} = {b.num_params / 1e6:.2f}M params, "
          f"global batch {t.batch_size} = micro-batch {micro_batch} × grad_accum {t.grad_accum} "
          f"× dp {dp}, {task.tokens_per_sample} tokens each"
          f"{f' split over cp {d.cp_size} ranks' if d.cp is not None else ''}, precision {t.precision}",
          flush=True)
    if b.lora:
        print(b.lora, flush=True)
    if b.optimizers is not None:
        m = cfg.muon
        print(f"optimizer: muon (momentum {m.momentum:g}{', nesterov' if m.nesterov else ''}, {m.ns_steps} "
              f"Newton-Schulz steps in {m.ns_dtype}, {m.update_scale} scale) for the blocks' matrices, "
              f"adamw for the rest", flush=True)
        for line in muon.assignment_lines(b.optimizers):
            print(f"  {line}", flush=True)
    if b.pipe is not None:
        print(pipeline_text(cfg, task.shape), flush=True)


def _start_profiler(cfg: Config, run_dir: Path | None, d: Dist):
    if not (cfg.profile.enabled and run_dir is not None):
        return None
    all_threads = fb_overlap.overlaps(cfg.parallel)
    profiler = StepProfiler(cfg.profile, run_dir, d.rank, d.device, all_threads=all_threads)
    profiler.__enter__()
    return profiler


def _stop_here(signum: int, step: int, ckpt, run_dir: Path | None, d: Dist, profiler, stop: StopRequest,
               cfg: Config):
    """The agreed stop: the checkpoint of this step published; on the scheduler's early warning
    under train.requeue, the Slurm job requeued; rank 0's record for the launcher."""
    if profiler is not None:
        profiler.__exit__(None, None, None)
    path = None
    if ckpt is not None:
        ckpt.close()  # waits for an async write: the checkpoint is complete before anyone leaves
        path = checkpoint.latest_checkpoint(run_dir)
    stop.close()
    note = None
    if d.is_main and cfg.train.requeue and signum == preempt_signal(cfg):
        note = slurm_requeue()  # the checkpoint is published: Slurm may end this job's steps from now on
    launches = [None] * d.world_size if d.is_main else None
    dist.gather_object(os.environ.get(LAUNCH_ENV), launches, dst=0)  # one launcher per node
    if d.is_main and run_dir is not None:
        record = {"signal": signum, "step": step, "checkpoint": str(path) if path else None, "note": note,
                  "launches": sorted({x for x in launches if x})}
        atomic_write(run_dir / "stopped.json", json.dumps(record).encode())
    dist.barrier()
    raise Stopped(signum, step, path, note)


class StepLog:
    """Each step's values, read back one step late: metrics.jsonl and the trackers of
    train.log_to (rank 0), the progress bar, the losses kept for the result, and the non-finite
    policy (every rank sees the same global values, so every rank takes the same decision).
    `plan`: this run's plan.json, whose MFU the trackers scale to the measured tokens/s."""

    def __init__(self, cfg: Config, run_dir: Path | None, start_step: int, tokens_per_step: int, main: bool,
                 say: bool, plan: dict | None = None):
        self.cfg, self.run_dir, self.say = cfg, run_dir, say
        self.tokens_per_step = tokens_per_step
        if cfg.train.log_to:
            require_trackers(cfg.train.log_to)  # every rank: a missing package stops them all alike
        self.metrics = MetricsFile(run_dir / "metrics.jsonl" if run_dir is not None and main else None,
                                   keep_through_step=start_step)
        self.trackers = Trackers.open(cfg, run_dir, main, plan)  # None unless rank 0 and train.log_to
        self.progress = Progress(cfg.train.steps, cfg.train.log_every, enabled=say)
        self.pending: dict | None = None  # the last step's device values
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.step_times: list[float] = []
        self.skipped_steps: list[int] = []
        self.evals: dict[int, float] = {}  # step -> held-out loss every train.eval_every steps, not the last
        self.moe_rows: list[dict] = []  # a mixture of experts' load and dropped tokens, per logged step

    def queued(self, step: int, out, phases: dict, step_start: float, exchange: dict | None = None) -> None:
        """Step `step` is queued: read back the step before it, keep this one's values pending.
        The step's time includes that read-back (on a GPU, the wait for the step before, not for
        this one: LateRead).
        `exchange`: context parallelism's bytes sent and host wait this step (context_parallel.take_tally)."""
        values = torch.stack([out.loss, out.grad_norm.float().reshape(()), out.skipped])
        if out.moe is not None:  # read back with them: [loss, grad norm, skipped, the routing's tally...]
            values = torch.cat([values, out.moe.float()])
        values = LateRead(values)
        self.flush()
        step_time = time.perf_counter() - step_start
        self.step_times.append(step_time)
        self.pending = {"step": step, "lr": out.lr, "step_time_s": step_time, "data_wait_s": out.data_wait_s,
                        "values": values, "phases": phases, **(exchange or {})}

    def eval(self, step: int, held_out: float | None, final: bool = False) -> None:
        """`final`: the last step's, which the summary prints (RunResult.eval_loss, not in `evals`)."""
        if held_out is None:
            return
        self.pending["eval_loss"] = held_out  # written with the step's metrics
        if final:
            return
        self.evals[step] = held_out
        if self.say:
            print(f"\neval loss at step {step}: {held_out:.4f}", flush=True)

    def flush(self) -> None:
        if self.pending is None:
            return
        entry, self.pending = self.pending, None
        values = entry.pop("values").tolist()
        loss, gnorm, skipped = values[:3]
        entry.update(moe_step.metrics(values[3:] or None))
        if "moe_load_imbalance" in entry:
            self.moe_rows.append({k: entry[k] for k in ("moe_load_imbalance", "moe_dropped")})
        self.losses.append(loss)
        self.grad_norms.append(gnorm)
        phases = PhaseTimer.resolve(entry.pop("phases"))
        if skipped:
            self.skipped_steps.append(entry["step"])
        entry.update(loss=loss, grad_norm=gnorm, tokens_per_s=self.tokens_per_step / entry["step_time_s"],
                     skipped=bool(skipped), nonfinite_steps=len(self.skipped_steps), **phases)
        self.metrics.write(entry)
        if self.trackers is not None:
            self.trackers.step(entry, phases)
        if skipped:
            self._on_nonfinite(entry["step"], loss, gnorm)
        self.progress.update(entry["step"], loss, entry["tokens_per_s"], phase_share(phases))

    def close(self, eval_loss: float | None = None, ranks: list[dict] | None = None) -> None:
        """The end: the final eval and every rank's memory to the trackers, then close all."""
        self.metrics.close()
        if self.trackers is not None:
            trackers, self.trackers = self.trackers, None
            try:
                trackers.finish(eval_loss, ranks)
            finally:
                trackers.close()

    def _on_nonfinite(self, step: int, loss: float, gnorm: float) -> None:
        what = f"step {step}: loss {loss} and gradient norm {gnorm}"
        if self.cfg.train.on_nonfinite == "stop":
            if self.trackers is not None:  # the run ends here: what was logged stays readable
                self.trackers.close(failed=True)
                self.trackers = None
            last = checkpoint.latest_checkpoint(self.run_dir) if self.run_dir is not None else None
            resume = f"; the last checkpoint is {last}" if last else ""
            raise AgreedError(f"{what} are not finite; stopped (train.on_nonfinite = stop){resume}; "
                            f"lower train.lr or raise train.warmup_steps, or set train.on_nonfinite=skip to "
                            f"skip such steps")
        if self.say:
            print(f"\n{what}: not finite, update skipped ({len(self.skipped_steps)} so far; "
                  f"train.on_nonfinite = skip)", flush=True)


def _finish_records(cfg: Config, d: Dist, b: Built, result: RunResult, plan: dict | None,
                    run_dir: Path | None, quiet: bool, from_config: bool = True) -> None:
    """Rank 0: memory.json and summary.json, and the report printed at the end."""
    p = cfg.parallel
    dp = d.dp_mesh.size()
    # cp ranks shard (and reduce) with the dp ranks: N spans dp_shard × cp
    shard = strategies.lookup(p.strategy).shard_size(d.mesh["dp_replicate"].size(),
                                                     d.mesh["dp_shard"].size() * d.cp_size)
    moe = [m for part in b.parts for m in moe_modules(part)]
    # the routed experts: split over ep, then sharded over the ranks holding the same ones
    expert_shard = strategies.lookup(p.strategy).shard_size(d.mesh["dp_replicate"].size(),
                                                            d.mesh["dp_shard"].size() // d.ep_size)
    if cfg.lora.rank is not None:
        expected, formula = _lora_states(cfg, b, moe, shard, expert_shard)
    else:
        local_params = sum(q.numel() for q in b.params)  # this rank's stage(s), before TP/EP/FSDP splits
        routed = sum(q.numel() for m in moe for q in m.experts.parameters())
        # TP splits every matrix; the norms' gains and the MoE feed-forwards stay whole on each TP rank.
        tp_replicated = sum(q.numel() for q in b.params if q.ndim == 1) \
            + sum(q.numel() for m in moe for q in m.parameters()) if p.tp > 1 else 0
        expected = model_state_bytes(p.strategy, local_params - routed, shard, tp=p.tp,
                                     tp_replicated=tp_replicated - (routed if p.tp > 1 else 0)).total
        if routed:
            expected += model_state_bytes(p.strategy, routed / d.ep_size, expert_shard).total
        formula = strategies.lookup(p.strategy).formula
    if cfg.train.optimizer == "muon" and b.engine == "torch":
        expected -= _muon_unkept_bytes(cfg, d, b, moe, shard, expert_shard)
        formula += " − Muon's 4Ψ_m"
    if b.engine == "deepspeed":
        act_bytes = 4 if cfg.train.precision == "fp32" else 2
        expected, formula = deepspeed_states(p.strategy, b.num_params, shard, act_bytes)
    summary = record.build_summary(cfg, result, expected, dp, shard)
    last = checkpoint.latest_checkpoint(run_dir) if run_dir is not None else None
    summary.update(start_step=result.extra["start_step"], skipped_steps=result.extra["skipped_steps"],
                   checkpoint=str(last) if last else None)
    if plan is not None:
        summary["measured_vs_planned"] = record.measured_vs_planned(result.memory, plan)
        summary["step_time_vs_planned"] = record.step_time_vs_planned(
            result.extra["step_time_s"], plan, sum(r.get("core_wait_share", 0.0) for r in result.memory))
    summary["figures"] = run_figures.figures(result.tokens_per_s, plan, result.extra["evals"],
                                             result.eval_loss, cfg.train.steps, result.extra["moe_rows"])
    report = None
    if run_dir is not None:
        record.write_end(run_dir, p.strategy, formula, shard, expected, result.memory, summary)
        report = write_run_report(run_dir)  # the curves and memory against the plan, to look at
    if quiet:
        return
    # Offloaded states, which the figures beside the formula and the plan count differently (legends).
    offload = tuple(x for x in (p.offload_optimizer, p.offload_params) if x != "none" and
                    (x == "nvme" or d.device.type == "cpu")) if b.engine == "deepspeed" else ()
    record.print_summary(summary, result.memory, formula, expected, run_dir, offload)
    print("\n".join(run_figures.lines(summary["figures"])))
    if report is not None:
        print(f"report: {report}  (loss and eval curves, tokens/s, memory against the plan)")
    if plan is not None:
        record.print_measured_vs_planned(summary["measured_vs_planned"], offload,
                                         plan.get("comm_loop_by_kind"))
        record.print_step_time(summary["step_time_vs_planned"], d.device.type)
    if last is not None:
        # `loom train` rebuilds the config's model (every setting from the run's config.toml); a
        # script's own model is rebuilt by the script. A command to copy as it is: twice the steps,
        # on as many ranks where they are one node's, or by srun's tasks again where srun started them.
        srun = shlex.join(srun_tasks())
        one_node = int(os.environ.get("LOCAL_WORLD_SIZE", d.world_size)) == d.world_size and not srun
        again = (f"{srun + ' ' if srun else ''}loom train --resume auto --out {shlex.quote(str(run_dir))} "
                 f"--set train.steps={2 * cfg.train.steps}{f' --nproc {d.world_size}' if one_node else ''}"
                 if from_config else
                 f"run your script again with train(cfg, Path('{run_dir}'), task=..., resume='auto') and a "
                 f"higher train.steps")
        name, step = last.parents[1].name, shlex.quote(str(last))
        weights = f"weights: loom export {step} model.safetensors"
        if cfg.lora.rank and peft_holds([n for n, q in b.model.named_parameters() if q.requires_grad]):
            weights = f"adapter: loom export {step} {shlex.quote(name + '-adapter')} --lora adapter"
        elif cfg.lora.rank:  # experts adapted, or norms trained whole: the merged model holds them
            weights = f"merged: loom export {step} {shlex.quote(name + '-merged.safetensors')} --lora merged"
        print(f"checkpoint: {last}  (continue: {again}; {weights})")


def _muon_unkept_bytes(cfg: Config, d: Dist, b: Built, moe: list, shard: int, expert_shard: int) -> float:
    """The AdamW moment Muon does not keep: 4 bytes per matrix parameter (train/muon.py) this rank
    holds the state of, split as the formula splits them (TP the blocks' matrices, ep and the
    expert shard the routed experts, the shard where the strategy shards the optimizer)."""
    p = cfg.parallel
    sharded = strategies.OPTIMIZER in strategies.lookup(p.strategy).sharded
    whole_over_tp = {id(q) for m in moe for q in m.parameters()}  # the MoE feed-forward, whole on each
    routed = {id(q) for m in moe for q in m.experts.parameters()}
    unkept = 0.0
    for name, q in b.model.named_parameters():
        if not (q.requires_grad and muon.is_muon_matrix(name, q)):
            continue
        if id(q) in routed:
            unkept += 4 * q.numel() / d.ep_size / (expert_shard if sharded else 1)
        else:
            tp = p.tp if id(q) not in whole_over_tp else 1
            unkept += 4 * q.numel() / tp / (shard if sharded else 1)
    return unkept


def _lora_states(cfg: Config, b: Built, moe: list, shard: int, expert_shard: int) -> tuple[float, str]:
    """LoRA's model states on this rank by the planner's formula (plan/memory.py): the frozen base in
    its dtype, what trains at 16 bytes, each counted after this rank's TP/EP splits; the routed
    experts sharded over expert_shard."""
    strategy = cfg.parallel.strategy
    base_bytes = precision.DTYPES[lora_base_dtype(cfg)].itemsize
    experts = {id(q) for m in moe for q in m.experts.parameters()}
    counts = {(expert, trains): 0 for expert in (False, True) for trains in (False, True)}
    for q in {id(q): q for part in b.parts for q in part.parameters()}.values():  # tied: once
        counts[id(q) in experts, q.requires_grad] += _split_numel(q, ("tp", "ep"))
    expected = lora_state_bytes(strategy, counts[False, False], counts[False, True], shard, base_bytes).total
    if experts:
        expected += lora_state_bytes(strategy, counts[True, False], counts[True, True], expert_shard,
                                     base_bytes).total
    return expected, f"LoRA {base_bytes}Ψ_base + 16Ψ_lora, by {strategy}"


def _split_numel(param: torch.Tensor, dims: tuple[str, ...]) -> float:
    """A parameter's elements on this rank after the splits over mesh `dims` (TP, EP), before the
    data-parallel sharding (a DTensor's numel is the global one)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return param.numel()
    mesh = param.device_mesh
    split = 1
    for name, placement in zip(mesh.mesh_dim_names or (), param.placements):
        if placement.is_shard() and name in dims:
            split *= mesh.size(mesh.mesh_dim_names.index(name))
    return param.numel() / split


def _full_state_dict(parts: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Unsharded weights of this rank's part(s), by the full model's parameter names."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    out = {}
    for part in parts:
        sd = get_model_state_dict(part, options=StateDictOptions(full_state_dict=True))
        out.update({k: v.detach().cpu().clone() for k, v in sd.items()})
    return out
