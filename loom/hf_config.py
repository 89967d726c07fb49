"""A Hugging Face decoder's `config.json` as typed, range-checked values, and where a model
folder's files may link to. Torch-free: `loom plan --model config.json` reads it too.

Every place loom reads a config.json reads it here (model.init_from in loom/models/pretrained.py,
the model a run trains in loom/train/task.py, the planner's loom/plan/shapes.py), so a string
where a number belongs, a NaN epsilon, `"false"` as a boolean or 20000 layers is one line naming
the file and the field, before anything is sized from it. Sizes have upper bounds well above any
released model, so that nothing is allocated from an absurd one.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from loom.checked import Fields, read_json
from loom.errors import ConfigError
from loom.models.gpt.config import GPTConfig

MAX_BYTES = 1 << 20  # a config.json is a few KB
MAX_VOCAB = 1 << 22
MAX_WIDTH = 1 << 17  # hidden_size, head_dim
MAX_FFN = 1 << 20
MAX_LAYERS = 1024
MAX_POSITIONS = 1 << 22  # loom's GPT keeps a RoPE table of this many rows
MAX_EXPERTS = 1 << 16  # routed experts of a block (loom/config.py's bound on model.moe_experts)
MOE_SCORES = ("softmax", "sigmoid")  # DeepSeek-V3's scoring_func (loom/models/gpt/config.py MOE_SCORES)
DTYPES = ("float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2")
LAYER_TYPES = ("full_attention", "sliding_attention")
# rope_scaling / rope_parameters fields (transformers' rope_config_validation): finite and > 0.
_ROPE_POSITIVE = ("rope_theta", "factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
                  "attention_factor")
_FIX = "it is damaged or not a decoder's config.json"
_BOOL = "write true or false (JSON booleans, without quotes)"


@dataclass(frozen=True)
class HFMoE:
    """A mixture-of-experts decoder's experts, as config.json gives them (Mixtral, Qwen2-MoE, Qwen3-MoE,
    DeepSeek-V3): what the planner's shape and loom's GPT fields need."""

    experts: int  # routed experts of an MoE block
    top_k: int  # routed experts per token
    hidden: int  # each routed expert's SwiGLU width
    shared_hidden: int  # the always-on shared experts' SwiGLU width, all of them (0: none)
    shared_gate: bool  # a sigmoid gate on the shared experts' output (Qwen2-MoE)
    every: int  # from dense_first on, every `every`-th block is an MoE block (GPTConfig.is_moe)
    dense_first: int
    score: str  # softmax | sigmoid
    norm_topk: bool  # the top-k weights renormalized to sum 1
    route_scale: float  # the routed output's scale (DeepSeek-V3's routed_scaling_factor)


@dataclass(frozen=True)
class HFConfig:
    """The fields of a Llama/Mistral/Qwen2-style config.json that loom uses, checked; `raw` is the
    whole file (what transformers builds the model from, and what a checkpoint records)."""

    source: str
    raw: dict
    model_type: str
    architectures: tuple[str, ...]
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    head_dim: int
    max_position_embeddings: int | None
    rms_norm_eps: float
    rope_theta: float
    rope_type: str
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    attention_dropout: float
    sliding_window: int | None
    hidden_act: str
    dtype: str | None
    moe: HFMoE | None = None  # a mixture of experts' (None: every block dense)

    def gpt_moe_fields(self) -> dict:
        """loom's GPTConfig MoE fields of this model's experts ({} for a dense model); the shared
        experts become moe_shared_experts of the routed experts' width, so their width must be a
        multiple of it."""
        m = self.moe
        if m is None:
            return {}
        if m.shared_hidden % m.hidden:
            raise ConfigError(f"{self.source}: the shared experts' width {m.shared_hidden} is not a multiple "
                              f"of the routed experts' {m.hidden}, which loom's GPT (moe_shared_experts × "
                              f"moe_ffn_hidden) cannot express")
        return {"moe_experts": m.experts, "moe_top_k": m.top_k, "moe_ffn_hidden": m.hidden,
                "moe_shared_experts": m.shared_hidden // m.hidden, "moe_shared_gate": m.shared_gate,
                "moe_every": m.every, "moe_dense_first": m.dense_first, "moe_score": m.score,
                "moe_norm_topk": m.norm_topk, "moe_route_scale": m.route_scale}

    def gpt(self) -> tuple[GPTConfig | None, str]:
        """loom's GPT when it expresses this model exactly, else (None, why not)."""
        d, heads = self.hidden_size, self.num_attention_heads
        moe = self._mixtral() if self.model_type == "mixtral" else {}
        reasons = {
            "architecture": self.model_type not in ("llama", "mistral", "mixtral"),
            "router jitter": moe.get("jitter", 0) > 0,
            "biases": self.attention_bias or self.mlp_bias,
            f"rope_type {self.rope_type}": self.rope_type != "default",
            "a sliding window": self.sliding_window is not None,
            f"activation {self.hidden_act}": self.hidden_act != "silu",
            "its head_dim": d % heads != 0 or self.head_dim != d // heads,
            "attention dropout": self.attention_dropout > 0,  # loom's GPT has none
        }
        why = [reason for reason, present in reasons.items() if present]
        if why:
            return None, ", ".join(why)
        return GPTConfig(vocab_size=self.vocab_size, d_model=d, n_layers=self.num_hidden_layers,
                         n_heads=heads, n_kv_heads=self.num_key_value_heads,
                         ffn_hidden=self.intermediate_size, max_seq_len=self.max_position_embeddings or 2048,
                         rope_theta=self.rope_theta,
                         norm_eps=self.rms_norm_eps, tie_embeddings=self.tie_word_embeddings,
                         **moe.get("gpt", {})), ""

    def _mixtral(self) -> dict:
        """Mixtral's experts as loom's GPT fields (every block MoE, softmax top-k renormalized, experts
        as wide as intermediate_size), and its router jitter (loom's GPT has none)."""
        doc = Fields(self.raw, self.source)
        experts = doc.int("num_local_experts", min=1, max=MAX_WIDTH, fix=_FIX)
        top_k = doc.int("num_experts_per_tok", min=1, max=experts, fix=_FIX)
        gpt = {"moe_experts": experts, "moe_top_k": top_k, "moe_norm_topk": True}
        if doc.raw.get("router_aux_loss_coef") is not None:
            gpt["moe_aux_loss_coef"] = doc.float("router_aux_loss_coef", min=0, max=1e6, fix=_FIX)
        jitter = doc.float("router_jitter_noise", default=0.0, min=0, max=1, fix=_FIX) \
            if doc.raw.get("router_jitter_noise") is not None else 0.0
        return {"gpt": gpt, "jitter": jitter}


def read_hf_config(path: Path, source: str | Path | None = None) -> HFConfig:
    """`path` (a config.json) read and checked; any fault is one line naming the file and field."""
    return hf_config_from(read_json(Path(path), source, max_bytes=MAX_BYTES), source or path)


def hf_config_from(raw: object, source: str | Path) -> HFConfig:
    """A config.json's parsed content (or one a checkpoint recorded), checked."""
    doc = Fields(raw, source)

    def given(key: str) -> bool:  # config.json writes null for an unset optional field
        return doc.raw.get(key) is not None

    def need(key: str, most: int) -> int:
        return doc.int(key, min=1, max=most, fix=_FIX)

    def size(key: str, most: int, default: int | None = None) -> int | None:
        return need(key, most) if given(key) else default

    vocab = need("vocab_size", MAX_VOCAB)
    hidden = need("hidden_size", MAX_WIDTH)
    layers = need("num_hidden_layers", MAX_LAYERS)
    heads = need("num_attention_heads", hidden)
    kv = size("num_key_value_heads", heads, heads)
    if heads % kv:
        raise doc.error("num_key_value_heads", f"a divisor of num_attention_heads ({heads})", kv, _FIX)
    head_dim = size("head_dim", MAX_WIDTH, hidden // heads)
    if head_dim % 2 and given("head_dim"):
        raise doc.error("head_dim", "even (RoPE rotates pairs)", head_dim, _FIX)
    if head_dim % 2:
        raise doc.error("hidden_size", f"a multiple of 2 × num_attention_heads = {2 * heads} (RoPE rotates "
                                       f"pairs within each head)", hidden, _FIX)
    if given("layer_types"):  # Qwen2: each layer's attention
        kinds = doc.list("layer_types", of=str, max_len=MAX_LAYERS)
        if len(kinds) != layers or any(k not in LAYER_TYPES for k in kinds):
            raise doc.error("layer_types", f"a list of {layers} of {', '.join(LAYER_TYPES)}", kinds, _FIX)
    if given("pad_token_id"):  # the embedding's padding row
        doc.int("pad_token_id", min=0, max=vocab - 1, fix=_FIX)
    if given("use_sliding_window"):
        doc.bool("use_sliding_window", fix=_BOOL)
    if given("max_window_layers"):
        doc.int("max_window_layers", min=0, max=MAX_LAYERS, fix=_FIX)
    dtype = None
    for key in ("torch_dtype", "dtype"):  # transformers 5 writes dtype, older releases torch_dtype
        if given(key):
            dtype = doc.str(key, choices=DTYPES)
    rope_theta, rope_type = _rope(doc)
    model_type = doc.str("model_type", default="")
    return HFConfig(
        source=str(source), raw=doc.raw, model_type=model_type,
        architectures=tuple(doc.list("architectures", of=str, max_len=64)) if given("architectures") else (),
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, intermediate_size=need("intermediate_size", MAX_FFN),
        head_dim=head_dim, max_position_embeddings=size("max_position_embeddings", MAX_POSITIONS),
        rms_norm_eps=doc.float("rms_norm_eps", min=0, min_open=True, max=1, fix=_FIX) if given("rms_norm_eps")
        else 1e-6,
        rope_theta=rope_theta, rope_type=rope_type,
        tie_word_embeddings=doc.bool("tie_word_embeddings", default=False, fix=_BOOL),
        attention_bias=doc.bool("attention_bias", default=False, fix=_BOOL),
        mlp_bias=doc.bool("mlp_bias", default=False, fix=_BOOL),
        attention_dropout=doc.float("attention_dropout", default=0.0, min=0, max=1, fix=_FIX),
        sliding_window=_sliding_window(doc),
        hidden_act=doc.str("hidden_act", default="silu", nonempty=True), dtype=dtype,
        moe=_moe(doc, model_type, layers, need("intermediate_size", MAX_FFN)))


def _moe(doc: Fields, model_type: str, layers: int, intermediate: int) -> HFMoE | None:
    """The experts of a Mixtral, Qwen2-MoE, Qwen3-MoE or DeepSeek-V3 config.json, each field typed and
    bounded (absent optional ones take transformers' defaults for that model), else None."""

    def count(key: str, default: int | None = None, least: int = 1, most: int = MAX_EXPERTS) -> int:
        if doc.raw.get(key) is None and default is not None:
            return default
        return doc.int(key, min=least, max=most, fix=_FIX)

    def flag(key: str, default: bool) -> bool:
        return doc.bool(key, default=default, fix=_BOOL) if doc.raw.get(key) is not None else default

    if model_type == "mixtral":  # every block MoE, experts intermediate_size wide, softmax top-k renormalized
        experts = count("num_local_experts")
        return HFMoE(experts, count("num_experts_per_tok", most=experts), intermediate, 0, False, 1, 0,
                     "softmax", True, 1.0)
    if model_type in ("qwen2_moe", "qwen3_moe"):  # block i sparse when (i + 1) % decoder_sparse_step == 0
        qwen2 = model_type == "qwen2_moe"
        experts = count("num_experts", 60 if qwen2 else 128)
        top_k = count("num_experts_per_tok", 4 if qwen2 else 8, most=experts)
        hidden = count("moe_intermediate_size", 1408 if qwen2 else 768, most=MAX_FFN)
        shared = count("shared_expert_intermediate_size", 5632, least=0, most=MAX_FFN) if qwen2 else 0
        step = count("decoder_sparse_step", 1, most=layers)
        if doc.raw.get("mlp_only_layers") is not None:
            dense = doc.list("mlp_only_layers", of=int, max_len=MAX_LAYERS)
            if dense:
                raise doc.error("mlp_only_layers", "empty (loom plans and runs every decoder_sparse_step-th "
                                "block as sparse, none kept dense by index)", dense, "remove its entries")
        return HFMoE(experts, top_k, hidden, shared, qwen2 and shared > 0, step, step - 1, "softmax",
                     flag("norm_topk_prob", False), 1.0)
    if model_type == "deepseek_v3":  # block i sparse when i ≥ first_k_dense_replace, i % moe_layer_freq = 0
        experts = count("n_routed_experts", 256)
        top_k = count("num_experts_per_tok", 8, most=experts)
        hidden = count("moe_intermediate_size", 2048, most=MAX_FFN)
        shared = count("n_shared_experts", 1, least=0)
        first = count("first_k_dense_replace", 3, least=0, most=layers - 1)
        every = count("moe_layer_freq", 1, most=layers)
        score = doc.str("scoring_func", choices=MOE_SCORES) if doc.raw.get("scoring_func") is not None \
            else "sigmoid"
        scale = doc.float("routed_scaling_factor", min=0, min_open=True, max=1e6, fix=_FIX) \
            if doc.raw.get("routed_scaling_factor") is not None else 2.5
        return HFMoE(experts, top_k, hidden, shared * hidden, False, every, -(-first // every) * every,
                     score, flag("norm_topk_prob", True), scale)
    return None


def _sliding_window(doc: Fields) -> int | None:
    """The attention window in effect: none where use_sliding_window is false (Qwen2-MoE writes 0 there)."""
    if doc.raw.get("sliding_window") is None:
        return None
    if doc.raw.get("use_sliding_window") is False:
        doc.int("sliding_window", min=0, max=MAX_POSITIONS, fix=_FIX)
        return None
    return doc.int("sliding_window", min=1, max=MAX_POSITIONS, fix=_FIX)


def _rope(doc: Fields) -> tuple[float, str]:
    """(theta, rope type) from rope_parameters (transformers 5) or rope_scaling + rope_theta (before),
    every field of either typed."""
    theta = doc.float("rope_theta", min=0, min_open=True, fix=_FIX) if doc.raw.get("rope_theta") is not None \
        else 10000.0
    rope_type = "default"
    for key in ("rope_scaling", "rope_parameters"):  # the latter wins, as in transformers 5
        if doc.raw.get(key) is None:
            continue
        rope = doc.section(key)
        for field in _ROPE_POSITIVE:
            if field in rope:
                value = rope.float(field, min=0, min_open=True, fix=_FIX)
                theta = value if field == "rope_theta" else theta
        for field in ("mscale", "mscale_all_dim"):
            if field in rope:
                rope.float(field, min=0, fix=_FIX)
        for field in ("short_factor", "long_factor"):  # longrope's per-frequency factors
            if field in rope:
                factors = rope.list(field, of=(int, float), max_len=MAX_WIDTH)
                if not all(_positive(x) for x in factors):
                    raise rope.error(field, "a list of finite numbers > 0", factors, _FIX)
        if "original_max_position_embeddings" in rope:
            rope.int("original_max_position_embeddings", min=1, max=MAX_POSITIONS, fix=_FIX)
        if "truncate" in rope:
            rope.bool("truncate", fix=_BOOL)
        if "partial_rotary_factor" in rope:
            rope.float("partial_rotary_factor", min=0, min_open=True, max=1, fix=_FIX)
        for name in ("type", "rope_type"):  # rope_type wins over the older type
            if name in rope:
                rope_type = rope.str(name, nonempty=True)
    return theta, rope_type


def folder_root(folder: Path) -> Path:
    """How far a model folder's files may link: a Hugging Face cache snapshot
    (`models--org--name/snapshots/<rev>/`) holds links into its repository's `blobs/`, so its
    repository folder; any other folder, itself."""
    real = Path(os.path.realpath(folder))
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        return real.parent.parent
    return real


def _positive(x: int | float) -> bool:
    try:
        return math.isfinite(x) and x > 0
    except OverflowError:  # an integer too large for a float
        return False
