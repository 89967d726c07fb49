"""Per-rank model-state bytes of each data-parallel strategy (the formulas measurements check).

Ψ = parameter count, N = ranks that share one shard. The `torch` recipe is torch-native mixed
precision: fp32 parameters and gradients, Adam m and v in fp32 -> 4Ψ + 4Ψ + 8Ψ = 16Ψ unsharded.
"""

from __future__ import annotations

from dataclasses import dataclass

# bytes per parameter: (params, grads, optimizer states)
RECIPES = {
    "torch": (4, 4, 8),  # fp32 params + fp32 grads + Adam m, v
    "zero": (2, 2, 12),  # ZeRO paper: fp16 params + fp16 grads + fp32 master, m, v
    "megatron": (2, 4, 12),  # Megatron/DeepSpeed keep fp32 main grads: 18 bytes/param
}


@dataclass(frozen=True)
class ModelStateBytes:
    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


# (sharded params?, sharded grads?, sharded optimizer?) for each ZeRO stage
_SHARDED = {
    "ddp": (False, False, False),
    "zero1": (False, False, True),
    "zero2": (True, True, True),  # FSDP2 SHARD_GRAD_OP: params are sharded at rest too
    "zero3": (True, True, True),
    "hsdp": (True, True, True),
}

# What the ZeRO paper's stage 2 keeps whole: its parameters (it has no resharding of params).
_ZERO_PAPER_SHARDED = dict(_SHARDED, zero2=(False, True, True))


def model_state_bytes(strategy: str, num_params: int, shard_size: int, recipe: str = "torch",
                      paper_stages: bool = False, tp: int = 1, tp_replicated: int = 0) -> ModelStateBytes:
    """Bytes of params, grads and optimizer state held by one rank at rest.

    `shard_size` is N, the number of ranks one shard is split over (the whole data-parallel
    group for ZeRO, dp_shard for HSDP). `paper_stages` follows the ZeRO paper's stage 2
    (unsharded fp16 params) instead of FSDP2's SHARD_GRAD_OP (params sharded at rest).
    """
    p, g, o = RECIPES[recipe]
    # With tensor parallelism each TP rank holds 1/tp of every split parameter and all of the
    # `tp_replicated` ones (the norms' gains).
    num_params = (num_params - tp_replicated) / tp + tp_replicated
    sp, sg, so = (_ZERO_PAPER_SHARDED if paper_stages else _SHARDED)[strategy]
    n = float(shard_size)
    return ModelStateBytes(
        params=p * num_params / (n if sp else 1),
        grads=g * num_params / (n if sg else 1),
        optimizer=o * num_params / (n if so else 1),
    )


def formula_text(strategy: str) -> str:
    """The per-rank model-state formula in Ψ, as the README's strategy table writes it."""
    return {"ddp": "16Ψ", "zero1": "8Ψ + 8Ψ/N", "zero2": "16Ψ/N", "zero3": "16Ψ/N",
            "hsdp": "16Ψ/N_shard"}[strategy]
