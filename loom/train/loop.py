"""The training loop: data -> forward -> backward -> optimizer, the same for every strategy.

Every rank runs this. Reading values back to the host (loss, grad norm) happens one step late,
so on a GPU the host never waits for the step it has just queued.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Dataset

from loom.config import (
    FSDP_STRATEGIES,
    Config,
    pipeline_microbatches,
    to_toml,
    validate,
)
from loom.data.corpus import load_tokens
from loom.data.loader import GlobalBatchSampler, make_loader, split_train_eval
from loom.errors import ConfigError, LoomError
from loom.models.gpt import GPTConfig, build_model, preset
from loom.observe import flight
from loom.observe.comms import CollectiveCounter
from loom.observe.memory import PeakMemory, RankMemory, measure_model_states
from loom.parallel.apply import parallelize
from loom.parallel.data_parallel import DTYPES, gradient_sync, uses_fsdp
from loom.parallel.mesh import Dist, init_distributed
from loom.parallel.pipeline import (
    bubble_fraction,
    build_schedule,
    pipeline_step,
    rank_stages,
    validate_pipeline,
)
from loom.parallel.tensor_parallel import check_tp_shapes, loss_context
from loom.plan.memory import formula_text, model_state_bytes
from loom.plan.shapes import ModelShape, from_gpt_config
from loom.train import checkpoint, faults
from loom.train.meters import (
    MetricsFile,
    PhaseTimer,
    Progress,
    format_duration,
    phase_share,
)
from loom.train.optim import build_optimizer, build_scheduler, clip_grad_norm

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


def model_config(cfg: Config, data_vocab: int) -> GPTConfig:
    """The preset with the config's overrides; the vocabulary must cover the data's token ids."""
    m = cfg.model
    overrides = {k: v for k, v in vars(m).items() if k != "preset" and v is not None}
    if "vocab_size" not in overrides and cfg.data.tokenizer == "bpe":
        overrides["vocab_size"] = data_vocab
    gpt = preset(m.preset, **overrides)
    if gpt.vocab_size < data_vocab:
        raise ConfigError(f"model vocab_size {gpt.vocab_size} is smaller than the tokenizer's {data_vocab}; "
                          f"set model.vocab_size={data_vocab}")
    if cfg.parallel.pp > 1:
        p = cfg.parallel
        validate_pipeline(gpt.n_layers, p.pp, p.pp_virtual_stages, p.pp_schedule, pipeline_microbatches(p),
                          tie_embeddings=gpt.tie_embeddings)
    if cfg.parallel.tp > 1:
        check_tp_shapes(gpt.n_heads, gpt.n_kv_heads, gpt.ffn_hidden, gpt.vocab_size, cfg.parallel.tp)
    if cfg.data.seq_len > gpt.max_seq_len:
        raise ConfigError(f"data.seq_len = {cfg.data.seq_len} exceeds the model's max_seq_len "
                          f"{gpt.max_seq_len}; lower data.seq_len or set model.max_seq_len")
    return gpt


def load_data(cfg: Config) -> tuple[Any, int]:
    """The run's token stream and its vocabulary size (a .bin file's vocab is the model's)."""
    d = cfg.data
    vocab = d.bpe_vocab_size
    if d.source.endswith(".bin"):
        vocab = cfg.model.vocab_size or preset(cfg.model.preset).vocab_size
    return load_tokens(d.source, d.tokenizer, vocab, d.bin_dtype, Path(d.cache_dir).expanduser())


def next_token_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = model(inputs)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _local(t: torch.Tensor) -> torch.Tensor:
    """A vocab-parallel loss is a replicated DTensor; its local value is the whole loss."""
    return t.to_local() if isinstance(t, DTensor) else t


def _autocast(cfg: Config, device: torch.device):
    """DDP/ZeRO-1 use autocast for bf16/fp16; FSDP2 casts parameters itself (MixedPrecisionPolicy)."""
    if cfg.train.precision == "fp32" or uses_fsdp(cfg.parallel):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[cfg.train.precision])


def _grad_scaler(cfg: Config, device: torch.device):
    """fp16 needs loss scaling; bf16 and fp32 do not."""
    if cfg.train.precision != "fp16":
        return None
    if uses_fsdp(cfg.parallel):
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type)
    return torch.amp.GradScaler(device.type)


def _all_reduce_mean(t: torch.Tensor, world: int) -> torch.Tensor:
    dist.all_reduce(t)  # SUM: gloo has no AVG
    return t / world


def evaluate(model: nn.Module, loader, d: Dist, cfg: Config, loss_fn=None,
             pipe: Pipeline | None = None) -> float | None:
    """Mean loss over the held-out batches (under a pipeline: forward-only through the stages)."""
    if loader is None:
        return None
    model.eval()
    total = torch.zeros((), device=d.device)
    count = 0
    with torch.no_grad(), _autocast(cfg, d.device), loss_context(cfg.parallel.tp):
        for batch in loader:
            batch = batch.to(d.device, non_blocking=True)
            if pipe is None:
                total += _local((loss_fn or next_token_loss)(model, batch))
            else:
                losses: list[torch.Tensor] | None = [] if pipe.last else None
                pipe.schedule.eval(*((batch[:, :-1],) if pipe.first else ()),
                                   target=batch[:, 1:] if pipe.last else None, losses=losses)
                if losses:  # each was divided by micro-batches × grad_accum (see build_pipeline)
                    total += _local(torch.stack([x.detach() for x in losses]).sum()) * cfg.train.grad_accum
            count += 1
    model.train()
    contributors = d.world_size // cfg.parallel.pp  # with a pipeline only the last stage has a loss
    return _all_reduce_mean(total / max(count, 1), contributors).item()


@dataclass
class Task:
    """What `train` trains: a model factory, its loss and its data. `loom train` itself runs
    `gpt_task(cfg)`: loom's GPT on the config's corpus. Any nn.Module works for the data-parallel
    strategies; TP/PP need a plan (see loom/models/adapters.py)."""

    model_fn: Callable[[], nn.Module]  # called on every rank with the same seed (meta device for loom's GPT)
    loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor]  # (model, batch) -> mean loss
    train_data: Dataset  # items of equal shape; the default collate stacks them
    eval_data: Dataset | None = None
    tokens_per_sample: int = 1  # for tokens/s
    description: str = "model"
    shape: ModelShape | None = None  # known to the planner: plan.json and measured-vs-planned


def gpt_task(cfg: Config) -> Task:
    tokens, vocab = load_data(cfg)
    train_set, eval_set = split_train_eval(tokens, cfg.data.seq_len, cfg.data.eval_fraction)
    gpt_cfg = model_config(cfg, vocab)
    return Task(model_fn=lambda: build_model(gpt_cfg, device="meta"), loss_fn=next_token_loss, train_data=train_set,
                eval_data=eval_set, tokens_per_sample=cfg.data.seq_len,
                description=f"GPT {gpt_cfg.n_layers}L d{gpt_cfg.d_model}",
                shape=from_gpt_config(gpt_cfg, cfg.model.preset))


@dataclass
class Data:
    train: DataLoader  # this rank's micro-batches, step after step
    eval: DataLoader | None  # this rank's slice of the held-out batches
    micro_batch: int


def build_data(cfg: Config, d: Dist, train_set: Dataset, eval_set: Dataset | None, start_step: int = 0) -> Data:
    """Every data-parallel rank reads its own disjoint slice of each global batch, from global
    batch `start_step` on (a resumed run continues where the checkpoint stopped)."""
    t = cfg.train
    dp_rank, dp_size = d.dp_mesh.get_local_rank(), d.dp_mesh.size()
    pin = cfg.data.pin_memory and d.device.type == "cuda"
    sampler = GlobalBatchSampler(len(train_set), t.batch_size, dp_rank, dp_size, t.grad_accum, t.seed,
                                 start_step=start_step, num_steps=t.steps - start_step)
    train_loader = make_loader(train_set, sampler, cfg.data.num_workers, cfg.data.prefetch_factor, pin)
    eval_loader = None
    # Whole batches for every dp rank (and, under a pipeline, for each of its micro-batches).
    unit = dp_size * (pipeline_microbatches(cfg.parallel) if cfg.parallel.pp > 1 else 1)
    eval_batch = min(t.batch_size, len(eval_set) // unit * unit) if eval_set else 0
    if eval_batch >= unit and t.eval_batches > 0:
        eval_sampler = GlobalBatchSampler(len(eval_set), eval_batch, dp_rank, dp_size, 1, t.seed,
                                          num_steps=min(t.eval_batches, len(eval_set) // eval_batch))
        eval_loader = make_loader(eval_set, eval_sampler, 0, None, pin)
    return Data(train_loader, eval_loader, sampler.micro_batch)


@dataclass
class Pipeline:
    schedule: Any  # torch.distributed.pipelining schedule over this rank's stage(s)
    first: bool  # holds the embedding: feeds the tokens
    last: bool  # holds the head: computes the loss
    group: dist.ProcessGroup


def build_pipeline(parts: list[nn.Module], cfg: Config, d: Dist) -> Pipeline:
    p = cfg.parallel
    num_stages = p.pp * p.pp_virtual_stages
    stage_ids = rank_stages(d.mesh["pp"].get_local_rank(), p.pp, p.pp_virtual_stages)
    accum = cfg.train.grad_accum

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # The schedule sums micro-batch gradients; over grad_accum steps they must average too.
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()) / accum

    schedule = build_schedule(parts, stage_ids, num_stages, d.mesh["pp"].get_group(), d.device,
                              p.pp_schedule, pipeline_microbatches(p), loss_fn)
    return Pipeline(schedule, 0 in stage_ids, num_stages - 1 in stage_ids, d.mesh["pp"].get_group())


def train_step(model: nn.Module, optimizer, scheduler, scaler, batches, params: list[torch.Tensor],
               cfg: Config, d: Dist, pipe: Pipeline | None = None, loss_fn=None,
               timer: PhaseTimer | None = None, step: int = 0) -> StepValues:
    """One optimizer step over grad_accum micro-batches; gradients sync on the last one only.

    Returns device tensors (the global mean loss, the global grad norm, whether the update was
    skipped as non-finite), the lr used and the seconds spent waiting for data.
    """
    t = cfg.train
    loss_fn = loss_fn or next_token_loss
    timer = timer or PhaseTimer(d.device)
    optimizer.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), device=d.device)
    data_wait = 0.0
    for micro in range(t.grad_accum):
        wait_start = time.perf_counter()
        with timer.phase("data"):
            batch = next(batches).to(d.device, non_blocking=True)
        data_wait += time.perf_counter() - wait_start
        if pipe is not None:
            # The stages sync gradients themselves (no_sync on all but each step's last backward).
            with timer.phase("pipeline"), _autocast(cfg, d.device), loss_context(cfg.parallel.tp):
                loss = pipeline_step(pipe.schedule, batch[:, :-1] if pipe.first else None,
                                     batch[:, 1:] if pipe.last else None, pipe.first, pipe.last)
            if loss is not None:
                loss_sum += _local(faults.after_forward(step, d.rank, loss)) * t.grad_accum  # undo 1/grad_accum
            continue
        with (gradient_sync(model, enabled=micro == t.grad_accum - 1), _autocast(cfg, d.device),
              loss_context(cfg.parallel.tp)):
            with timer.phase("forward"):
                loss = faults.after_forward(step, d.rank, loss_fn(model, batch))
                scaled = loss / t.grad_accum
            with timer.phase("backward"):
                (scaler.scale(scaled) if scaler else scaled).backward()
        loss_sum += _local(loss.detach())
    # Mean loss over the global batch: each rank's micro-steps, then all ranks (with a pipeline
    # only the last stage's dp × tp ranks hold a loss; the others add 0). Every rank gets the
    # same value, so every rank takes the same decision on a non-finite step.
    global_loss = _all_reduce_mean(loss_sum / t.grad_accum, d.world_size // cfg.parallel.pp)
    with timer.phase("optimizer"):
        grad_norm, skipped, lr = _optimizer_step(optimizer, scheduler, scaler, params, t, pipe, global_loss)
    return StepValues(global_loss, grad_norm, skipped, lr, data_wait)


@dataclass
class StepValues:
    loss: torch.Tensor  # global mean loss (device)
    grad_norm: torch.Tensor  # global gradient norm (device)
    skipped: torch.Tensor  # 1.0 when the update was skipped as non-finite (device)
    lr: float
    data_wait_s: float


def _optimizer_step(optimizer, scheduler, scaler, params: list[torch.Tensor], t, pipe: Pipeline | None,
                    loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Unscale, clip, step (unless the loss or grad norm is NaN/Inf) and advance the schedule.

    Returns (grad norm, skipped flag, lr used). A fused AdamW skips on the device (its
    `found_inf` input, as under a GradScaler): no host sync. Other optimizers read the flag on
    the host before stepping (free on CPU). Under fp16 the scaler already skips overflowed
    gradients (that is its normal operation), so only the loss decides there.
    """
    if scaler:
        scaler.unscale_(optimizer)
    grad_norm = clip_grad_norm(params, t.grad_clip, pipe.group if pipe is not None else None)
    lr = scheduler.get_last_lr()[0]
    finite = torch.isfinite(loss) if scaler else torch.isfinite(loss) & torch.isfinite(grad_norm)
    skipped = (~finite).float()
    if scaler:
        if finite.item():
            scaler.step(optimizer)  # skips the step when fp16 gradients overflowed
        scaler.update()
    elif (fused := _fused_adamw(optimizer)) is not None:
        fused.found_inf = skipped
        try:
            optimizer.step()
        finally:
            del fused.found_inf
    elif finite.item():
        optimizer.step()
    scheduler.step()
    return grad_norm, skipped, lr


def _fused_adamw(optimizer) -> torch.optim.AdamW | None:
    """The fused AdamW that takes the step (ZeRO-1 steps its local one), if the step is one."""
    inner = getattr(optimizer, "optim", optimizer)
    return inner if isinstance(inner, torch.optim.AdamW) and inner.defaults.get("fused") else None


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
    d = init_distributed(lambda world: validate(cfg, world), t.device, timeout_s=t.collective_timeout_s)
    watcher = flight.Watcher(run_dir, d) if run_dir is not None and d.world_size > 1 else None
    try:
        return _train(cfg, d, run_dir, return_state, quiet, task, resume)
    except (RuntimeError, dist.DistError) as e:
        if flight.is_timeout(e) and run_dir is not None:
            raise flight.timeout_error(e, run_dir, d, t.collective_timeout_s) from None
        raise
    finally:
        if watcher is not None:
            watcher.stop()


def _train(cfg: Config, d: Dist, run_dir: Path | None, return_state: bool, quiet: bool, task: Task | None,
           resume: str | Path | None) -> RunResult:
    t, p = cfg.train, cfg.parallel
    main = d.is_main
    torch.manual_seed(t.seed)
    task = task or gpt_task(cfg)
    ckpt_path = checkpoint.resolve_resume(str(resume), run_dir) if resume is not None else None
    dp_size = d.dp_mesh.size()

    built = build_training(cfg, d, task)
    parts, model, pipe, optimizer, scheduler = built.parts, built.model, built.pipe, built.optimizer, built.scheduler
    scaler, params, num_params = built.scaler, built.params, built.num_params
    local_params = sum(q.numel() for q in params)  # this rank's stage(s), before TP/FSDP splits
    tokens_per_step = t.batch_size * task.tokens_per_sample

    start_step = 0
    if ckpt_path is not None:
        meta = checkpoint.load(ckpt_path, model, optimizer, scheduler, cfg, d)
        start_step = meta["step"]
        if main and not quiet:
            print(f"resumed from {ckpt_path} (step {start_step}, saved by {meta.get('layout', {}).get('strategy', '?')} on "
                  f"{meta['world_size']} rank(s)); training steps {start_step + 1}..{t.steps}", flush=True)
    elif resume is not None and main and not quiet:
        print(f"no checkpoint in {run_dir} yet: starting from step 1", flush=True)
    data = build_data(cfg, d, task.train_data, task.eval_data, start_step)
    ckpt = checkpoint.Checkpointer(run_dir, cfg, d, t.keep_last, t.ckpt_async) if run_dir is not None else None

    plan = _plan_run(cfg, task.shape, d) if task.shape is not None else None
    if run_dir is not None and main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(to_toml(cfg))
        if plan is not None:
            (run_dir / "plan.json").write_text(json.dumps(plan, indent=1))
    metrics = MetricsFile(run_dir / "metrics.jsonl" if run_dir is not None and main else None,
                          keep_through_step=start_step)
    if main and not quiet:
        print(f"loom: {p.strategy} on {d.world_size} rank(s) ({d.device.type}), dp={dp_size} "
              f"[replicate {d.mesh['dp_replicate'].size()} × shard {d.mesh['dp_shard'].size()}], "
              f"{task.description} = {num_params / 1e6:.2f}M params, "
              f"global batch {t.batch_size} = micro-batch {data.micro_batch} × grad_accum {t.grad_accum} "
              f"× dp {dp_size}, {task.tokens_per_sample} tokens each, precision {t.precision}", flush=True)
    if main and not quiet and pipe is not None:
        m = pipeline_microbatches(p)
        print(f"pipeline: {p.pp} stages × {p.pp_virtual_stages} virtual, {p.pp_schedule}, {m} micro-batches "
              f"per step: bubble (p−1)/({'v·' if p.pp_virtual_stages > 1 else ''}m+p−1) = "
              f"{bubble_fraction(p.pp, m, p.pp_virtual_stages):.3f}", flush=True)
    progress = Progress(t.steps, t.log_every, enabled=main and not quiet)

    losses: list[float] = []
    grad_norms: list[float] = []
    step_times: list[float] = []
    skipped_steps: list[int] = []
    evals: dict[int, float] = {}  # step -> held-out loss, every train.eval_every steps
    memory: RankMemory | None = None
    peak = PeakMemory(d.device, model, optimizer)
    pending: dict | None = None  # last step's device values, read back after the next step is queued
    comm_seen: dict | None = None  # the collectives of the second step (CollectiveCounter.summary)

    def flush(record: dict) -> None:
        loss, gnorm, skipped = record.pop("values").tolist()
        losses.append(loss)
        grad_norms.append(gnorm)
        phases = PhaseTimer.resolve(record.pop("phases"))
        if skipped:
            skipped_steps.append(record["step"])
        record.update(loss=loss, grad_norm=gnorm, tokens_per_s=tokens_per_step / record["step_time_s"],
                      skipped=bool(skipped), nonfinite_steps=len(skipped_steps), **phases)
        metrics.write(record)
        if skipped:
            _on_nonfinite(record["step"], loss, gnorm, t.on_nonfinite, len(skipped_steps), run_dir, main, quiet)
        progress.update(record["step"], loss, record["tokens_per_s"], phase_share(phases))

    timer = PhaseTimer(d.device)
    profiler = None
    if cfg.profile.enabled and run_dir is not None:
        from loom.observe.profiler import StepProfiler

        profiler = StepProfiler(cfg.profile, run_dir, d.rank, d.device)
        profiler.__enter__()
    batches = iter(data.train)
    start = time.perf_counter()
    for step in range(start_step + 1, t.steps + 1):
        step_start = time.perf_counter()
        faults.at_step_start(step, d.rank)
        # The first step creates the gradients and optimizer states; the second is the steady-state peak.
        steady = step == start_step + 2
        with peak.track() if steady else contextlib.nullcontext(), \
                CollectiveCounter() if steady else contextlib.nullcontext() as comm:
            out = train_step(model, optimizer, scheduler, scaler, batches, params, cfg, d, pipe, task.loss_fn,
                             timer, step)
        phases = timer.end_step()
        if comm is not None:
            comm_seen = comm.summary()
        if step == start_step + 1:
            memory = measure_model_states(model, optimizer)
            memory.num_params = num_params
        values = torch.stack([out.loss, out.grad_norm.float().reshape(()), out.skipped])
        if pending is not None:
            flush(pending)
        step_time = time.perf_counter() - step_start
        step_times.append(step_time)
        pending = {"step": step, "lr": out.lr, "step_time_s": step_time, "data_wait_s": out.data_wait_s,
                   "values": values, "phases": phases}
        if profiler is not None:
            profiler.step()
        if t.eval_every and step % t.eval_every == 0 and step < t.steps:  # the last step: the final eval
            held_out = evaluate(model, data.eval, d, cfg, task.loss_fn, pipe)
            if held_out is not None:
                evals[step] = pending["eval_loss"] = held_out  # written with the step's metrics
                if main and not quiet:
                    print(f"\neval loss at step {step}: {held_out:.4f}", flush=True)
        if ckpt is not None:
            ckpt.poll()
            if (t.ckpt_every and step % t.ckpt_every == 0) or step == t.steps:
                flush(pending)  # the metrics reach step k before checkpoint k exists (saving syncs anyway)
                pending = None
                ckpt.save(step, model, optimizer, scheduler, checkpoint_meta(cfg, step, d, task))
    if pending is not None:
        flush(pending)
    if profiler is not None:
        profiler.__exit__(None, None, None)
    elapsed = time.perf_counter() - start
    if ckpt is not None:
        ckpt.close()
    eval_loss = evaluate(model, data.eval, d, cfg, task.loss_fn, pipe)
    metrics.close()

    memory.peak_bytes = peak.peak_bytes
    rank_memory: list[dict] = [None] * d.world_size  # type: ignore[list-item]
    # Observed: count and payload of the collectives of step 2; wire bytes only as the ring model.
    measured = {**memory.to_dict(), "pp_stage": d.mesh["pp"].get_local_rank(),
                **{f"comm_{k}": comm_seen[k] if comm_seen else None
                   for k in ("count", "payload_bytes", "modelled_wire_bytes", "by_kind")}}
    dist.all_gather_object(rank_memory, measured)
    # The first step pays for warm-up and the second for memory tracking: time the steady state after them.
    timed = step_times[2:] or step_times
    tokens_per_s = tokens_per_step * len(timed) / sum(timed)
    state = _full_state_dict(parts) if return_state else None
    result = RunResult(losses, grad_norms, eval_loss, rank_memory, tokens_per_s, elapsed, state,
                       extra={"start_step": start_step, "skipped_steps": skipped_steps, "evals": evals,
                              "checkpoint_stall_s": ckpt.stall_s if ckpt is not None else []})
    if main:
        shard = d.mesh["dp_shard"].size() if p.strategy in FSDP_STRATEGIES else dp_size
        # TP splits every matrix; only the norms' gains stay whole on each TP rank.
        tp_replicated = sum(q.numel() for q in params if q.ndim == 1) if p.tp > 1 else 0  # the norms' gains
        expected = model_state_bytes(p.strategy, local_params, shard, tp=p.tp, tp_replicated=tp_replicated)
        summary = _summary(cfg, result, expected.total, dp_size, shard)
        last = checkpoint.latest_checkpoint(run_dir) if run_dir is not None else None
        summary.update(start_step=start_step, skipped_steps=skipped_steps, checkpoint=str(last) if last else None)
        if plan is not None:
            summary["measured_vs_planned"] = measured_vs_planned(rank_memory, plan)
        if run_dir is not None:
            (run_dir / "memory.json").write_text(json.dumps(
                {"strategy": p.strategy, "formula": formula_text(p.strategy), "shard_size": shard,
                 "expected_model_state_bytes": expected.total,
                 "ranks": {str(r): m for r, m in enumerate(rank_memory)}}, indent=2))
            (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        if not quiet:
            _print_summary(summary, rank_memory, p.strategy, expected.total, run_dir)
            if plan is not None:
                _print_measured_vs_planned(summary["measured_vs_planned"])
            if last is not None:
                print(f"checkpoint: {last}  (continue: loom train --resume auto --out {run_dir} "
                      f"--set train.steps=N; weights: loom export {last} model.safetensors)")
    return result


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


def build_training(cfg: Config, d: Dist, task: Task) -> Built:
    """The parallelized model, pipeline schedule, optimizer and LR schedule for this rank."""
    t, p = cfg.train, cfg.parallel
    # The same seed on every rank gives every rank the same model (loom's GPT: on meta, initialized
    # per parameter after sharding).
    with torch.random.fork_rng():
        torch.manual_seed(t.seed)
        user_model = task.model_fn()
    num_params = sum(q.numel() for q in user_model.parameters())
    parts = parallelize(user_model, cfg, d)
    del user_model  # a pipeline stage keeps only its layers
    model = parts[0] if len(parts) == 1 else nn.ModuleList(parts)  # interleaved: several stages
    pipe = build_pipeline(parts, cfg, d) if p.pp > 1 else None
    optimizer = build_optimizer(model, t, p.strategy, d)
    scheduler = build_scheduler(optimizer, t)
    params = [q for q in model.parameters() if q.requires_grad]
    return Built(parts, model, pipe, optimizer, scheduler, _grad_scaler(cfg, d.device), params, num_params)


def checkpoint_meta(cfg: Config, step: int, d: Dist, task: Task) -> dict:
    """What a checkpoint records besides tensors: the layout that wrote it and the data position
    (global batch `step` is next; the sampler gives the same one under any layout)."""
    layout = {"strategy": cfg.parallel.strategy, "world_size": d.world_size,
              "mesh": dict(zip(d.mesh.mesh_dim_names, d.mesh.shape))}
    return {"layout": layout, "model": task.description,
            "data": {"next_global_batch": step, "samples_seen": step * cfg.train.batch_size,
                     "tokens_seen": step * cfg.train.batch_size * task.tokens_per_sample, "seed": cfg.train.seed}}


def _on_nonfinite(step: int, loss: float, gnorm: float, policy: str, count: int, run_dir: Path | None,
                  main: bool, quiet: bool) -> None:
    """Every rank sees the same (global) values, so every rank takes the same decision."""
    what = f"step {step}: loss {loss} and gradient norm {gnorm}"
    if policy == "stop":
        last = checkpoint.latest_checkpoint(run_dir) if run_dir is not None else None
        resume = f"; the last checkpoint is {last}" if last else ""
        raise LoomError(f"{what} are not finite; stopped (train.on_nonfinite = stop){resume}; lower train.lr or "
                        f"raise train.warmup_steps, or set train.on_nonfinite=skip to skip such steps")
    if main and not quiet:
        print(f"\n{what}: not finite, update skipped ({count} so far; train.on_nonfinite = skip)", flush=True)


def _plan_run(cfg: Config, shape: ModelShape, d: Dist) -> dict:
    """The planner's prediction for this very run (written as plan.json, printed beside the
    measurements). On CPU there is no GPU to price time on: bytes only."""
    import os

    from loom.plan.comm import comm_per_step
    from loom.plan.hardware import Cluster, detect
    from loom.plan.memory import stage_memory
    from loom.plan.search import config_candidate, config_workload, estimate

    gpu = None
    if d.device.type == "cuda":
        props = torch.cuda.get_device_properties(d.device)
        gpu = detect(props.name, props.total_memory)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", d.world_size))
    cluster = Cluster(gpu, per_node, max(d.world_size // per_node, 1))
    m = d.mesh
    c = config_candidate(cfg, m["dp_replicate"].size(), m["dp_shard"].size(), m["tp"].size(), m["pp"].size())
    w = config_workload(cfg, shape)
    record = estimate(w, c, cluster)
    record["memory_bytes_by_stage"] = {s: stage_memory(w, c, s, cluster.fragmentation).to_dict()
                                       for s in range(c.pp)}
    # What a rank can observe (payload bytes and counts per collective kind), for comparison with
    # the run's CollectiveCounter; comm_bytes_per_step stays the ring model's wire bytes.
    payload = comm_per_step(w, c, cluster.gpus_per_node)[0].payload_dict()
    record.update(comm_payload_bytes_per_step=payload["payload_bytes"],
                  comm_payload_bytes_by_kind=payload["payload_bytes_by_kind"],
                  comm_count_per_step=payload["count"], comm_count_by_kind=payload["count_by_kind"])
    record["gpu"] = gpu.name if gpu else None
    return record


def _full_state_dict(parts: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Unsharded weights of this rank's part(s), by the full model's parameter names."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    out = {}
    for part in parts:
        sd = get_model_state_dict(part, options=StateDictOptions(full_state_dict=True))
        out.update({k: v.detach().cpu().clone() for k, v in sd.items()})
    return out


def measured_vs_planned(ranks: list[dict], plan: dict) -> list[dict]:
    """Per rank, [measured, planned] pairs: model-state bytes, the step's activation peak (peak
    minus model states) and the collectives of a step: payload bytes and counts (observed, in all
    and per kind; a planned count is None where the plan does not know it). Wire bytes are not
    observable: `comm_modelled_wire_bytes` is the ring model on the observed payloads beside the
    plan's (modelled) comm_bytes_per_step."""
    rows = []
    plan_payload = plan.get("comm_payload_bytes_by_kind") or {}
    plan_count = plan.get("comm_count_by_kind") or {}
    for rank, m in enumerate(ranks):
        planned = plan["memory_bytes_by_stage"][m["pp_stage"]]
        activation = m["peak_bytes"] - m["model_state_bytes"] if m["peak_bytes"] is not None else None
        seen = m["comm_by_kind"]  # None: no step was counted (a run of one step)
        absent = {"payload_bytes": 0, "count": 0} if seen is not None else {}
        by_kind = {}
        for k in sorted({*(seen or {}), *plan_payload}):
            got = (seen or {}).get(k, absent)
            by_kind[k] = {"payload_bytes": [got.get("payload_bytes"), plan_payload.get(k, 0)],
                          "count": [got.get("count"), plan_count.get(k, 0)]}
        rows.append({
            "rank": rank,
            "model_state_bytes": [m["model_state_bytes"], planned["model_states"]],
            "activation_peak_bytes": [activation, planned["activations"] + planned["buffers"]],
            "comm_payload_bytes": [m["comm_payload_bytes"], plan.get("comm_payload_bytes_per_step")],
            "comm_count": [m["comm_count"], plan.get("comm_count_per_step")],
            "comm_by_kind": by_kind,
            "comm_modelled_wire_bytes": [m["comm_modelled_wire_bytes"], plan["comm_bytes_per_step"]],
        })
    return rows


def _print_measured_vs_planned(rows: list[dict]) -> None:
    mib = 2**20

    def cell(got, want) -> str:
        ratio = f"{got / want:5.2f}" if got is not None and want else "  n/a"
        got_text = f"{got / mib:8.2f}" if got is not None else "     n/a"
        want_text = f"{want / mib:8.2f}" if want is not None else "     n/a"
        return f"{got_text} / {want_text} {ratio}"

    print("measured / planned (MiB)  model states           activation peak        "
          "collective payload per step (observed)")
    for row in rows:
        keys = ("model_state_bytes", "activation_peak_bytes", "comm_payload_bytes")
        print(f"  rank {row['rank']:<18}" + "   ".join(cell(*row[k]) for k in keys))
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


def _summary(cfg: Config, r: RunResult, expected: float, dp: int, shard: int) -> dict:
    return {
        "strategy": cfg.parallel.strategy, "steps": len(r.losses), "dp": dp, "shard_size": shard,
        "first_loss": r.losses[0], "final_loss": r.losses[-1], "eval_loss": r.eval_loss,
        "tokens_per_s": r.tokens_per_s, "elapsed_s": r.elapsed_s,
        "expected_model_state_bytes": expected,
    }


def _print_summary(s: dict, ranks: list[dict], strategy: str, expected: float, run_dir: Path | None) -> None:
    mib = 2**20
    eval_text = f", eval {s['eval_loss']:.4f}" if s["eval_loss"] is not None else ""
    print(f"\ndone: {s['steps']} steps in {format_duration(s['elapsed_s'])}, loss {s['first_loss']:.4f} → "
          f"{s['final_loss']:.4f}{eval_text}, {s['tokens_per_s']:,.0f} tokens/s")
    print(f"memory per rank (MiB)   params    grads   optim   model states   formula "
          f"{formula_text(strategy)} = {expected / mib:.2f}   peak in step")
    for rank, m in enumerate(ranks):
        peak = f"{m['peak_bytes'] / mib:8.2f}" if m["peak_bytes"] is not None else "     n/a"
        ratio = m["model_state_bytes"] / expected
        print(f"  rank {rank:<17} {m['params_bytes'] / mib:8.2f} {m['grads_bytes'] / mib:8.2f} "
              f"{m['optimizer_bytes'] / mib:7.2f} {m['model_state_bytes'] / mib:14.2f}   "
              f"measured/formula {ratio:.3f}        {peak}")
    if run_dir is not None:
        print(f"run directory: {run_dir}")
