"""The data-parallel strategies as data: what each shards, which engine runs it, what it costs.

Config validation, parallelize, the optimizer, memory measurement and the planner read this
table instead of comparing strategy names. Adding a strategy (or an engine) is a row here and
one engine module under loom/parallel/. No torch: the planner imports it.

Ψ = parameters, N = the ranks one shard is split over. Bytes are per rank, at rest, under the
torch recipe (fp32 params 4 + grads 4 + Adam m, v 8 = 16 bytes a parameter).
"""

from __future__ import annotations

from dataclasses import dataclass

PARAMS, GRADS, OPTIMIZER = "params", "grads", "optimizer"


@dataclass(frozen=True)
class Strategy:
    name: str
    zero_stage: int  # as the ZeRO paper / DeepSpeed number them (ddp = 0)
    engine: str  # what runs it: "ddp" (loom/parallel/ddp.py) or "fsdp2" (loom/parallel/fsdp.py)
    dp_mesh: str  # how the data-parallel ranks are used: "replicate", "shard" or "hybrid"
    sharded: frozenset[str]  # which model states are split over the shard group at rest
    reshard_after_forward: bool | None  # FSDP2's default (None: not FSDP2)
    formula: str  # per-rank model-state bytes, as docs/strategies.md writes them
    collectives: tuple[str, ...]  # what its gradient sync issues on the data-parallel group
    summary: str  # one line: what is sharded and by what

    @property
    def shards_optimizer_only(self) -> bool:
        """ZeRO-1: a ZeroRedundancyOptimizer over a replicated model."""
        return self.sharded == frozenset({OPTIMIZER})

    @property
    def shards_params(self) -> bool:
        return PARAMS in self.sharded

    @property
    def deepspeed_stage(self) -> int | None:
        """The ZeRO stage the deepspeed engine runs it with (None: hybrid sharding, which it does not)."""
        return None if self.dp_mesh == "hybrid" else self.zero_stage

    def uses_fsdp(self, tp: int = 1, ep: int = 1, split_backward: bool = False) -> bool:
        """Under TP or EP, ddp and zero1 replicate through FSDP2 on a (dp, 1) mesh: DDP takes no DTensor
        parameters, and FSDP2 with nothing to shard over holds the same 16Ψ as DDP. So under a pipeline
        schedule that splits the backward (`split_backward`: torch assigns the weight gradients
        without autograd's hooks, which DDP's reducer waits on; the stage calls FSDP2's reduction)."""
        return self.engine == "fsdp2" or tp > 1 or ep > 1 or split_backward

    def dp_dims(self, dp: int, hybrid_shard: int = 0) -> tuple[int, int]:
        """(dp_replicate, dp_shard) of dp ranks: all replicas, one shard group, or (hybrid) groups
        of `hybrid_shard` ranks replicated across."""
        if self.dp_mesh == "replicate":
            return dp, 1
        if self.dp_mesh == "shard":
            return 1, dp
        return dp // hybrid_shard, hybrid_shard

    def shard_size(self, dp_replicate: int, dp_shard: int) -> int:
        """N, the ranks one shard of the sharded states is split over (1: nothing is sharded)."""
        if not self.sharded:
            return 1
        return dp_shard if self.dp_mesh != "replicate" else dp_replicate * dp_shard


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    Strategy("ddp", 0, "ddp", "replicate", frozenset(), None, "16Ψ", ("all_reduce",),
             "nothing: a full replica per rank (DistributedDataParallel)"),
    Strategy("zero1", 1, "ddp", "replicate", frozenset({OPTIMIZER}), None, "8Ψ + 8Ψ/N",
             ("all_reduce", "broadcast"), "optimizer states (DDP + ZeroRedundancyOptimizer)"),
    Strategy("zero2", 2, "fsdp2", "shard", frozenset({PARAMS, GRADS, OPTIMIZER}), False, "16Ψ/N",
             ("all_gather", "reduce_scatter"),
             "params at rest, grads, optimizer states (FSDP2, SHARD_GRAD_OP)"),
    Strategy("zero3", 3, "fsdp2", "shard", frozenset({PARAMS, GRADS, OPTIMIZER}), True, "16Ψ/N",
             ("all_gather", "reduce_scatter"), "params, grads, optimizer states (FSDP2, FULL_SHARD)"),
    Strategy("hsdp", 3, "fsdp2", "hybrid", frozenset({PARAMS, GRADS, OPTIMIZER}), True, "16Ψ/N_shard",
             ("all_gather", "reduce_scatter", "all_reduce"),
             "as zero3 inside a shard group, replicated across groups (FSDP2 on a 2-D mesh)"),
)}
ALIASES = {"fsdp": "zero3", "zero0": "ddp"}


def lookup(name: str) -> Strategy:
    """The strategy a (validated) config names, aliases resolved."""
    return STRATEGIES[ALIASES.get(name, name)]




def fsdp_units(items: list, sizes: list[int], unit_mb: float) -> list[list]:
    """`items` (given their parameter counts, in forward order) grouped into FSDP units: consecutive
    items until a unit holds at least `unit_mb` of fp32 parameters (parallel.fsdp_unit_mb; 0: one
    item each; the last unit may hold less). Every all-gather and reduce-scatter has a fixed cost,
    so small modules are grouped, as DDP and DeepSpeed bucket their gradients; the blocks of a
    billion-parameter model are each a unit already."""
    units, unit, held = [], [], 0
    for item, n in zip(items, sizes):
        unit.append(item)
        held += 4 * n
        if held >= unit_mb * 2**20:
            units.append(unit)
            unit, held = [], 0
    return units + ([unit] if unit else [])
