"""loom's GPT as loom/parallel sees it: built on the meta device and initialized per parameter
after sharding, with a tensor-parallel plan (sequence parallel included) and pipeline stages."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from loom.models.gpt.model import RandomInit
from loom.models.gpt.moe import moe_modules
from loom.models.gpt.pipeline import build_stage
from loom.models.gpt.tensor_parallel import apply_tensor_parallel
from loom.parallel.adapter import ModelAdapter
from loom.parallel.weights import WeightSource


class GPTAdapter(ModelAdapter):
    """loom's own decoder: meta init, TP (with sequence parallel) and PP plans."""

    meta_init = True

    def layers(self, model: nn.Module) -> nn.ModuleList | nn.ModuleDict:
        return model.layers

    def init_weights(self, model: nn.Module, seed: int, source: WeightSource | None = None) -> None:
        model.init_weights(seed, source)

    def weight_source(self, model: nn.Module, seed: int) -> WeightSource:
        return RandomInit(model, seed)

    def apply_tensor_parallel(self, model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
        apply_tensor_parallel(model, tp_mesh, sequence_parallel)

    def supports_pipeline(self, model: nn.Module) -> bool:
        return True

    def split_sequences(self, model: nn.Module, split) -> None:
        model.sequence_split = split

    def expert_modules(self, model: nn.Module) -> list[nn.Module]:
        return [moe.experts for moe in moe_modules(model)]

    def num_layers(self, model: nn.Module) -> int:
        return model.cfg.n_layers

    def pipeline_stage(self, model: nn.Module, stage: int, num_stages: int,
                       layer_ids: list[int]) -> nn.Module:
        return build_stage(model, stage, num_stages, layer_ids)
