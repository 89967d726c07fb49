"""Megatron-style tensor parallelism for loom's GPT through DTensor `parallelize_module` plans.

Per block: q/k/v and the MLP gate/up projections split by columns (output features), the
attention output and MLP down projections by rows (input features), so each block needs one
all-reduce in forward for attention and one for the MLP. The embedding is split over the
vocabulary and the head over its output (vocab) dim: logits stay sharded and the loss is
computed vocab-parallel, so full logits never exist on one rank.

With sequence parallelism the norms and residual stream are sharded along the sequence, turning
each all-reduce into a reduce-scatter + all-gather pair and dividing those activations by tp.
"""

from __future__ import annotations

import contextlib

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from loom.errors import ConfigError


def check_tp_shapes(n_heads: int, n_kv_heads: int, ffn_hidden: int, vocab_size: int, tp: int) -> None:
    """Every split dimension must divide by tp; one line naming the one that does not."""
    for name, value in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads), ("ffn_hidden", ffn_hidden),
                        ("vocab_size", vocab_size)):
        if value % tp:
            divisors = [k for k in range(1, value + 1) if value % k == 0 and k <= 64]
            raise ConfigError(f"parallel.tp = {tp} does not divide model.{name} = {value}; "
                              f"use tp in {divisors[-6:]} or change the model")


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Parallelize loom's GPT in place over `tp_mesh`."""
    seq = Shard(1) if sequence_parallel else Replicate()  # layout of the residual stream
    root_plan: dict[str, object] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        # Logits sharded over the vocabulary, left as DTensor for the vocab-parallel loss.
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
        "norm": SequenceParallel(),
    }
    if not sequence_parallel:
        del root_plan["norm"]
    # A pipeline stage may lack the embedding or the head.
    root_plan = {name: style for name, style in root_plan.items() if getattr(model, name, None) is not None}
    if root_plan:
        parallelize_module(model, tp_mesh, root_plan)
    for block in model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers:
        plan: dict[str, object] = {
            # Gather the sequence (SP) once per sub-layer; rope (2nd input) is a plain replicated buffer.
            # The input stays a DTensor into the column-split linears, so their partial input
            # gradients add up first and backward reduces once per sub-layer (not once per linear).
            "attention": PrepareModuleInput(input_layouts=(seq, None), desired_input_layouts=(Replicate(), None),
                                            use_local_output=False),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                                               use_local_output=False),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        }
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, tp_mesh, plan)


def loss_context(tp: int):
    """Cross entropy over vocab-sharded logits (forward and backward must both run inside)."""
    return loss_parallel() if tp > 1 else contextlib.nullcontext()


def apply_hf_decoder_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """The same Megatron split for a Hugging Face Llama/Mistral/Qwen2 `*ForCausalLM` (names differ)."""
    root_plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    # A pipeline stage may lack the embedding or the head.
    present = {"model.embed_tokens": model.model.embed_tokens is not None, "lm_head": model.lm_head is not None}
    root_plan = {name: style for name, style in root_plan.items() if present[name]}
    if root_plan:
        parallelize_module(model, tp_mesh, root_plan)
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
