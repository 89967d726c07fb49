"""`loom plan --calibrate`: measure this machine into a device profile (see loom/plan/device.py).

For each number of ranks a node may run (1, 2, 4, … up to twice the cores on a CPU; 1 on a GPU),
that many processes run the measurements at once, each with the threads loom's launcher gives a
rank, so the rates include what ranks share (cores, memory bandwidth):
  - a linear layer's forward + backward (three matmuls) over a grid of shapes: FLOP/s;
  - causal attention's forward + backward (scaled_dot_product_attention): FLOP/s;
  - elementwise kernels (add, mul, silu, casts) on tensors of a few sizes: bytes/s moved;
  - the fixed cost of one small op under autograd (dispatch + launch): seconds;
  - two of loom's decoder blocks forward + backward against the sum of their parts above: how
    much slower kernels run one after another than each repeated alone (the in-situ factor);
  - the optimizer step (gradient clipping + AdamW) per parameter: seconds;
  - the collectives loom issues (all-reduce, all-gather, reduce-scatter, broadcast, send/recv)
    at sizes from 4 KB to 16 MB, fitted to t = α + bytes/β per kind (gloo on CPU, NCCL on GPU).
`loom plan --calibrate` measures the full grid; the first `loom plan` (and --quick) a thin one
within QUICK_BUDGET_S. The shapes' rates are timed in passes, each rate the median of its windows.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import statistics
import time
import traceback
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from loom.observe import core_wait
from loom.plan.device import (
    ATTENTION_HEAD_DIMS,
    ATTENTION_SEQS,
    COLLECTIVE_SIZES,
    ELEMENTWISE_SIZES,
    LINEAR_ROWS,
    LINEAR_SIZES,
    DeviceProfile,
    fit_alpha_beta,
)

BLOCK_SHAPES = ((512, 256), (2048, 256), (2048, 512), (4096, 512))  # (tokens, d_model)
IN_SITU_SHAPES = ((1024, 256), (2048, 512))  # (tokens, d_model): the small preset's block, and wider
MAX_FLOPS = 1e10  # skip grid points slower than a tenth of a second or so on a CPU core


def _timed(fn, min_time: float, device: torch.device, deadline: float = math.inf) -> float:
    """Seconds per call as training sees it: every rank makes the same number of calls at once (the
    count agreed, the slowest rank's), a window's time is the slowest rank's (training waits for it
    at its next collective), and the median of PASSES windows is taken: ranks share cores and memory
    bandwidth all along, which a best-of — or a rank timing alone after the others finished — hides."""
    return _in_passes([fn], min_time, device, deadline)[0]


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _agreed(value: float, device: torch.device, op: str) -> float:
    """The min or max of `value` over the ranks (the value itself on one rank)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX)
    return t.item()


@dataclass(frozen=True)
class Grid:
    """The shapes a calibration measures, and how long: the full grid for `--calibrate`, a thin one
    (the planner interpolates between its points) for the first `loom plan`, which must be quick."""
    linear_rows: tuple = LINEAR_ROWS
    linear_sizes: tuple = LINEAR_SIZES
    attention_seqs: tuple = ATTENTION_SEQS
    attention_head_dims: tuple = ATTENTION_HEAD_DIMS
    elementwise_sizes: tuple = ELEMENTWISE_SIZES
    block_shapes: tuple = BLOCK_SHAPES
    in_situ_shapes: tuple = IN_SITU_SHAPES
    collective_sizes: tuple = COLLECTIVE_SIZES
    max_flops: float = MAX_FLOPS  # on a CPU, grid points above this many FLOPs are skipped
    min_time: float = 0.15  # seconds a measurement runs for, split over its PASSES windows


FULL = Grid()
QUICK = Grid(linear_rows=(128, 1024, 4096), linear_sizes=(64, 256, 1024, 4096), attention_seqs=(128, 512),
             attention_head_dims=(32, 128), elementwise_sizes=(2**18, 2**24), block_shapes=BLOCK_SHAPES[:1],
             in_situ_shapes=IN_SITU_SHAPES[:1], collective_sizes=(2**12, 2**18, 2**22), max_flops=2e9,
             min_time=0.03)
QUICK_BUDGET_S = 30  # the first `loom plan`'s calibration: later passes are dropped past it
PASSES = 3  # each rate: the median of this many windows, spread over the calibration (not back to back)


def measure_compute(device: torch.device, dtype: torch.dtype, grid: Grid = FULL,
                    deadline: float = math.inf) -> dict:
    """The rates of the grid's shapes. Every probe is timed once per pass and the passes run one after
    another, so a rate's windows lie seconds to minutes apart: the median rides over a burst of load
    from another process. Passes after the first are dropped once `deadline` (time.time()) is past."""
    probes = []  # (table, key, work per call, call): rate = work / seconds per call
    for rows in grid.linear_rows:
        for size in grid.linear_sizes:
            flops = 6 * rows * size * size
            if device.type == "cpu" and flops > grid.max_flops:
                continue
            x = torch.randn(rows, size, device=device, dtype=dtype, requires_grad=True)
            w = torch.randn(size, size, device=device, dtype=dtype, requires_grad=True)
            grad = torch.randn(rows, size, device=device, dtype=dtype)

            def step(x=x, w=w, grad=grad):
                F.linear(x, w).backward(grad)
                x.grad = w.grad = None
            probes.append(("linear_flops", f"{rows}x{size}", flops, step))
    for seq in grid.attention_seqs:
        for head_dim in grid.attention_head_dims:
            heads = 8
            flops = 12 * heads * seq * seq * head_dim  # the planner's count: 12·H·Q·T per token
            q, k, v = (torch.randn(1, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
                       for _ in range(3))

            def step(q=q, k=k, v=v):
                F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
                q.grad = k.grad = v.grad = None
            probes.append(("attention_flops", f"{seq}x{head_dim}", flops, step))
    for size in grid.elementwise_sizes:
        n = size // 4
        a, b = torch.randn(n, device=device), torch.randn(n, device=device)
        out = torch.empty(n, device=device)

        def step(a=a, b=b, out=out):
            torch.add(a, b, out=out)
            torch.mul(a, b, out=out)
            F.silu(a, inplace=False)
            a.to(torch.bfloat16)
        moved = 3 * size + 3 * size + 2 * size + size * 3 // 2  # bytes read + written by the four
        probes.append(("elementwise_bytes", str(size), moved, step))
    one = torch.ones(1, device=device, requires_grad=True)
    probes.append(("op_overhead_s", "", 0.5, lambda: (one + one) * one))  # two ops: seconds / 2

    seconds = _in_passes([call for *_, call in probes], grid.min_time, device, deadline)
    rates: dict = {"linear_flops": {}, "attention_flops": {}, "elementwise_bytes": {}}
    for (table, key, work, _), t in zip(probes, seconds):
        if table == "op_overhead_s":
            rates[table] = t * work
        else:
            rates[table][key] = work / t
    block = {}
    for tokens, d_model in grid.block_shapes:
        moved, spent = _block_elementwise(tokens, d_model, device, dtype, grid.min_time, deadline)
        block[str(tokens * d_model * 4)] = moved / spent
    rates["block_elementwise_bytes"] = block
    in_situ = {}
    for tokens, d_model in grid.in_situ_shapes:
        in_situ[str(tokens * d_model * 4)] = _block_in_situ(tokens, d_model, device, dtype, grid.min_time,
                                                            rates, deadline)
    optimizer = _optimizer_step(device, grid.min_time, deadline)
    return {**rates, "block_in_situ": in_situ, "optimizer_s_per_param": optimizer}


def _in_passes(calls: list, min_time: float, device: torch.device, deadline: float = math.inf) -> list[float]:
    """Seconds per call of each of `calls`: the median over up to PASSES windows, one per pass through
    all of them. The ranks agree on each window's call count (the slowest rank's) and on whether to
    run another pass, so that they make the same calls together."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    counts = []
    for fn in calls:  # warm up, and the calls that fill a window
        _barrier()
        fn()
        sync()
        made, start = 0, time.perf_counter()
        while made < 1 or time.perf_counter() - start < min_time / PASSES:
            fn()
            made += 1
        sync()
        counts.append(int(_agreed(made, device, "min")))
    windows: list[list[float]] = [[] for _ in calls]
    for done in range(PASSES):
        if done and _agreed(float(time.time() > deadline), device, "max"):
            break
        for fn, count, samples in zip(calls, counts, windows):
            _barrier()
            waits, start = core_wait.snapshot(), time.perf_counter()
            for _ in range(count):
                fn()
            sync()
            wall = time.perf_counter() - start
            seconds = max(wall - core_wait.waited_s(waits), 0.1 * wall)  # other processes' turns taken out
            samples.append(_agreed(seconds / count, device, "max"))
    return [statistics.median(samples) for samples in windows]


MATMULS = {"mm", "addmm", "bmm", "linear", "_scaled_dot_product_flash_attention_for_cpu",
           "_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_flash_attention",
           "_scaled_dot_product_flash_attention_backward", "_scaled_dot_product_efficient_attention",
           "_scaled_dot_product_efficient_attention_backward", "_scaled_dot_product_cudnn_attention",
           "_scaled_dot_product_cudnn_attention_backward"}


class _ElementwiseClock(TorchDispatchMode):
    """Seconds spent in every aten op but the matmuls and attention (those are priced apart)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.seconds = 0.0
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._overloadpacket.__name__ in MATMULS:
            return func(*args, **(kwargs or {}))
        self.sync()
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.sync()
        self.seconds += time.perf_counter() - start
        return out


def _blocks(count: int, tokens: int, d_model: int, device: torch.device, dtype: torch.dtype):
    """`count` of loom's decoder blocks at width `d_model` (heads of 32, GQA 2:1, SwiGLU 3×), their
    RoPE tables, an input of `tokens` tokens (sequences of 128) and a gradient for the output."""
    from loom.models.gpt.config import preset
    from loom.models.gpt.model import Block, rope_tables

    seq = 128
    cfg = preset("small", d_model=d_model, n_heads=d_model // 32, n_kv_heads=d_model // 64,
                 ffn_hidden=3 * d_model, max_seq_len=seq)
    blocks = [Block(cfg).to(device=device, dtype=dtype) for _ in range(count)]
    rope = rope_tables(cfg.head_dim, seq, cfg.rope_theta, device)
    x = torch.randn(tokens // seq, seq, d_model, device=device, dtype=dtype, requires_grad=True)
    return cfg, blocks, rope, x, torch.randn_like(x)


def _block_elementwise(tokens: int, d_model: int, device: torch.device, dtype: torch.dtype,
                       min_time: float, deadline: float = math.inf) -> tuple[float, float]:
    """(bytes, seconds) of the elementwise part of loom's decoder block — norms, RoPE, SwiGLU,
    residuals, with their broadcasts and strides — at one shape, each op timed as it runs in the
    block's forward + backward (the median of a few runs, the slowest rank's)."""
    from loom.plan.step import BLOCK_ELEMENTWISE

    cfg, (block,), rope, x, grad = _blocks(1, tokens, d_model, device, dtype)
    runs = []
    for done in range(3 if min_time < FULL.min_time else 5):
        if done > 1 and _agreed(float(time.time() > deadline), device, "max"):
            break  # the first run warms up; past the deadline one more is enough
        _barrier()  # the ranks run the block together, as in training; the slowest rank counts
        waits, start = core_wait.snapshot(), time.perf_counter()
        with _ElementwiseClock(device) as clock:
            block(x, rope).backward(grad)
        x.grad = None
        block.zero_grad(set_to_none=True)
        wall = time.perf_counter() - start
        own = max(wall - core_wait.waited_s(waits), 0.1 * wall) / wall  # the share other processes left
        runs.append(_agreed(clock.seconds * own, device, "max"))
    seconds = statistics.median(runs[1:])  # the first run warms the allocator up
    a, b, e = BLOCK_ELEMENTWISE
    kv = cfg.n_kv_heads * cfg.head_dim
    return 4 * tokens * (a * d_model + b * cfg.ffn_hidden + e * kv), seconds


def _block_in_situ(tokens: int, d_model: int, device: torch.device, dtype: torch.dtype, min_time: float,
                   rates: dict, deadline: float = math.inf) -> float:
    """Two of loom's decoder blocks run forward + backward, per block, divided by what the parts'
    rates just measured add up to for that block (plan/step.block_seconds): the factor by which
    kernels run slower one after another in training than each repeated alone."""
    from loom.plan.device import DeviceProfile
    from loom.plan.shapes import from_gpt_config
    from loom.plan.step import block_seconds

    cfg, blocks, rope, x, grad = _blocks(2, tokens, d_model, device, dtype)

    def step():
        h = x
        for block in blocks:
            h = block(h, rope)
        h.backward(grad)
        x.grad = None
        for block in blocks:
            block.zero_grad(set_to_none=True)

    measured = _timed(step, min_time, device, deadline) / len(blocks)
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    parts = DeviceProfile("", "", 0, 0, "", "", {str(ranks): rates})
    seq = x.shape[1]
    return measured / block_seconds(parts, ranks, from_gpt_config(cfg, "calibration"), seq, tokens, 1)


def _optimizer_step(device: torch.device, min_time: float, deadline: float = math.inf) -> float:
    """Seconds per parameter of loom's optimizer step: gradient clipping and AdamW (foreach on a
    CPU, fused on a GPU) over fp32 parameters shaped like two decoder blocks of width 512."""
    from loom.models.gpt.config import preset
    from loom.models.gpt.model import Block

    cfg = preset("small", d_model=512, n_heads=16, n_kv_heads=8, ffn_hidden=1536)
    params = [p for _ in range(2) for p in Block(cfg).to(device).parameters()]
    for p in params:
        p.grad = torch.randn_like(p)
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=not fused, fused=fused)

    def step():
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()

    return _timed(step, min_time, device, deadline) / sum(p.numel() for p in params)


def measure_collectives(device: torch.device, min_time: float, sizes: tuple = COLLECTIVE_SIZES) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        return {}
    samples: dict[str, list[tuple[float, float]]] = {}
    for size in sizes:
        n = size // 4
        full = torch.zeros(n * world, device=device)
        part = torch.zeros(n, device=device)
        calls = {
            "all_reduce": (lambda: dist.all_reduce(part), size),
            "all_gather": (lambda: dist.all_gather_into_tensor(full, part), size * world),
            "reduce_scatter": (lambda: dist.reduce_scatter_tensor(part, full), size * world),
            "broadcast": (lambda: dist.broadcast(part, 0), size),
            "send": ((lambda: dist.send(part, 1)) if rank == 0 else
                     (lambda: dist.recv(part, 0)) if rank == 1 else (lambda: None), size),
        }
        for kind, (call, payload) in calls.items():
            dist.barrier()
            seconds = _timed_together(call, min_time / 4, device)
            samples.setdefault(kind, []).append((payload, seconds))
    return {kind: fit_alpha_beta(points) for kind, points in samples.items()}


def _timed_together(call, min_time: float, device: torch.device) -> float:
    """Seconds per collective: every rank must make the same number of calls, so the count comes
    from a timed first call, agreed (max) across ranks."""
    call()  # warm up: gloo and NCCL set up a pair's connection on its first use
    dist.barrier()
    start = time.perf_counter()
    call()
    first = time.perf_counter() - start
    count = torch.tensor([max(3, min(200, int(min_time / max(first, 1e-6))))], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    dist.barrier()
    waits, start = core_wait.snapshot(), time.perf_counter()
    for _ in range(int(count.item())):
        call()
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    # a collective waits for every rank: the longest any rank waited for a core is out of all of them
    waited = _agreed(core_wait.waited_s(waits, chained=True), device, "max")
    return max(wall - waited, 0.1 * wall) / int(count.item())


def _rank(ranks: int, threads: int, device_type: str, grid: Grid, deadline: float, queue) -> None:
    # torch 2.13 renames the *_tensor collectives; the ones FSDP2 calls are what we time
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(threads)
    rank = int(os.environ["RANK"])
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    cuda = device_type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None,
                            timeout=datetime.timedelta(minutes=5))
    try:
        dist.barrier()
        dtype = torch.bfloat16 if device_type == "cuda" else torch.float32
        compute = measure_compute(device, dtype, grid, deadline)
        comm = measure_collectives(device, grid.min_time, grid.collective_sizes)

        if rank == 0:
            queue.put({**compute, "collectives": comm, "threads": threads})
    finally:
        dist.destroy_process_group()


def _spawned(index: int, ranks: int, threads: int, device_type: str, grid: Grid, deadline: float, port: int,
             queue) -> None:
    from loom.launch import exit_rank

    os.environ.update(RANK=str(index), WORLD_SIZE=str(ranks), LOCAL_RANK=str(index),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        _rank(ranks, threads, device_type, grid, deadline, queue)
    except BaseException:
        traceback.print_exc()
        exit_rank(1)
    # past the interpreter's teardown, whose joins of gloo's threads occasionally abort a rank
    # that finished (rc -6); SimpleQueue.put has already written the result to its pipe
    exit_rank(0)


def rank_counts(quick: bool, cuda: bool) -> list[int]:
    """The rank counts measured: 1 (and 2 with two GPUs) on a GPU; on a CPU 1, 2, 4, … up to twice
    the cores (oversubscribed runs happen: hsdp 2×2 on 2 cores), or quick: up to the cores."""
    if cuda:
        return [1] + ([2] if torch.cuda.device_count() > 1 else [])
    cores = os.cpu_count() or 1
    return sorted({1, 2, *(r for r in (4, 8, 16, 32) if r <= (cores if quick else 2 * cores))})


FULL_SECONDS = 120  # `loom plan --calibrate` on the 2-core development machine, unloaded


def calibration_notice(path, first: bool, quick: bool) -> str:
    """What the user is told before measuring starts: why, and how long it takes."""
    how_long = (f"about {QUICK_BUDGET_S} s" if quick else f"about {FULL_SECONDS // 60} minutes") + \
        " (longer while other processes load the cores)"
    if first:
        return (f"no device profile at {path}: measuring this machine once, {how_long} "
                f"(`loom plan --calibrate` measures it again, more precisely, in about {FULL_SECONDS // 60} "
                f"minutes)")
    return f"measuring this machine into {path}: {how_long}"


def calibrate(quick: bool = False, say=print) -> DeviceProfile:
    """Measure this machine. quick (the first `loom plan`): the thin grid, within about
    QUICK_BUDGET_S seconds (each rank count's later passes dropped past its share of it)."""
    from loom.launch import free_port

    cuda = torch.cuda.is_available()
    cores = os.cpu_count() or 1
    counts = rank_counts(quick, cuda)
    if cuda:
        name, memory = torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory
    else:
        name, memory = platform.processor() or platform.machine(), _host_memory()
    grid = QUICK if quick else FULL
    started = time.time()
    by_ranks = {}
    ctx = torch.multiprocessing.get_context("spawn")
    for done, ranks in enumerate(counts):
        # quick: each rank count gets its share of the budget, less the children's start-up
        deadline = started + QUICK_BUDGET_S * (done + 1) / len(counts) - 5 if quick else math.inf
        threads = 1 if cuda else max(1, cores // ranks)  # what loom.launch gives a rank
        say(f"calibrating {ranks} rank(s) × {threads} thread(s) on {'cuda' if cuda else 'cpu'} …")
        queue = ctx.SimpleQueue()
        port = free_port()
        kind = "cuda" if cuda else "cpu"
        procs = [ctx.Process(target=_spawned, args=(i, ranks, threads, kind, grid, deadline, port, queue))
                 for i in range(ranks)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs) or queue.empty():
            raise RuntimeError(f"calibration with {ranks} ranks failed (exit codes "
                               f"{[p.exitcode for p in procs]})")
        by_ranks[str(ranks)] = queue.get()
    return DeviceProfile(device="cuda" if cuda else "cpu", name=name, cores=cores, memory_bytes=memory,
                         torch_version=torch.__version__, date=datetime.date.today().isoformat(),
                         by_ranks=by_ranks)


def _host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
