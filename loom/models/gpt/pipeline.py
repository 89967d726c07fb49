"""Pipeline stages of loom's GPT: the same class with the parts a stage does not hold removed.

`layers` becomes an nn.ModuleDict keyed by the original layer index, `tok_embeddings` is None
after the first stage, `norm` and `output` before the last. Parameter names stay the full model's,
so `init_weights(seed)` gives each stage the full model's values and checkpoints map 1:1.
"""

from __future__ import annotations

import copy

from torch import nn

from loom.layout import refuse_tied_embeddings
from loom.models.gpt.model import GPT


def build_stage(model: GPT, stage_index: int, num_stages: int, layer_ids: list[int]) -> GPT:
    """The stage module for `stage_index`, from a GPT on the meta device; `model` is left unchanged.

    Only the structure is copied (meta tensors have no storage), so one full model can give every
    stage a rank holds; materialize with `to_empty` + `init_weights(seed)` afterwards.
    """
    if any(not t.is_meta for t in [*model.parameters(), *model.buffers()]):
        raise ValueError("build_stage needs the model on the meta device (build_model(cfg, 'meta'))")
    if not isinstance(model.layers, nn.ModuleList):
        raise TypeError("build_stage needs the full model (layers as an nn.ModuleList), not a stage")
    refuse_tied_embeddings(model.cfg.tie_embeddings, num_stages, "set model.tie_embeddings=false")
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index {stage_index} is outside 0..{num_stages - 1}")
    n_layers = len(model.layers)
    if not layer_ids or any(not 0 <= i < n_layers for i in layer_ids):
        raise ValueError(f"layer_ids {layer_ids} must be a non-empty list of indices in 0..{n_layers - 1}")

    stage = copy.deepcopy(model)
    # Keyed by the original index, so names stay "layers.<i>.…" as in the full model.
    stage.layers = nn.ModuleDict({str(i): stage.layers[i] for i in layer_ids})
    if stage_index > 0:
        stage.tok_embeddings = None  # takes hidden states from the previous stage
    if stage_index < num_stages - 1:
        stage.norm = None  # returns hidden states to the next stage
        stage.output = None
    return stage
