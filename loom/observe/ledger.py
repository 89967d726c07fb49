"""The step ledger: where each training step's wall time went, per rank, from profiler traces.

Each `ProfilerStep#N` window is partitioned exactly (integer nanoseconds) into compute,
exposed communication, IO and idle, so the four add up to the step's wall time:

- CPU traces (gloo): the main thread (the one carrying the steps) is the timeline. IO is time
  inside DataLoader fetches and loom's `loom/data` / `loom/checkpoint` ranges; exposed
  communication is time in c10d ops (enqueue, wait) plus main-thread gaps while a collective is
  in flight (gloo runs it on its `pt_gloo_runloop` threads from the c10d enqueue to the end of
  its `gloo:*` span); compute is time under `cpu_op` events; idle is the rest (gaps with nothing
  in flight). Hidden communication is in-flight time under main-thread compute. A pipeline's
  helper thread (one carrying `PP:` actions: DualPipeV's overlapped backward under expert
  parallelism) computes beside the main thread: the step computes while either does, its
  exchanges are communication, and either side's wait for its turn (`fb_overlap_wait`) is neither.
- GPU traces: the GPU is the timeline. Compute is the union of non-NCCL kernels, exposed
  communication NCCL kernels outside it, hidden communication NCCL under it, IO memcpy/memset and
  main-thread DataLoader time while the GPU runs nothing else, idle the rest.

Only interval arrays per thread and class are kept while a trace streams by (not its events),
plus three integers per CPU op for its self time (its time minus the ops nested in it, which is
what "top ops" ranks by), so a rank's 100 MB trace costs tens of MB. `analyze_dir` runs one
process per trace.

Context parallelism's exchanges are told from the pipeline's p2p by the profiler range they run
in: a collective issued inside a `cp_ring` range (its k/v and dk/dv isend/irecv) is of kind
`cp_ring`, one inside `cp_alltoall` (Ulysses' all_to_all_single) of kind `cp_alltoall`; the same
send/recv outside stay send/recv/p2p. Expert parallelism's all-to-alls (the split counts, then the
tokens to their experts' ranks and back, forward and backward) run inside `ep_alltoall` ranges and
are of kind `ep_alltoall` alike. On CPU traces the main thread's time inside CP's and EP's ranges
(issuing the exchange, waiting for it) is communication, though the autograd Function's op around
it (`_AllToAll`, a backward node) would read as compute. Muon's gathers and scatters of whole
matrices (the optimizer step's all-to-alls) run inside `muon_alltoall` ranges, which only name
their kind. Steps of a rank with such exchanges also say
how much of their exposed and hidden communication was CP's (`cp_exposed_ms`, `cp_hidden_ms`) and
EP's (`ep_exposed_ms`, `ep_hidden_ms`): parts of `comm_exposed_ms` and `comm_hidden_ms`, the
exchange's wherever it was in flight or waited for. On GPU traces NCCL runs an all-to-all as
grouped send/recv (a SendRecv kernel): the kernel runs the all-to-all issued before it.

Under a pipeline (loom's `loom/pipeline` range, torch.distributed.pipelining's `PP:<action>` or
`Forward i` / `Backward i` ranges in the trace) a step also says its bubble: the time the rank
computes nothing while it waits for a neighbour stage. In real gloo traces (loom profile, pp 2, 1f1b
and zbv) that wait is the main thread inside the pipeline group's recv (and the send it waits on),
so the exposed time with a send/recv in flight is bubble (`bubble_comm_ms`), and so are idle gaps
between the schedule's first and last action (`bubble_idle_ms`); both are parts of comm_exposed_ms
and idle_ms, and `shares["bubble"]` is their sum's share. The runtime schedules' actions give the
phases: forward (F), backward (a full B), and where the trace has them `backward_input_ms` (I, the
papers' B), `backward_weight_ms` (W) and DualPipeV's `overlap_f_b_ms`.

Host syncs are counted per step outside the optimizer (its step counters are the library's) and,
in a loom run, inside loom's forward / backward / pipeline / data ranges only: the syncs between
them are loom's own loop (`host_syncs_loop`: the stop agreement's reads of a gloo-reduced CPU
tensor, the step before's loss read back a step late), needed and not the user's to fix. So are
the syncs inside loom's GPT MoE blocks (their `moe` profiler range: the routing's tokens per expert
read on the host as split sizes, for CPU's per-expert matmuls and expert parallelism's all-to-alls;
CUDA's grouped experts read none at ep 1),
counted apart as `host_syncs_moe` in the steps of a trace that has such blocks.

Events of a kind the ledger does not use (metadata, instants, flows) are skipped. A complete
event (`ph` X) whose fields the ledger reads have the wrong type or range — `ts`/`dur` not finite
µs ≥ 0, `pid`/`tid` not an id, `args` not a mapping, a collective's sizes not counts — makes the
trace damaged (`BadTrace`): one line naming the file and the event's index, never a partial
ledger built around it.
"""

from __future__ import annotations

import itertools
import math
import multiprocessing
import os
import re
import sys
from array import array
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from loom.errors import LoomError
from loom.observe.trace_events import (
    MAX_NS,
    BadTrace,
    TraceStream,
    distributed_info,
    find_traces,
    refuse_copies,
)

# Interval classes kept per CPU thread.
IO, COMM, CPU, WORK, SYNC = "io", "comm", "cpu", "work", "sync"
PHASES = ("forward", "backward", "optimizer", "data")
_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_COMM_PREFIXES = ("c10d::", "_c10d_functional::", "c10d_functional::", "record_param_comms")
_WORK_PREFIXES = ("gloo:", "nccl:")  # a collective's work span (async: not a main-thread scope)
# loom's ranges around the code a user brings (model, loss, data): a host sync outside them and
# outside the optimizer is loom's own loop (the gloo stop agreement on a CPU tensor, reading the
# step before's loss back), known, needed and not the user's to fix.
_LOOM_STEP = ("loom/forward", "loom/backward", "loom/pipeline", "loom/data")
LOOM_STEP = "loom:step"
# The profiler range around each forward of loom's GPT MoE block (loom/models/gpt/moe.py): the host
# syncs inside it (split sizes) are the block's own.
MOE_BLOCK = "moe"
_MOE_CLASS = "loom:moe"
# An overlapped forward or backward waiting for its turn (loom/parallel/fb_overlap.py's range)
TURN_WAIT = "fb_overlap_wait"
# Context parallelism's profiler ranges (loom/parallel/context_parallel.py); each name is also the
# kind of the collectives issued inside it.
CP_KINDS = ("cp_ring", "cp_alltoall")
# Expert parallelism's range and kind (loom/parallel/context_parallel.py's EP_ALLTOALL; not imported:
# the analysis runs without torch).
EP_ALLTOALL = "ep_alltoall"
EP_KINDS = (EP_ALLTOALL,)
# Muon's gathers of each matrix to its owner and the scatters back, in the optimizer step
# (loom/train/muon.py's range of the same name)
MUON_ALLTOALL = "muon_alltoall"
_EXCHANGE_KINDS = (*CP_KINDS, *EP_KINDS, MUON_ALLTOALL)
# torch.distributed.pipelining's ranges: the runtime schedules (interleaved, zb, zbv, dualpipev)
# wrap each action in `PP:<stage><type><micro-batch>` (F forward, I input-gradient backward "B",
# W weight gradient, B full backward) or `PP:(<a>;<b>)OVERLAP_F_B` (DualPipeV); gpipe and 1f1b in
# `Forward i` / `Backward i` (1f1b: none). Any of them, or loom's `loom/pipeline` range around the
# schedule's step, marks a pipeline rank (PIPE: the schedule's span).
PIPE = "pp:action"
_PP_ACTION = re.compile(r"PP:\d+([FIWB])\d+$")
_PP_PHASES = {"F": "forward", "I": "backward_input", "W": "backward_weight", "B": "backward"}
_PP_SIMPLE = re.compile(r"(Forward|Backward) \d+$")
PIPELINE_PHASES = ("backward_input", "backward_weight", "overlap_f_b")
_P2P_KINDS = ("send", "recv", "p2p")
_TORCH_FORWARD = ("DistributedDataParallel.forward", "FullyShardedDataParallel.forward")
_SYNC_OPS = frozenset({
    "aten::item", "aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero",
    "cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy",
    "hipDeviceSynchronize", "hipStreamSynchronize", "hipEventSynchronize", "hipMemcpy",
})
_COMM_ARGS = ("Collective name", "In msg nelems", "Out msg nelems", "dtype", "Group size",
              "Process Group Name", "Seq", "seq", "Input Dims", "Input type")
_KINDS = (("sendrecv", "p2p"), ("batchp2p", "p2p"), ("allreduce", "all_reduce"),
          ("allgather", "all_gather"), ("reducescatter", "reduce_scatter"),
          ("alltoall", "all_to_all"), ("broadcast", "broadcast"), ("barrier", "barrier"),
          ("send", "send"), ("recv", "recv"), ("gather", "gather"), ("scatter", "scatter"),
          ("reduce", "reduce"))
# Element sizes by the dtype spellings of `Input type` (C++ names) and record_param_comms (ScalarType).
_DTYPE_BYTES = {
    "float": 4, "float32": 4, "double": 8, "float64": 8, "c10::half": 2, "half": 2, "float16": 2,
    "c10::bfloat16": 2, "bfloat16": 2, "long int": 8, "long": 8, "int64": 8, "int": 4, "int32": 4,
    "short": 2, "int16": 2, "signed char": 1, "char": 1, "int8": 1, "unsigned char": 1, "byte": 1,
    "uint8": 1, "bool": 1, "c10::complex<float>": 8, "complexfloat": 8, "c10::complex<double>": 16,
    "complexdouble": 16, "c10::float8_e4m3fn": 1, "float8_e4m3fn": 1, "c10::float8_e5m2": 1,
    "float8_e5m2": 1,
}
TOP_OPS = 20
_MAX_US = MAX_NS // 1000 - 1  # an event's ts and dur (µs): each below MAX_NS ns once rounded
_NUMBER = (int, float)  # checked with type(), so a bool is not a time
_ID = (int, str, type(None))  # pid, tid (absent: None)
# What a collective's args must hold, where they are present (counts are ints ≥ 0).
_COUNT_ARGS = ("In msg nelems", "Out msg nelems", "Group size", "Seq", "seq")
_TEXT_ARGS = ("Collective name", "dtype", "Process Group Name")
_LIST_ARGS = ("Input Dims", "Input type")


class BadEvent(Exception):
    """An event the ledger reads is malformed (the caller names the file and the index)."""


def _bad(key: str, must: str, value) -> BadEvent:
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:39] + "…"
    return BadEvent(f"{key} must be {must}, got {shown} ({type(value).__name__})")


def collective_kind(name: str | None) -> str | None:
    """all_reduce, all_gather, ... from an op, work or NCCL kernel name (None: not a collective)."""
    if not name:
        return None
    key = "".join(ch for ch in name.rsplit(":", 1)[-1].lower() if ch.isalnum())
    if name.lower().startswith("nccl") and "kernel" in key:  # ncclDevKernel_AllReduce_Sum_f32...
        key = key[key.find("kernel") + 6:]
    for prefix, kind in _KINDS:
        if key.startswith(prefix):
            return kind
    return None


def _compatible(issued: str, ran: str | None) -> bool:
    # gloo runs reduce_scatter as an all-reduce; NCCL runs send/recv as one SendRecv kernel, and an
    # all-to-all as grouped send/recv (a SendRecv kernel too)
    return (ran is None or ran == issued or (issued == "reduce_scatter" and ran == "all_reduce")
            or ({issued, ran} <= {"send", "recv", "p2p"}) or (issued == "all_to_all" and ran == "p2p"))


def _classify(name: str, cat: str) -> tuple[str, ...]:
    """The interval classes an event on a CPU thread belongs to (cached per name and category)."""
    if cat == "python_function":
        return ()
    io = name.startswith(("enumerate(DataLoader)", "loom/data", "loom/checkpoint")) or "DataLoader" in name
    comm = name.startswith(_COMM_PREFIXES)
    work = name.startswith(_WORK_PREFIXES)
    out = []
    if io:
        out.append(IO)
    if comm:
        out.append(COMM)
    if work:
        out.append(WORK)
    if cat == "cpu_op" and not (io or comm or work):
        out.append(CPU)
    if name in _SYNC_OPS:
        out.append(SYNC)
    if name.startswith("loom/forward"):
        out.append("loom:forward")
    elif name in _TORCH_FORWARD or (name.startswith("## ") and "forward" in name.lower()):
        out.append("torch:forward")
    if name.startswith("loom/backward"):
        out.append("loom:backward")
    elif name.startswith("autograd::engine::evaluate_function:"):
        out.append("torch:backward")
    if name.startswith("loom/optimizer"):
        out.append("loom:optimizer")
    elif name.startswith(("Optimizer.step#", "Optimizer.zero_grad#")):
        out.append("torch:optimizer")
    if name.startswith(_LOOM_STEP):
        out.append(LOOM_STEP)
    if name == MOE_BLOCK:
        out.append(_MOE_CLASS)
    elif name == TURN_WAIT:
        out.append(TURN_WAIT)
    if name in CP_KINDS:
        out.append(name)
    elif name in EP_KINDS:
        out.append(name)
    elif name == MUON_ALLTOALL:
        out.append(name)
    out.extend(_pipeline_classes(name))
    if name.startswith("loom/data"):
        out.append("loom:data")
    elif io and not name.startswith("loom/checkpoint"):
        out.append("torch:data")
    return tuple(out)


def _pipeline_classes(name: str) -> tuple[str, ...]:
    """A pipeline action's phase class and PIPE, or () for any other name."""
    if name.startswith("PP:"):
        action = _PP_ACTION.match(name)
        if action:
            return PIPE, "pp:" + _PP_PHASES[action.group(1)]
        return (PIPE, "pp:overlap_f_b") if name.endswith("OVERLAP_F_B") else (PIPE,)  # SEND_F, RECV_B...
    if name.startswith("loom/pipeline"):  # loom's range around the schedule (1f1b records no action)
        return (PIPE,)
    simple = _PP_SIMPLE.match(name)
    if simple:
        return PIPE, "pp:" + simple.group(1).lower()
    return ()


@dataclass
class _CommEvent:
    thread: tuple
    start: int
    end: int
    name: str
    args: dict
    work: bool  # a gloo:/nccl: work span (or an NCCL kernel), not an issuing op


@dataclass
class _Collector:
    """What the ledger needs from one trace, gathered in one pass over its events."""

    threads: dict = field(default_factory=dict)  # (pid, tid) -> class -> array('q') [s0, e0, s1, e1, ...]
    steps: list = field(default_factory=list)  # (thread, N, start, end)
    comm: list = field(default_factory=list)  # _CommEvent
    cpu_ops: dict = field(default_factory=dict)  # name -> [ns, count]
    op_spans: dict = field(default_factory=dict)  # thread -> array('q') [start, end, name id, ...]
    op_ids: dict = field(default_factory=dict)  # cpu_op name -> id (self time per name)
    kernel_ops: dict = field(default_factory=dict)
    k_start: array = field(default_factory=lambda: array("q"))
    k_end: array = field(default_factory=lambda: array("q"))
    k_nccl: array = field(default_factory=lambda: array("b"))
    k_occ: array = field(default_factory=lambda: array("d"))
    mem: array = field(default_factory=lambda: array("q"))
    names: dict = field(default_factory=dict)  # (name, cat) -> classes

    def add(self, ev: dict) -> None:
        if ev.get("ph") != "X":
            return
        ts, dur, name, cat = ev.get("ts"), ev.get("dur"), ev.get("name", ""), ev.get("cat", "")
        pid, tid, args = ev.get("pid"), ev.get("tid"), ev.get("args")
        if (type(ts) not in _NUMBER or not 0 <= ts <= _MAX_US or type(dur) not in _NUMBER
                or not 0 <= dur <= _MAX_US or type(name) is not str or type(cat) is not str
                or type(pid) not in _ID or type(tid) not in _ID or type(args) not in (dict, type(None))):
            raise _malformed(ev)
        start = round(ts * 1000)
        end = start + round(dur * 1000)
        if cat in _GPU_CATS:
            self._gpu(ev, name, cat, start, end)
            return
        if cat == "gpu_user_annotation" or cat == "Trace":
            return
        thread = (pid, tid)
        if name.startswith("ProfilerStep#"):
            try:
                self.steps.append((thread, int(name[13:]), start, end))
            except ValueError:
                pass
            return
        classes = self.names.get((name, cat))
        if classes is None:
            classes = self.names[(name, cat)] = _classify(name, cat)
        if classes:
            arrays = self.threads.get(thread)
            if arrays is None:
                arrays = self.threads[thread] = {}
            for c in classes:
                a = arrays.get(c)
                if a is None:
                    a = arrays[c] = array("q")
                a.append(start)
                a.append(end)
            if COMM in classes or WORK in classes:
                self.comm.append(_CommEvent(thread, start, end, name, _comm_args(args), WORK in classes))
        if cat == "cpu_op":
            _tally(self.cpu_ops, name, end - start)
            spans = self.op_spans.get(thread)
            if spans is None:
                spans = self.op_spans[thread] = array("q")
            spans.extend((start, end, self.op_ids.setdefault(name, len(self.op_ids))))

    def _gpu(self, ev: dict, name: str, cat: str, start: int, end: int) -> None:
        if cat != "kernel":
            self.mem.append(start)
            self.mem.append(end)
            return
        nccl = "nccl" in name.lower()
        args = ev.get("args") or {}
        occ = args.get("est. achieved occupancy %", math.nan)
        if type(occ) not in _NUMBER or not (math.isnan(occ) or 0 <= occ <= 100):
            raise _bad("args.est. achieved occupancy %", "a percentage", occ)
        self.k_start.append(start)
        self.k_end.append(end)
        self.k_nccl.append(nccl)
        self.k_occ.append(float(occ))
        _tally(self.kernel_ops, name, end - start)
        if nccl:
            self.comm.append(_CommEvent((ev.get("pid"), ev.get("tid")), start, end, name, _comm_args(args),
                                        True))


def _malformed(ev: dict) -> BadEvent:
    """What is wrong with a complete event that failed the collector's check, field by field."""
    for key in ("ts", "dur"):
        if key not in ev:
            return BadEvent(f"{key} is missing; a complete event (ph X) has one")
        if type(ev[key]) not in _NUMBER or not 0 <= ev[key] <= _MAX_US:
            return _bad(key, f"a finite number of µs in [0, {_MAX_US:.3g}]", ev[key])
    for key in ("name", "cat"):
        if type(ev.get(key, "")) is not str:
            return _bad(key, "a string", ev[key])
    for key in ("pid", "tid"):
        if type(ev.get(key)) not in _ID:
            return _bad(key, "an integer or a string", ev[key])
    return _bad("args", "a mapping", ev.get("args"))


def _comm_args(args: dict | None) -> dict:
    """The args of a collective's event that the ledger reads, each of the type it needs."""
    kept = {k: args[k] for k in _COMM_ARGS if k in args} if args else {}
    for key, value in kept.items():
        if key in _COUNT_ARGS and (type(value) is not int or value < 0):
            raise _bad(f"args.{key}", "a count (an integer ≥ 0)", value)
        if key in _TEXT_ARGS and type(value) not in (str, int):
            raise _bad(f"args.{key}", "a string", value)
        if key in _LIST_ARGS and type(value) is not list:
            raise _bad(f"args.{key}", "a list", value)
    return kept


def _tally(table: dict, name: str, ns: int) -> None:
    t = table.get(name)
    if t is None:
        table[name] = [ns, 1]
    else:
        t[0] += ns
        t[1] += 1


# -- interval algebra on integer nanoseconds ---------------------------------------------------

_EMPTY = (np.zeros(0, np.int64), np.zeros(0, np.int64))


def _pairs(flats: Iterable[array]) -> np.ndarray:
    parts = [np.frombuffer(a, dtype=np.int64).reshape(-1, 2) for a in flats if len(a)]
    return np.concatenate(parts) if parts else np.zeros((0, 2), np.int64)


def _union(pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint sorted (starts, ends) covering the same time as the [start, end) pairs."""
    if not len(pairs):
        return _EMPTY
    order = np.argsort(pairs[:, 0], kind="stable")
    s, e = pairs[order, 0], np.maximum.accumulate(pairs[order, 1])
    new = np.ones(len(s), bool)
    new[1:] = s[1:] > e[:-1]
    first = np.flatnonzero(new)
    return s[first], e[np.append(first[1:] - 1, len(s) - 1)]


def _clip(u: tuple[np.ndarray, np.ndarray], lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    s, e = u
    i0, i1 = np.searchsorted(e, lo, "right"), np.searchsorted(s, hi, "left")
    return np.maximum(s[i0:i1], lo), np.minimum(e[i0:i1], hi)


def _covers(u: tuple[np.ndarray, np.ndarray], points: np.ndarray) -> np.ndarray:
    s, e = u
    idx = np.searchsorted(s, points, "right") - 1
    return (idx >= 0) & (e[np.maximum(idx, 0)] > points) if len(s) else np.zeros(len(points), bool)


def _segments(lo: int, hi: int, sets: list) -> tuple[np.ndarray, list[np.ndarray]]:
    """[lo, hi) cut at every boundary of `sets`: segment lengths and, per set, which it covers."""
    clipped = [_clip(u, lo, hi) for u in sets]
    pts = np.unique(np.concatenate([np.array([lo, hi], np.int64)] + [x for c in clipped for x in c]))
    left = pts[:-1]
    return np.diff(pts), [_covers(c, left) for c in clipped]


def _measure(u: tuple[np.ndarray, np.ndarray], lo: int, hi: int) -> int:
    s, e = _clip(u, lo, hi)
    return int((e - s).sum())


def _inside(points: np.ndarray, intervals: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Which sorted `points` fall in a union of disjoint sorted [start, end) intervals."""
    starts, ends = intervals
    if not len(starts):
        return np.zeros(len(points), bool)
    idx = np.searchsorted(starts, points, "right") - 1
    return (idx >= 0) & (points < ends[np.clip(idx, 0, None)])


def _outermost_starts(flats: Iterable[array]) -> np.ndarray:
    """Starts of the events not nested in another (item() calls _local_scalar_dense: one sync)."""
    starts = []
    for flat in flats:
        p = _pairs([flat])
        if not len(p):
            continue
        p = p[np.lexsort((-p[:, 1], p[:, 0]))]
        prev_end = np.maximum.accumulate(np.concatenate([[np.iinfo(np.int64).min], p[:-1, 1]]))
        starts.append(p[p[:, 1] > prev_end, 0])
    return np.sort(np.concatenate(starts)) if starts else np.zeros(0, np.int64)


# -- collectives --------------------------------------------------------------------------------

def _nelems(dims) -> int | None:
    if isinstance(dims, list) and dims and all(isinstance(d, int) for d in dims):
        return math.prod(dims)
    if isinstance(dims, list) and dims and all(isinstance(d, list) for d in dims):
        parts = [_nelems(d) for d in dims]
        return sum(p for p in parts if p) or None
    return None


def _dtype_bytes(name) -> int | None:
    return _DTYPE_BYTES.get(name.lower()) if isinstance(name, str) else None


def _payload_bytes(kind: str, events: list[_CommEvent], group_size: int | None) -> int | None:
    """The logical tensor moved (as loom.observe.comms counts it): the gathered output of an
    all-gather, the unreduced input of a reduce-scatter, the tensor of the others."""
    if kind == "barrier":
        return 0
    for ev in events:  # record_param_comms (and NCCL kernels) carry sizes
        a = ev.args
        size = _dtype_bytes(a.get("dtype"))
        if size and ("In msg nelems" in a or "Out msg nelems" in a):
            return max(int(a.get("In msg nelems") or 0), int(a.get("Out msg nelems") or 0)) * size
    nelems, size = 0, None  # else tensor shapes, when the profiler ran with record_shapes=True
    for ev in events:
        dims, types = ev.args.get("Input Dims"), ev.args.get("Input type") or []
        if not isinstance(dims, list):
            continue
        for i, d in enumerate(dims):
            n = _nelems(d) or 0
            if d == [] and i < len(types) and _dtype_bytes(types[i]):
                n = 1  # a 0-d tensor (a scalar: the loop's token count), not an argument without shape
            if ev.work and kind == "all_gather" and group_size:  # gloo's work span sees one shard
                n *= group_size
            nelems = max(nelems, n)
            if size is None and i < len(types):
                size = _dtype_bytes(types[i])
    return nelems * size if nelems and size else None


def _first(events: list[_CommEvent], *keys: str):
    for ev in events:
        for k in keys:
            if ev.args.get(k) is not None:
                return ev.args[k]
    return None


def _issues(events: list[_CommEvent]) -> list[list[_CommEvent]]:
    """Outermost issuing comm events per thread, each with the comm events starting inside it
    (nested ops, or a work span that outlives its issuing op)."""
    by_thread: dict[tuple, list[_CommEvent]] = {}
    for ev in events:
        by_thread.setdefault(ev.thread, []).append(ev)
    groups = []
    for evs in by_thread.values():
        evs.sort(key=lambda ev: (ev.start, -ev.end))
        for ev in evs:
            if groups and groups[-1][0].thread == ev.thread and ev.start < groups[-1][0].end:
                groups[-1].append(ev)
            else:
                groups.append([ev])
    return sorted(groups, key=lambda g: g[0].start)


def _group_kind(group: list[_CommEvent]) -> str | None:
    for ev in group:
        kind = collective_kind(ev.name) or collective_kind(ev.args.get("Collective name"))
        if kind:
            return kind
    return None


def _collectives(col: _Collector, gpu: bool, world: int | None) -> list[dict]:
    """Issued collectives in issue order, each matched to the span that ran it (FIFO by kind)."""
    # On GPU traces nccl:* CPU spans belong to the issue and NCCL kernels run it; on CPU traces
    # gloo:* spans (on the runloop threads, or the caller's for send/recv) run it.
    def runs_it(ev: _CommEvent) -> bool:
        return ev.work and (not gpu or _is_kernel(ev) or ev.name.startswith("gloo:"))

    issue_evs = [ev for ev in col.comm if not runs_it(ev)]
    runs = sorted((ev for ev in col.comm if runs_it(ev)), key=lambda ev: ev.start)
    run_kinds = [collective_kind(ev.name) or collective_kind(ev.args.get("Collective name")) for ev in runs]
    used = [False] * len(runs)
    lo = 0
    out = []
    for group in _issues(issue_evs):
        kind = _group_kind(group)
        if kind is None:  # a wait, a coalescing marker: time on the thread, not a collective
            continue
        head = group[0]
        while lo < len(runs) and (used[lo] or runs[lo].start < head.start):
            lo += 1  # runs starting before this issue belong to earlier (or unseen) issues
        match = None
        j, looked = lo, 0
        while j < len(runs) and looked < 8:
            if not used[j]:
                looked += 1
                if _compatible(kind, run_kinds[j]):
                    match = j
                    break
            j += 1
        run = None
        if match is not None:
            used[match] = True
            run = runs[match]
        out.append(_record(kind, group, run, world))
    for j, run in enumerate(runs):  # spans whose issue the trace does not show
        if not used[j] and run_kinds[j]:
            out.append(_record(run_kinds[j], [], run, world))
    _tag_exchanges(out, col)
    out.sort(key=lambda c: c["_issue"])
    return out


def _tag_exchanges(records: list[dict], col: _Collector) -> None:
    """A collective issued inside a CP or EP range (on the issuing thread) takes the range's kind;
    without its issue in the trace, the thread and start of the span that ran it decide."""
    ranges = {(thread, kind): _union(_pairs([arrays[kind]])) for thread, arrays in col.threads.items()
              for kind in _EXCHANGE_KINDS if kind in arrays}
    if not ranges:
        return
    for r in records:
        thread, at = r["_issued_on"]
        for kind in _EXCHANGE_KINDS:
            u = ranges.get((thread, kind))
            if u is not None and _inside(np.array([at], np.int64), u)[0]:
                r["kind"] = kind
                break


def _is_kernel(ev: _CommEvent) -> bool:
    return ev.work and not ev.name.startswith(_WORK_PREFIXES)


def _record(kind: str, group: list[_CommEvent], run: _CommEvent | None, world: int | None) -> dict:
    events = group + ([run] if run else [])
    size = _first(events, "Group size")
    size = int(size) if size is not None else world
    head = group[0] if group else None
    start, end = (run.start, run.end) if run else (head.start, head.end)
    pg = _first(events, "Process Group Name")
    first = head or run
    return {"kind": kind, "bytes": _payload_bytes(kind, events, size), "group_size": size,
            "group": str(pg) if pg is not None else None, "seq": _first(events, "Seq", "seq"),
            "_issue": head.start if head else start, "_enqueue": head.start if head else None,
            "_start": start, "_end": end, "_ran": run is not None, "_issued_on": (first.thread, first.start)}


# -- the ledger ---------------------------------------------------------------------------------

def rank_ledger(events: Iterable[dict], rank: int | None = None, *, base_ns: int | None = None,
                trace: str = "", header: dict | None = None) -> dict:
    """One rank's ledger from its trace events (a TraceStream supplies base time and header).

    Returns {"rank", "kind", "trace", "warnings", "steps", "collectives", "top_ops"}; times in
    steps are ms, `*_us` are absolute µs (comparable across ranks).
    """
    col = _collect(events, str(events.path) if isinstance(events, TraceStream) else trace or "trace")
    warnings: list[str] = []
    if isinstance(events, TraceStream):
        base_ns = events.base_ns if base_ns is None else base_ns
        header = events.header if header is None else header
        trace = trace or str(events.path)
        warnings += events.warnings
    return _ledger(col, rank, base_ns or 0, trace, header or {}, warnings)


def _collect(events: Iterable[dict], source: str) -> _Collector:
    """One pass over the events; a malformed one is the trace's damage, named by its index."""
    col = _Collector()
    add, index = col.add, -1
    try:
        for index, ev in enumerate(events):
            add(ev)
    except BadEvent as e:
        raise BadTrace(f"{source}: traceEvents[{index}] {e}; the trace is damaged: profile the run again "
                       "or remove the file") from None
    return col


def _ledger(col: _Collector, rank, base_ns: int, trace: str, header: dict, warnings: list[str]) -> dict:
    gpu = len(col.k_start) > 0
    info = distributed_info(header, trace or "trace")
    world = info.get("world_size") if (info.get("pg_count") or 1) <= 1 else None
    label = f"rank {rank}" if rank is not None else (trace or "trace")

    step_threads = Counter(t for t, *_ in col.steps)
    if step_threads:
        main = step_threads.most_common(1)[0][0]
        windows = sorted(((n, s, e) for t, n, s, e in col.steps if t == main), key=lambda w: w[1])
    else:
        main, windows = _whole_trace(col)
        if windows:
            warnings.append(f"{label}: no ProfilerStep# events (call prof.step() once per iteration, "
                            "or use a schedule): the whole trace is one step (-1)")
        else:
            warnings.append(f"{label}: no timed events in the trace: nothing to analyze")
    arrays = col.threads.get(main, {})
    all_threads = list(col.threads.values())

    def union_all(cls: str):
        return _union(_pairs(t[cls] for t in all_threads if cls in t))

    phases = {}
    for p in PHASES:
        loom = union_all(f"loom:{p}")
        phases[p] = loom if len(loom[0]) else union_all(f"torch:{p}")
    # Under a pipeline the schedule's own ranges give the phases (forward and backward per action,
    # and the zero-bubble schedules' B and W apart), where loom's or torch's would miss them.
    pipe = union_all(PIPE)
    pipe_phases = {p: union_all(f"pp:{p}") for p in ("forward", "backward", *PIPELINE_PHASES)}
    for p in ("forward", "backward"):
        if len(pipe_phases[p][0]):
            phases[p] = pipe_phases[p]
    syncs = _outermost_starts(t[SYNC] for t in all_threads if SYNC in t)
    # Optimizers read their step counters on the host (AdamW on CPU: .item() per parameter):
    # those are the library's; the syncs worth a finding are the ones outside it.
    in_optimizer = _inside(syncs, phases["optimizer"])
    opt_syncs, syncs = syncs[in_optimizer], syncs[~in_optimizer]
    loom_step = union_all(LOOM_STEP)
    loop_syncs = syncs[:0]
    if len(loom_step[0]):  # a loom run: the user's code runs inside its ranges
        in_step = _inside(syncs, loom_step)
        loop_syncs, syncs = syncs[~in_step], syncs[in_step]
    moe_blocks = union_all(_MOE_CLASS)
    moe_syncs = syncs[:0]
    if len(moe_blocks[0]):  # loom's MoE blocks read their split sizes on the host
        in_moe = _inside(syncs, moe_blocks)
        moe_syncs, syncs = syncs[in_moe], syncs[~in_moe]
    io = _union(_pairs([arrays[IO]] if IO in arrays else []))
    ops = _union(_pairs([arrays[c] for c in (CPU, COMM) if c in arrays]))

    collectives = _collectives(col, gpu, world)
    helpers: list = []  # CPU: threads that compute beside the main one
    if gpu:
        k = _pairs([_interleave(col.k_start, col.k_end)])
        nccl = np.frombuffer(col.k_nccl, dtype=np.int8).astype(bool)
        sets = [_union(k[~nccl]), _union(k[nccl]),
                _union(np.concatenate([_pairs([col.mem]), np.stack(io, 1)]))]
        kstart = np.frombuffer(col.k_start, dtype=np.int64)
        order = np.argsort(kstart, kind="stable")
        kstart, kdur = kstart[order], (np.frombuffer(col.k_end, dtype=np.int64) - np.frombuffer(
            col.k_start, dtype=np.int64))[order]
        kocc = np.frombuffer(col.k_occ, dtype=np.float64)[order]
    else:
        inflight = np.array([(c["_enqueue"] if c["_enqueue"] is not None else c["_start"], c["_end"])
                             for c in collectives], np.int64).reshape(-1, 2)
        # the main thread inside a CP or EP range issues or waits for the exchange: communication,
        # even inside the autograd Function's op (_AllToAll, a backward node) that holds it
        ep_waits = [arrays[c] for c in EP_KINDS if c in arrays]
        sets = [io, _union(_pairs(ep_waits + [arrays[c] for c in (COMM, *CP_KINDS) if c in arrays])),
                _union(_pairs([arrays[CPU]] if CPU in arrays else [])), _union(inflight)]
        # A pipeline's helper thread (DualPipeV's overlapped backward, loom/parallel/fb_overlap.py)
        # computes and exchanges beside the main thread: its compute is the rank's compute, its
        # exchanges and their waits communication.
        # A side waiting for its turn (inside an autograd node, which reads as compute) is neither.
        helpers = [t for thread, t in col.threads.items() if thread != main and PIPE in t]
        helper_comm = _union(_pairs([t[c] for t in helpers for c in (COMM, *EP_KINDS, *CP_KINDS) if c in t]))
        sets += [_union(_pairs([t[CPU] for t in helpers if CPU in t])), helper_comm,
                 _union(_pairs([t[TURN_WAIT] for t in helpers if TURN_WAIT in t])),
                 _union(_pairs([arrays[TURN_WAIT]] if TURN_WAIT in arrays else []))]
    # The pipeline's p2p (send/recv of activations and gradients between stages) in flight: a rank
    # that waits on it waits for its neighbour stage, which is the bubble (see the row's bubble_ms).
    p2p = [c for c in collectives if c["kind"] in _P2P_KINDS and (c["_ran"] or not gpu)]
    p2p_at = len(sets)
    if len(pipe[0]):
        sets.append(_in_flight(p2p, gpu, []) if p2p else _EMPTY)
        sets.append(pipe)
    # EP's all-to-alls in flight, their own set (CP's stays the last one)
    ep = [c for c in collectives if c["kind"] in EP_KINDS and (c["_ran"] or not gpu)]
    ep_at = len(sets)
    if ep:
        waits = [] if gpu else [t[k] for t in (arrays, *helpers) for k in EP_KINDS if k in t]
        sets.append(_in_flight(ep, gpu, waits))
    # CP's exchanges in flight: on GPUs the kernels that ran them, on CPUs issue to end (as above)
    cp = [c for c in collectives if c["kind"] in CP_KINDS and (c["_ran"] or not gpu)]
    if cp:
        ranges = [] if gpu else [arrays[k] for k in CP_KINDS if k in arrays]  # its waits on the main thread
        sets.append(_in_flight(cp, gpu, ranges))
    unsized = sum(c["bytes"] is None for c in collectives)
    if unsized == len(collectives) and collectives:
        warnings.append(f"{label}: collective sizes unknown: profile with record_shapes=True")
    elif unsized:
        warnings.append(f"{label}: {unsized} of {len(collectives)} collectives have no recorded size")

    steps = []
    for n, lo, hi in windows:
        wall = hi - lo
        lengths, cov = _segments(lo, hi, sets)
        if gpu:
            compute_m, comm_m = cov[0], cov[1] & ~cov[0]
            io_m = cov[2] & ~cov[0] & ~cov[1]
            hidden_m = cov[0] & cov[1]
        else:
            io_m = cov[0]
            compute_m = ((cov[2] & ~cov[1] & ~cov[7]) | (cov[4] & ~cov[5] & ~cov[6])) & ~cov[0]
            comm_m = ((cov[1] & ~cov[0]) | (cov[3] & ~cov[0] & ~cov[1] & ~cov[2]) | (cov[5] & ~cov[0])) \
                & ~compute_m
            hidden_m = compute_m & cov[3]
        compute, exposed = int(lengths[compute_m].sum()), int(lengths[comm_m].sum())
        io_ns, hidden = int(lengths[io_m].sum()), int(lengths[hidden_m].sum())
        idle = wall - compute - exposed - io_ns
        row = {"step": n, "start_us": (base_ns + lo) / 1000, "wall_ms": wall / 1e6,
               "compute_ms": compute / 1e6, "comm_exposed_ms": exposed / 1e6,
               "comm_hidden_ms": hidden / 1e6, "io_ms": io_ns / 1e6, "idle_ms": idle / 1e6}
        if cp:  # the part of the exposed and hidden communication that was CP's exchange
            row["cp_exposed_ms"] = int(lengths[comm_m & cov[-1]].sum()) / 1e6
            row["cp_hidden_ms"] = int(lengths[hidden_m & cov[-1]].sum()) / 1e6
        if ep:  # and EP's all-to-alls'
            row["ep_exposed_ms"] = int(lengths[comm_m & cov[ep_at]].sum()) / 1e6
            row["ep_hidden_ms"] = int(lengths[hidden_m & cov[ep_at]].sum()) / 1e6
        for p in PHASES:
            row[f"{p}_ms"] = _measure(phases[p], lo, hi) / 1e6
        if not len(phases["forward"][0]):  # no forward range anywhere (FSDP2, a bare module)
            row["forward_ms"] = _forward_by_bounds(lo, hi, phases["backward"], ops, io) / 1e6
        row["overlap_pct"] = round(100 * hidden / (hidden + exposed), 2) if hidden + exposed else 0.0
        row["shares"] = _shares(wall, compute, exposed, io_ns, idle)
        if len(pipe[0]):
            _bubble(row, lo, hi, lengths, cov[p2p_at], cov[p2p_at + 1], compute_m, comm_m, io_m)
            for p in PIPELINE_PHASES:
                if len(pipe_phases[p][0]):
                    row[f"{p}_ms"] = _measure(pipe_phases[p], lo, hi) / 1e6
        row["host_syncs"] = int(np.searchsorted(syncs, hi, "left") - np.searchsorted(syncs, lo, "left"))
        row["host_syncs_optimizer"] = int(np.searchsorted(opt_syncs, hi, "left")
                                          - np.searchsorted(opt_syncs, lo, "left"))
        row["host_syncs_loop"] = int(np.searchsorted(loop_syncs, hi, "left")
                                     - np.searchsorted(loop_syncs, lo, "left"))
        if len(moe_blocks[0]):
            row["host_syncs_moe"] = int(np.searchsorted(moe_syncs, hi, "left")
                                        - np.searchsorted(moe_syncs, lo, "left"))
        if gpu:
            a, b = np.searchsorted(kstart, lo, "left"), np.searchsorted(kstart, hi, "left")
            dur, occ = kdur[a:b], kocc[a:b]
            has = ~np.isnan(occ)
            row["kernels"] = int(b - a)
            row["mean_kernel_us"] = round(float(dur.mean()) / 1000, 3) if b > a else 0.0
            w = dur[has].sum()
            row["occupancy_pct"] = round(float((occ[has] * dur[has]).sum() / w), 2) if w > 0 else 0.0
        steps.append(row)

    starts = np.array([lo for _, lo, _ in windows], np.int64)
    out_coll = []
    for c in collectives:
        t = c["_enqueue"] if c["_enqueue"] is not None else c["_start"]
        i = int(np.searchsorted(starts, t, "right")) - 1
        step = windows[i][0] if i >= 0 and t < windows[i][2] else None
        out_coll.append({"step": step, "kind": c["kind"], "bytes": c["bytes"], "group_size": c["group_size"],
                         "group": c["group"], "seq": c["seq"],
                         "enqueue_us": ((base_ns + c["_enqueue"]) / 1000 if c["_enqueue"] is not None
                                        else None),
                         "start_us": (base_ns + c["_start"]) / 1000, "end_us": (base_ns + c["_end"]) / 1000,
                         "duration_ms": (c["_end"] - c["_start"]) / 1e6})
    table = col.kernel_ops if gpu else col.cpu_ops
    # kernels do not nest (self = total); CPU ops do (aten::linear calls aten::mm): ranked by self
    own = ({k: v[0] for k, v in table.items()} if gpu else
           dict(zip(col.op_ids, _self_ns(col.op_spans, len(col.op_ids)).tolist())))
    top = sorted(table.items(), key=lambda kv: (-own[kv[0]], -kv[1][0]))[:TOP_OPS]
    return {"rank": rank, "kind": "gpu" if gpu else "cpu", "trace": trace, "warnings": warnings,
            "steps": steps, "collectives": out_coll,
            "top_ops": [{"name": k, "total_ms": v[0] / 1e6, "self_ms": own[k] / 1e6, "count": v[1]}
                        for k, v in top]}


def _bubble(row: dict, lo: int, hi: int, lengths, in_p2p, in_schedule, compute_m, comm_m, io_m) -> None:
    """The pipeline bubble of one step: the time this rank computes nothing and waits for a
    neighbour stage — exposed time with the pipeline's p2p in flight (on gloo the main thread sits
    in the recv; on GPUs only SendRecv kernels run), plus idle gaps between the schedule's first and
    last action. It is carved out of comm_exposed_ms and idle_ms (`bubble_comm_ms`, `bubble_idle_ms`),
    which keep their totals so the four shares still add up to the wall; the other idle and the other
    exposed communication are those minus these."""
    idle_m = ~compute_m & ~comm_m & ~io_m
    span = np.zeros(len(lengths), bool)
    at = np.flatnonzero(in_schedule)
    if len(at):
        span[at[0]:at[-1] + 1] = True
    comm_ns = int(lengths[comm_m & in_p2p].sum())
    idle_ns = int(lengths[idle_m & (span | in_p2p)].sum())
    row["bubble_comm_ms"], row["bubble_idle_ms"] = comm_ns / 1e6, idle_ns / 1e6
    row["bubble_ms"] = (comm_ns + idle_ns) / 1e6
    row["shares"]["bubble"] = round(100 * (comm_ns + idle_ns) / (hi - lo), 2) if hi > lo else 0.0


def _in_flight(calls: list[dict], gpu: bool, ranges: list[array]) -> tuple[np.ndarray, np.ndarray]:
    """An exchange's time in flight: on GPUs the kernels that ran its collectives; on CPUs each
    collective from its issue to its end, and the main thread's `ranges` around it (its waits)."""
    begin = [c["_start"] if gpu or c["_enqueue"] is None else c["_enqueue"] for c in calls]
    spans = np.array([(b, c["_end"]) for b, c in zip(begin, calls)], np.int64)
    return _union(np.concatenate([spans, _pairs(ranges)]))


def _self_ns(spans_by_thread: dict, names: int) -> np.ndarray:
    """Per op name id, its events' time minus the time of the ops directly inside them (per thread)."""
    out = np.zeros(names, np.int64)
    for flat in spans_by_thread.values():
        a = np.frombuffer(flat, dtype=np.int64).reshape(-1, 3)
        a = a[np.lexsort((-a[:, 1], a[:, 0]))]  # parents before the children they hold
        inner = [0] * len(a)
        stack: list[tuple[int, int]] = []  # (index, end) of the ops open at this point
        for i, (s, e) in enumerate(a[:, :2].tolist()):
            while stack and stack[-1][1] <= s:
                stack.pop()
            if stack:
                parent, parent_end = stack[-1]
                inner[parent] += min(e, parent_end) - s
            stack.append((i, e))
        own = np.maximum(a[:, 1] - a[:, 0] - np.array(inner, np.int64), 0)
        np.add.at(out, a[:, 2], own)
    return out


def _forward_by_bounds(lo: int, hi: int, backward, ops, io) -> int:
    """Without forward ranges: from the step's first main-thread op outside a data fetch to its
    first backward op (the forward and the loss)."""
    bs, _ = _clip(backward, lo, hi)
    if not len(bs):
        return 0
    lengths, (op, fetch) = _segments(lo, int(bs[0]), [ops, io])
    first = np.flatnonzero(op & ~fetch)
    return int(lengths[first[0]:].sum()) if len(first) else 0


def _interleave(starts: array, ends: array) -> array:
    out = np.empty(2 * len(starts), np.int64)
    out[0::2], out[1::2] = np.frombuffer(starts, dtype=np.int64), np.frombuffer(ends, dtype=np.int64)
    return array("q", out.tobytes())


def _whole_trace(col: _Collector) -> tuple[tuple | None, list]:
    """No steps: the busiest thread's span is one step (-1)."""
    def busy(t):
        return sum(len(a) for a in col.threads[t].values())
    if col.threads:
        main = max(col.threads, key=busy)
        p = _pairs(col.threads[main].values())
        return main, [(-1, int(p[:, 0].min()), int(p[:, 1].max()))]
    if len(col.k_start):
        return None, [(-1, min(col.k_start), max(col.k_end))]
    return None, []


def _shares(wall: int, compute: int, exposed: int, io: int, idle: int) -> dict:
    if wall <= 0:
        return {"compute": 0.0, "comm_exposed": 0.0, "io": 0.0, "idle": 100.0}
    return {k: round(100 * v / wall, 2) for k, v in
            (("compute", compute), ("comm_exposed", exposed), ("io", io), ("idle", idle))}


# -- a directory of traces ----------------------------------------------------------------------

def analyze_file(path: str, rank: int | None = None) -> dict:
    """One trace file's ledger (rank: for messages; the file's own distributedInfo otherwise)."""
    stream = TraceStream(path)
    col = _collect(stream, str(path))
    rank = rank if rank is not None else stream.distributed_rank
    ledger = _ledger(col, rank, stream.base_ns, str(path), stream.header, list(stream.warnings))
    if not ledger["steps"]:  # a verdict from no events would read as a healthy run: refused
        held = f"{stream.count} event{'' if stream.count == 1 else 's'}"
        held += ", cut short" if stream.truncated else ""
        raise BadTrace(f"{path} holds no timed events of torch.profiler's (steps, ops, kernels; it has "
                       f"{held}): nothing to analyze; the profiler stopped before it recorded a step (a run "
                       "shorter than profile.wait + warmup + active steps?) or it is another tool's trace: "
                       "record one with loom profile")
    ledger["_distributed_rank"] = stream.distributed_rank
    ledger["_world_size"] = distributed_info(stream.header, path).get("world_size")
    return ledger


def _analyze_safely(path: str, rank: int | None) -> dict | str | BadTrace:
    """The ledger; the message of a file that is no trace (skipped); a damaged trace's error."""
    try:
        return analyze_file(path, rank)
    except BadTrace as e:
        return e
    except LoomError as e:
        return str(e)


def _can_spawn() -> bool:
    # spawned workers re-import __main__ by path: impossible for `python - < script` (<stdin>)
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    return main is None or os.path.exists(main)


def analyze_dir(path, workers: int | None = None) -> dict:
    """The ledger of every trace in `path`: {"ranks": {"<rank>": ledger}, "warnings": [...]}.

    Ranks come from the file name (rank0, rank_1, rank-2), else the trace's distributedInfo,
    else file order; several traces of one rank are merged in time order. Files that are not
    traces are skipped with a warning, unless none is one; a damaged trace is refused (BadTrace), and
    so are a file with another's bytes (a copy) and traces recording different world sizes.
    Several files: one process each (`workers`, default one per core).
    """
    files = find_traces(path)
    refuse_copies(files)
    jobs = [(str(f.path), f.name_rank) for f in files]
    workers = min(len(jobs), workers or os.cpu_count() or 1)
    results = None
    if workers > 1 and _can_spawn():
        try:
            with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
                results = list(pool.map(_analyze_safely, *zip(*jobs)))
        except BrokenProcessPool:  # a worker died (out of memory, killed): try again in this process
            results = None
    if results is None:
        results = [_analyze_safely(p, r) for p, r in jobs]
    for r in results:
        if isinstance(r, BadTrace):  # a damaged trace is refused, not analyzed around
            raise r
    errors = [r for r in results if isinstance(r, str)]
    if len(errors) == len(results):
        raise LoomError(errors[0] if len(errors) == 1 else
                        f"no readable trace among {len(errors)} files in {path}: {errors[0]}")
    warnings = [f"skipped: {e}" for e in errors]
    ranked, worlds = [], {}
    for f, r in zip(files, results):
        if not isinstance(r, str):
            dist_rank = r.pop("_distributed_rank")
            ranked.append((f.name_rank if f.name_rank is not None else dist_rank, r))
            worlds.setdefault(r.pop("_world_size"), f.path)
    worlds.pop(None, None)
    if len(worlds) > 1:  # one run's ranks agree on its world: these are several runs' traces
        (a, pa), (b, pb) = list(worlds.items())[:2]
        raise LoomError(f"{pa} records world size {a} but {pb} records {b}: traces of different runs; "
                        "analyze one run's traces at a time (a folder each)")
    known = {rank for rank, _ in ranked}
    free = (i for i in itertools.count() if i not in known)  # no rank anywhere: file order
    by_rank: dict[int, list[dict]] = {}
    for rank, r in ranked:
        by_rank.setdefault(next(free) if rank is None else rank, []).append(r)
    by_rank = dict(sorted(by_rank.items()))
    ranks = {}
    for rank, ledgers in by_rank.items():
        ranks[str(rank)] = ledgers[0] if len(ledgers) == 1 else _merge(ledgers)
        ranks[str(rank)]["rank"] = rank
    refuse_apart(ranks)
    world = next(iter(worlds), None)
    missing = [r for r in range(world or 0) if str(r) not in ranks]
    if missing:  # each present rank's ledger holds; the comparison across ranks is of these alone
        shown = ", ".join(map(str, missing[:8])) + (", …" if len(missing) > 8 else "")
        warnings.append(f"traces of {len(ranks)} of the run's {world} ranks (none of rank {shown}): "
                        f"stragglers and imbalance are told among these only; put every rank's trace in "
                        f"{path} for the whole run")
    return {"ranks": ranks, "warnings": warnings}


# One run's ranks profile the same steps together (their collectives tie them): traces whose steps
# ran further apart than this were recorded by different runs (or on clocks this far apart).
MAX_APART_S = 60.0


def refuse_apart(ranks: dict) -> None:
    """Traces of different runs in one folder (world sizes alike) would be analyzed as ranks of one,
    the later run's reading as a straggler hours behind: refused, by when their steps ran."""
    spans = {r: (min(s["start_us"] for s in led["steps"]),
                 max(s["start_us"] + s["wall_ms"] * 1000 for s in led["steps"]))
             for r, led in ranks.items() if led.get("steps")}
    if len(spans) < 2:
        return
    first = min(spans, key=lambda r: spans[r][1])  # the rank whose steps ended first
    last = max(spans, key=lambda r: spans[r][0])  # and the one whose steps began last
    apart_s = (spans[last][0] - spans[first][1]) / 1e6
    if apart_s <= MAX_APART_S:
        return
    gap = (f"{apart_s:.0f} s" if apart_s < 120 else f"{apart_s / 60:.0f} min" if apart_s < 7200
           else f"{apart_s / 3600:.1f} h")
    pa, pb = (ranks[r]["trace"].split("; ")[0] for r in (first, last))
    raise LoomError(f"{pb}'s steps began {gap} after {pa}'s ended: traces of different runs (the ranks of "
                    "one profile the same steps together); analyze one run's traces at a time (a folder "
                    "each)")


def _merge(ledgers: list[dict]) -> dict:
    """Several traces of one rank (a profiler schedule that repeats): one ledger, in time order."""
    ops: dict[str, list] = {}
    for led in ledgers:
        for op in led["top_ops"]:
            t = ops.setdefault(op["name"], [0.0, 0, 0.0])
            t[0] += op["total_ms"]
            t[1] += op["count"]
            t[2] += op.get("self_ms", op["total_ms"])
    names = ", ".join(Path(led["trace"]).name for led in ledgers)
    return {"rank": ledgers[0]["rank"],
            "kind": "gpu" if any(led["kind"] == "gpu" for led in ledgers) else "cpu",
            "trace": "; ".join(led["trace"] for led in ledgers),
            "warnings": [w for led in ledgers for w in led["warnings"]] + [
                f"{len(ledgers)} traces of one rank merged ({names})"],
            "steps": sorted((s for led in ledgers for s in led["steps"]), key=lambda s: s["start_us"]),
            "collectives": sorted((c for led in ledgers for c in led["collectives"]),
                                  key=lambda c: (c["enqueue_us"] if c["enqueue_us"] is not None
                                                 else c["start_us"])),
            "top_ops": [{"name": k, "total_ms": v[0], "self_ms": v[2], "count": v[1]}
                        for k, v in sorted(ops.items(), key=lambda kv: -kv[1][2])[:TOP_OPS]]}
