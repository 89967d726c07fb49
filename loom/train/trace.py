"""Traced memory: one real training step of loom's model and strategy, on fake tensors.

`trace_memory` builds what `loom train` builds (`build_training`: loom's GPT on the meta device,
parallelized, AdamW) and runs one `train_step` of one micro-batch, all under `FakeTensorMode` with
a fake process group of `world_size` ranks (this process is rank 0). Nothing is computed and no
real memory is allocated, so a 70B model at world size 64 traces on one CPU process; `MemTracker`
follows every storage rank 0 would hold.

The planner's formulas (loom/plan/memory.py) are checked against it by `traced_vs_analytic`, and
`loom plan --trace` prints the two side by side (`print_trace`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator
from unittest import mock

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import _sharding_prop
from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

from loom import strategies
from loom.config import Config, ParallelDims, lora_base_dtype, validate
from loom.data.hf_tokenizer import HFTokenizer, resolve_tokenizer
from loom.data.tokenizer import ByteTokenizer
from loom.errors import ConfigError, LoomError
from loom.models.gpt.config import GPTConfig
from loom.models.gpt.model import build_model
from loom.observe.rank_memory import count_params, global_peak_tracker, optimizer_states, storage_bytes
from loom.parallel.mesh import Dist, build_mesh, local_view
from loom.parallel.precision import DTYPES
from loom.plan.memory import lora_state_bytes, model_state_bytes
from loom.train.driver import build_training
from loom.train.step import train_step
from loom.train.task import Task, model_config, next_token_loss


def _traceable() -> list[str]:
    """FSDP2 runs on fake tensors. DDP (ddp, zero1) does not: its C++ reducer and parameter check
    read tensor data and its comm hook expects a real future from the process group."""
    return [name for name, s in strategies.STRATEGIES.items() if s.uses_fsdp()]


def trace_memory(cfg: Config, world_size: int, micro_batch: int = 1) -> dict:
    """Rank 0's memory for one training step of `cfg` at `world_size` ranks, traced on fake tensors.

    Returns bytes: params, grads and optimizer states held after the optimizer step (each
    distinct storage once, FSDP2's padded shards included) and the peak of live tensors over
    the whole step (model states, all-gathered parameters, activations, temporaries).
    """
    return _trace(cfg, world_size, micro_batch, fake=True)


def _trace(cfg: Config, world_size: int, micro_batch: int, fake: bool) -> dict:
    """`trace_memory`, or with fake=False the same step on real tensors (world size 1 only: the
    check that tracing on fake tensors measures what a real step holds)."""
    cfg = _trace_config(cfg, world_size, micro_batch)
    dims = validate(cfg, world_size, cuda_available=False, this_machine=False)  # fake tensors, planned ranks
    gpt = _gpt_config(cfg)
    if not fake and world_size != 1:
        raise ValueError("a real step runs alone: world_size must be 1")
    result = _run(cfg, gpt, dims, world_size, micro_batch, fake)
    return {"world_size": world_size, "strategy": cfg.parallel.strategy, "shard_size": dims.dp_shard,
            "micro_batch": micro_batch, "seq_len": cfg.data.seq_len, **result}


def _run(cfg: Config, gpt: GPTConfig, dims: ParallelDims, world_size: int, micro_batch: int,
         fake: bool) -> dict:
    """One step in a process group of its own: fake tensors on the fake backend, or real on gloo."""
    if dist.is_initialized():
        raise LoomError("memory tracing starts its own process group; call it outside a distributed run")
    if fake:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh, dp_mesh, grad_mesh, cp = build_mesh("cpu", dims, cfg.parallel.cp_mode)
        d = Dist(rank=0, local_rank=0, world_size=world_size, device=torch.device("cpu"), mesh=mesh,
                 dp_mesh=dp_mesh, grad_mesh=grad_mesh, cp=cp)
        # Every tensor made in here is fake, the model's meta tensors included: no real memory.
        with FakeTensorMode() if fake else contextlib.nullcontext():
            return _traced_step(cfg, gpt, d, micro_batch)
    finally:
        dist.destroy_process_group()


def traced_vs_analytic(cfg: Config, world_size: int, micro_batch: int = 1) -> dict:
    """The traced bytes beside the planner's formula (`torch` recipe: 4 + 4 + 8 bytes/param).

    `analytic` is the formula with Ψ = the model's parameter count and N = the shard size;
    `analytic_padded` puts in rank 0's padded FSDP2 shard (each dim 0 rounded up to a multiple
    of N) instead of Ψ/N, which is what rank 0 really holds. `ratio` = traced / analytic.
    """
    traced = trace_memory(cfg, world_size, micro_batch)
    strategy, n = traced["strategy"], traced["shard_size"]
    exact = model_state_bytes(strategy, traced["num_params"], n)
    padded = model_state_bytes(strategy, traced["local_numel"] * n, n)
    if cfg.lora.rank is not None:  # the frozen base in its dtype, what trains at 16 bytes
        base = DTYPES[lora_base_dtype(cfg)].itemsize
        exact = lora_state_bytes(strategy, traced["frozen_params"], traced["trainable_params"], n, base)
        padded = lora_state_bytes(strategy, traced["local_frozen_numel"] * n, traced["local_numel"] * n, n,
                                  base)
    kinds = ("params", "grads", "optimizer")

    def as_dict(m) -> dict:
        return {"params_bytes": m.params, "grads_bytes": m.grads, "optimizer_bytes": m.optimizer,
                "model_state_bytes": m.total}

    analytic, analytic_padded = as_dict(exact), as_dict(padded)
    ratio = {f"{k}_bytes": traced[f"{k}_bytes"] / analytic[f"{k}_bytes"] for k in (*kinds, "model_state")}
    return {"strategy": strategy, "world_size": world_size, "shard_size": n,
            "num_params": traced["num_params"], "formula": strategies.lookup(strategy).formula,
            "traced": traced, "analytic": analytic, "analytic_padded": analytic_padded, "ratio": ratio}


def _trace_config(cfg: Config, world_size: int, micro_batch: int) -> Config:
    """A copy of `cfg` for one traced micro-step on CPU; unsupported layouts are refused."""
    cfg = copy.deepcopy(cfg)
    p, t = cfg.parallel, cfg.train
    p.strategy = strategies.ALIASES.get(p.strategy, p.strategy)
    if not strategies.lookup(p.strategy).uses_fsdp():
        raise ConfigError(f"memory tracing supports the FSDP2 strategies ({', '.join(_traceable())}), not "
                          f"'{p.strategy}': DDP's reducer does not run on fake tensors; use the analytic "
                          f"plan for ddp/zero1")
    if p.tp != 1 or p.pp != 1:
        raise ConfigError(f"memory tracing covers data parallelism only; set parallel.tp=1 and parallel.pp=1 "
                          f"(got tp={p.tp}, pp={p.pp})")
    if micro_batch < 1 or world_size < 1:
        raise ConfigError(f"micro_batch = {micro_batch} and world_size = {world_size} must be ≥ 1")
    t.device, t.compile = "cpu", False  # fake CPU tensors; compiled code cannot trace fake inputs here
    # A fused AdamW skips a non-finite step on the device; the foreach path reads a flag on the host,
    # which a fake tensor does not have.
    t.optimizer_impl = "fused"
    t.grad_accum = 1
    t.batch_size = micro_batch * world_size  # one micro-batch per rank: a valid global batch
    return cfg


def _gpt_config(cfg: Config) -> GPTConfig:
    """The preset with the config's overrides, as training builds it (a BPE vocab if no override)."""
    vocab = cfg.data.bpe_vocab_size if cfg.data.tokenizer == "bpe" else ByteTokenizer.vocab_size
    if cfg.data.tokenizer not in ("auto", "byte", "bpe"):  # a tokenizer.json (or its folder): its vocabulary
        vocab = HFTokenizer(resolve_tokenizer(cfg.data.tokenizer)).vocab_size
    return model_config(cfg, vocab)


def _traced_step(cfg: Config, gpt: GPTConfig, d: Dist, micro_batch: int) -> dict:
    """What `loom train` builds (build_training) and one step of it (train_step), in the current
    process group (and fake mode, if any)."""
    task = Task(model_fn=lambda: build_model(gpt, "meta"), loss_fn=next_token_loss, train_data=[],
                tokens_per_sample=cfg.data.seq_len)
    built = build_training(cfg, d, task)
    params, optimizer = built.params, built.optimizer
    tracker = global_peak_tracker()
    tracker.track_external(built.model, optimizer)  # the sharded parameters that already exist
    with _own_fake_mode_for_sharding_propagation(), tracker:
        batches = iter([torch.randint(0, gpt.vocab_size, (micro_batch, cfg.data.seq_len + 1))])
        train_step(built.model, optimizer, built.scheduler, built.scaler, batches, params, cfg, d, None,
                   task.loss_fn)
    peak = tracker.get_tracker_snapshot("peak")
    breakdown: dict[str, int] = {}
    for stats in peak.values():  # one entry per device (only cpu here)
        for kind, nbytes in stats.items():
            name = str(getattr(kind, "value", kind))  # MemTracker's categories are an enum
            breakdown[name] = breakdown.get(name, 0) + int(nbytes)
    frozen = [q for q in built.model.parameters() if not q.requires_grad]  # LoRA's base
    params_bytes = storage_bytes([*params, *frozen])
    grads_bytes = storage_bytes(q.grad for q in params)
    optimizer_bytes = storage_bytes(optimizer_states(optimizer))
    trainable = count_params(built.model, trainable=True)
    return {
        "num_params": built.num_params,
        "trainable_params": trainable,
        "frozen_params": count_params(built.model) - trainable,
        "local_frozen_numel": sum(local_view(q).numel() for q in frozen),
        # rank 0's shard elements; rank 0 always gets a full first chunk, so this is the padded size
        "local_numel": sum(local_view(q).numel() for q in params),
        "params_bytes": params_bytes,
        "grads_bytes": grads_bytes,
        "optimizer_bytes": optimizer_bytes,
        "model_state_bytes": params_bytes + grads_bytes + optimizer_bytes,
        "peak_bytes": breakdown.pop("Total", 0),
        "peak_breakdown": breakdown,
    }


@contextlib.contextmanager
def _own_fake_mode_for_sharding_propagation() -> Iterator[None]:
    """DTensor computes an op's output shape by running it on global-shape fake tensors, in the
    active fake mode if there is one. MemTracker tells those shadow ops from the real (local)
    ones only by their fake mode, so under our FakeTensorMode it would count a whole unsharded
    tensor for every DTensor op (AdamW's step, gradient clipping). Give DTensor its own mode."""
    with mock.patch.object(_sharding_prop, "detect_fake_mode", lambda *args, **kwargs: None):
        yield


def print_trace(cfg: Config, plan, model: str | None) -> None:
    """`loom plan --trace`: the plan's recommended sharding strategy (zero3 when it needs TP, PP
    or offload, or is DDP/ZeRO-1, whose reducer does not run on fake tensors) traced at the plan's
    world size, printed beside the formula."""
    best = plan.candidates[plan.recommended]
    plain = best["tp"] == best["pp"] == 1 and best["offload"] == "none"
    sharded = strategies.lookup(best["strategy"]).engine == "fsdp2"
    strategy = best["strategy"] if plain and sharded else "zero3"
    traced_cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, strategy=strategy,
                                                                       tp=1, pp=1, offload="none"))
    if model is not None and not model.endswith(".json"):
        traced_cfg.model.preset = model
    result = traced_vs_analytic(traced_cfg, plan.cluster.world_size)
    traced, analytic = result["traced"], result["analytic"]
    print(f"\ntraced under FakeTensorMode: the real model and {strategy} on a fake process group of "
          f"{plan.cluster.world_size} ranks (rank 0; torch recipe, micro-batch {traced['micro_batch']} × "
          f"{traced['seq_len']} tokens)")
    print(f"  {'MB per rank':<14} {'traced':>12} {'analytic':>12} {'ratio':>7}")
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "model_state_bytes"):
        print(f"  {key.removesuffix('_bytes'):<14} {traced[key] / 1e6:12.3f} {analytic[key] / 1e6:12.3f} "
              f"{result['ratio'][key]:7.3f}")
    print(f"  {'step peak':<14} {traced['peak_bytes'] / 1e6:12.3f}")
