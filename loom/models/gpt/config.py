"""loom's GPT shapes: the config dataclass and the named presets, without importing torch.

The planner (`loom plan`) reads these shapes and must start fast, so nothing here needs torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from loom.errors import ConfigError


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
            f"model.d_model ({cfg.d_model}) must be divisible by model.n_heads ({cfg.n_heads}); "
            f"change one of them"
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
