"""A model's shape for the planner: parameter counts, FLOPs per token and activation bytes.

Pure Python (no torch). The shape comes from a loom preset, a config's model section, a Hugging
Face `config.json`, or only a parameter count (`--params`: model states alone; activations and
the attention FLOPs are then unknown and taken as zero, which the output says).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import typing
from dataclasses import dataclass
from pathlib import Path

from loom.checked import finite
from loom.config import rank_stages, stage_sizes, stages_per_rank
from loom.errors import ConfigError
from loom.hf_config import HFConfig, read_hf_config
from loom.models.gpt.config import GPTConfig, preset
from loom.plan.terms import NO_TERMS, Terms, gb, num


@dataclass(frozen=True)
class ModelShape:
    name: str
    vocab_size: int = 0
    d_model: int = 0
    n_layers: int = 0
    n_heads: int = 0
    n_kv_heads: int = 0
    ffn_hidden: int = 0
    tie_embeddings: bool = False
    params_only: int = 0  # > 0: only the parameter count is known
    # Mixture of experts (loom/models/gpt/moe.py); moe_experts = 0: every block is dense. An MoE
    # block's feed-forward is a router [E, h], E routed SwiGLU experts of width moe_hidden (each token
    # takes moe_top_k of them) and the shared experts as one always-on SwiGLU of moe_shared_hidden
    # (S·moe_hidden; 0: none), optionally gated by an h-vector. Blocks moe_dense_first,
    # moe_dense_first + moe_every, ... are MoE blocks (GPTConfig.is_moe).
    moe_experts: int = 0
    moe_top_k: int = 0
    moe_hidden: int = 0
    moe_shared_hidden: int = 0
    moe_shared_gate: bool = False
    moe_every: int = 1
    moe_dense_first: int = 0
    # parallel.pp_stage_layers: the blocks of each stage of a pipeline of len(stage_split) stages (a
    # pipeline of any other stage count splits evenly: config.stage_sizes)
    stage_split: tuple[int, ...] = ()

    @functools.cached_property
    def known(self) -> bool:
        return self.params_only == 0

    @functools.cached_property
    def moe(self) -> bool:
        """Whether some blocks route their tokens to experts."""
        return self.moe_experts > 0 and self.known

    def is_moe(self, layer: int) -> bool:
        """Whether block `layer` is an MoE block (GPTConfig.is_moe)."""
        return self.moe and layer >= self.moe_dense_first \
            and (layer - self.moe_dense_first) % self.moe_every == 0

    def moe_layers_in(self, start: int, count: int) -> int:
        """How many of the blocks start .. start + count − 1 are MoE blocks."""
        if not self.moe or count <= 0:
            return 0
        every, first = self.moe_every, self.moe_dense_first
        # the first MoE block at or after `start`
        at = first if start <= first else first + -(-(start - first) // every) * every
        end = start + count
        return 0 if at >= end else (end - 1 - at) // every + 1

    @functools.cached_property
    def moe_layers(self) -> int:
        return self.moe_layers_in(0, self.n_layers)

    @functools.cached_property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @functools.cached_property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @functools.cached_property
    def layer_params(self) -> int:
        """A dense block's parameters (an MoE block's: moe_layer_params)."""
        d = self.d_model
        return 2 * d * d + 2 * d * self.kv_dim + 3 * d * self.ffn_hidden + 2 * d

    @functools.cached_property
    def routed_params_per_block(self) -> int:
        """An MoE block's routed experts: E SwiGLUs of 3·h·h_e (what expert parallelism splits)."""
        return 3 * self.d_model * self.moe_hidden * self.moe_experts

    def moe_ffn_params(self, active: bool = False) -> int:
        """An MoE block's feed-forward: router h·E, routed experts (k of them when `active`), the
        shared SwiGLU and its gate (GPTConfig.moe_block_params)."""
        d, experts = self.d_model, self.moe_top_k if active else self.moe_experts
        shared = 3 * d * self.moe_shared_hidden + (d if self.moe_shared_gate else 0)
        return d * self.moe_experts + 3 * d * self.moe_hidden * experts + shared

    @functools.cached_property
    def moe_layer_params(self) -> int:
        """An MoE block's parameters: attention, the two norms, the MoE feed-forward."""
        d = self.d_model
        return 2 * d * d + 2 * d * self.kv_dim + 2 * d + self.moe_ffn_params()

    def block_params(self, layer: int) -> int:
        return self.moe_layer_params if self.is_moe(layer) else self.layer_params

    @functools.cached_property
    def layer_norm_params(self) -> int:
        """Norm gains: not split by tensor parallelism."""
        return 2 * self.d_model

    @property
    def autocast_cached_params(self) -> int:
        """A block's weights whose 16-bit copy torch.autocast caches (and autograd keeps): every
        matmul's but w2's, which swiglu_down casts itself, in forward and again in backward (tp 1,
        as autocast always is in loom)."""
        return self.layer_params - self.layer_norm_params - self.d_model * self.ffn_hidden

    @functools.cached_property
    def embedding_params(self) -> int:
        return self.vocab_size * self.d_model

    @functools.cached_property
    def head_params(self) -> int:
        """Output head + final norm (the head is the embedding itself when tied)."""
        return (0 if self.tie_embeddings else self.vocab_size * self.d_model) + self.d_model

    def _blocks_params(self, start: int, count: int) -> int:
        """Parameters of the blocks start .. start + count − 1."""
        moe = self.moe_layers_in(start, count)
        return (count - moe) * self.layer_params + moe * self.moe_layer_params if moe \
            else count * self.layer_params

    @functools.cached_property
    def num_params(self) -> int:
        """Every parameter (all the routed experts of an MoE model)."""
        if not self.known:
            return self.params_only
        return self._blocks_params(0, self.n_layers) + self.embedding_params + self.head_params

    @property
    def active_params(self) -> int:
        """The parameters one token passes through: of an MoE block's routed experts only its
        top k (GPTConfig.num_params(active=True)); num_params for a dense model."""
        unused = self.moe_layers * (self.moe_experts - self.moe_top_k) * 3 * self.d_model * self.moe_hidden
        return self.num_params - unused

    def stage_layers(self, stage: int, stages: int) -> tuple[int, int]:
        """(first block, blocks) of a pipeline stage, split as the run splits it (config.stage_sizes)."""
        sizes = self.stage_sizes(stages)
        return sum(sizes[:stage]), sizes[stage]

    def stage_sizes(self, stages: int) -> tuple[int, ...]:
        """The blocks of each of a pipeline's stages: stage_split where it has that many, else even."""
        return stage_sizes(self.n_layers, stages, self.stage_split if len(self.stage_split) == stages else ())

    def stage_blocks(self, stage: int, stages: int) -> int:
        """The blocks of one pipeline stage."""
        return self.stage_sizes(stages)[stage]

    def stage_params(self, stage: int, stages: int) -> int:
        """Parameters of one pipeline stage: its layers (dense or MoE blocks, as the stage holds
        them), plus the embedding on the first and norm + head on the last (tied: the last stage
        holds its own copy of the embedding)."""
        if not self.known or stages == 1:
            return self.num_params // stages
        if self.moe:
            return _moe_stage_params(self, stage, stages)
        return self._stage_params(stage, stages)

    def _stage_params(self, stage: int, stages: int) -> int:
        start, layers = self.stage_layers(stage, stages)
        total = self._blocks_params(start, layers)
        if stage == 0:
            total += self.embedding_params
        if stage == stages - 1:
            total += self.head_params + (self.embedding_params if self.tie_embeddings else 0)
        return total

    def stage_moe_layers(self, stage: int, stages: int) -> int:
        """The MoE blocks of a pipeline stage."""
        if not self.moe:
            return 0
        return _moe_stage_layers(self, stage, stages)

    def stage_routed_params(self, stage: int, stages: int) -> int:
        """The routed experts' parameters of a pipeline stage (0 for a dense model)."""
        return self.stage_moe_layers(stage, stages) * self.routed_params_per_block

    def priced_stages(self, stages: int) -> list[int]:
        """The pipeline stages whose memory and traffic the planner prices: the first (the
        embedding), the last (the head), and the stage holding the most parameters (an MoE model's
        MoE blocks may lie in the middle: DeepSeek-V3's first three are dense; an uneven split gives
        the middle stages the extra blocks)."""
        if self.known and stages > 2:
            return list(_priced_stages(self, stages))
        return sorted({0, stages - 1})

    def tp_replicated_params(self, layers: int, last: bool, moe_layers: int = 0) -> int:
        """Parameters every TP rank holds whole: the norms' gains, and an MoE block's whole
        feed-forward (router, experts, shared: TP splits the dense parts only, each TP rank runs
        the MoE on the whole sequence)."""
        replicated = layers * self.layer_norm_params + (self.d_model if last else 0)
        return replicated + moe_layers * self.moe_ffn_params() if moe_layers else replicated

    def routed_flops_per_token(self) -> float:
        """Training FLOPs of one token through its k routed experts, all MoE blocks: 6·k·3·h·h_e each."""
        return 6.0 * self.moe_layers * self.moe_top_k * 3 * self.d_model * self.moe_hidden

    def moe_ffn_flops_per_token(self) -> float:
        """Training FLOPs of one token through the MoE feed-forwards (router, k routed experts, shared)."""
        return 6.0 * self.moe_layers * self.moe_ffn_params(active=True)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, 6N + 12·L·H·Q·T (PaLM, appendix B); N counts the weights
        that take part in matmuls (the input embedding is a lookup, the head is a matmul), of an
        MoE model the active ones (each token's k routed experts, not all E)."""
        if not self.known:
            return 6.0 * self.params_only
        matmul = self.active_params - (0 if self.tie_embeddings else self.embedding_params)
        return 6.0 * matmul + 12.0 * self.n_layers * self.n_heads * self.head_dim * seq_len


@functools.lru_cache(maxsize=1024)
def stage_flops_per_token(shape: ModelShape, seq_len: int, stages: int) -> tuple[float, ...]:
    """ModelShape.flops_per_token split over a pipeline's stages, as the run splits its blocks: each
    block 6·P (an MoE block's active P: its top k routed experts) + 12·H·Q·T, and the last stage the
    head's 6·(V·h + h), the final norm's with it (the first stage's embedding is a lookup). They sum
    to flops_per_token; a stage holding the head runs more than its share of the blocks."""
    if not shape.known:
        return (shape.flops_per_token(seq_len) / stages,) * stages
    return _stage_flops(_block_flops(shape, seq_len), shape.stage_sizes(stages))


def _block_flops(shape: ModelShape, seq_len: int) -> tuple[list[float], float]:
    """(each block's training FLOPs per token, the head's and the final norm's)."""
    attention = 12.0 * shape.n_heads * shape.head_dim * seq_len
    dense = 6.0 * shape.layer_params + attention
    moe = 6.0 * (shape.moe_layer_params - shape.moe_ffn_params() + shape.moe_ffn_params(active=True)) \
        + attention if shape.moe else 0.0
    blocks = [moe if shape.is_moe(layer) else dense for layer in range(shape.n_layers)]
    return blocks, 6.0 * (shape.vocab_size * shape.d_model + shape.d_model)


def _stage_flops(costs: tuple[list[float], float], sizes: typing.Sequence[int]) -> tuple[float, ...]:
    blocks, head = costs
    bounds = list(itertools.accumulate(sizes, initial=0))
    return tuple(sum(blocks[a:b]) + (head if stage == len(sizes) - 1 else 0.0)
                 for stage, (a, b) in enumerate(itertools.pairwise(bounds)))


@functools.lru_cache(maxsize=1024)
def with_stage_split(shape: ModelShape, split: tuple[int, ...]) -> ModelShape:
    """The shape with its pipeline's stages holding `split`'s blocks, one object per split (remembered:
    the search prices thousands of candidates on it, and each object computes its properties once)."""
    return shape if split == shape.stage_split else dataclasses.replace(shape, stage_split=split)


@functools.lru_cache(maxsize=1024)
def balanced_split(shape: ModelShape, seq_len: int, pp: int, schedule: str, virtual: int) -> tuple[int, ...]:
    """The blocks of each pipeline stage (parallel.pp_stage_layers) that leave the busiest rank the
    fewest FLOPs (stage_flops_per_token's, summed over each rank's stages): from the even split, one
    block at a time off the busiest rank to the stage that most lowers the ranks' loads (compared
    busiest first), while one does. The 1b at pp 4 runs 5, 5, 5, 1 blocks: its head is 3.4 of them.
    () where the even split (config.stage_sizes) is already as good, or for a shape only counted."""
    if pp == 1 or not shape.known:
        return ()
    per = stages_per_rank(schedule, virtual)
    owner = {s: r for r in range(pp) for s in rank_stages(r, pp, per, schedule)}
    costs = _block_flops(shape, seq_len)

    def loads(sizes: list[int]) -> list[float]:
        per_rank = [0.0] * pp
        for stage, flops in enumerate(_stage_flops(costs, sizes)):
            per_rank[owner[stage]] += flops
        return per_rank

    even = list(stage_sizes(shape.n_layers, pp * per))
    sizes, best = even, sorted(loads(even), reverse=True)
    while True:
        per_rank = loads(sizes)
        busiest = max(range(pp), key=lambda r: (per_rank[r], -r))
        moves = []
        for source in (s for s in owner if owner[s] == busiest and sizes[s] > 1):
            for target in (s for s in owner if owner[s] != busiest):
                moved = list(sizes)
                moved[source] -= 1
                moved[target] += 1
                moves.append((sorted(loads(moved), reverse=True), moved))
        if not moves or min(moves)[0] >= best:
            break
        best, sizes = min(moves)
    return tuple(sizes) if best[0] < max(loads(even)) else ()


# A balanced split worth running: its busiest pipeline rank this much lighter than the even split's (a
# few percent is within what a FLOPs count can tell; the 70B's head, a block's worth beside 20, gains 1%)
SPLIT_WORTH = 0.05


@functools.lru_cache(maxsize=1024)
def worthwhile_split(shape: ModelShape, seq_len: int, pp: int, schedule: str,
                     virtual: int) -> tuple[int, ...]:
    """balanced_split where its busiest rank runs at least SPLIT_WORTH fewer FLOPs than the even split's
    (what the search prices and launch suggests); else ()."""
    split = balanced_split(shape, seq_len, pp, schedule, virtual)
    if not split:
        return ()
    even, balanced = (max(rank_flops_per_token(with_stage_split(shape, s), seq_len, pp, schedule, virtual))
                      for s in ((), split))
    return split if balanced <= (1 - SPLIT_WORTH) * even else ()


@functools.lru_cache(maxsize=4096)
def rank_flops_per_token(shape: ModelShape, seq_len: int, pp: int, schedule: str,
                         virtual: int) -> tuple[float, ...]:
    """stage_flops_per_token summed over each pipeline rank's stages (loom.config.rank_stages places
    them), as the shape splits the blocks."""
    per = stages_per_rank(schedule, virtual)
    flops = stage_flops_per_token(shape, seq_len, pp * per)
    return tuple(sum(flops[s] for s in rank_stages(r, pp, per, schedule)) for r in range(pp))


@functools.lru_cache(maxsize=1024)
def _moe_stage_params(shape: ModelShape, stage: int, stages: int) -> int:
    """ModelShape.stage_params of an MoE model, remembered (the search asks for every stage's often)."""
    return shape._stage_params(stage, stages)


@functools.lru_cache(maxsize=1024)
def _moe_stage_layers(shape: ModelShape, stage: int, stages: int) -> int:
    return shape.moe_layers_in(*shape.stage_layers(stage, stages))


@functools.lru_cache(maxsize=256)
def _priced_stages(shape: ModelShape, stages: int) -> tuple[int, ...]:
    heaviest = max(range(stages), key=lambda s: (shape.stage_params(s, stages), -s))
    return tuple(sorted({0, stages - 1, heaviest}))


def attention_kv_width(shape: ModelShape, elem: int, device: str = "cpu", masked: bool = False) -> int:
    """The width of k and of v as attention keeps them for backward, per token
    (loom/parallel/sdpa.py): grouped, n_kv_heads·head_dim, where the device's fused kernel takes
    grouped heads (CPU's; CUDA's flash: 16-bit, head_dim ≤ 256, no mask); otherwise, on CUDA (fp32 or
    `masked`, document masks: the memory-efficient kernel), repeated to every query head. (The cp ring
    keeps them grouped on every device: its pieces repeat them only while they run.)"""
    if device != "cuda" or (elem < 4 and shape.head_dim <= 256 and not masked):
        return shape.kv_dim
    return shape.n_heads * shape.head_dim


def activation_bytes_per_layer(shape: ModelShape, seq: int, micro_batch: int, elem: int,
                               tp: int = 1, sequence_parallel: bool = False, autocast: bool = False,
                               terms: Terms = NO_TERMS, kv_width: int | None = None,
                               mask_keys: int = 0) -> float:
    """Bytes one decoder block keeps for backward, for one micro-batch.

    Korthikanti et al. 2022 (arXiv 2205.05198) Table 2 counts sbh(34 + 5as/h) for a GPT block in
    16-bit. Adapted to this decoder (RMSNorm, RoPE, SwiGLU, GQA) with fused (flash) attention,
    which keeps no s×s matrix, so the 5as/h term becomes the softmax statistics (fp32, per head).
    The block's pieces keep only what their backward needs (loom/models/gpt/lean_ops.py); what
    autograd keeps, tensor by tensor (tests/unit/test_lean_block.py counts it), in bytes per token
    (s·b of them), e = the compute dtype's bytes, kv = n_kv_heads·head_dim:
      each norm (2)  its input, in its own dtype (fp32 under autocast: the residual
                     stream), and its fp32 rstd                                         e·h + 4
                     its output, which the next linears read (all-gathered under
                     sequence parallel); under autocast already 16-bit, one copy        e·h
      attention      q after RoPE, k after RoPE and v (grouped: kv wide, not
                     repeated to every head), and its output, which is also wo's input  e·(2·h + 2·kv)
                     (`kv_width`: k's and v's as kept, where the kernel repeats them:
                     attention_kv_width)
                     under a document mask (`mask_keys` keys a query sees, 0: none),
                     the mask as the kernel's bias, B×1×T×T in e (SDPA converts
                     the boolean mask, and its backward keeps it); not split by TP   e·keys
                     the softmax statistics (log-sum-exp, fp32, per head)               4·a
      MLP (SwiGLU)   gate and up: SwiGLU fused with w2 (swiglu_down) recomputes silu(gate)
                     and their product, w2's input, in backward                          2·e·f
                     under TP (w2 row-parallel, a DTensor through its module) the
                     product is kept too                                                 + e·f
      RoPE           the table only: its backward is the inverse rotation
    In all (tp 1): fp32 24·h + 8·kv + 8·f; 16-bit weights 12·h + 4·kv + 4·f; autocast
    16·h + 4·kv + 4·f (+ 4·a + 8).
    `autocast`: 16-bit through torch.autocast (loom's ddp and zero1 without TP): the residual
    stream, the norms' inputs and the loss stay fp32 and each matmul casts its inputs; the cached
    16-bit weight copies are counted among the buffers. Otherwise (FSDP2's MixedPrecisionPolicy,
    DeepSpeed's 16-bit model) the weights are cast and every activation is 16-bit; FSDP2 also
    casts the block's RoPE table input to 16-bit, a copy per block that RoPE keeps (e·s·head_dim
    bytes per block, not per sequence). Under TP everything between the column- and row-split
    linears is divided by tp; the norms stay whole unless sequence parallel splits them too, and
    then the all-gathered inputs of the column-split linears stay whole.
    """
    s, b, h, f = seq, micro_batch, shape.d_model, shape.ffn_hidden
    autocast = autocast and elem < 4
    kv = shape.kv_dim if kv_width is None else kv_width
    sb = s * b
    split = sb * ((2 * h + 2 * kv + mlp_saved_widths(tp) * f) * elem + 4 * shape.n_heads)
    norms = 2 * sb * (h * (4 if autocast else elem) + 4)
    linear_inputs = 2 * sb * h * elem
    rope = elem * s * shape.head_dim if elem < 4 and not autocast else 0
    sp = sequence_parallel and tp > 1
    mask = sb * mask_keys * elem
    per_layer = split / tp + (norms / tp if sp else norms) + linear_inputs + rope + mask
    if terms:
        e, ne, m, a = elem, 4 if autocast else elem, mlp_saved_widths(tp), shape.n_heads
        repeated = "; k, v repeated to every head: kv = H·Q" if kv != shape.kv_dim else ""
        terms.item("split by TP", f"s·b·((2h + 2kv + {m}f)·e + 4a) (q, k, v, out; gate, up"
                   f"{', product' if m == 3 else ''}; lse{repeated})",
                   f"{sb}·((2·{h} + 2·{kv} + {m}·{f})·{e} + 4·{a})",
                   gb(split))
        terms.item("norms", f"2·s·b·(h·{'4' if autocast else 'e'} + 4) (input + fp32 rstd)",
                   f"2·{sb}·({h}·{ne} + 4)", gb(norms))
        terms.item("linear inputs", "2·s·b·h·e (the two norm outputs)", f"2·{sb}·{h}·{e}", gb(linear_inputs))
        if rope:
            terms.item("RoPE table", "e·s·Q (FSDP2's 16-bit cast, kept)", f"{e}·{s}·{shape.head_dim}",
                       gb(rope))
        if mask:
            terms.item("document mask", "s·b·keys·e (the mask as attention's bias)",
                       f"{sb}·{mask_keys}·{e}", gb(mask))
        over, by = ("/tp", f"/{tp}") if sp else ("", "")
        rope_sym, rope_num = (" + RoPE", f" + {gb(rope)}") if rope else ("", "")
        if mask:
            rope_sym, rope_num = rope_sym + " + mask", rope_num + f" + {gb(mask)}"
        terms.item("per block", f"split/tp + norms{over} + linear inputs{rope_sym}"
                   + (" (sequence parallel)" if sp else ""),
                   f"{gb(split)}/{tp} + {gb(norms)}{by} + {gb(linear_inputs)}{rope_num}", gb(per_layer))
    return per_layer


def plain_ops_bytes_per_layer(shape: ModelShape, seq: int, micro_batch: int, elem: int, tp: int = 1,
                              sequence_parallel: bool = False) -> tuple[float, float]:
    """What a block keeps beyond activation_bytes_per_layer where loom's GPT runs plain autograd ops
    (candidate.plain_ops: a split backward on a torch whose weight pass cannot start at a Function),
    as (its norms', its dense SwiGLU's), for one micro-batch:
      each norm (2)  its fp32 input (or x itself, fp32) and its normalized tensor in x's dtype, where
                     the lean norm keeps x alone                                        4·h a token
      SwiGLU         silu(gate) and the product (w2's input) beside gate and up         2·e·f a token
    Under TP the SwiGLU is torch's module and the lean product Function (no parameter): unchanged.
    (No autocast: a split backward runs every strategy through FSDP2, its weights cast.)"""
    sb, h, f = seq * micro_batch, shape.d_model, shape.ffn_hidden
    norms = 2 * sb * 4 * h / (tp if sequence_parallel and tp > 1 else 1)
    return norms, 0.0 if tp > 1 else 2 * sb * f * elem


GROUP_ROWS = 8  # the grouped GEMM's row alignment per expert (loom/models/gpt/moe.py GROUP_ROWS)


def grouped_experts(shape: ModelShape, precision: str, device: str = "cpu", ep: int = 1,
                    lora_rank: int = 0) -> int:
    """The experts a rank runs through CUDA's grouped GEMM (loom/models/gpt/moe.py grouped_dtype),
    E/ep, or 0 where the per-expert loop runs: off CUDA, outside bf16, or where a width (d, h_e, a
    LoRA rank) leaves bf16 rows not 16-byte aligned."""
    widths = (shape.d_model, shape.moe_hidden) + ((lora_rank,) if lora_rank else ())
    if device != "cuda" or precision != "bf16" or any(w % 8 for w in widths):
        return 0
    return shape.moe_experts // ep


def moe_ffn_saved_bytes(shape: ModelShape, seq: int, micro_batch: int, elem: int, imbalance: float = 1.0,
                        terms: Terms = NO_TERMS, grouped_experts: int = 0, plain: bool = False) -> float:
    """Bytes an MoE block's feed-forward keeps for backward, for one micro-batch of T = s·b tokens
    on a rank (loom/models/gpt/moe.py; not split by TP: each TP rank runs it on the whole gathered
    sequence), e = the compute dtype's bytes, k = top_k, h_e = the experts' width:
      router        its scores (softmax or sigmoid output, fp32)                 T·E·4
      dispatched    the rows the rank's experts take (their first linears' input;
                    under ep the all-to-all's received buffer)                  imb·T·k·h·e
      experts       each expert's SwiGLU as the dense one keeps it (swiglu_down:
                    gate and up; w2's input recomputed)                          imb·2·T·k·h_e·e
      combined      the rows back from the experts, kept by the routing weights'
                    product                                                      T·k·h·e
      shared        the shared experts: a dense SwiGLU of width S·h_e (gate, up)  2·T·S·h_e·e
    `grouped_experts` (CUDA's grouped GEMMs: the rank's experts E_r, from grouped_experts): the rows
    are laid out padded, GROUP_ROWS-aligned per expert, at the static length
    L = imb·T·k + E_r·(GROUP_ROWS − 1) (w2's input recomputed, as swiglu_down does:
    lean_ops.grouped_swiglu_down):
    dispatched and experts become                                                L·(h + 2h_e)·e
    The router's input is the block's ffn_norm output, already among the linear inputs
    (activation_bytes_per_layer). `imbalance` (the busiest expert's tokens over the mean) scales
    what the experts hold: the busiest rank's. `plain` (plain_ops_bytes_per_layer): each SwiGLU,
    the experts' and the shared, keeps silu(gate) and the product too (2·h_e wider per row). Not
    counted: the routing's small int64 indices and fp32 weights (T·k each)."""
    t, k, d, he = seq * micro_batch, shape.moe_top_k, shape.d_model, shape.moe_hidden
    router = 4 * t * shape.moe_experts
    routed = imbalance * t * k * (d + 2 * he) * elem
    rows = imbalance * t * k + grouped_experts * (GROUP_ROWS - 1)
    if grouped_experts:
        routed = rows * (d + 2 * he) * elem
    combined = t * k * d * elem
    shared = 2 * t * shape.moe_shared_hidden * elem
    total = router + routed + combined + shared
    if plain:
        total += 2 * he * elem * (rows if grouped_experts else imbalance * t * k) + shared
    if terms and grouped_experts:
        terms.item("grouped rows L", f"imb·T·k + E_r·{GROUP_ROWS - 1} (padded per expert)",
                   f"{imbalance:g}·{t}·{k} + {grouped_experts}·{GROUP_ROWS - 1}", num(rows))
        terms.item("MoE feed-forward", "T·4E + L·(h + 2h_e)·e + T·k·h·e + 2·T·S·h_e·e (scores; padded rows, "
                   "expert gate and up; combined rows; shared gate and up)",
                   f"{t}·4·{shape.moe_experts} + {num(rows)}·({d} + 2·{he})·{elem} + {t}·{k}·{d}·{elem} + "
                   f"2·{t}·{shape.moe_shared_hidden}·{elem}", gb(total))
    elif terms:
        imb = f"{imbalance:g}·" if imbalance != 1 else ""
        terms.item("MoE feed-forward", f"T·(4E + {imb}k·(h + 2h_e)·e + k·h·e + 2·S·h_e·e) (scores; "
                   "dispatched rows, expert gate and up; combined rows; shared gate and up)",
                   f"{t}·(4·{shape.moe_experts} + {imb}{k}·({d} + 2·{he})·{elem} + {k}·{d}·{elem} + "
                   f"2·{shape.moe_shared_hidden}·{elem})", gb(total))
    return total


def dense_mlp_saved_bytes(shape: ModelShape, seq: int, micro_batch: int, elem: int, tp: int = 1) -> float:
    """The dense SwiGLU's part of activation_bytes_per_layer (gate and up, under TP also their
    product): what an MoE block keeps in its place moe_ffn_saved_bytes."""
    return seq * micro_batch * mlp_saved_widths(tp) * shape.ffn_hidden * elem / tp


def mlp_saved_widths(tp: int) -> int:
    """How many f-wide tensors the MLP keeps per token: gate and up; under TP also their product
    (loom/models/gpt/model.py FeedForward: the fused swiglu_down takes plain tensors only)."""
    return 2 if tp == 1 else 3


def residual_bytes(shape: ModelShape, seq: int, micro_batch: int, elem: int, autocast: bool = False) -> float:
    """One [s, b, h] tensor of the residual stream: a checkpointed block's input, a pipeline
    stage's output. fp32 under autocast (the residual adds take the fp32 embedding output)."""
    return seq * micro_batch * shape.d_model * (4 if autocast else elem)


def head_saved_bytes(shape: ModelShape, seq: int, micro_batch: int, elem: int, tp: int = 1,
                     pipelined: bool = False, sequence_parallel: bool = False,
                     autocast: bool = False, chunk: int = 0, terms: Terms = NO_TERMS,
                     grad_in_forward: bool = False) -> float:
    """What the final norm and the loss keep per micro-batch until its backward: the norm's input
    and fp32 rstd (lean_ops._RMSNorm; plain ops add theirs: memory.py) and the head's input, its
    output (as in a block, one linear reading it); the
    loss's fp32 log-softmax (loss_parallel under TP keeps its fp32 shifted logits instead, split
    over the vocabulary). The logits themselves are not kept (the head's matmul keeps its input,
    cross entropy casts them to fp32). A pipeline schedule also keeps the stage's output, the
    logits, in the compute dtype. Chunked (train.loss_chunk, loom/models/chunked_loss.py, every
    layout; a last pipeline stage outputs the norm's output, the head's input): no logits kept,
    only each token's fp32 logsumexp; `grad_in_forward` (but GPipe and split backwards) keeps the
    head input's fp32 gradient, computed in forward, in place of the input and the logsumexp (the
    weight's gradient made there too is the one head_backward_bytes prices)."""
    sb, h = seq * micro_batch, shape.d_model
    sbv = sb * shape.vocab_size / tp
    kept_by_norm = sb * (h * (4 if autocast and elem < 4 else elem) + 4)  # (measured on gloo, GPipe pp 2)
    sp, autocast = sequence_parallel and tp > 1, autocast and elem < 4
    norm = (kept_by_norm / tp if sp else kept_by_norm) + sb * h * elem
    if chunk and grad_in_forward:  # (a pipeline keeps h as well: the stage's output, to its backward)
        saved = norm + sb * h * (4 - elem) + (sb * h * elem if pipelined else 0)
    else:
        saved = norm + 4 * sb if chunk else norm + sbv * (4 + (elem if pipelined else 0))
    if terms:
        e, ne, v = elem, 4 if autocast else elem, shape.vocab_size
        over, by = ("/tp", f"/{tp}") if sp else ("", "")
        formula = f"s·b·(h·{'4' if autocast else 'e'} + 4){over} + s·b·h·e"
        if chunk and grad_in_forward:  # h's fp32 gradient in place of h
            norm_only = formula.removesuffix(" + s·b·h·e") if not pipelined else formula
            kept = "beside h, the stage's output)" if pipelined else "in place of h)"
            output = f" + {sb}·{h}·{e}" if pipelined else ""
            terms.item("final norm + loss", f"{norm_only} + 4·s·b·h (chunked loss: h's fp32 gradient from "
                       f"forward, kept {kept}", f"{sb}·({h}·{ne} + 4){by}{output} + 4·{sb}·{h}", gb(saved))
        elif chunk:  # no logits kept, each token's logsumexp
            terms.item("final norm + loss", f"{formula} + 4·s·b (chunked loss: fp32 logsumexp)",
                       f"{sb}·({h}·{ne} + 4){by} + {sb}·{h}·{e} + 4·{sb}", gb(saved))
        else:
            logits = f" + sbV/tp·{e} (the logits a pipeline keeps)" if pipelined else ""
            kept = 4 + (e if pipelined else 0)  # bytes per logit: the fp32 log-softmax (+ the logits)
            terms.item("final norm + loss", f"{formula} + 4·s·b·V/tp (fp32 log-softmax){logits}",
                       f"{sb}·({h}·{ne} + 4){by} + {sb}·{h}·{e} + {kept}·{sb}·{v}/{tp}",
                       gb(saved))
    return saved


def chunk_logits_bytes(shape: ModelShape, seq: int, micro_batch: int, elem: int, chunk: int,
                       tp: int = 1) -> float:
    """The chunked loss's one chunk of logits at a time, in forward and in backward: the compute
    dtype's and its fp32 form (the softmax, made in place), min(chunk, s·b) tokens of this rank's
    V/tp vocabulary shard."""
    return min(chunk, seq * micro_batch) * shape.vocab_size / tp * (4 + (elem if elem < 4 else 0))


def head_transient_bytes(shape: ModelShape, seq: int, micro_batch: int, tp: int = 1, chunk: int = 0,
                         elem: int = 4, terms: Terms = NO_TERMS) -> float:
    """At the start of backward the loss's fp32 gradients of the logits exist at once: two (nll's
    and log-softmax's); loss_parallel's backward under TP makes three (the one-hot target, the
    softmax and their difference), each split over the vocabulary. Chunked: one chunk's."""
    sb, v, k = seq * micro_batch, shape.vocab_size, 2 if tp == 1 else 3
    if chunk:
        transient = chunk_logits_bytes(shape, seq, micro_batch, elem, chunk, tp)
        if terms:
            x = 4 + (elem if elem < 4 else 0)
            terms.item("loss gradients", f"min(chunk, s·b)·V/tp·{x} (one chunk's logits and fp32 softmax)",
                       f"{min(chunk, sb)}·{v}/{tp}·{x}", gb(transient))
        return transient
    transient = k * 4 * sb * v / tp
    if terms:
        terms.item("loss gradients", f"{k}·4·s·b·V/tp (the loss's fp32 gradients of the logits)",
                   f"{k}·4·{sb}·{v}/{tp}", gb(transient))
    return transient


def head_backward_bytes(shape: ModelShape, seq: int, micro_batch: int, elem: int, tp: int = 1,
                        autocast: bool = False, chunk: int = 0) -> tuple[float, float]:
    """The head's backward, once the loss's tensors are gone: (the logits' gradient in the compute
    dtype, the head weight's gradient). The weight's gradient is V·h in the compute dtype (FSDP2's
    unsharded gradient of the weight it all-gathered); under autocast also its fp32 copy on the
    way to the fp32 parameter's gradient. Chunked (loom/models/chunked_loss.py), the weight's
    gradient (e·V·h; under autocast its fp32 sum, 4·V·h) and, beside it at the backward's peak, the
    rest: with several chunks a later chunk's fp32 and 16-bit softmax (and under autocast the chunk's
    16-bit product, e·V·h, beside that chunk's 16-bit gradient); with one chunk its gradient lives
    beside the weight's only in the compute dtype (and under autocast the 16-bit gradient is cast
    to fp32 at the end). The first value is that rest, so the two add up to the peak."""
    if chunk:
        e, vh, tokens = elem, shape.vocab_size * shape.d_model / tp, seq * micro_batch
        logits = chunk_logits_bytes(shape, seq, micro_batch, elem, chunk, tp)  # (4 + e)·c·V/tp, e < 4
        grad = min(chunk, tokens) * shape.vocab_size / tp * e  # one chunk's gradient, compute dtype
        cast = autocast and e < 4
        weight = vh * (4 if cast else e)
        if tokens > chunk:  # the gradient summed over the chunks exists beside each later one's
            peak = weight + max(logits, e * vh + grad) if cast else weight + logits
        else:
            peak = max(logits, e * vh + grad, e * vh + 4 * vh) if cast else max(logits, e * vh + grad)
        return peak - weight, weight
    logits = seq * micro_batch * shape.vocab_size / tp * elem
    weight = shape.vocab_size * shape.d_model / tp * (elem + (4 if autocast and elem < 4 else 0))
    return logits, weight


def checkpointed_layers(layers: int, mode: str, every: int) -> int:
    """How many of a stage's blocks are checkpointed: keep only their input (full, selective) or
    their input and their matmuls' and attention's outputs (op)."""
    if mode == "none":
        return 0
    return math.ceil(layers / every) if mode == "selective" else layers


def op_saved_bytes_per_layer(shape: ModelShape, seq: int, micro_batch: int, elem: int, tp: int = 1,
                             sequence_parallel: bool = False, autocast: bool = False,
                             terms: Terms = NO_TERMS) -> float:
    """Bytes one block checkpointed under "op" keeps for backward, for one micro-batch: its input
    (residual_bytes) and what the policy saves (loom/parallel/activation_checkpointing.py), counted
    from the block's code (loom/models/gpt/model.py), in the compute dtype e:
      wq, wk, wv outputs                       e·(h + 2·kv)  (split by TP)
      attention's output, its log-sum-exp     e·h + 4·a     (split by TP)
      w1, w3 outputs (gate, up)                2·e·f         (split by TP)
      wo, w2 outputs                           2·e·h         (TP: each rank's partial sums, whole)
    Under TP the column linears' outputs are split, the row linears' are not (the reduction follows
    them); sequence parallel splits only the input."""
    sb, h, f = seq * micro_batch, shape.d_model, shape.ffn_hidden
    split = sb * (elem * (2 * h + 2 * shape.kv_dim + 2 * f) + 4 * shape.n_heads) / tp
    rows = sb * 2 * h * elem
    block_input = residual_bytes(shape, seq, micro_batch, elem, autocast and elem < 4)
    if terms:
        e, kv, a = elem, shape.kv_dim, shape.n_heads
        terms.item("kept outputs (op)", "s·b·(e·(2h + 2kv + 2f) + 4a)/tp + 2·s·b·h·e (q k v, attention "
                   "+ log-sum-exp, gate up; wo, w2 whole)",
                   f"{sb}·({e}·(2·{h} + 2·{kv} + 2·{f}) + 4·{a})/{tp} + 2·{sb}·{h}·{e}", gb(split + rows))
    return split + rows + block_input / (tp if sequence_parallel and tp > 1 else 1)


def op_shared_bytes_per_layer(shape: ModelShape, seq: int, micro_batch: int, elem: int, tp: int = 1) -> float:
    """The part of op_saved_bytes_per_layer a plain block keeps too (activation_bytes_per_layer):
    v (attention reads wv's output itself), gate, up, attention's output and its log-sum-exp: shared
    when "op" rebuilds a block in backward."""
    sb, h, f = seq * micro_batch, shape.d_model, shape.ffn_hidden
    return sb * (elem * (shape.kv_dim + h + 2 * f) + 4 * shape.n_heads) / tp


def from_preset(name: str, **overrides: object) -> ModelShape:
    return from_gpt_config(preset(name, **overrides), name)


def from_gpt_config(cfg: GPTConfig, name: str) -> ModelShape:
    moe = {}
    if cfg.moe_experts:
        moe = dict(moe_experts=cfg.moe_experts, moe_top_k=cfg.moe_top_k, moe_hidden=cfg.expert_hidden,
                   moe_shared_hidden=cfg.moe_shared_experts * cfg.expert_hidden,
                   moe_shared_gate=cfg.moe_shared_gate, moe_every=cfg.moe_every,
                   moe_dense_first=cfg.moe_dense_first)
    return ModelShape(name=name, vocab_size=cfg.vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers,
                      n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, ffn_hidden=cfg.ffn_hidden,
                      tie_embeddings=cfg.tie_embeddings, **moe)


def from_hf_config(path: str | Path) -> ModelShape:
    """A Llama/Mistral/Qwen2-style decoder from its Hugging Face `config.json` (no weights), read
    through loom's one config.json reader (loom/hf_config.py)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"model config {path} does not exist; pass a Hugging Face config.json")
    hf = read_hf_config(path)
    if hf.hidden_size % hf.num_attention_heads:
        raise ConfigError(f"{path}: hidden_size {hf.hidden_size} is not divisible by num_attention_heads "
                          f"{hf.num_attention_heads}; the planner counts heads of hidden_size / heads")
    return from_hf(hf, hf.model_type or path.stem)


def from_hf(hf: HFConfig, name: str) -> ModelShape:
    """The planner's shape of a checked config.json (Mixtral's, Qwen2/3-MoE's and DeepSeek-V3's experts
    included: hf.moe)."""
    moe = {}
    if hf.moe is not None:
        m = hf.moe
        moe = dict(moe_experts=m.experts, moe_top_k=m.top_k, moe_hidden=m.hidden,
                   moe_shared_hidden=m.shared_hidden, moe_shared_gate=m.shared_gate, moe_every=m.every,
                   moe_dense_first=m.dense_first)
    return ModelShape(name=name, vocab_size=hf.vocab_size, d_model=hf.hidden_size,
                      n_layers=hf.num_hidden_layers, n_heads=hf.num_attention_heads,
                      n_kv_heads=hf.num_key_value_heads, ffn_hidden=hf.intermediate_size,
                      tie_embeddings=hf.tie_word_embeddings, **moe)


MAX_PARAMS = 1e15  # a thousand times the largest models trained: beyond it is a typo


def from_params(count: float) -> ModelShape:
    count = finite(count, "--params", fix="give a parameter count such as 70e9")
    if not 1 <= count <= MAX_PARAMS:
        raise ConfigError(f"--params {count:g} must be a positive parameter count (1 to {MAX_PARAMS:g}) "
                          f"such as 70e9")
    return ModelShape(name=f"{count / 1e9:g}B params", params_only=int(count))


def llama_like(count: int) -> ModelShape:
    """A Llama-style decoder of about `count` parameters — heads of 128 (8 KV heads once there are
    8), SwiGLU's 8/3·d rounded up to 256, a 32,000-token vocabulary, d_model about 128 × the layers
    as Llama's are — for what only a parameter count leaves open: the shape `--emit` writes, and
    the layer the planner counts gathered on the GPU under offload."""
    vocab, head = 32000, 128
    width = 128 * (count / (12 * 128**2)) ** (1 / 3)  # 12·L·d² ≈ count with d = 128·L
    step = 1024 if width >= 1024 else head
    d = max(head, step * round(width / step))
    heads = d // head
    kv = 8 if heads % 8 == 0 else heads
    ffn = 256 * math.ceil(8 * d / 3 / 256)
    one = ModelShape("", vocab, d, 1, heads, kv, ffn)
    layers = max(1, round((count - one.embedding_params - one.head_params) / one.layer_params))
    return ModelShape(f"Llama-style shape of {count / 1e9:.3g}B params", vocab, d, layers, heads, kv, ffn)
