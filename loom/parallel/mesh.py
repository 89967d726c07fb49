"""The process group and the DeviceMesh: world -> [pp, dp_replicate, dp_shard, cp, tp].

The mesh dims are named so every engine takes the sub-mesh it needs: the batch is sliced over the
flattened "dp" ranks; gradients are reduced over dp × cp (context-parallel ranks hold other tokens of
the same sequences, as torchtitan runs it): DDP and ZeRO-1 over the flattened "dp_cp", FSDP2 shards
over "dp_shard" × "cp", HSDP replicates that over "dp_replicate"; tensor parallel is "tp" (innermost,
so a TP group sits on one node's fast links), context parallel "cp" next to it.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from loom.config import ParallelDims
from loom.launch import free_port
from loom.parallel.context_parallel import ContextGroup
from loom.parallel.expert_parallel import ExpertGroup
from loom.parallel.known_warnings import silence_flattened_dim_slicing

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# Under expert parallelism dp_shard is split into the ranks that shard the same experts (edp_shard) and,
# innermost, the ranks that split the experts (ep); "dp_shard" is their flattening, as before. Without
# sharding (ddp: dp_shard 1) dp_replicate is split so instead.
EP_MESH_DIMS = ("pp", "dp_replicate", "edp_shard", "ep", "cp", "tp")
EP_REPLICA_MESH_DIMS = ("pp", "edp_replicate", "ep", "dp_shard", "cp", "tp")


@dataclass
class Dist:
    """What a rank knows about its place in the run."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh  # named dims MESH_DIMS
    dp_mesh: DeviceMesh  # the data-parallel ranks as one 1-D mesh: who takes which part of the batch
    # The ranks whose gradients are summed: dp × cp as one 1-D mesh (DDP, ZeRO-1), dp_mesh when cp = 1
    grad_mesh: DeviceMesh | None = None
    cp: ContextGroup | None = None  # the ranks sharing each sequence (None: cp = 1)
    ep: ExpertGroup | None = None  # the ranks splitting each MoE block's experts (None: ep = 1)

    def __post_init__(self) -> None:
        if self.grad_mesh is None:
            self.grad_mesh = self.dp_mesh

    @property
    def cp_size(self) -> int:
        return self.cp.size if self.cp is not None else 1

    def fsdp_mesh(self, replicated: bool) -> DeviceMesh:
        """FSDP2's mesh: its shard dim spans dp_shard × cp; `replicated` (hsdp, and ddp/zero1 under TP)
        adds dp_replicate as the replicate dim (under cp, ddp/zero1 replicate over dp_replicate × cp)."""
        cp = self.cp is not None
        if not replicated:
            return self.mesh["dp_shard_cp" if cp else "dp_shard"]
        if cp and self.mesh["dp_shard"].size() == 1 and self.mesh["dp_replicate"].size() > 1:
            # replication: no sharding over cp either. Built from the two dims' groups (no new group):
            # torch 2.11 slices no flattened dim with a root dim of a larger stride after it
            replicate, shard = self.mesh["dp_replicate_cp"], self.mesh["dp_shard"]
            return DeviceMesh.from_group([replicate.get_group(), shard.get_group()], self.device.type,
                                         replicate.mesh.reshape(-1, 1),
                                         mesh_dim_names=("dp_replicate_cp", "dp_shard"))
        return self.mesh[("dp_replicate", "dp_shard_cp" if cp else "dp_shard")]

    def expert_fsdp_mesh(self, replicated: bool) -> DeviceMesh:
        """FSDP2's mesh for the routed experts under expert parallelism: the ranks holding the same
        experts (edp_shard), replicated over dp_replicate under hsdp; ddp's replicas of them."""
        if "edp_replicate" in self.mesh.mesh_dim_names:
            return self.mesh[("edp_replicate", "dp_shard")]
        return self.mesh[("dp_replicate", "edp_shard")] if replicated else self.mesh["edp_shard"]

    @property
    def ep_size(self) -> int:
        return self.ep.size if self.ep is not None else 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def local_view(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard (a replicated one's whole value), or
    the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def pick_device(requested: str) -> torch.device:
    use_cuda = requested == "cuda" or (requested == "auto" and torch.cuda.is_available())
    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(dims_for_world, device_request: str = "auto", timeout_s: float = 600.0,
                     cp_mode: str = "ring", host_collectives: bool = False) -> Dist:
    """Join (or, run alone, create) the process group and build the mesh.

    `dims_for_world(world_size) -> ParallelDims` chooses the layout once the world size is
    known. A plain `python` run without torchrun becomes a world of one. `host_collectives`
    (CPU offload): on a GPU, collectives of host tensors too (the gradient norm of offloaded
    gradients), by gloo beside NCCL.
    """
    if "RANK" not in os.environ:  # not under torchrun/srun: a single-process world
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    device = pick_device(device_request)
    if not dist.is_initialized():
        backend = "gloo" if device.type != "cuda" else "cpu:gloo,cuda:nccl" if host_collectives else "nccl"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **_attempt_store(timeout_s))
    world = dist.get_world_size()
    dims: ParallelDims = dims_for_world(world)
    mesh, dp_mesh, grad_mesh, cp = build_mesh(device.type, dims, cp_mode)
    return Dist(rank=dist.get_rank(), local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                world_size=world, device=device, mesh=mesh, dp_mesh=dp_mesh, grad_mesh=grad_mesh, cp=cp,
                ep=expert_group(mesh, dims))


def expert_group(mesh: DeviceMesh, dims: ParallelDims) -> ExpertGroup | None:
    if dims.ep == 1:
        return None
    return ExpertGroup(mesh["ep"].get_group(), dims.ep, mesh["ep"].get_local_rank())


def build_mesh(device_type: str, dims: ParallelDims, mode: str = "ring"):
    """(mesh, dp_mesh, grad_mesh, cp group or None) for `dims`; the dims cp needs flattened only under cp,
    dp_shard split in two (EP_MESH_DIMS) only under ep."""
    silence_flattened_dim_slicing()  # dp_shard_cp, and dp_shard under ep, are sliced from the root
    if dims.ep > 1 and dims.dp_shard > 1:
        mesh = init_device_mesh(device_type, (dims.pp, dims.dp_replicate, dims.dp_shard // dims.ep, dims.ep,
                                              dims.cp, dims.tp), mesh_dim_names=EP_MESH_DIMS)
        mesh[("edp_shard", "ep")]._flatten("dp_shard")
    elif dims.ep > 1:
        mesh = init_device_mesh(device_type, (dims.pp, dims.dp_replicate // dims.ep, dims.ep, dims.dp_shard,
                                              dims.cp, dims.tp), mesh_dim_names=EP_REPLICA_MESH_DIMS)
        mesh[("edp_replicate", "ep")]._flatten("dp_replicate")
    else:
        mesh = init_device_mesh(device_type, (dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp),
                                mesh_dim_names=MESH_DIMS)
    dp_mesh = mesh[("dp_replicate", "dp_shard")]._flatten("dp")
    if dims.cp == 1:
        return mesh, dp_mesh, dp_mesh, None
    grad_mesh = mesh[("dp_replicate", "dp_shard", "cp")]._flatten("dp_cp")
    mesh[("dp_shard", "cp")]._flatten("dp_shard_cp")
    mesh[("dp_replicate", "cp")]._flatten("dp_replicate_cp")
    cp = ContextGroup(mesh["cp"].get_group(), dims.cp, mesh["cp"].get_local_rank(), mode)
    return mesh, dp_mesh, grad_mesh, cp


def _attempt_store(timeout_s: float) -> dict:
    """Under torchrun, a store private to this attempt (init_process_group's store, rank, world):
    torchrun may keep its store across a restart, and a restarted group must not read the dead
    group's addresses. Elsewhere nothing: env:// as usual."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return {}
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent_store and rank == 0,
                          timeout=timedelta(seconds=timeout_s), multi_tenant=not agent_store)
    return {"store": dist.PrefixStore(f"loom/attempt_{attempt}", store), "rank": rank, "world_size": world}


# What init_distributed sets for a world of one (left set, a later run would think it a torchrun rank).
WORLD_OF_ONE_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def shutdown(world_of_one: bool = False) -> None:
    """End the process group, and with it the native threads of gloo and its TCP store: left running
    at interpreter exit they can abort it ("terminate called without an active exception", rc -6).
    `world_of_one`: also unset what init_distributed set for one (WORLD_OF_ONE_ENV)."""
    if dist.is_initialized():
        dist.destroy_process_group()
        # The groups live on in reference cycles (the mesh, the engines' modules) until a collection:
        # collect now, so that their threads are joined here, not in the interpreter's teardown.
        gc.collect()
    if world_of_one:
        for key in WORLD_OF_ONE_ENV:
            os.environ.pop(key, None)


@contextlib.contextmanager
def group_of_this_call():
    """Ends the process group a block starts (none running before it): run alone (a world of one),
    when the block ends, however it ends, so a script calling train() may exit at once and call it
    again as a new world. Ranks of a launcher keep it for their script's next call (each rank ends
    a block at its own time: a new group on the same port would race the old one) and end it at
    exit, before the interpreter's teardown."""
    starts, alone = not dist.is_initialized(), "RANK" not in os.environ
    try:
        yield
    finally:
        if starts and alone:
            shutdown(world_of_one=True)
        elif starts:
            atexit.register(shutdown)
