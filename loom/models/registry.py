"""Which adapter hands a model to loom/parallel: loom's GPT, a Hugging Face decoder, or the generic
one (data parallelism only)."""

from __future__ import annotations

from torch import nn

from loom.models.gpt.adapter import GPTAdapter
from loom.models.gpt.model import GPT
from loom.models.hf.adapter import HFDecoderAdapter, is_hf_decoder
from loom.parallel.adapter import ModelAdapter


def adapter_for(model: nn.Module) -> ModelAdapter:
    if isinstance(model, GPT):
        return GPTAdapter()
    if is_hf_decoder(model):
        return HFDecoderAdapter(meta_init=any(p.is_meta for p in model.parameters()))
    return ModelAdapter()
