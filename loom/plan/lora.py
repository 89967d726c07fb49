"""LoRA for the planner: what a LoRA fine-tune holds and trains (loom/models/lora.py builds it), counted
per rank for plan/memory.py, comm.py and step.py to price.

Each adapted linear y = W x (in → out) gains two fp32 trainable parameters, A [r, in] and B [out, r]:
r·(in + out). The targets name roles in every block: q, k, v, o (attention's wq, wk, wv, wo) and gate,
up, down (a SwiGLU's w1, w3, w2) — of the dense SwiGLU, of an MoE block's routed experts (each of the E:
A [E, r, in], B [E, out, r]) and of its shared experts; never the router, the embedding or the head.
Every other parameter is frozen in the base dtype (lora.base_dtype; auto: the compute dtype): no
gradient, no optimizer state. lora.train_embeddings (the embedding and the head) and lora.train_norms
(the norms' gains) train those too, in fp32. So before sharding a rank holds b·Ψ_base + 16·Ψ_lora bytes
of model states (Ψ_lora: what trains; b: the base's bytes per element; 16: fp32 param 4, grad 4, Adam's
m and v 8).

As loom lays the adapters out: TP keeps a column-split linear's A whole on each TP rank and splits its
B (q, k, v, gate, up: r·(in + out/tp)), a row-split linear the other way (o, down: r·(in/tp + out)); an
MoE block's feed-forward is whole on each TP rank, its routed experts' adapters split over ep with the
experts. FSDP2 shards frozen and trainable parameters alike, in the units it groups (fsdp_units).
"""

from __future__ import annotations

import fnmatch
import functools
import re
from dataclasses import dataclass

from loom import strategies
from loom.errors import ConfigError
from loom.plan.shapes import ModelShape, llama_like

ROLES = ("q", "k", "v", "o", "gate", "up", "down")
ATTENTION, SWIGLU = ROLES[:4], ROLES[4:]
ALL_LINEAR = "all-linear"
COLUMN, ROW = "column", "row"  # how TP splits a linear: its output (A whole) or its input (B whole)
BASE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# Each role's leaf name in loom's GPT and in Hugging Face decoders (loom/models/lora.py adapts by them too)
LEAVES = {"q": ("wq", "q_proj"), "k": ("wk", "k_proj"), "v": ("wv", "v_proj"), "o": ("wo", "o_proj"),
          "gate": ("w1", "gate_proj"), "up": ("w3", "up_proj"), "down": ("w2", "down_proj")}


def _names(loom: str, hf: str, roles: tuple[str, ...]) -> dict[str, tuple[str, str]]:
    return {role: (f"{loom}.{LEAVES[role][0]}", f"{hf}.{LEAVES[role][1]}") for role in roles}


# Where a role's linear sits — the block (attention, the dense SwiGLU), an MoE block's routed experts, its
# shared experts — and the module names it has there, which a target pattern is tried on (fnmatch, as
# loom/models/lora.py matches it). {i}: the block's index (and, for Hugging Face's experts, each a module of
# its own, the expert's: a pattern naming one expert is priced as naming them all, or none)
NAMES = {
    "block": {**_names("layers.{i}.attention", "model.layers.{i}.self_attn", ATTENTION),
              **_names("layers.{i}.feed_forward", "model.layers.{i}.mlp", SWIGLU)},
    "experts": _names("layers.{i}.feed_forward.experts", "model.layers.{i}.mlp.experts.{i}", SWIGLU),
    "shared": _names("layers.{i}.feed_forward.shared", "model.layers.{i}.mlp.shared_expert", SWIGLU),
}
PATTERN_BLOCKS = 256  # a pattern naming a block by its index is tried on blocks 0 .. 255


@dataclass(frozen=True)
class LoRA:
    """The LoRA of a plan: the rank, the roles adapted in each place, what else trains, and the frozen
    base's bytes per element."""

    rank: int
    targets: tuple[str, ...] = ROLES  # in every block: attention and the dense SwiGLU
    expert_targets: tuple[str, ...] = SWIGLU  # an MoE block's routed experts
    shared_targets: tuple[str, ...] = SWIGLU  # an MoE block's shared experts
    train_embeddings: bool = False
    train_norms: bool = False
    base_bytes: int = 2
    dropout: float = 0.0

    def describe(self) -> str:
        """'rank 16 on q, k, v, o, gate, up, down' (+ the experts' where they differ, what else trains)."""
        text = f"rank {self.rank} on {', '.join(self.targets) or 'no attention or dense linear'}"
        if self.expert_targets != tuple(r for r in self.targets if r in SWIGLU):
            text += f" (routed experts: {', '.join(self.expert_targets) or 'none'})"
        if self.shared_targets != tuple(r for r in self.targets if r in SWIGLU):
            text += f" (shared experts: {', '.join(self.shared_targets) or 'none'})"
        also = [what for what, on in (("the embeddings", self.train_embeddings),
                                      ("the norms", self.train_norms)) if on]
        return text + (f"; also training {' and '.join(also)}" if also else "")


def from_config(cfg, precision: str | None = None) -> LoRA | None:
    """The LoRA a config trains (None: full fine-tuning). `precision`: the compute dtype the plan prices
    (a GPU plan of an fp32 config prices bf16), which lora.base_dtype = auto stores the base in; by
    default the config's train.precision."""
    lora = cfg.lora
    if lora.rank is None:
        return None
    dtype = (precision or cfg.train.precision) if lora.base_dtype == "auto" else lora.base_dtype
    places = resolve_targets(lora.targets)
    return LoRA(lora.rank, places["block"], places["experts"], places["shared"], lora.train_embeddings,
                lora.train_norms, BASE_BYTES[dtype], lora.dropout)


def resolve_targets(targets: list[str]) -> dict[str, tuple[str, ...]]:
    """The roles lora.targets adapts in each place (block, experts, shared), in ROLES' order: a role by
    name in every place that has it; all-linear every one; a pattern those whose module name it matches
    in some block (a pattern naming certain blocks is priced as if it named every block)."""
    found: dict[str, set[str]] = {place: set() for place in NAMES}
    for target in targets:
        hit = False
        for place, roles in NAMES.items():
            for role in roles:
                named = target in (ALL_LINEAR, role)
                if named or (target not in ROLES and _pattern_names(target, place, role)):
                    found[place].add(role)
                    hit = True
        if not hit:
            raise ConfigError(f"lora.targets entry {target!r} names no linear the planner knows; use q, k, "
                              f"v, o, gate, up, down, all-linear or a module-name pattern such as "
                              f"'*.attention.wq'")
    return {place: tuple(r for r in ROLES if r in roles) for place, roles in found.items()}


def _pattern_names(target: str, place: str, role: str) -> bool:
    """Whether the pattern matches the module name of `role` in `place` in some block."""
    match = re.compile(fnmatch.translate(target)).match
    return any(match(name.format(i=i)) for i in range(PATTERN_BLOCKS) for name in NAMES[place][role])


@dataclass(frozen=True)
class Params:
    """Parameters a rank holds of some part of the model, before any data-parallel sharding: the frozen
    base's (in the base dtype) and the trained ones (adapters, trained embeddings and norms; fp32)."""

    frozen: float = 0.0
    trainable: float = 0.0

    @property
    def total(self) -> float:
        return self.frozen + self.trainable

    def __add__(self, other: Params) -> Params:
        return Params(self.frozen + other.frozen, self.trainable + other.trainable)

    def __mul__(self, count: float) -> Params:
        return Params(self.frozen * count, self.trainable * count)


def adapter(rank: int, inp: int, out: int, split: str, tp: int = 1) -> float:
    """One adapted linear's A [r, in] and B [out, r] on a TP rank (the module docstring's split)."""
    if tp == 1:
        return rank * (inp + out)
    return rank * (inp + out / tp) if split == COLUMN else rank * (inp / tp + out)


def linears(shape: ModelShape, hidden: int | None = None) -> dict[str, tuple[int, int, str]]:
    """(in, out, TP split) of each role's linear: a block's attention and its SwiGLU of width `hidden`
    (the dense ffn_hidden by default; an expert's or the shared experts' width)."""
    h, kv = shape.d_model, shape.kv_dim
    f = shape.ffn_hidden if hidden is None else hidden
    return {"q": (h, h, COLUMN), "k": (h, kv, COLUMN), "v": (h, kv, COLUMN), "o": (h, h, ROW),
            "gate": (h, f, COLUMN), "up": (h, f, COLUMN), "down": (f, h, ROW)}


def block_adapters(shape: ModelShape, lora: LoRA, moe: bool, tp: int = 1, ep: int = 1) -> tuple[float, float]:
    """(a block's adapters but its routed experts', the routed experts' adapters) on a rank: attention's
    and the dense SwiGLU's split over tp; an MoE block's shared and routed experts' whole over tp, the
    routed ones E/ep per rank."""
    r = lora.rank
    shaped = linears(shape)
    rest = sum(adapter(r, *shaped[role], tp) for role in lora.targets if role in ATTENTION or not moe)
    if not moe:
        return rest, 0.0
    if shape.moe_shared_hidden:
        shared = linears(shape, shape.moe_shared_hidden)
        rest += sum(adapter(r, *shared[role]) for role in lora.shared_targets)
    expert = linears(shape, shape.moe_hidden)
    routed = shape.moe_experts / ep * sum(adapter(r, *expert[role]) for role in lora.expert_targets)
    return rest, routed


def tp_synced_grads(shape: ModelShape, lora: LoRA, layers: float, moe_layers: float = 0) -> tuple[int, float]:
    """(all-reduces, bytes) over tp per micro-batch of the adapter factors TP keeps whole on each rank (a
    column-split linear's A, a row-split linear's B): each rank's gradient of one is a partial sum, which
    DTensor all-reduces in backward (fp32). One per adapted linear TP splits, of `layers` blocks: of the
    `moe_layers` among them only the attention's (their feed-forward runs whole on each TP rank)."""
    r, shaped = lora.rank, linears(shape)

    def whole(roles) -> list[int]:
        return [r * (inp if split == COLUMN else out) for inp, out, split in (shaped[role] for role in roles)]

    dense, attention = whole(lora.targets), whole([role for role in lora.targets if role in ATTENTION])
    calls = len(dense) * (layers - moe_layers) + len(attention) * moe_layers
    return round(calls), 4.0 * (sum(dense) * (layers - moe_layers) + sum(attention) * moe_layers)


def counted_shape(shape: ModelShape) -> ModelShape:
    """The shape adapters are counted on: a parameter count's Llama-style stand-in (shapes.llama_like)."""
    return shape if shape.known else llama_like(shape.num_params)


def block_params(shape: ModelShape, lora: LoRA, moe: bool, tp: int = 1, ep: int = 1) -> tuple[Params, Params]:
    """(a block but its routed experts, its routed experts) as a rank holds them: the base (attention and a
    dense SwiGLU split over tp, the norms' gains and an MoE feed-forward whole, the routed experts E/ep)
    frozen but the norms under train_norms; the adapters trainable."""
    d, norms = shape.d_model, shape.layer_norm_params
    rest, routed = block_adapters(shape, lora, moe, tp, ep)
    if moe:
        attention = 2 * d * d + 2 * d * shape.kv_dim
        base = attention / tp + norms + shape.moe_ffn_params() - shape.routed_params_per_block
    else:
        base = (shape.layer_params - norms) / tp + norms
    trained = norms if lora.train_norms else 0
    experts = Params(shape.routed_params_per_block / ep, routed) if moe else Params()
    return Params(base - trained, rest + trained), experts


def end_params(shape: ModelShape, lora: LoRA, embedding: bool, head: bool, tp: int = 1) -> Params:
    """The embedding (`embedding`) and the head with the final norm (`head`; a tied head is the embedding:
    only its norm) as a rank holds them, the vocabulary split over tp."""
    vh = shape.vocab_size * shape.d_model / tp
    matrices = (vh if embedding else 0) + (vh if head and not shape.tie_embeddings else 0)
    norm = shape.d_model if head else 0
    trained = (matrices if lora.train_embeddings else 0) + (norm if lora.train_norms else 0)
    return Params(matrices + norm - trained, trained)


@functools.lru_cache(maxsize=4096)
def stage_params(shape: ModelShape, lora: LoRA, stage: int = 0, pp: int = 1, tp: int = 1,
                 ep: int = 1) -> tuple[Params, Params]:
    """(the stage but its routed experts, the stage's routed experts) as a rank holds them, before
    data-parallel sharding (what ModelShape.stage_params and the TP and EP splits give a rank, the
    adapters added): the local counts memory.lora_state_bytes takes."""
    if not shape.known:  # a parameter count: adapters and trained parts of its Llama-style stand-in
        counted = counted_shape(shape)
        whole, _ = stage_params(counted, lora)
        trained = whole.trainable - adapter_params(counted, lora)
        return Params((shape.num_params - trained) / pp, whole.trainable / pp), Params()
    start, layers = shape.stage_layers(stage, pp)
    moe = shape.moe_layers_in(start, layers)
    dense, _ = block_params(shape, lora, False, tp, ep)
    moe_rest, moe_routed = block_params(shape, lora, True, tp, ep) if moe else (Params(), Params())
    last = stage == pp - 1
    # a tied model's last stage (pp > 1) holds its own copy of the embedding as its head
    ends = end_params(shape, lora, stage == 0 or (last and pp > 1 and shape.tie_embeddings), last, tp)
    return dense * (layers - moe) + moe_rest * moe + ends, moe_routed * moe


def adapter_params(shape: ModelShape, lora: LoRA) -> int:
    """Ψ_lora: every adapter of the model (all routed experts' too); of a parameter count, of its
    Llama-style stand-in."""
    shape = counted_shape(shape)
    dense, _ = block_adapters(shape, lora, False)
    rest, routed = block_adapters(shape, lora, True) if shape.moe else (0, 0)
    moe = shape.moe_layers
    return round((shape.n_layers - moe) * dense + moe * (rest + routed))


def trainable_params(shape: ModelShape, lora: LoRA) -> int:
    """Every parameter that trains: the adapters, and the embeddings and norms lora trains too."""
    rest, routed = stage_params(shape, lora)
    return round(rest.trainable + routed.trainable)


def fsdp_units(shape: ModelShape, lora: LoRA, layers: int, first: bool, last: bool, start: int,
               unit_mb: float, tp: int = 1, ep: int = 1, experts_apart: bool = False) -> list[Params]:
    """Each FSDP2 unit of a stage (Candidate.fsdp_unit_params' grouping, the adapters counted in each
    module's parameters as loom/parallel/fsdp.py counts them) as a rank holds it gathered: its frozen and
    trainable parameters after TP and EP. `experts_apart`: an MoE block's routed experts are a unit of
    their own (expert parallelism, synced apart: plan/comm.py), left out here; else gathered with the
    block, the rank's E/ep of them."""
    return list(_units(shape, lora, layers, first, last, start, unit_mb, tp, ep, experts_apart))


@functools.lru_cache(maxsize=4096)
def _units(shape, lora, layers, first, last, start, unit_mb, tp, ep, experts_apart) -> tuple[Params, ...]:
    tied = shape.tie_embeddings
    whole = {False: sum(block_params(shape, lora, False), Params()).total,
             True: sum(block_params(shape, lora, True), Params()).total if shape.moe else 0.0}
    local = {}
    for moe in (False, True) if shape.moe else (False,):
        rest, routed = block_params(shape, lora, moe, tp, ep)
        local[moe] = rest if experts_apart else rest + routed
    blocks = range(start, start + layers)
    entries, sizes = [local[shape.is_moe(i)] for i in blocks], [whole[shape.is_moe(i)] for i in blocks]
    if first and not tied:
        entries = [end_params(shape, lora, True, False, tp)] + entries
        sizes = [shape.embedding_params] + sizes
    if last and not tied:
        entries, sizes = entries + [end_params(shape, lora, False, True, tp)], sizes + [shape.head_params]
    units = [sum(unit, Params()) for unit in strategies.fsdp_units(entries, sizes, unit_mb)]
    root = end_params(shape, lora, True, True, tp) if tied else None  # the root holds both
    if len(units) == 1:
        return (units[0] + root,) if root else tuple(units)
    return tuple(units + ([root] if root else []))


def flops_per_token(shape: ModelShape, lora: LoRA, seq_len: int) -> tuple[float, float]:
    """(training FLOPs per token, of them the forward's) under LoRA. Forward: 2N + 4·L·H·Q·T (as
    ModelShape.flops_per_token's 6N + 12·L·H·Q·T counts a forward) and 2 per adapter a token passes
    through; backward: the input gradients through every linear (2N) and attention's (8·L·H·Q·T), the
    adapters' input and weight gradients (4 per adapter), a frozen weight's gradient never: 4N + 12·L·H·Q·T
    + 6·A against full fine-tuning's 6N + 12·L·H·Q·T. A trained head adds its weight gradient (2·V·h)."""
    counted = counted_shape(shape)
    full = shape.flops_per_token(seq_len)
    matmul = full / 6 if not shape.known else \
        shape.active_params - (0 if shape.tie_embeddings else shape.embedding_params)
    active = active_adapters(counted, lora)
    head = 2 * counted.vocab_size * counted.d_model if lora.train_embeddings else 0.0
    attention = full - 6 * matmul  # 12·L·H·Q·T
    return full - 2 * matmul + 6 * active + head, 2 * matmul + attention / 3 + 2 * active


def active_adapters(shape: ModelShape, lora: LoRA) -> float:
    """The adapters one token passes through: every block's but, of an MoE block's routed experts, its k."""
    dense, _ = block_adapters(shape, lora, False)
    if not shape.moe:
        return shape.n_layers * dense
    rest, routed = block_adapters(shape, lora, True)
    moe = shape.moe_layers
    return (shape.n_layers - moe) * dense + moe * (rest + routed * shape.moe_top_k / shape.moe_experts)


def adapted_linears(shape: ModelShape, lora: LoRA, moe: bool) -> int:
    """Linears a block adapts (a rank's experts counted once: they run one after the other)."""
    if not moe:
        return len(lora.targets)
    shared = len(lora.shared_targets) if shape.moe_shared_hidden else 0
    return sum(r in ATTENTION for r in lora.targets) + shared + len(lora.expert_targets)


def saved_bytes(shape: ModelShape, lora: LoRA, tokens: int, elem: int, tp: int = 1, moe: bool = False,
                imbalance: float = 1.0) -> float:
    """What a block keeps for backward under LoRA beyond what the frozen block keeps at full fine-tuning
    (shapes.activation_bytes_per_layer; an MoE block's, moe_ffn_saved_bytes), for `tokens` tokens:
      each adapted linear   its r-wide A·x (whole on each TP rank)                      e·r
      with lora.dropout     its dropped input and the mask (a TP rank's share of in)    in·(e + 1)
      an adapted down       its input, the SwiGLU's product, which swiglu_down would
                            recompute (under TP a dense block keeps it already)          e·f
      the norms' outputs    not kept when no adapted linear reads them (frozen linears
                            keep no input): attention's without q, k, v; the dense
                            SwiGLU's without gate, up; an MoE block's without the
                            shared experts' gate, up (the router is frozen)              −e·h each
    An MoE block's experts count their rows (imbalance·k per token; the dispatched rows, −k·h·e, when
    neither their gate nor up is adapted), its shared experts every token."""
    e, r, h = elem, lora.rank, shape.d_model

    def adapted(roles, hidden: int | None, rows: float, split: bool) -> float:
        shaped = linears(shape, hidden)
        kept = 0.0
        for role in roles:
            inp, _, how = shaped[role]
            width = inp / tp if split and how == ROW else inp
            kept += rows * (e * r + (width * (e + 1) if lora.dropout else 0))
        return kept

    attention = [role for role in lora.targets if role in ATTENTION]
    kept = adapted(attention, None, tokens, True) - (0 if set(attention) - {"o"} else tokens * h * e)
    if not moe:
        kept += adapted([role for role in lora.targets if role in SWIGLU], None, tokens, True)
        if "down" in lora.targets and tp == 1:
            kept += tokens * shape.ffn_hidden * e
        if not {"gate", "up"} & set(lora.targets):
            kept -= tokens * h * e
        return kept
    rows = imbalance * tokens * shape.moe_top_k
    kept += adapted(lora.expert_targets, shape.moe_hidden, rows, False)
    kept += rows * shape.moe_hidden * e if "down" in lora.expert_targets else 0.0
    if not {"gate", "up"} & set(lora.expert_targets):  # the dispatched rows: read by no adapter
        kept -= rows * h * e
    shared = shape.moe_shared_hidden and {"gate", "up"} & set(lora.shared_targets)
    if shape.moe_shared_hidden:
        kept += adapted(lora.shared_targets, shape.moe_shared_hidden, tokens, False)
        kept += tokens * shape.moe_shared_hidden * e if "down" in lora.shared_targets else 0.0
    if not shared:  # the ffn norm's output: the frozen router and no shared adapter read it
        kept -= tokens * h * e
    return kept
