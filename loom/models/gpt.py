"""Llama-style decoder: RMSNorm, RoPE, SwiGLU MLP, grouped-query attention, optional tied embeddings.

The model is built on any device (usually "meta"), parallelized, materialized, and only then
initialized with `GPT.init_weights(seed)`, which gives the same weights for the same seed whatever
the parameter layout (plain tensors or sharded DTensors on any mesh).

A pipeline stage is the same class with parts removed (see loom/parallel/pipeline.py): `layers`
becomes an nn.ModuleDict keyed by the original layer index, and `tok_embeddings` (not the first
stage) or `norm` and `output` (not the last stage) become None. Parameter names stay those of
the full model, so a stage initializes to the same values and its checkpoints map 1:1.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from loom.errors import ConfigError

# Wrappers that insert a segment into parameter names (torch.compile, activation checkpointing).
# They are stripped so that wrapping a layer never changes its initial weights.
_WRAPPER_SEGMENTS = ("_orig_mod.", "_checkpoint_wrapped_module.")


@dataclass
class GPTConfig:
    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 128  # SwiGLU hidden width
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def num_params(self) -> int:
        """Exact parameter count from the shapes alone (tied embeddings counted once)."""
        d, hd = self.d_model, self.head_dim
        q_dim, kv_dim = self.n_heads * hd, self.n_kv_heads * hd
        attention = d * q_dim + 2 * d * kv_dim + q_dim * d  # wq, wk, wv, wo
        feed_forward = 3 * d * self.ffn_hidden  # w1, w3, w2
        norms = 2 * d  # attention_norm, ffn_norm
        per_layer = attention + feed_forward + norms
        embeddings = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.n_layers * per_layer + embeddings + d  # + final norm


PRESETS: dict[str, GPTConfig] = {
    # Unit tests and smoke runs: well under 1M parameters.
    "tiny": GPTConfig(),
    # CPU demos: ~3.3M parameters, byte-level vocabulary.
    "small": GPTConfig(
        vocab_size=256, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4,
        ffn_hidden=768, max_seq_len=256,
    ),
    # GPT-3 Small shape (Brown et al. 2020, Table 2.1: d 768, 12 layers, 12 heads, tied embeddings)
    # with the GPT-2 vocabulary padded to 50304; SwiGLU width 2048 (≈ 8/3·d), MHA. ~124M.
    "125m": GPTConfig(
        vocab_size=50304, d_model=768, n_layers=12, n_heads=12, n_kv_heads=12,
        ffn_hidden=2048, max_seq_len=2048, tie_embeddings=True,
    ),
    # Llama-3.2-1B (meta-llama/Llama-3.2-1B config.json); context capped at 8192 (no RoPE scaling). ~1.24B.
    "1b": GPTConfig(
        vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8,
        ffn_hidden=8192, max_seq_len=8192, rope_theta=500000.0, tie_embeddings=True,
    ),
    # Llama-3-8B (meta-llama/Meta-Llama-3-8B config.json). ~8.03B.
    "8b": GPTConfig(
        vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
        ffn_hidden=14336, max_seq_len=8192, rope_theta=500000.0,
    ),
    # Llama-3-70B (meta-llama/Meta-Llama-3-70B config.json). ~70.6B.
    "70b": GPTConfig(
        vocab_size=128256, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8,
        ffn_hidden=28672, max_seq_len=8192, rope_theta=500000.0,
    ),
}


def preset(name: str, **overrides: object) -> GPTConfig:
    """A copy of a named preset with some fields replaced, validated."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; choose one of: {', '.join(PRESETS)}")
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ConfigError(
            f"unknown model field(s) {', '.join(unknown)}; valid fields are: {', '.join(sorted(fields))}"
        )
    cfg = dataclasses.replace(PRESETS[name], **overrides)
    validate(cfg)
    return cfg


def validate(cfg: GPTConfig) -> None:
    """Raise ConfigError on the first inconsistent or out-of-range field."""
    for field in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len"):
        value = getattr(cfg, field)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"model.{field} must be a positive integer, got {value!r}")
    for field in ("rope_theta", "norm_eps"):
        value = getattr(cfg, field)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"model.{field} must be a positive number, got {value!r}")
    if not isinstance(cfg.tie_embeddings, bool):
        raise ConfigError(f"model.tie_embeddings must be true or false, got {cfg.tie_embeddings!r}")
    if cfg.d_model % cfg.n_heads:
        raise ConfigError(
            f"model.d_model ({cfg.d_model}) must be divisible by model.n_heads ({cfg.n_heads}); change one of them"
        )
    if cfg.n_kv_heads > cfg.n_heads or cfg.n_heads % cfg.n_kv_heads:
        raise ConfigError(
            f"model.n_heads ({cfg.n_heads}) must be a multiple of model.n_kv_heads ({cfg.n_kv_heads}); "
            "pick n_kv_heads dividing n_heads"
        )
    if cfg.head_dim % 2:
        raise ConfigError(
            f"head dim d_model/n_heads = {cfg.head_dim} must be even for RoPE; change d_model or n_heads"
        )


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    """cos and sin of the RoPE angles, stacked: shape [2, max_seq_len, head_dim // 2], fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    return torch.stack([angles.cos(), angles.sin()])


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate (even, odd) pairs of x [B, T, H, D] by the angles in rope [2, T, D//2]."""
    # fp32 for the rotation (angles of far positions lose precision in bf16), then back.
    xf = x.float().unflatten(-1, (-1, 2))
    x_even, x_odd = xf[..., 0], xf[..., 1]
    cos = rope[0].float()[None, :, None, :]
    sin = rope[1].float()[None, :, None, :]
    rotated = torch.stack([x_even * cos - x_odd * sin, x_even * sin + x_odd * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 for stability under bf16 compute.
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.n_rep = cfg.n_heads // cfg.n_kv_heads  # query heads per kv head
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # -1 heads: under tensor parallel each rank holds only its share of the heads.
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        if self.n_rep > 1:
            k = k.repeat_interleave(self.n_rep, dim=1)
            v = v.repeat_interleave(self.n_rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)  # gate
        self.w3 = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        validate(cfg)
        self.cfg = cfg
        # Pipeline stages set the parts they don't hold to None and `layers` to a ModuleDict.
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers: nn.ModuleList | nn.ModuleDict = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm: RMSNorm | None = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Non-persistent: derived from the config, so never saved; init_weights recomputes it
        # after `to_empty` has left it uninitialized.
        self.register_buffer("rope", self._rope_tables(None), persistent=False)

    def _rope_tables(self, device: torch.device | None) -> torch.Tensor:
        return rope_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta, device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] (int64) -> logits [B, T, vocab].

        A pipeline stage without the embedding takes hidden states [B, T, d_model] instead of
        tokens; one without the norm and head returns hidden states.
        """
        seq = tokens.shape[1]
        if seq > self.cfg.max_seq_len:
            raise ConfigError(
                f"sequence length {seq} exceeds model.max_seq_len {self.cfg.max_seq_len}; "
                "shorten the sequences or raise max_seq_len"
            )
        rope = self.rope[:, :seq]
        h = tokens if self.tok_embeddings is None else self.tok_embeddings(tokens)
        for layer in self.blocks():
            h = layer(h, rope)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h

    def blocks(self) -> list[nn.Module]:
        """The decoder blocks this module holds, in order (all of them, or one pipeline stage's)."""
        if isinstance(self.layers, nn.ModuleDict):
            return list(self.layers.values())  # insertion order = layer order
        return list(self.layers)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialize every parameter from (seed, its name) alone, so any sharding gives the same values."""
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        dtensor_cls = _dtensor_class()
        for raw_name, param in self.named_parameters():  # dedups tied weights: initialized once
            name = _plain_name(raw_name)
            full = torch.empty(param.shape, dtype=torch.float32)
            if name.endswith("norm.weight"):
                full.fill_(1.0)
            else:
                # Residual-branch outputs are scaled down so the residual stream's variance stays O(1).
                std = residual_std if name.endswith(("wo.weight", "w2.weight")) else 0.02
                full.normal_(0.0, std, generator=_generator(seed, name))
            if dtensor_cls is not None and isinstance(param, dtensor_cls):
                from torch.distributed.tensor import distribute_tensor

                # src_data_rank=None: every rank slices its own piece of the identical full tensor.
                local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
                param.to_local().copy_(local)
            else:
                param.copy_(full)
        self.rope = self._rope_tables(self.rope.device)


def build_model(cfg: GPTConfig, device: torch.device | str = "meta") -> GPT:
    """Construct the model with its tensors on `device` (meta by default: no memory, no init)."""
    with torch.device(device):
        return GPT(cfg)


def _plain_name(name: str) -> str:
    for segment in _WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


def _generator(seed: int, name: str) -> torch.Generator:
    # zlib.crc32 is stable across processes, unlike Python's salted hash(). The CPU generator
    # (mt19937) keeps only 32 bits of its seed, so seed and name are hashed together into 32 bits.
    generator = torch.Generator(device="cpu")
    generator.manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    return generator


def _dtensor_class() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor
