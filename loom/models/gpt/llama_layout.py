"""loom's GPT under Hugging Face Llama names: the parameter names, and the q/k projection rows,
which differ because loom rotates interleaved RoPE pairs (2i, 2i+1) and Llama rotates halves
(i, i + head_dim/2). `loom export --layout hf` writes this layout and `model.init_from` of a Llama
folder reads it. A mixture of experts is Mixtral's layout: the router `block_sparse_moe.gate` and
each expert's matrices apart (`block_sparse_moe.experts.J.w1`), where loom stacks them on dim 0.
"""

from __future__ import annotations

import dataclasses

import torch

from loom.errors import LoomError
from loom.models.gpt.config import GPTConfig

# loom name -> Hugging Face Llama name, per decoder layer.
HF_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
# loom name -> Mixtral's, per MoE layer; {expert} is each expert's index (loom stacks them on dim 0).
HF_MOE_LAYER = {
    "feed_forward.router.weight": "block_sparse_moe.gate.weight",
    "feed_forward.experts.w1": "block_sparse_moe.experts.{expert}.w1.weight",
    "feed_forward.experts.w3": "block_sparse_moe.experts.{expert}.w3.weight",
    "feed_forward.experts.w2": "block_sparse_moe.experts.{expert}.w2.weight",
}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}


def hf_name(name: str, tied: bool = False) -> str:
    """The Hugging Face name of loom's parameter `name` (a tied head reads the embedding)."""
    if name == "output.weight" and tied:
        return _TOP["tok_embeddings.weight"]
    if name in _TOP:
        return _TOP[name]
    _, layer, rest = name.split(".", 2)
    return f"model.layers.{layer}.{HF_LAYER.get(rest) or HF_MOE_LAYER[rest]}"


def is_stacked(name: str) -> bool:
    """Whether loom's `name` stacks one Hugging Face tensor per expert ({expert} in its HF name)."""
    return "{expert}" in hf_name(name)


def rope_heads(name: str, gpt: GPTConfig) -> int:
    """How many heads' rows a projection holds whose rows are reordered (q, k), else 0."""
    if name.endswith("attention.wq.weight"):
        return gpt.n_heads
    if name.endswith("attention.wk.weight"):
        return gpt.n_kv_heads
    return 0


def to_halves(w: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """Reorder each head's output rows from loom's interleaved pairs to Llama's halves: the row for
    rotation pair i's first element goes to i, the second to i + head_dim/2 (Meta's Llama →
    Hugging Face permutation)."""
    return (w.reshape(n_heads, head_dim // 2, 2, w.shape[1]).transpose(1, 2)
            .reshape(n_heads * head_dim, w.shape[1]))


def halves_row(row: int, head_dim: int) -> int:
    """The Llama row that holds loom's q/k row `row` (the inverse direction of to_halves)."""
    head, j = divmod(row, head_dim)
    return head * head_dim + (j % 2) * (head_dim // 2) + j // 2


def hf_state_dict(tensors: dict[str, torch.Tensor], gpt: GPTConfig) -> dict[str, torch.Tensor]:
    """loom's GPT weights under Hugging Face `LlamaForCausalLM` names (lm_head omitted when tied)."""
    out = {}
    for name, t in tensors.items():
        if name == "output.weight" and gpt.tie_embeddings:
            continue
        if name.endswith("expert_bias"):
            if t.any():  # routing depends on it, and Mixtral's layout has no place for it
                raise LoomError(f"{name} is not zero (aux-loss-free balancing trained it); Mixtral's layout "
                                f"has no routing bias: export with --layout loom")
            continue
        if is_stacked(name):
            out.update({hf_name(name).format(expert=j): t[j] for j in range(t.shape[0])})
            continue
        heads = rope_heads(name, gpt)
        out[hf_name(name)] = to_halves(t, heads, gpt.head_dim) if heads else t
    return out


def mixtral_refusal(gpt: GPTConfig) -> str:
    """Why Mixtral's layout cannot hold this mixture of experts ("" when it can, or the model is dense)."""
    if not gpt.moe_experts:
        return ""
    differs = {"shared experts": gpt.moe_shared_experts > 0, "dense blocks": gpt.moe_layers != gpt.n_layers,
               f"{gpt.moe_score} scores": gpt.moe_score != "softmax",
               "top-k weights not renormalized": not gpt.moe_norm_topk,
               "a routed scale": gpt.moe_route_scale != 1,
               "experts wider or narrower than ffn_hidden": gpt.expert_hidden != gpt.ffn_hidden}
    return ", ".join(what for what, present in differs.items() if present)


def hf_config(gpt: GPTConfig, dtype: torch.dtype = torch.float32) -> dict:
    """A `LlamaConfig` (config.json) for the same model, a `MixtralConfig` for a mixture of experts:
    loom.hf_config reads it back as this GPT."""
    if gpt.moe_experts:
        if why := mixtral_refusal(gpt):
            raise LoomError(f"this mixture of experts has {why}, which Mixtral's layout cannot hold; export "
                            f"with --layout loom")
        llama = hf_config(dataclasses.replace(gpt, moe_experts=0), dtype)
        return {**llama, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "num_local_experts": gpt.moe_experts, "num_experts_per_tok": gpt.moe_top_k,
                "router_aux_loss_coef": gpt.moe_aux_loss_coef, "router_jitter_noise": 0.0,
                "sliding_window": None, "output_router_logits": False}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": gpt.vocab_size,
        "hidden_size": gpt.d_model,
        "intermediate_size": gpt.ffn_hidden,
        "num_hidden_layers": gpt.n_layers,
        "num_attention_heads": gpt.n_heads,
        "num_key_value_heads": gpt.n_kv_heads,
        "head_dim": gpt.head_dim,
        "max_position_embeddings": gpt.max_seq_len,
        "rope_theta": float(gpt.rope_theta),
        "rope_scaling": None,
        "rms_norm_eps": float(gpt.norm_eps),
        "tie_word_embeddings": gpt.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
