"""Muon for the blocks' matrices, AdamW for the rest, on every layout.

Muon keeps one momentum per matrix and steps each matrix by its momentum orthogonalized with a
few Newton-Schulz iterations (the quintic of torch.optim.Muon and of the published runs). Those
iterations need the whole matrix, which a sharded layout splits:
  - FSDP2 (zero2, zero3, hsdp, cp's dp×cp shards): each matrix gets an owner, round-robin over the
    shard group; the shards of W matrices go to their W owners in one all-to-all, each owner
    orthogonalizes its matrix, and a second all-to-all sends the pieces back. The next batch's
    gather runs while this one is orthogonalized.
  - a matrix split on more than one mesh dimension (FSDP2 × TP) is gathered whole on every rank
    (its TP group included) and each rank keeps its piece.
  - a split along a leading dim only (the experts of a stacked [E, rows, cols] tensor, FSDP2's or
    EP's) leaves each expert's matrix whole: orthogonalized where it is, one expert at a time.
  - ddp: every rank holds every matrix; ZeRO-1 (ZeroRedundancyOptimizer over this class): the rank
    holding a matrix's state orthogonalizes it.
The embedding, head, norms and routers stay on AdamW: torch's own, over this optimizer's AdamW
groups and states, so one optimizer, one state dict and one LR schedule cover both.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.profiler import record_function

from loom.config import MuonConfig, TrainConfig

MUON_ALLTOALL = "muon_alltoall"  # the profiler range of its exchanges (observe/ledger.py's kind)
NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)  # the quintic's a, b, c (torch.optim.Muon's)
NS_EPS = 1e-7
# Path components of the parameters that stay on AdamW although they are matrices: the embedding,
# the head and the MoE router (loom's GPT and the Hugging Face names).
ADAMW_MODULES = frozenset({"tok_embeddings", "output", "router", "embed_tokens", "lm_head", "gate", "wte"})
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def is_muon_matrix(name: str, p: torch.Tensor) -> bool:
    """A block's 2-D matrix (or a stack of experts' matrices): attention, MLP, experts, LoRA's A and
    B. Not the embedding, head or router, and nothing 1-D."""
    shape = getattr(p, "ds_shape", p.shape)
    return len(shape) >= 2 and not ADAMW_MODULES.intersection(name.split("."))


def assignment(model: nn.Module) -> dict[str, dict]:
    """Which optimizer steps which trained parameters: per side, the names (each block's index as
    `*`) and the parameter count. The run prints it at start and records it in config.toml."""
    out: dict[str, dict] = {"muon": {"names": [], "params": 0}, "adamw": {"names": [], "params": 0}}
    for name, p in model.named_parameters():
        if p.requires_grad:
            pattern = ".".join("*" if part.isdigit() else part for part in name.split("."))
            side = out["muon" if is_muon_matrix(name, p) else "adamw"]
            side["params"] += p.numel()
            if pattern not in side["names"]:
                side["names"].append(pattern)
    return out


def assignment_lines(sides: dict[str, dict]) -> list[str]:
    """One line per optimizer: its parameter count and names."""
    return [f"{side}: {info['params'] / 1e6:.3f}M params: {', '.join(info['names']) or 'none'}"
            for side, info in sides.items()]


def muon_groups(model: nn.Module, t: TrainConfig, m: MuonConfig) -> list[dict]:
    """The parameter groups: Muon's matrices, then AdamW's decayed and undecayed rest."""
    muon, decay, no_decay = [], [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            side = muon if is_muon_matrix(name, p) else decay if len(p.shape) >= 2 else no_decay
            side.append(p)
    return [{"params": muon, "algorithm": "muon", "lr": t.lr if m.lr is None else m.lr,
             "weight_decay": t.weight_decay if m.weight_decay is None else m.weight_decay,
             "momentum": m.momentum, "nesterov": m.nesterov, "ns_steps": m.ns_steps,
             "update_scale": m.update_scale, "ns_dtype": m.ns_dtype},
            {"params": decay, "algorithm": "adamw", "weight_decay": t.weight_decay},
            {"params": no_decay, "algorithm": "adamw", "weight_decay": 0.0}]


def newton_schulz(g: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """The orthogonalized `g` (each [rows, cols] matrix of its last two dims, one at a time): the
    quintic Newton-Schulz iteration of torch.optim.Muon, op for op, in `dtype`."""
    if g.ndim > 2 or g.numel() == 0:  # (a rank may hold no experts, or no rows, of a split)
        if g.numel() == 0:
            return g.to(dtype)
        flat = g.reshape(-1, *g.shape[-2:])
        return torch.stack([newton_schulz(m, steps, dtype) for m in flat]).reshape(g.shape)
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:  # iterate on the wide side: the Gram matrix is the smaller one
        x = x.T
    x = x.div(x.norm().clamp(min=NS_EPS))  # the spectral norm ≤ the Frobenius norm ≤ 1
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def update_scale(rule: str, shape: torch.Size) -> float:
    """The factor on Muon's LR for a [rows, cols] matrix: match_rms_adamw gives the update AdamW's
    RMS (0.2·sqrt(max(rows, cols))); original is sqrt(max(1, rows/cols))."""
    rows, cols = shape[-2], shape[-1]
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))


class MuonAdamW(torch.optim.Optimizer):
    """Muon over the groups marked algorithm = "muon", torch's AdamW over the others.

    Like torch's fused AdamW it takes `found_inf` (a device flag, 1: skip this step), set by the
    training step for a step whose loss or gradient norm is not finite: the skip decided on the
    device, not read on the host. Only with a fused AdamW inside (`takes_found_inf`), which takes
    the flag too."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, foreach: bool | None = None, fused: bool | None = None):
        groups = [dict(g) for g in params]
        for g in groups:
            g.setdefault("algorithm", "adamw")
        adamw_groups = [g for g in groups if g["algorithm"] == "adamw"] or [{"params": []}]
        # torch's AdamW fills its defaults into these same dicts; step() hands it them again.
        self._adamw = torch.optim.AdamW(adamw_groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                        foreach=foreach, fused=fused)
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=0.95, nesterov=True, ns_steps=5,
                        update_scale="match_rms_adamw", ns_dtype="bf16", algorithm="adamw")
        super().__init__(groups, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)
        adamw = [g for g in self.param_groups if g["algorithm"] == "adamw"]
        if any(p.grad is not None for g in adamw for p in g["params"]):
            # a load_state_dict replaces the groups and states: hand AdamW the current ones
            self._adamw.param_groups, self._adamw.state = adamw, self.state
            if found_inf is not None:
                self._adamw.found_inf = found_inf
            try:
                self._adamw.step()
            finally:
                self._adamw.__dict__.pop("found_inf", None)
        for group in self.param_groups:
            if group["algorithm"] == "muon":
                self._muon_step(group, found_inf)
        return loss

    def takes_found_inf(self) -> bool:
        return bool(self._adamw.defaults.get("fused"))

    def _muon_step(self, group: dict, found_inf: torch.Tensor | None = None) -> None:
        params, updates = [], []
        # under found_inf each factor of the step is chosen on the device (a skipped step's: the
        # identity), the very values of a plain step otherwise; and a skipped step's gradients (NaN or
        # Inf, which a zero factor would keep) are replaced by zeros
        skip = keep = None
        if found_inf is not None:
            skip = found_inf.bool()
            keep = torch.where(skip, 0.0, 1.0)
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            grad = p.grad if skip is None else torch.where(skip, 0.0, p.grad)
            weight = 1 - group["momentum"]
            buf.lerp_(grad, weight if skip is None else torch.where(skip, 0.0, weight))
            params.append(p)
            updates.append(grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf)
        dtype = DTYPES[group["ns_dtype"]]
        for p, o in zip(params, orthogonalize(updates, group["ns_steps"], dtype)):
            local = p.to_local() if isinstance(p, DTensor) else p
            step = group["lr"] * update_scale(group["update_scale"], p.shape)
            if keep is None:
                local.mul_(1 - group["lr"] * group["weight_decay"])
                local.add_(o, alpha=-step)
            else:
                local.mul_(torch.where(skip, 1.0, 1 - group["lr"] * group["weight_decay"]))
                local.add_(o.mul_(keep), alpha=-step)  # o: this step's own result


# ---------------------------------------------------------------------------------------------
# Whole matrices from their shards


def _shards(placement) -> bool:
    # FSDP2 over a TP-sharded dim records its split as a _StridedShard, which is_shard() disowns
    return placement.is_shard() or isinstance(placement, _StridedShard)


def _splits(t: DTensor) -> list[int]:
    """The mesh dims that split a matrix of `t` (shard its last two dims over more than one rank)."""
    out = []
    for i, placement in enumerate(t.placements):
        if _shards(placement) and t.device_mesh.size(i) > 1:
            dim = placement.dim % t.ndim
            if dim >= t.ndim - 2:
                out.append(i)
    return out


def orthogonalize(updates: list[torch.Tensor], steps: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Each update's orthogonalized local part (this rank's piece of the whole matrix's result)."""
    out: list[torch.Tensor | None] = [None] * len(updates)
    owned: dict[tuple, list[int]] = {}  # (mesh, mesh dim): the updates shared out by the owners
    for i, u in enumerate(updates):
        if not isinstance(u, DTensor):
            out[i] = newton_schulz(u, steps, dtype)
            continue
        splits = _splits(u)
        if not splits:  # whole matrices here (replicated, or split along the experts)
            out[i] = newton_schulz(u.to_local(), steps, dtype)
        elif len(splits) == 1 and type(u.placements[splits[0]]) is Shard:
            owned.setdefault((u.device_mesh, splits[0]), []).append(i)
        else:  # split on several mesh dims: whole on every rank, each keeps its piece
            full = newton_schulz(u.full_tensor(), steps, dtype)
            out[i] = distribute_tensor(full, u.device_mesh, u.placements, src_data_rank=None).to_local()
    for (mesh, mesh_dim), idx in owned.items():
        for i, o in zip(idx, _by_owners([updates[i] for i in idx], mesh.get_group(mesh_dim), steps, dtype)):
            out[i] = o
    return out


def _chunks(n: int, world: int) -> list[int]:
    """torch.chunk's sizes of n rows over `world` (FSDP2's and DTensor's Shard): ⌈n/world⌉ each, the
    last ones short or empty."""
    size = -(-n // world)
    return [max(0, min(size, n - r * size)) for r in range(world)]


def _layout(u: DTensor, world: int) -> tuple[int, list[int], list[int]]:
    """(the split dim, each rank's rows of it, the whole matrix's shape with that dim first). The
    other dims are this rank's: the shard group holds the same part of any other split."""
    dim = next(p.dim % u.ndim for i, p in enumerate(u.placements)
               if p.is_shard() and p.dim % u.ndim >= u.ndim - 2 and u.device_mesh.size(i) > 1)
    shape = list(u.to_local().shape)
    shape[dim] = u.shape[dim]
    shape.insert(0, shape.pop(dim))
    return dim, _chunks(u.shape[dim], world), shape


def _by_owners(updates: list[DTensor], group, steps: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Orthogonalize updates sharded over `group`: matrix k's owner is rank k mod world; one
    all-to-all gathers a batch of `world` matrices to their owners, a second sends the results
    back. The next batch's gather is in flight while this one's owner iterates."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    layouts = [_layout(u, world) for u in updates]
    per_row = [math.prod(shape[1:]) for _, _, shape in layouts]
    batches = [list(range(s, min(s + world, len(updates)))) for s in range(0, len(updates), world)]

    def exchange(send: torch.Tensor, send_sizes: list[int], recv_sizes: list[int]):
        recv = send.new_empty(sum(recv_sizes))
        with record_function(MUON_ALLTOALL):  # the ledger's kind for these (observe/ledger.py)
            work = dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group, async_op=True)
        return work, recv, recv_sizes

    def gather(batch: list[int]):  # each rank's piece of matrix batch[j] to rank j
        pieces = [updates[k].to_local().movedim(layouts[k][0], 0).to(dtype).reshape(-1) for k in batch]
        owned = batch[me] if me < len(batch) else None
        recv = [0] * world if owned is None else [r * per_row[owned] for r in layouts[owned][1]]
        return exchange(torch.cat(pieces), [t.numel() for t in pieces] + [0] * (world - len(batch)), recv)

    def scatter(batch: list[int], result: torch.Tensor):  # the owner's result, cut back into pieces
        send = [0] * world if me >= len(batch) else [r * per_row[batch[me]] for r in layouts[batch[me]][1]]
        recv = [layouts[k][1][me] * per_row[k] for k in batch] + [0] * (world - len(batch))
        return exchange(result, send, recv)

    pending = gather(batches[0]) if batches else None
    returns = []
    for b, batch in enumerate(batches):
        work, recv, _ = pending
        pending = gather(batches[b + 1]) if b + 1 < len(batches) else None
        with record_function(MUON_ALLTOALL):
            work.wait()
        result = recv  # empty: this rank owns none of the batch
        if me < len(batch):
            dim, _, shape = layouts[batch[me]]
            whole = newton_schulz(recv.reshape(shape).movedim(0, dim), steps, dtype)
            result = whole.movedim(dim, 0).reshape(-1).contiguous()
        returns.append((batch, scatter(batch, result)))
    out: list[torch.Tensor] = [torch.empty(0)] * len(updates)
    for batch, (work, recv, sizes) in returns:
        with record_function(MUON_ALLTOALL):
            work.wait()
        for k, piece in zip(batch, recv.split(sizes[:len(batch)])):
            dim = layouts[k][0]
            local = list(updates[k].to_local().shape)
            local.insert(0, local.pop(dim))
            out[k] = piece.reshape(local).movedim(0, dim)
    return out
