"""Bad-input cases of pretrained weights (docs/bad-input.md, "Pretrained models"): a weight that
holds NaN or Inf, refused as the ranks read their blocks of it, before step 1 (a NaN would have
every step's update skipped and the run end with exit 0)."""

from __future__ import annotations

import dataclasses
import json

from bad_input import Ctx, case
from bad_input_cases_model_folder import llama_folder


def _train_from(c: Ctx, path) -> str:
    return c.train("--set", f'model.init_from="{path}"')


@case("model-weight-nan")
def _(c: Ctx) -> str:
    from safetensors.torch import load_file, save_file

    folder = llama_folder(c.tmp / "m")
    file = folder / "model.safetensors"
    tensors = load_file(file)
    tensors["model.layers.0.mlp.up_proj.weight"][0, :3] = float("nan")
    save_file(tensors, file, metadata={"format": "pt"})
    return _train_from(c, folder)


@case("model-export-weight-inf")
def _(c: Ctx) -> str:
    from safetensors.torch import save_file

    from loom.models.gpt.config import preset
    from loom.models.gpt.model import build_model

    gpt = preset("tiny")
    tensors = {k: v.contiguous() for k, v in build_model(gpt, device="cpu").state_dict().items()}
    tensors["output.weight"][5, 7] = float("inf")
    record = json.dumps(dataclasses.asdict(gpt))
    save_file(tensors, c.tmp / "model.safetensors", metadata={"loom_model": record})
    return _train_from(c, c.tmp / "model.safetensors")
