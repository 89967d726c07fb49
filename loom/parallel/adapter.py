"""What loom/parallel needs to know about a model, as a protocol every model answers: its repeated
blocks, how to initialize it, and (optionally) its tensor-parallel plan and pipeline stages.

Data parallelism (DDP, ZeRO, FSDP2) works for any module through this base class: the FSDP units,
activation checkpointing and compilation wrap each repeated block (the wrap policy). Tensor and
pipeline parallelism need a plan that knows the module's layer names; the models that have them
subclass this beside their code (loom/models/gpt/adapter.py, loom/models/hf/adapter.py), and
loom.models.registry.adapter_for picks one. Any other model gets a one-line error naming what
to provide.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from loom.errors import ConfigError
from loom.parallel.weights import WeightSource


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
            raise ConfigError(f"cannot find the repeated blocks of {type(model).__name__} (an nn.ModuleList "
                              f"of identical layers); give loom a ModelAdapter whose layers() returns them")
        return best

    def init_weights(self, model: nn.Module, seed: int, source: WeightSource | None = None) -> None:
        """Write the weights of a model materialized after parallelization (meta_init adapters):
        from `source` (pretrained weights) or the model's own initialization from `seed`; each rank
        writes the blocks it holds (loom/parallel/weights.py)."""
        raise NotImplementedError  # only adapters with meta_init

    def weight_source(self, model: nn.Module, seed: int) -> WeightSource:
        """The model's initialization as a source (meta_init adapters), for an engine that writes
        its partitions itself (DeepSpeed's ZeRO-3)."""
        raise NotImplementedError

    def apply_tensor_parallel(self, model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
        raise ConfigError(f"no tensor-parallel plan for {type(model).__name__}; set parallel.tp=1, or give a "
                          f"ModelAdapter whose apply_tensor_parallel() parallelizes it")

    def supports_pipeline(self, model: nn.Module) -> bool:
        return False

    def split_sequences(self, model: nn.Module, split) -> None:
        """Lay the input sequences out as `split` (a context_parallel.SequenceSplit) says: this rank's
        tokens of each sequence (cp), attention within documents (packing)."""
        raise ConfigError(f"{type(model).__name__} does not split its sequences; set parallel.cp=1 and "
                          f"data.packing=concat (context parallelism and packed documents run on loom's GPT)")

    def expert_modules(self, model: nn.Module) -> list[nn.Module]:
        """The modules holding each MoE block's routed experts (parameters stacked on dim 0, split over
        the ep ranks under expert parallelism); none for a dense model."""
        return []

    def num_layers(self, model: nn.Module) -> int:
        return len(self.layers(model))

    def pipeline_stage(self, model: nn.Module, stage: int, num_stages: int,
                       layer_ids: list[int]) -> nn.Module:
        raise ConfigError(f"no pipeline plan for {type(model).__name__}; set parallel.pp=1 (pipeline stages "
                          f"exist for loom's GPT and Hugging Face Llama/Mistral/Qwen2 decoders)")
