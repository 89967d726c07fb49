"""What loom needs to know about a model to parallelize it: its repeated blocks, how to
initialize it, and (optionally) its tensor-parallel and pipeline plans.

Data parallelism (DDP, ZeRO, FSDP2) works for any module: the FSDP units, activation
checkpointing and compilation wrap each repeated block (the wrap policy). Tensor and pipeline
parallelism need a plan that knows the module's layer names: loom's GPT has both, Hugging Face
Llama/Mistral/Qwen2-style decoders have a tensor-parallel plan, and any other model gets a
one-line error naming what to provide.
"""

from __future__ import annotations

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


HF_DECODERS = ("llama", "mistral", "qwen2")


class HFDecoderAdapter(ModelAdapter):
    """Hugging Face `*ForCausalLM` decoders with Llama-style layer names (Llama, Mistral, Qwen2)."""

    def layers(self, model: nn.Module) -> nn.ModuleList:
        return model.model.layers

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


def is_hf_decoder(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    return (getattr(config, "model_type", None) in HF_DECODERS and hasattr(model, "lm_head")
            and isinstance(getattr(getattr(model, "model", None), "layers", None), nn.ModuleList))


def adapter_for(model: nn.Module) -> ModelAdapter:
    from loom.models.gpt import GPT

    if isinstance(model, GPT):
        return GPTAdapter()
    if is_hf_decoder(model):
        return HFDecoderAdapter()
    return ModelAdapter()
