"""LoRA (Hu et al., 2021): the base model frozen, each targeted linear y = W x learning a low-rank
update, y = W x + (alpha / r) · B A dropout(x), with A [r, in] random and B [out, r] zero at the
start, so the first step's loss is the base model's.

A targeted nn.Linear has its class swapped in place for LoRALinear: its name, weight and what the
engines do with a linear (TP plans, FSDP units, checkpoints) stay as they were, and it gains the
parameters `lora_A` and `lora_B`. loom's stacked MoE experts adapt each expert the same way
(`w1_lora_A` [E, r, in], ...: loom/models/gpt/moe.py). Every other parameter is frozen and stored
in the base dtype: no gradient, no optimizer state, no gradient collective.

Adapter parameters are named `*lora_A` / `*lora_B`; their initial values come from (seed, name)
alone, like loom's GPT's (WithAdapters), so any sharding starts from the same adapters.
"""

from __future__ import annotations

import fnmatch
import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from loom.errors import ConfigError
from loom.parallel.weights import WeightSource, block, plain_name
from loom.plan.lora import ALL_LINEAR, LEAVES

# The targets by role, and the leaf names each model family gives that linear (the planner's, which
# prices the same ones).
ROLES = LEAVES
ADAPTER_SUFFIXES = ("lora_A", "lora_B")


@dataclass(frozen=True)
class LoRASpec:
    rank: int
    alpha: float
    dropout: float = 0.0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def is_adapter(name: str) -> bool:
    return name.endswith(ADAPTER_SUFFIXES)


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, dropout: float,
               training: bool) -> torch.Tensor:
    """(alpha / r) · B A dropout(x); the scale applied to the r-wide intermediate (cheapest)."""
    if dropout and training:
        x = F.dropout(x, dropout, training=True)
    return F.linear(F.linear(x, a) * scale, b)


def merged(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + (alpha / r) · B A, computed in fp32 and stored in W's dtype (stacked experts: per expert)."""
    return (weight.float() + scale * (b.float() @ a.float())).to(weight.dtype)


class LoRALinear(nn.Linear):
    """A frozen linear plus its trainable low-rank update. Made from an nn.Linear by add_lora, never
    constructed: under TP its A and B are split with the weight (loom/parallel/tensor_parallel.py)."""

    lora_scale: float
    lora_dropout: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)
        if isinstance(base, DTensor):  # tensor parallel's split adapters: as the plan lays them out
            return base + lora_delta(x, self.lora_A, self.lora_B, self.lora_scale, self.lora_dropout,
                                     self.training)
        # The update summed into the base output by the second matmul itself (addmm: no separate
        # add over [tokens, out]), the scale as its alpha on the r-wide product.
        if self.lora_dropout and self.training:
            x = F.dropout(x, self.lora_dropout, training=True)
        low = F.linear(x, self.lora_A)
        out = torch.addmm(base.reshape(-1, base.shape[-1]), low.reshape(-1, low.shape[-1]),
                          self.lora_B.t(), alpha=self.lora_scale)
        return out.view(base.shape)


def _adapt_linear(module: nn.Linear, spec: LoRASpec) -> None:
    w = module.weight
    module.__class__ = LoRALinear
    module.lora_scale, module.lora_dropout = spec.scale, spec.dropout
    module.lora_A = nn.Parameter(torch.empty(spec.rank, module.in_features, device=w.device))
    module.lora_B = nn.Parameter(torch.empty(module.out_features, spec.rank, device=w.device))


def _matches(name: str, targets: list[str]) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    for target in targets:
        if target == ALL_LINEAR or leaf in ROLES.get(target, ()):
            return True
        if target not in ROLES and fnmatch.fnmatchcase(name, target):
            return True
    return False


def _is_router(name: str) -> bool:
    """MoE routers and gates (loom's `router`, `shared_gate`; Hugging Face's `gate`,
    `shared_expert_gate`): all-linear leaves them frozen; a pattern may still name them."""
    return name.rsplit(".", 1)[-1] in ("router", "shared_gate", "gate", "shared_expert_gate")


def add_lora(model: nn.Module, blocks: list[nn.Module], spec: LoRASpec, targets: list[str]) -> list[str]:
    """Adapt the linears of `blocks` (the model's repeated blocks) that `targets` name; returns the
    adapted modules' names. One line when a target names nothing."""
    owned = {id(m) for b in blocks for m in b.modules()}
    adapted: list[str] = []
    for target in targets:  # each must name something
        found = [n for n, m in model.named_modules() if id(m) in owned and _adaptable(n, m, [target])]
        if not found:
            raise ConfigError(f"lora.targets entry {target!r} matches no linear of the model's blocks "
                              f"(e.g. {_examples(model, owned)}); use q, k, v, o, gate, up, down, "
                              f"all-linear or a pattern such as '*.{_examples(model, owned, 1)}'")
    chosen = [(n, m) for n, m in model.named_modules() if id(m) in owned and _adaptable(n, m, targets)]
    _check_rank(spec.rank, chosen, targets)
    for name, module in chosen:
        if type(module) is nn.Linear:
            _adapt_linear(module, spec)
        else:
            module.add_lora(spec, [w for w in module.EXPERT_WEIGHTS if _expert_targeted(name, w, targets)])
        adapted.append(name)
    return adapted


def _check_rank(rank: int, chosen: list[tuple[str, nn.Module]], targets: list[str]) -> None:
    """A rank above min(in, out) of every matrix adapted is pointless (PEFT takes it): B A of rank
    min(in, out) can already be any update of such a matrix, so the rest only adds parameters and
    memory. It is a typo, or a rank meant for a bigger model."""
    shapes = []  # (name, out, in) of each adapted matrix
    for name, m in chosen:
        if type(m) is nn.Linear:
            shapes.append((name, m.out_features, m.in_features))
        else:  # loom's stacked experts: [E, out, in] each
            shapes += [(f"{name}.{w}", *getattr(m, w).shape[-2:]) for w in m.EXPERT_WEIGHTS
                       if _expert_targeted(name, w, targets)]
    if not shapes:
        return
    name, out, inp = max(shapes, key=lambda s: min(s[1:]))
    most = min(out, inp)
    if rank > most:
        raise ConfigError(f"lora.rank = {rank} is above the rank of every matrix lora.targets adapts (the "
                          f"largest, {name}, is {out} × {inp}: rank {most}); an adapter of rank {most} can "
                          f"already learn any update of it, so a higher one only adds parameters: set "
                          f"lora.rank ≤ {most}, e.g. --set lora.rank={min(16, most)}")


def _adaptable(name: str, module: nn.Module, targets: list[str]) -> bool:
    if type(module) is nn.Linear:
        explicit = [t for t in targets if t != ALL_LINEAR]
        return _matches(name, explicit) or (ALL_LINEAR in targets and not _is_router(name))
    weights = getattr(module, "EXPERT_WEIGHTS", ())  # loom's stacked experts: w1 (gate), w3 (up), w2 (down)
    return any(_expert_targeted(name, w, targets) for w in weights)


def _expert_targeted(name: str, weight: str, targets: list[str]) -> bool:
    return _matches(f"{name}.{weight}", targets)


def _examples(model: nn.Module, owned: set[int], n: int = 4) -> str:
    names = []
    for name, m in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if id(m) in owned and type(m) is nn.Linear and leaf not in names:
            names.append(leaf)
    return ", ".join(names[:n]) or "none"


def freeze_base(model: nn.Module, dtype: torch.dtype, train_embeddings: bool, train_norms: bool) -> None:
    """Every parameter but the adapters (and, if asked, the embedding/head and the norms) frozen and
    stored in `dtype`; what trains stays fp32. Tied weights stay one parameter."""
    heads = {id(getattr(model, n).weight) for n in ("output", "lm_head")
             if isinstance(getattr(model, n, None), nn.Module)}
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in done:
                trains = is_adapter(key) \
                    or (train_norms and "norm" in type(module).__name__.lower()) \
                    or (train_embeddings and (isinstance(module, nn.Embedding) or id(param) in heads))
                keep = torch.float32 if trains else dtype
                done[id(param)] = nn.Parameter(param.detach().to(keep), requires_grad=trains)
            module._parameters[key] = done[id(param)]


def adapter_value(seed: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """An adapter's whole initial value from (seed, name): B zero; A uniform in ±1/√in (PyTorch's
    nn.Linear init, as the LoRA paper and peft use), one generator per expert for stacked experts."""
    name = plain_name(name)
    if name.endswith("lora_B"):
        return torch.zeros(shape)
    if len(shape) == 3:
        return torch.stack([adapter_value(seed, f"{name}.{e}", shape[1:]) for e in range(shape[0])])
    generator = torch.Generator(device="cpu")
    generator.manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    bound = 1 / math.sqrt(shape[-1])
    return torch.empty(shape).uniform_(-bound, bound, generator=generator)


class WithAdapters:
    """A weight source for a model with adapters: the adapters' initial values, the rest from
    `base` (pretrained weights or the model's own initialization)."""

    def __init__(self, base: WeightSource, seed: int):
        self.base, self.seed = base, seed

    def read(self, name: str, shape: tuple[int, ...], offset: tuple[int, ...],
             size: tuple[int, ...]) -> torch.Tensor:
        if is_adapter(name):
            return block(adapter_value(self.seed, name, shape), offset, size)
        return self.base.read(name, shape, offset, size)


def blocks_of(layers: nn.ModuleList | nn.ModuleDict) -> list[nn.Module]:
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """Initialize the adapters of a model built whole (not on the meta device)."""
    for name, param in model.named_parameters():
        if is_adapter(name) and not param.is_meta:
            param.copy_(adapter_value(seed, name, tuple(param.shape)))


def apply_lora(model: nn.Module, blocks: list[nn.Module], lora, base_dtype: torch.dtype,
               seed: int) -> list[str]:
    """The config's LoRA (`lora`: loom.config.LoRAConfig with a rank) on `model`: adapters added,
    the base frozen in `base_dtype`. Returns the adapted modules' names."""
    spec = LoRASpec(lora.rank, lora.alpha, lora.dropout)
    adapted = add_lora(model, blocks, spec, lora.targets)
    freeze_base(model, base_dtype, lora.train_embeddings, lora.train_norms)
    init_adapters(model, seed)
    return adapted
