"""Observed communication per rank: every collective a region issues, its kind, group and payload.

A TorchDispatchMode sees the c10d ops where every engine ends up, whichever API issued them:
DDP's C++ reducer, FSDP2, ZeroRedundancyOptimizer, pipelining's p2p, DTensor and functional
collectives. Only shapes and dtypes are read, so counting adds no device synchronization.

Observed (read off the tensors handed to the collective): the count of calls and the payload,
the Φ of the ring formulas, in bytes:
  all_reduce, broadcast, reduce           the buffer
  all_gather                              the full (gathered) output, N shards
  reduce_scatter                          the full (unreduced) input, N shards
  gather, scatter                         the full tensor, N per-rank pieces
  all_to_all                              this rank's input
  send, recv                              the tensor (batch_isend_irecv: each op separately)
  cp_ring                                 context parallelism's ring: the tensors this rank sends
  cp_alltoall                             context parallelism's all-to-all: this rank's input
What the wire carries depends on the algorithm the backend picks and is not seen here;
`modelled_wire_bytes` applies the ring model (loom.plan.comm.ring) to the observed payload and is
labelled as the model it is.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from loom.parallel.context_parallel import RING, active_exchange
from loom.plan.comm import ring

# op -> (kind, argument holding the payload, payload is one rank's share to multiply by N).
# c10d ops are what ProcessGroup calls dispatch, functional ops do their c10d call inside their
# kernel (where this mode is off), so each collective is seen once.
_OPS: dict[str, tuple[str, str | None, bool]] = {
    "c10d::allreduce_": ("all_reduce", "tensors", False),
    "c10d::allreduce_coalesced_": ("all_reduce", "tensors", False),
    "c10d::_allgather_base_": ("all_gather", "output_tensor", False),
    "c10d::allgather_": ("all_gather", "output_tensors", False),
    "c10d::allgather_coalesced_": ("all_gather", "output_lists", False),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", "outputs", False),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", "input_tensor", False),
    "c10d::reduce_scatter_": ("reduce_scatter", "input_tensors", False),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs", False),
    "c10d::broadcast_": ("broadcast", "tensors", False),
    "c10d::reduce_": ("reduce", "tensors", False),
    "c10d::gather_": ("gather", "input_tensors", True),
    "c10d::scatter_": ("scatter", "output_tensors", True),
    "c10d::alltoall_": ("all_to_all", "input_tensors", False),
    "c10d::alltoall_base_": ("all_to_all", "input", False),
    "c10d::send": ("send", "tensors", False),
    "c10d::recv_": ("recv", "tensors", False),
    "c10d::recv_any_source_": ("recv", "tensors", False),
    "c10d::barrier": ("barrier", None, False),
    "_c10d_functional::all_reduce": ("all_reduce", "input", False),
    "_c10d_functional::all_reduce_": ("all_reduce", "input", False),
    "_c10d_functional::all_reduce_coalesced": ("all_reduce", "inputs", False),
    "_c10d_functional::all_reduce_coalesced_": ("all_reduce", "inputs", False),
    "_c10d_functional::all_gather_into_tensor": ("all_gather", "input", True),
    "_c10d_functional::all_gather_into_tensor_out": ("all_gather", "input", True),
    "_c10d_functional::all_gather_into_tensor_coalesced": ("all_gather", "inputs", True),
    "_c10d_functional::reduce_scatter_tensor": ("reduce_scatter", "input", False),
    "_c10d_functional::reduce_scatter_tensor_out": ("reduce_scatter", "input", False),
    "_c10d_functional::reduce_scatter_tensor_coalesced": ("reduce_scatter", "inputs", False),
    "_c10d_functional::all_to_all_single": ("all_to_all", "input", False),
    "_c10d_functional::broadcast": ("broadcast", "input", False),
    "_c10d_functional::broadcast_": ("broadcast", "input", False),
    "_c10d_functional::isend": ("send", "tensor", False),
    "_c10d_functional::irecv": ("recv", "tensor", False),
    "_c10d_functional::batch_p2p_ops": ("p2p", None, False),  # one record per isend/irecv
    "_dtensor::shard_dim_alltoall": ("all_to_all", "input", False),  # GPU only; CPU all-gathers
}


def ring_sent_bytes(kind: str, payload_bytes: int, group_size: int) -> int:
    """Modelled, not observed: bytes one rank would send to move `payload_bytes` by the ring model,
    in whole bytes."""
    return math.floor(ring(kind, group_size, payload_bytes) + 1e-6)  # floor, robust to float rounding


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _dtype(x: Any) -> str | None:
    """The element type a collective carries (the first tensor's: one op moves one dtype)."""
    if isinstance(x, torch.Tensor):
        return str(x.dtype).removeprefix("torch.")
    if isinstance(x, (list, tuple)) and x:
        return _dtype(x[0])
    return None


def _group_size(group: Any) -> int:
    if isinstance(group, str):  # functional collectives name their group
        group = _resolve_process_group(group)
    elif isinstance(group, torch.ScriptObject):  # c10d ops get the TorchBind-boxed group
        group = dist.ProcessGroup.unbox(group)
    return group.size()


class CollectiveCounter(TorchDispatchMode):
    """Records every collective issued inside `with CollectiveCounter() as comm:` on this rank.

    `comm.records`: one dict per collective (kind, group_size, payload_bytes, modelled_wire_bytes,
    op, dtype: what it carries, "float32" for gradients reduced in fp32); `comm.summary()`: count
    and payload bytes in all and per kind (observed), with the ring model's wire bytes beside them
    (modelled). Payload conventions: the module's docstring.
    """

    def __init__(self) -> None:
        super().__init__()
        self.records: list[dict] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in types:
            # Ops on DTensors go to DTensor first: the collectives its redistributions issue on
            # local tensors come back here, counted once (inside our own call they would not).
            if issubclass(t, DTensor):
                return NotImplemented
        kwargs = kwargs or {}
        rule = _OPS.get(func.name())
        if rule is not None:
            bound = dict(zip((a.name for a in func._schema.arguments), args), **kwargs)
            self._record(func, rule, bound)
        return func(*args, **kwargs)

    def _record(self, func, rule: tuple[str, str | None, bool], bound: dict) -> None:
        kind, payload_arg, per_rank = rule
        n = _group_size(bound.get("process_group", bound.get("group_name")))
        if kind == "p2p":
            pairs = zip(bound["op_list"], bound["tensors"])
            ops = [("send" if op == "isend" else "recv", t) for op, t in pairs]
        else:
            ops = [(kind, bound[payload_arg] if payload_arg else None)]
        exchange = active_exchange()  # context parallelism's: its own kind
        for k, tensors in ops:
            if exchange == RING and k == "recv":
                continue  # a ring's receives are the previous rank's sends: its payload is what it sends
            payload = _nbytes(tensors) * (n if per_rank else 1)
            wire = ring_sent_bytes(k, payload, n)  # by what the wire carries: a send, an all-to-all
            k = exchange or k
            self.records.append({"kind": k, "group_size": n, "payload_bytes": payload,
                                 "modelled_wire_bytes": wire, "op": func.name(),
                                 "dtype": _dtype(tensors)})

    def summary(self) -> dict:
        """{"count", "payload_bytes", "modelled_wire_bytes", "by_kind": {kind: the same three}}."""
        keys = ("count", "payload_bytes", "modelled_wire_bytes")
        by_kind: dict[str, dict[str, int]] = {}
        for r in self.records:
            s = by_kind.setdefault(r["kind"], dict.fromkeys(keys, 0))
            s["count"] += 1
            s["payload_bytes"] += r["payload_bytes"]
            s["modelled_wire_bytes"] += r["modelled_wire_bytes"]
        total = {k: sum(s[k] for s in by_kind.values()) for k in keys}
        return {**total, "by_kind": by_kind}
