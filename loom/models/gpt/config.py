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
    # Mixture of experts (loom/models/gpt/moe.py); 0 routed experts: every block is dense.
    moe_experts: int = 0  # routed experts in each MoE block
    moe_top_k: int = 2  # routed experts per token
    moe_shared_experts: int = 0  # always-on experts: one SwiGLU of moe_shared_experts × moe_ffn_hidden
    moe_every: int = 1  # from moe_dense_first on, every moe_every-th block is an MoE block
    moe_dense_first: int = 0  # the first blocks stay dense (DeepSeek-V3: 3)
    moe_ffn_hidden: int = 0  # each expert's SwiGLU width (0: ffn_hidden)
    moe_score: str = "softmax"  # the router's scores: softmax (Mixtral, Qwen) | sigmoid (DeepSeek-V3)
    moe_norm_topk: bool = False  # the top-k weights renormalized to sum to 1
    moe_route_scale: float = 1.0  # the routed experts' output scaled (DeepSeek-V3's routed_scaling_factor)
    moe_shared_gate: bool = False  # a sigmoid gate on the shared expert's output (Qwen2-MoE)
    # Load balancing (training, not shape: may change under model.init_from)
    moe_aux_loss_coef: float = 0.01  # auxiliary loss E·Σ f_e·P_e per sequence, times this; 0: off
    moe_bias_update_rate: float = 0.0  # aux-loss-free: each step b_e += rate·sign(mean load − load_e)
    # 0: dropless; else each expert takes at most ceil(factor·k·T/E) of a sequence's T tokens
    moe_capacity_factor: float = 0.0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def expert_hidden(self) -> int:
        return self.moe_ffn_hidden or self.ffn_hidden

    def is_moe(self, layer: int) -> bool:
        """Whether block `layer` routes its tokens to experts (else its feed-forward is dense)."""
        return self.moe_experts > 0 and layer >= self.moe_dense_first \
            and (layer - self.moe_dense_first) % self.moe_every == 0

    @property
    def moe_layers(self) -> int:
        return sum(self.is_moe(i) for i in range(self.n_layers))

    def moe_block_params(self, active: bool = False) -> int:
        """An MoE block's feed-forward parameters: router, routed experts (top_k of them when
        `active`), shared experts and their gate."""
        d, h = self.d_model, self.expert_hidden
        routed = (self.moe_top_k if active else self.moe_experts) * 3 * d * h
        shared = 3 * d * h * self.moe_shared_experts + (d if self.moe_shared_gate else 0)
        return d * self.moe_experts + routed + shared

    def num_params(self, active: bool = False) -> int:
        """Exact parameter count from the shapes alone (tied embeddings counted once); `active`:
        the parameters one token passes through (its top_k routed experts, not all of them)."""
        d, hd = self.d_model, self.head_dim
        q_dim, kv_dim = self.n_heads * hd, self.n_kv_heads * hd
        attention = d * q_dim + 2 * d * kv_dim + q_dim * d  # wq, wk, wv, wo
        feed_forward = 3 * d * self.ffn_hidden  # w1, w3, w2
        norms = 2 * d  # attention_norm, ffn_norm
        moe = self.moe_layers
        layers = self.n_layers * (attention + norms) + (self.n_layers - moe) * feed_forward \
            + moe * self.moe_block_params(active)
        embeddings = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return layers + embeddings + d  # + final norm


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
    # Tests of mixtures of experts: the tiny shape with 8 routed experts (top 2) and a shared one.
    "tiny-moe": GPTConfig(moe_experts=8, moe_top_k=2, moe_shared_experts=1, moe_ffn_hidden=32),
    # Shapes for the planner. Mixtral-8x7B (mistralai/Mixtral-8x7B-v0.1 config.json): 8 experts, top 2,
    # weights renormalized. ~46.7B total, ~12.9B active.
    "mixtral-8x7b": GPTConfig(
        vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336,
        max_seq_len=32768, rope_theta=1e6, moe_experts=8, moe_top_k=2, moe_norm_topk=True,
    ),
    # Qwen3-30B-A3B-like (Qwen/Qwen3-30B-A3B config.json: 128 experts of width 768, top 8,
    # renormalized); its attention is wider than d_model (32 heads of 128), here 16 heads of 128.
    # ~30.1B total, ~3.0B active.
    "qwen3-moe-30b": GPTConfig(
        vocab_size=151936, d_model=2048, n_layers=48, n_heads=16, n_kv_heads=4, ffn_hidden=6144,
        max_seq_len=32768, rope_theta=1e6, moe_experts=128, moe_top_k=8, moe_ffn_hidden=768,
        moe_norm_topk=True,
    ),
    # DeepSeek-V3-like (deepseek-ai/DeepSeek-V3 config.json: 3 dense blocks, then 256 routed experts
    # of width 2048, top 8, one shared, sigmoid scores, aux-loss-free balancing); its multi-head
    # latent attention is here grouped-query attention of 56 heads of 128. ~667B total, ~33B active.
    "deepseek-v3": GPTConfig(
        vocab_size=129280, d_model=7168, n_layers=61, n_heads=56, n_kv_heads=8, ffn_hidden=18432,
        max_seq_len=16384, rope_theta=10000.0, moe_experts=256, moe_top_k=8, moe_shared_experts=1,
        moe_dense_first=3, moe_ffn_hidden=2048, moe_score="sigmoid", moe_norm_topk=True,
        moe_route_scale=2.5, moe_aux_loss_coef=0.0001, moe_bias_update_rate=0.001,
    ),
}

MOE_SCORES = ("softmax", "sigmoid")
# The MoE fields that are training choices, not the model's shape: a pretrained model's may change.
MOE_TRAINING_FIELDS = ("moe_aux_loss_coef", "moe_bias_update_rate", "moe_capacity_factor")


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
    _validate_moe(cfg)
    if cfg.head_dim % 2:
        raise ConfigError(
            f"head dim d_model/n_heads = {cfg.head_dim} must be even for RoPE; change d_model or n_heads"
        )


def _validate_moe(cfg: GPTConfig) -> None:
    for field in ("moe_experts", "moe_shared_experts", "moe_dense_first", "moe_ffn_hidden"):
        value = getattr(cfg, field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"model.{field} must be an integer ≥ 0, got {value!r}")
    for field in ("moe_top_k", "moe_every"):
        value = getattr(cfg, field)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"model.{field} must be a positive integer, got {value!r}")
    for field in ("moe_route_scale", "moe_aux_loss_coef", "moe_bias_update_rate", "moe_capacity_factor"):
        value = getattr(cfg, field)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < float("inf") \
                or (field == "moe_route_scale" and value == 0):
            bound = "> 0" if field == "moe_route_scale" else "≥ 0"
            raise ConfigError(f"model.{field} must be a finite number {bound}, got {value!r}")
    for field in ("moe_norm_topk", "moe_shared_gate"):
        if not isinstance(getattr(cfg, field), bool):
            raise ConfigError(f"model.{field} must be true or false, got {getattr(cfg, field)!r}")
    if cfg.moe_score not in MOE_SCORES:
        raise ConfigError(f"model.moe_score = {cfg.moe_score!r} is not one of {', '.join(MOE_SCORES)}")
    if cfg.moe_experts == 0:
        return
    if cfg.moe_top_k > cfg.moe_experts:
        raise ConfigError(f"model.moe_top_k = {cfg.moe_top_k} routes each token to more experts than the "
                          f"{cfg.moe_experts} there are (model.moe_experts); set moe_top_k ≤ "
                          f"{cfg.moe_experts}")
    if cfg.moe_layers == 0:
        raise ConfigError(f"model.moe_dense_first = {cfg.moe_dense_first} leaves no MoE block among the "
                          f"{cfg.n_layers} layers; lower it below {cfg.n_layers} or set model.moe_experts=0")
    if cfg.moe_shared_gate and cfg.moe_shared_experts == 0:
        raise ConfigError("model.moe_shared_gate gates the shared expert, but model.moe_shared_experts = 0; "
                          "set moe_shared_experts ≥ 1 or moe_shared_gate=false")
