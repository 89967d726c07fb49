"""Tensor parallelism for Hugging Face Llama/Mistral/Qwen2 decoders: the same Megatron split as
loom's GPT (loom/models/gpt/tensor_parallel.py) under the Hugging Face module names."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    PrepareModuleInput,
    parallelize_module,
)

from loom.parallel.tensor_parallel import ColwiseParallel, RowwiseParallel, parallelize_root


def apply_hf_decoder_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """The same Megatron split for a Hugging Face Llama/Mistral/Qwen2 `*ForCausalLM` (names differ)."""
    root_plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    # A pipeline stage may lack the embedding or the head.
    present = {"model.embed_tokens": model.model.embed_tokens is not None,
               "lm_head": model.lm_head is not None}
    root_plan = {name: style for name, style in root_plan.items() if present[name]}
    parallelize_root(model, tp_mesh, root_plan, model.model.embed_tokens, model.lm_head)
    layers = model.model.layers
    for layer in layers.values() if isinstance(layers, nn.ModuleDict) else layers:
        parallelize_module(layer, tp_mesh, {
            # As for loom's GPT: the input reaches the column-split linears as a DTensor, so
            # backward reduces their summed input gradients once per sub-layer.
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Replicate()},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                            use_local_output=False),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                                      use_local_output=False),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        })
