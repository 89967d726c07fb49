"""The DeepSpeed engine (`parallel.engine = "deepspeed"`): ZeRO stages 0-3 with the optimizer
and (stage 3) the parameters offloaded to host memory or NVMe, run by loom's own loop.

loom derives DeepSpeed's config from its own keys (`deepspeed_config`): the ZeRO stage from the
strategy table, offload from `parallel.offload_optimizer` / `offload_params` / `nvme_path`,
buckets from `parallel.ddp_bucket_mb`, accumulation, clipping and precision from `[train]`; a
user's JSON (`parallel.deepspeed_config`) is merged over it, and may not set any of those
(`loom.config.DEEPSPEED_DERIVED`). The optimizer is loom's AdamW (its
weight-decay groups and LR schedule; DeepSpeed's CPU Adam when the optimizer is offloaded), so
both engines train the same model the same way.

Under ZeRO-3 the model is built inside `deepspeed.zero.Init`: each module's parameters are
partitioned as soon as the module exists, so a rank never holds the whole model. loom's GPT is
then initialized parameter by parameter (each one gathered, written, partitioned again), giving
the same weights as the torch engine for the same seed.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import math
import os
import sys
from pathlib import Path

import torch
from torch import nn

from loom import heap, strategies
from loom.config import Config, choose_deepspeed_accelerator, read_deepspeed_json
from loom.parallel.adapter import ModelAdapter
from loom.parallel.known_warnings import deepspeed_build_notes_dropped, silence_deepspeed_collective_names
from loom.parallel.mesh import Dist
from loom.parallel.weights import WeightSource, plain_name, read_flat
from loom.parallel.zero1 import create_states


def deepspeed_config(cfg: Config, micro_batch: int, swap_dir: Path | None = None) -> dict:
    """DeepSpeed's config for this run: derived from loom's keys, then the user's JSON over it.
    NVMe offload swaps into `swap_dir`, a folder of this run's own under parallel.nvme_path."""
    p, t = cfg.parallel, cfg.train
    stage = strategies.lookup(p.strategy).zero_stage
    bucket = int(p.ddp_bucket_mb * 2**20 // 4)  # DeepSpeed counts bucket sizes in elements (fp32)
    zero: dict = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
                  "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    for key, where in (("offload_optimizer", p.offload_optimizer), ("offload_param", p.offload_params)):
        if where != "none":
            zero[key] = {"device": where, "pin_memory": torch.cuda.is_available()}
            if where == "nvme":
                zero[key]["nvme_path"] = str(swap_dir or swap_folder(p.nvme_path, None))
    if p.offload_optimizer == "nvme":
        zero["sub_group_size"] = 2**20  # swap the states through memory in pieces of 1M elements
    ds = {
        "train_batch_size": t.batch_size,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": t.grad_accum,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": t.precision == "bf16"},
        "fp16": {"enabled": t.precision == "fp16", "initial_scale_power": 16},
        "steps_per_print": 2**31 - 1,  # loom prints progress itself
        "wall_clock_breakdown": False,
    }
    if p.deepspeed_config:  # checked: none of the keys loom derives, DeepSpeed's own types
        ds = _merged(ds, read_deepspeed_json(p))
    return ds


def swap_folder(nvme_path: str, run_dir: Path | None) -> Path:
    """This run's folder under parallel.nvme_path (removed when the run ends): named after the run
    directory, so a restarted run finds (and clears) what a killed one left; without one, after
    the launcher's process, which every rank shares."""
    tag = run_dir.resolve().name + "-" + hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:8] \
        if run_dir is not None else f"pid{os.getppid()}"
    return Path(nvme_path).expanduser() / f"loom-swap-{tag}"


def _merged(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in override.items():
        both_sections = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if both_sections else value
    return out


def model_context(ds: dict):
    """Where to build the model: under ZeRO-3 inside zero.Init, which partitions each module's
    parameters as soon as the module exists (a rank never holds the whole model)."""
    if ds["zero_optimization"]["stage"] != 3:
        return contextlib.nullcontext()
    choose_deepspeed_accelerator()
    import deepspeed

    join_process_group()
    # Built in fp32 (the engine casts for bf16/fp16 itself). Not through dtype=: DeepSpeed 0.19.8
    # ignores it where the accelerator has no fp16 (`dtype or fp16 if … else bf16 …` in
    # partition_parameters._set_dtype), so a CPU without AVX-512 FP16 built the model in bf16. Its
    # config path gives fp32 when neither 16-bit mode is on.
    fp32 = {**ds, "bf16": {"enabled": False}, "fp16": {"enabled": False}}
    return _building_partitioned(deepspeed.zero.Init(config_dict_or_path=fp32))


@contextlib.contextmanager
def _building_partitioned(init):
    """zero.Init builds each module whole, then keeps only this rank's partition. glibc would keep
    the freed whole weights in the heap (its mmap threshold grows after the first large free), so
    the process would still grow by about the whole model: while building, allocations of 1 MB and
    more are mapped and go back to the system when freed; afterwards, glibc's usual ceiling."""
    heap.map_allocations_from(1 << 20)
    try:
        with init:
            yield
    finally:
        heap.map_allocations_from(None)
        heap.release_free_memory()


def join_process_group() -> None:
    """DeepSpeed's communication layer over loom's process group (already initialized)."""
    choose_deepspeed_accelerator()
    import deepspeed
    import torch.distributed as dist

    silence_deepspeed_collective_names()
    # Its CPU backend compiles a shared-memory all-reduce on first use (about a minute on 2 cores) that
    # only its inference all-reduce calls, falling back to the process group's without it: loom never
    # calls it, so the op is marked unavailable (DeepSpeed keeps this table for such edits).
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    with deepspeed_build_notes_dropped():  # should a DeepSpeed version build that op anyway
        deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False)


def initialize_weights(model: nn.Module, adapter: ModelAdapter, seed: int, partitioned: bool,
                       source: WeightSource | None = None) -> None:
    """The weights from `source` (pretrained), or the model's per-parameter initialization from
    (seed, name) (loom's GPT): the same values as the torch engine. A ZeRO-3 partition is this
    rank's slice of the flattened parameter (DeepSpeed pads the last one): each rank reads and
    writes its own slice, one parameter at a time, with no communication and nothing gathered."""
    if not adapter.meta_init and source is None:
        return  # built by its own factory, the same on every rank (same seed)
    if not partitioned:
        adapter.init_weights(model, seed, source)
        return
    source = source if source is not None else adapter.weight_source(model, seed)
    choose_deepspeed_accelerator()
    import deepspeed
    import torch.distributed as dist

    rank = dist.get_rank()
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied weight once
            name, shape = plain_name(name), tuple(param.ds_shape)
            part = param.ds_tensor
            if part.dim() != 1 or part.numel() == 0:  # offloaded (to NVMe): let DeepSpeed bring it in
                with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                    param.copy_(source.read(name, shape, (0,) * len(shape), shape))
                continue
            numel = math.prod(shape)
            start, stop = min(rank * part.numel(), numel), min((rank + 1) * part.numel(), numel)
            part.zero_()
            if stop > start:
                part[:stop - start].copy_(read_flat(source, name, shape, start, stop))


def initialize(model: nn.Module, optimizer: torch.optim.Optimizer, ds: dict, d: Dist):
    """deepspeed.initialize over loom's process group: the engine (it wraps model and optimizer)."""
    choose_deepspeed_accelerator()
    import deepspeed

    join_process_group()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds,
                                           dist_init_required=False)
    return engine


# ---------------------------------------------------------------------------------------------
# Checkpoints in loom's layout: whole tensors under the model's parameter names, so a checkpoint
# resumes under either engine and any world size, and `loom export` reads it as any other.


def is_engine(model) -> bool:
    if "deepspeed" not in sys.modules:
        return False
    from deepspeed import DeepSpeedEngine

    return isinstance(model, DeepSpeedEngine)


def _aliases(module: nn.Module) -> dict[str, list[str]]:
    """Each parameter's first name, with every name it has (a tied weight has two)."""
    first: dict[int, str] = {}
    names: dict[str, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(first.setdefault(id(p), name), []).append(name)
    return names


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a checkpoint keeps (an MoE block's expert_bias): ZeRO partitions parameters only,
    so each rank holds them whole."""
    out = {}
    for prefix, sub in module.named_modules():
        for name, buffer in sub.named_buffers(recurse=False):
            if name not in sub._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = buffer
    return out


def checkpoint_entries(engine) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """What `full_states` writes, as (dtype, shape): fp32 weights and AdamW's states, and the
    persistent buffers as they are."""
    params = dict(engine.module.named_parameters())
    buffers = persistent_buffers(engine.module)
    out = {f"model.{name}": (b.dtype, tuple(b.shape)) for name, b in buffers.items()}
    for name, all_names in _aliases(engine.module).items():
        shape = tuple(getattr(params[name], "ds_shape", params[name].shape))
        out.update({f"model.{alias}": (torch.float32, shape) for alias in all_names})
        out[f"optim.{name}.step"] = (torch.float32, ())
        out[f"optim.{name}.exp_avg"] = out[f"optim.{name}.exp_avg_sq"] = (torch.float32, shape)
    return out


def full_states(engine, optimizer: torch.optim.Optimizer, rank: int, world: int) -> dict[str, torch.Tensor]:
    """The fp32 weights and AdamW states, whole: every rank takes part in gathering each parameter
    (one at a time) and keeps those it owns (round-robin), so each is written once."""
    _link_optimizer_states(engine, optimizer)
    step = _adam_step(optimizer)
    params = dict(engine.module.named_parameters())
    out = {f"model.{name}": b.detach().cpu().clone() for name, b in persistent_buffers(engine.module).items()
           if rank == 0}
    for i, (name, all_names) in enumerate(_aliases(engine.module).items()):
        p = params[name]
        weight = _get_full(engine, optimizer, p, None)
        exp_avg, exp_avg_sq = (_get_full(engine, optimizer, p, key) for key in ("exp_avg", "exp_avg_sq"))
        if i % world != rank:
            continue
        for alias in all_names:
            out[f"model.{alias}"] = weight.detach().float().cpu()
        out[f"optim.{name}.step"] = step.clone()
        out[f"optim.{name}.exp_avg"] = exp_avg.detach().float().cpu()
        out[f"optim.{name}.exp_avg_sq"] = exp_avg_sq.detach().float().cpu()
    return out


def _get_full(engine, optimizer, param, key: str | None) -> torch.Tensor:
    """A parameter's whole fp32 weight (key None) or Adam state: gathered from its ZeRO partitions,
    or (ZeRO-0: a plain optimizer over the model's own parameters) read directly."""
    if engine.zero_optimization_stage() == 0:
        return param if key is None else optimizer.state[param][key]
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    return safe_get_full_fp32_param(param) if key is None else safe_get_full_optimizer_state(param, key)


def _set_full(engine, optimizer, param, value: torch.Tensor, key: str | None) -> None:
    if engine.zero_optimization_stage() == 0:
        (param if key is None else optimizer.state[param][key]).copy_(value)
        return
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    if key is None:
        safe_set_full_fp32_param(param, value)
    else:
        safe_set_full_optimizer_state(param, value, key)


def full_weights(engine) -> dict[str, torch.Tensor]:
    """The whole fp32 weights on every rank, by the model's parameter names (tied ones under both), and
    the persistent buffers."""
    params = dict(engine.module.named_parameters())
    out = {name: b.detach().cpu().clone() for name, b in persistent_buffers(engine.module).items()}
    for name, all_names in _aliases(engine.module).items():
        weight = _get_full(engine, None, params[name], None).detach().float().cpu().clone()
        out.update(dict.fromkeys(all_names, weight))
    return out


def load_full_states(engine, optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]) -> None:
    """Write whole weights and AdamW states into the engine's (partitioned) fp32 masters, its
    optimizer states and the model's own parameters."""
    choose_deepspeed_accelerator()
    import deepspeed

    _link_optimizer_states(engine, optimizer)
    params = dict(engine.module.named_parameters())
    with torch.no_grad():
        for name, buffer in persistent_buffers(engine.module).items():
            buffer.copy_(tensors[f"model.{name}"])
        for name in _aliases(engine.module):
            p, weight = params[name], tensors[f"model.{name}"]
            _set_full(engine, optimizer, p, weight, None)
            for key in ("exp_avg", "exp_avg_sq"):
                _set_full(engine, optimizer, p, tensors[f"optim.{name}.{key}"], key)
            # The model's own (compute-dtype) parameter is a copy of the master: refresh it too.
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0) if hasattr(p, "ds_id") \
                    else contextlib.nullcontext():
                p.copy_(weight.to(p.dtype))
    step = max(float(t) for k, t in tensors.items() if k.endswith(".step"))
    for state in optimizer.state.values():  # Adam's step count, the same for every parameter
        old = state.get("step")
        state["step"] = (torch.tensor(step, dtype=torch.float32) if isinstance(old, torch.Tensor)
                         else int(step))


def _link_optimizer_states(engine, optimizer: torch.optim.Optimizer) -> None:
    """Adam's states exist (before the first step: a step at lr 0 creates them, changing nothing),
    and every parameter's ZeRO-1/2 fragment points at them. DeepSpeed links the fragments once,
    right after the first parameter group steps, so a second group (loom's undecayed norms) is
    linked before its states exist: link again."""
    zero = engine.optimizer
    if engine.zero_optimization_stage() == 0:
        create_states(optimizer)
        return
    if hasattr(zero, "fp32_partitioned_groups_flat"):
        _create_stage3_states(zero, optimizer)
    else:
        create_states(optimizer)  # ZeRO-1/2 keep their fp32 partitions in the optimizer's groups
    if hasattr(zero, "_hp_optimizer_states_linked"):
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()


def _create_stage3_states(zero, optimizer: torch.optim.Optimizer) -> None:
    """ZeRO-3 hands each fp32 sub-group to the optimizer only while stepping it: do the same, with
    zero gradients at lr 0, for the sub-groups that have no Adam state yet."""
    for i, flat in enumerate(zero.fp32_partitioned_groups_flat):
        if optimizer.state.get(flat):
            continue
        group = optimizer.param_groups[zero.sub_group_to_group_id[i]]
        params, lr = group["params"], group["lr"]
        group["params"], group["lr"] = [flat], 0.0
        flat.grad = torch.zeros_like(flat)
        try:
            optimizer.step()
        finally:
            group["params"], group["lr"] = params, lr
            flat.grad = None


def _adam_step(optimizer: torch.optim.Optimizer) -> torch.Tensor:
    steps = [s["step"] for s in optimizer.state.values() if "step" in s]
    return torch.as_tensor(steps[0] if steps else 0.0, dtype=torch.float32).reshape(())


def rank_swap_bytes(swap: Path, rank: int) -> int:
    """This rank's offload files under the run's swap folder (DeepSpeed keeps one folder per rank)."""
    return sum(f.stat().st_size for folder in swap.rglob(f"rank{rank}") for f in folder.rglob("*")
               if f.is_file())


def master_weights(engine) -> list[torch.Tensor]:
    """The fp32 partitions DeepSpeed's optimizer steps (ZeRO 1-3; ZeRO-0 steps the weights)."""
    zero = engine.optimizer
    return list(getattr(zero, "fp32_partitioned_groups_flat", None)
                or getattr(zero, "single_partition_of_fp32_groups", None) or [])


def ops_to_build(ds: dict) -> list[str]:
    """DeepSpeed's C++ ops this config loads that are not compiled yet (they compile on first use:
    a minute or more on a small machine, which would look like a hang)."""
    zero = ds["zero_optimization"]
    offloads = [zero.get(k, {}).get("device") for k in ("offload_optimizer", "offload_param")]
    needed = ["cpu_adam"] if offloads[0] not in (None, "none") else []
    needed += ["async_io"] if "nvme" in offloads else []
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    return [op for op in needed if not any(root.glob(f"*/{op}/*.so"))]
