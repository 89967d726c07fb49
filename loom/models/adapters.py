"""What loom needs to know about a model to parallelize it: its repeated blocks, how to
initialize it, and (optionally) its tensor-parallel and pipeline plans.

Data parallelism (DDP, ZeRO, FSDP2) works for any module: the FSDP units, activation
checkpointing and compilation wrap each repeated block (the wrap policy). Tensor and pipeline
parallelism need a plan that knows the module's layer names: loom's GPT and Hugging Face
Llama/Mistral/Qwen2-style decoders have both, and any other model gets a one-line error naming
what to provide.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from loom.errors import ConfigError


class ModelAdapter:
    """Any nn.Module: its blocks are the largest nn.ModuleList of same-class modules."""

    #: Built on the meta device and initialized per parameter after sharding (no full copy per rank).
    meta_init = False

    def layers(self, model: nn.Module) -> nn.ModuleList | nn.ModuleDict:
        best: nn.ModuleList | None = None
        for module in model.modules():
            if isinstance(module, nn.ModuleList) and len(module) > 0 \
                    and len({type(m) for m in module}) == 1 and (best is None or len(module) > len(best)):
                best = module
        if best is None:
            raise ConfigError(f"cannot find the repeated blocks of {type(model).__name__} (an nn.ModuleList of "
                              f"identical layers); give loom a ModelAdapter whose layers() returns them")
        return best

    def init_weights(self, model: nn.Module, seed: int) -> None:
        raise NotImplementedError  # only adapters with meta_init

    def apply_tensor_parallel(self, model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
        raise ConfigError(f"no tensor-parallel plan for {type(model).__name__}; set parallel.tp=1, or give a "
                          f"ModelAdapter whose apply_tensor_parallel() parallelizes it")

    def supports_pipeline(self, model: nn.Module) -> bool:
        return False

    def num_layers(self, model: nn.Module) -> int:
        return len(self.layers(model))

    def pipeline_stage(self, model: nn.Module, stage: int, num_stages: int, layer_ids: list[int]) -> nn.Module:
        raise ConfigError(f"no pipeline plan for {type(model).__name__}; set parallel.pp=1 (pipeline stages "
                          f"exist for loom's GPT and Hugging Face Llama/Mistral/Qwen2 decoders)")


class GPTAdapter(ModelAdapter):
    """loom's own decoder: meta init, TP (with sequence parallel) and PP plans."""

    meta_init = True

    def layers(self, model: nn.Module) -> nn.ModuleList | nn.ModuleDict:
        return model.layers

    def init_weights(self, model: nn.Module, seed: int) -> None:
        model.init_weights(seed)

    def apply_tensor_parallel(self, model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
        from loom.parallel.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, tp_mesh, sequence_parallel)

    def supports_pipeline(self, model: nn.Module) -> bool:
        return True

    def num_layers(self, model: nn.Module) -> int:
        return model.cfg.n_layers

    def pipeline_stage(self, model: nn.Module, stage: int, num_stages: int, layer_ids: list[int]) -> nn.Module:
        from loom.parallel.pipeline import build_stage

        return build_stage(model, stage, num_stages, layer_ids)


HF_DECODERS = ("llama", "mistral", "qwen2")


class HFDecoderAdapter(ModelAdapter):
    """Hugging Face `*ForCausalLM` decoders with Llama-style layer names (Llama, Mistral, Qwen2)."""

    def layers(self, model: nn.Module) -> nn.ModuleList | nn.ModuleDict:
        return model.model.layers

    def supports_pipeline(self, model: nn.Module) -> bool:
        return True

    def num_layers(self, model: nn.Module) -> int:
        return model.config.num_hidden_layers

    def pipeline_stage(self, model: nn.Module, stage: int, num_stages: int, layer_ids: list[int]) -> nn.Module:
        if model.config.tie_word_embeddings and num_stages > 1:
            raise ConfigError("pipeline parallelism cannot split tied embeddings; build the model with "
                              "tie_word_embeddings=False")
        return HFDecoderStage(model, layer_ids, first=stage == 0, last=stage == num_stages - 1)

    def apply_tensor_parallel(self, model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
        from loom.parallel.tensor_parallel import apply_hf_decoder_tensor_parallel

        if sequence_parallel:
            raise ConfigError("parallel.sequence_parallel has a plan for loom's GPT only; set it to false for "
                              f"{type(model).__name__}")
        cfg = model.config
        from loom.parallel.tensor_parallel import check_tp_shapes

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


def adapter_for(model: nn.Module) -> ModelAdapter:
    from loom.models.gpt import GPT

    if isinstance(model, GPT):
        return GPTAdapter()
    if is_hf_decoder(model):
        return HFDecoderAdapter()
    return ModelAdapter()
