"""Llama-style decoder: RMSNorm, RoPE, SwiGLU MLP, grouped-query attention, optional tied embeddings.

The model is built on any device (usually "meta"), parallelized, materialized, and only then
initialized with `GPT.init_weights(seed)`, which gives the same weights for the same seed whatever
the parameter layout (plain tensors or sharded DTensors on any mesh).

A pipeline stage is the same class with parts removed (see loom/models/gpt/pipeline.py): `layers`
becomes an nn.ModuleDict keyed by the original layer index, and `tok_embeddings` (not the first
stage) or `norm` and `output` (not the last stage) become None. Parameter names stay those of
the full model, so a stage initializes to the same values and its checkpoints map 1:1.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from loom.errors import ConfigError
from loom.models.chunked_loss import Head
from loom.models.gpt.config import GPTConfig, validate
from loom.models.gpt.lean_ops import apply_rope, rms_norm, swiglu, swiglu_down
from loom.models.gpt.moe import EXPERT_WEIGHTS, MoE
from loom.parallel.context_parallel import Sequence, SequenceSplit, attention
from loom.parallel.mesh import local_view
from loom.parallel.sdpa import attend
from loom.parallel.weights import WeightSource, block, plain_name, write_weights


def rope_tables(head_dim: int, max_seq_len: int, theta: float,
                device: torch.device | str | None = None) -> torch.Tensor:
    """cos and sin of the RoPE angles, stacked: shape [2, max_seq_len, head_dim // 2], fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    return torch.stack([angles.cos(), angles.sin()])


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Keeps x and the fp32 rstd for backward; under autocast the output is already 16-bit.
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.n_rep = cfg.n_heads // cfg.n_kv_heads  # query heads per kv head
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, seq: Sequence | None = None) -> torch.Tensor:
        bsz, tokens, _ = x.shape
        # -1 heads: under tensor parallel each rank holds only its share of the heads.
        q = self.wq(x).view(bsz, tokens, -1, self.head_dim)
        k = self.wk(x).view(bsz, tokens, -1, self.head_dim)
        v = self.wv(x).view(bsz, tokens, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        # under TP, q/k/v are DTensors sharded over heads: each rank attends its own heads
        local = [local_view(t) for t in (q, k, v)]
        if seq is None or (seq.cp is None and seq.docs is None):
            # Grouped k, v go in as they are where the device's flash kernel takes them (sdpa.py).
            out = _like(attend(*local, is_causal=True), q)
        else:  # the sequence split over cp ranks, or packed documents (loom/parallel/context_parallel.py)
            out = _like(attention(*local, seq), q)
        return self.wo(out.transpose(1, 2).reshape(bsz, tokens, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)  # gate
        self.w3 = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)  # down


    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x), self.w3(x)
        if _hooked(self.w2) or isinstance(self.w2.weight, DTensor) or type(self.w2) is not nn.Linear:
            # Tensor parallel's row-parallel w2 lays out its input and output in its hooks, and an
            # adapted w2 (LoRA) adds its update: through the module, keeping the product (planned
            # so: loom/plan/shapes.py).
            return self.w2(swiglu(gate, up))
        return swiglu_down(gate, up, self.w2.weight)


def _like(out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The attention output in q's layout (a DTensor sharded over heads under TP)."""
    if isinstance(q, DTensor):
        return DTensor.from_local(out, q.device_mesh, q.placements, run_check=False)
    return out


def _hooked(module: nn.Module) -> bool:
    """Whether calling `module` does more than its forward (hooks that a direct use of its weight skips)."""
    return bool(module._forward_pre_hooks or module._forward_hooks)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int = 0) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        # A mixture of experts where the config says (loom/models/gpt/moe.py), else a dense SwiGLU
        self.feed_forward = MoE(cfg) if cfg.is_moe(layer) else FeedForward(cfg)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, seq: Sequence | None = None) -> torch.Tensor:
        # seq by keyword: the TP plan's input hook lays out the positional inputs only
        h = x + self.attention(self.attention_norm(x), rope, seq=seq)
        return h + self.feed_forward(self.ffn_norm(h))


class GPT(nn.Module):
    # A last pipeline stage under the chunked loss: forward returns the final norm's output and the
    # schedule's loss calls the head with the targets (loom/train/step.py), so no logits leave it.
    head_in_loss: bool = False
    # Context parallelism and packed documents (loom/parallel/context_parallel.py): how the input
    # sequences are split over ranks and documents; None: each sequence whole, one document.
    sequence_split: SequenceSplit | None = None
    # Tensor parallelism's sequence parallel (loom/models/gpt/tensor_parallel.py): the residual stream
    # between blocks, and so a later pipeline stage's input, is each rank's 1/tp of the sequence.
    residual_shards: int = 1

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        validate(cfg)
        self.cfg = cfg
        # Pipeline stages set the parts they don't hold to None and `layers` to a ModuleDict.
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers: nn.ModuleList | nn.ModuleDict = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm: RMSNorm | None = RMSNorm(cfg.d_model, cfg.norm_eps)
        # Head: an nn.Linear that, given targets, returns the loss (chunked: no full logits)
        self.output: nn.Linear | None = Head(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Non-persistent: derived from the config, so never saved; init_weights recomputes it
        # after `to_empty` has left it uninitialized.
        self.register_buffer("rope", self._rope_tables(None), persistent=False)

    def _rope_tables(self, device: torch.device | None) -> torch.Tensor:
        return rope_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta, device)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None, loss_chunk: int = 0,
                masked: bool = False) -> torch.Tensor:
        """tokens [B, T] (int64) -> logits [B, T, vocab]; with targets [B, T] the mean cross
        entropy instead, `loss_chunk` tokens at a time (0: from the full logits; see Head).

        A pipeline stage without the embedding takes hidden states [B, T, d_model] instead of
        tokens; one without the norm and head returns hidden states.
        """
        split = self.sequence_split
        first = self.tok_embeddings is not None
        # A later pipeline stage's hidden states are already this rank's share of each sequence.
        shards = (split.cp.size if split and split.cp else 1) * self.residual_shards
        seq_len = tokens.shape[1] * (shards if not first else 1)
        if seq_len > self.cfg.max_seq_len:
            raise ConfigError(
                f"sequence length {seq_len} exceeds model.max_seq_len {self.cfg.max_seq_len}; "
                "shorten the sequences or raise max_seq_len"
            )
        seq = None
        if split is None:
            rope = self.rope[:, :seq_len]
        else:
            seq = split.sequence(seq_len, tokens if first else None, tokens.device)
            rope = self.rope[:, split.rope_positions(seq)]
            if first:
                tokens = split.shard(tokens)
            if targets is not None:
                targets = split.shard(targets)
        h = tokens if self.tok_embeddings is None else self.tok_embeddings(tokens)
        for layer in self.blocks():
            h = layer(h, rope) if seq is None else layer(h, rope, seq)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None and not self.head_in_loss:
            # The loss inside the head's call (FSDP2 gathers it there); targets by keyword: the TP
            # plan's input hook passes on the first positional argument alone.
            if targets is not None:
                return self.output(h, targets=targets, loss_chunk=loss_chunk, masked=masked)
            h = self.output(h)
        return h

    def blocks(self) -> list[nn.Module]:
        """The decoder blocks this module holds, in order (all of them, or one pipeline stage's)."""
        if isinstance(self.layers, nn.ModuleDict):
            return list(self.layers.values())  # insertion order = layer order
        return list(self.layers)

    @torch.no_grad()
    def init_weights(self, seed: int, source: WeightSource | None = None) -> None:
        """Every parameter from `source` (pretrained weights), or from (seed, its name) alone: each
        rank writes only the block it holds, so any sharding gives the same values."""
        if self.cfg.tie_embeddings and self.output is not None and self.tok_embeddings is not None:
            self.output.weight = self.tok_embeddings.weight  # `to_empty` gives each module its own copy
        write_weights(self, source if source is not None else RandomInit(self, seed))
        self.rope = self._rope_tables(self.rope.device)
        for name, buffer in self.named_buffers():
            if name.endswith("expert_bias"):  # aux-loss-free balancing starts unbiased
                buffer.zero_()

    def initial_value(self, seed: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The whole initial value of parameter `name`, from (seed, name) alone: norms' gains 1,
        every matrix N(0, 0.02), residual-branch outputs scaled down so the residual stream's
        variance stays O(1)."""
        name = plain_name(name)
        if is_expert_weight(name):
            return torch.stack([self.expert_value(seed, name, e, shape[1:]) for e in range(shape[0])])
        full = torch.empty(shape, dtype=torch.float32)
        if name.endswith("norm.weight"):
            return full.fill_(1.0)
        return full.normal_(0.0, self._std(name), generator=_generator(seed, name))

    def expert_value(self, seed: int, name: str, expert: int, shape: tuple[int, ...]) -> torch.Tensor:
        """Expert `expert`'s initial matrix of the stacked weight `name`, from (seed, name, expert)
        alone: a rank holding some experts makes only theirs."""
        full = torch.empty(shape, dtype=torch.float32)
        return full.normal_(0.0, self._std(name), generator=_generator(seed, f"{name}.{expert}"))

    def _std(self, name: str) -> float:
        return 0.02 / math.sqrt(2 * self.cfg.n_layers) if name.endswith(("wo.weight", "w2.weight", "w2")) \
            else 0.02


def build_model(cfg: GPTConfig, device: torch.device | str = "meta") -> GPT:
    """Construct the model with its tensors on `device` (meta by default: no memory, no init)."""
    with torch.device(device):
        return GPT(cfg)


def _generator(seed: int, name: str) -> torch.Generator:
    # zlib.crc32 is stable across processes, unlike Python's salted hash(). The CPU generator
    # (mt19937) keeps only 32 bits of its seed, so seed and name are hashed together into 32 bits.
    generator = torch.Generator(device="cpu")
    generator.manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    return generator


class RandomInit:
    """The initial weights as a source: each parameter's whole value from (seed, name), cut to the
    block a rank asks for."""

    def __init__(self, model: GPT, seed: int):
        self.model, self.seed = model, seed

    def read(self, name: str, shape: tuple[int, ...], offset: tuple[int, ...],
             size: tuple[int, ...]) -> torch.Tensor:
        if is_expert_weight(name):  # only the experts asked for (each rank's under expert parallelism)
            experts = [self.model.expert_value(self.seed, name, e, shape[1:])
                       for e in range(offset[0], offset[0] + size[0])]
            return block(torch.stack(experts), (0, *offset[1:]), size) if experts \
                else torch.empty(size)
        return block(self.model.initial_value(self.seed, name, shape), offset, size)


def is_expert_weight(name: str) -> bool:
    """Whether `name` is an MoE block's stacked expert weight ([E, ...], one matrix per expert)."""
    return name.rsplit(".", 2)[-2:-1] == ["experts"] and name.rsplit(".", 1)[-1] in EXPERT_WEIGHTS
