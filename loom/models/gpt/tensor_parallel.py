"""Megatron-style tensor parallelism for loom's GPT through DTensor `parallelize_module` plans.

Per block: q/k/v and the MLP gate/up projections split by columns (output features), the
attention output and MLP down projections by rows (input features), so each block needs one
all-reduce in forward for attention and one for the MLP. The embedding is split over the
vocabulary and the head over its output (vocab) dim: logits stay sharded and the loss is
computed vocab-parallel (loom.parallel.tensor_parallel.loss_context), so full logits never exist
on one rank.

With sequence parallelism the norms and residual stream are sharded along the sequence, turning
each all-reduce into a reduce-scatter + all-gather pair and dividing those activations by tp.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    PrepareModuleInput,
    PrepareModuleInputOutput,
    SequenceParallel,
    parallelize_module,
)

from loom.models.gpt.moe import MoE
from loom.parallel.tensor_parallel import ColwiseParallel, RowwiseParallel, parallelize_root


class VocabParallelHead(ColwiseParallel):
    """The head split over the vocabulary; a loss it computed itself (Head given targets: the chunked
    loss's plain scalar, the same on every TP rank, or loss_parallel's replicated one) leaves as it
    is, logits as ColwiseParallel lays them out."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if not isinstance(outputs, DTensor) or outputs.dim() == 0:
            return outputs
        return ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Parallelize loom's GPT in place over `tp_mesh`."""
    seq = Shard(1) if sequence_parallel else Replicate()  # layout of the residual stream
    model.residual_shards = tp_mesh.size() if sequence_parallel else 1  # a later stage's input: its share
    root_plan: dict[str, object] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        # Logits sharded over the vocabulary, left as DTensor for the vocab-parallel loss (or, given
        # targets, the chunked loss the head computed on its shard: loom/models/chunked_loss.py).
        "output": VocabParallelHead(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
        "norm": SequenceParallel(),
    }
    if not sequence_parallel:
        del root_plan["norm"]
    # A pipeline stage may lack the embedding or the head.
    root_plan = {name: style for name, style in root_plan.items() if getattr(model, name, None) is not None}
    parallelize_root(model, tp_mesh, root_plan, getattr(model, "tok_embeddings", None),
                     getattr(model, "output", None))
    for block in model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers:
        plan: dict[str, object] = {
            # Gather the sequence (SP) once per sub-layer; rope (2nd input) is a plain replicated buffer.
            # The input stays a DTensor into the column-split linears, so their partial input
            # gradients add up first and backward reduces once per sub-layer (not once per linear).
            "attention": PrepareModuleInput(input_layouts=(seq, None),
                                            desired_input_layouts=(Replicate(), None),
                                            use_local_output=False),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
        }
        if isinstance(block.feed_forward, MoE):
            # The experts are not split by TP: each TP rank routes the whole (gathered) sequence
            # alike, so their gradients agree across the TP ranks without a reduction.
            plan["feed_forward"] = PrepareModuleInputOutput(
                input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_input=True,
                output_layouts=(Replicate(),), desired_output_layouts=(seq,), use_local_output=True)
        else:
            plan.update({
                "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                                                   use_local_output=False),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=seq),
            })
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, tp_mesh, plan)
