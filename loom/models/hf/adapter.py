"""Hugging Face `*ForCausalLM` decoders with Llama-style layer names (Llama, Mistral, Qwen2) as
loom/parallel sees them: built whole on every rank (same seed), a tensor-parallel plan and
pipeline stages that run the model's own forward, cut to what the stage holds."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from loom.errors import ConfigError
from loom.layout import check_tp_shapes, refuse_tied_embeddings
from loom.models.hf.tensor_parallel import apply_hf_decoder_tensor_parallel
from loom.parallel.adapter import ModelAdapter
from loom.parallel.weights import WeightSource, write_weights

# mixtral runs as loom's GPT (loom/hf_config.py); the MoE ones (loom/models/hf/experts.py) through
# transformers' modules, data parallel only
HF_DECODERS = ("llama", "mistral", "qwen2", "mixtral", "qwen2_moe", "qwen3_moe")


class HFDecoderAdapter(ModelAdapter):
    """Hugging Face `*ForCausalLM` decoders with Llama-style layer names (Llama, Mistral, Qwen2).
    Built whole by a factory (random init, same seed on every rank), or on the meta device to be
    filled from pretrained weights after sharding (`model.init_from`)."""

    def __init__(self, meta_init: bool = False):
        self.meta_init = meta_init

    @torch.no_grad()
    def init_weights(self, model: nn.Module, seed: int, source: WeightSource | None = None) -> None:
        if source is None:
            self.weight_source(model, seed)
        embed, head = model.model.embed_tokens, model.lm_head
        if model.config.tie_word_embeddings and embed is not None and head is not None:
            head.weight = embed.weight  # `to_empty` gave each its own copy
        write_weights(model, source)
        for module in model.modules():  # the rotary tables are buffers computed at build: not on meta
            if hasattr(module, "inv_freq") and hasattr(module, "config"):
                fresh = type(module)(module.config)
                module.inv_freq = fresh.inv_freq.to(module.inv_freq.device)
                module.original_inv_freq = fresh.original_inv_freq.to(module.inv_freq.device)
                module.attention_scaling = fresh.attention_scaling

    def weight_source(self, model: nn.Module, seed: int) -> WeightSource:
        raise ConfigError(f"{type(model).__name__} built on the meta device has no initialization of its own "
                          f"in loom; give its weights with model.init_from, or build it on CPU")

    def layers(self, model: nn.Module) -> nn.ModuleList | nn.ModuleDict:
        return model.model.layers

    def supports_pipeline(self, model: nn.Module) -> bool:
        return True

    def num_layers(self, model: nn.Module) -> int:
        return model.config.num_hidden_layers

    def pipeline_stage(self, model: nn.Module, stage: int, num_stages: int,
                       layer_ids: list[int]) -> nn.Module:
        refuse_tied_embeddings(model.config.tie_word_embeddings, num_stages,
                               "build the model with tie_word_embeddings=False")
        return HFDecoderStage(model, layer_ids, first=stage == 0, last=stage == num_stages - 1)

    def apply_tensor_parallel(self, model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
        if sequence_parallel:
            raise ConfigError("parallel.sequence_parallel has a plan for loom's GPT only; set it to false "
                              f"for {type(model).__name__}")
        cfg = model.config
        check_tp_shapes(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size,
                        cfg.vocab_size, tp_mesh.size())
        apply_hf_decoder_tensor_parallel(model, tp_mesh)


class HFDecoderStage(nn.Module):
    """One pipeline stage of a Hugging Face decoder: the embedding (first stage), some layers, the
    final norm and head (last stage). It keeps the full model's parameter names, and its forward
    is the model's own (causal mask, rotary embeddings, layers), cut to what the stage holds."""

    def __init__(self, full: nn.Module, layer_ids: list[int], first: bool, last: bool):
        super().__init__()
        self.config = full.config
        self.model = nn.Module()
        self.model.embed_tokens = full.model.embed_tokens if first else None
        self.model.layers = nn.ModuleDict({str(i): full.model.layers[i] for i in layer_ids})
        self.model.rotary_emb = copy.deepcopy(full.model.rotary_emb)  # buffers only; one per stage
        self.model.norm = full.model.norm if last else None
        self.lm_head = full.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        h = self.model.embed_tokens(x) if self.model.embed_tokens is not None else x
        position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        mask_fns = {"full_attention": create_causal_mask,
                    "sliding_attention": create_sliding_window_causal_mask}
        masks = {kind: mask_fns[kind](config=self.config, inputs_embeds=h, attention_mask=None, cache=None,
                                      position_ids=position_ids)
                 for kind in {self._attention_kind(int(i)) for i in self.model.layers}}
        rotary = self.model.rotary_emb(h, position_ids=position_ids)
        for i, layer in self.model.layers.items():
            h = layer(h, attention_mask=masks[self._attention_kind(int(i))], position_embeddings=rotary,
                      position_ids=position_ids)
        if self.lm_head is None:
            return h
        return self.lm_head(self.model.norm(h))

    def _attention_kind(self, layer_id: int) -> str:
        """The mask the full model gives layer `layer_id`: per layer (Qwen2's `layer_types`), or a
        sliding window on every layer when the config has one (Mistral), else causal (Llama)."""
        layer_types = getattr(self.config, "layer_types", None)
        if layer_types is not None:
            return layer_types[layer_id]
        sliding = getattr(self.config, "sliding_window", None) is not None
        return "sliding_attention" if sliding else "full_attention"


def is_hf_decoder(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    layers = getattr(getattr(model, "model", None), "layers", None)
    return (getattr(config, "model_type", None) in HF_DECODERS and hasattr(model, "lm_head")
            and isinstance(layers, (nn.ModuleList, nn.ModuleDict)))
