"""A split backward (zb, zbv, dualpipev) runs the graph twice, an input pass then a weight pass; loom's
Functions that take a weight (RMSNorm, SwiGLU fused with its down projection, the chunked loss) compute
in each only the gradients that pass takes (loom/parallel/backward_pass.py). The two passes give the
full backward's gradients, and their matmuls are the full backward's plus the chunked loss's logits
once more, not each Function's backward twice."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.utils._python_dispatch import TorchDispatchMode

from loom.models.chunked_loss import chunked_cross_entropy
from loom.models.gpt.lean_ops import rms_norm, swiglu_down
from loom.parallel import backward_pass as passes
from loom.parallel.pipeline import _Stage, weight_pass_takes_functions

TOKENS, D, F, V, CHUNK = 16, 8, 12, 20, 4


class _CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.count += 1
        return func(*args, **(kwargs or {}))


class _Head(nn.Module):
    """A last stage in small: a norm, a SwiGLU MLP with its down projection fused, the chunked loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.Parameter(torch.rand(D) + 0.5)
        self.gate, self.up = nn.Linear(D, F, bias=False), nn.Linear(D, F, bias=False)
        self.down = nn.Parameter(torch.randn(D, F) / F ** 0.5)
        self.head = nn.Parameter(torch.randn(V, D) / D ** 0.5)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = rms_norm(x, self.norm, 1e-5)
        h = x + swiglu_down(self.gate(h), self.up(h), self.down)
        # grad_in_forward=False, as loom's last stage under a split backward (loom/train/step.py)
        return chunked_cross_entropy(h, self.head, targets, CHUNK, grad_in_forward=False)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(TOKENS, D), torch.randint(0, V, (TOKENS,))


def _full(model: _Head) -> tuple[list[torch.Tensor], torch.Tensor, int]:
    x, targets = _inputs()
    x.requires_grad_(True)
    loss = model(x * 1.0, targets)
    with _CountMatmuls() as counted:
        loss.backward()
    return [p.grad.clone() for p in model.parameters()], x.grad.clone(), counted.count


def _split(model: _Head) -> tuple[list[torch.Tensor], torch.Tensor, int]:
    """torch's own input pass then weight pass, as a zero-bubble stage runs them (each in its pass)."""
    x, targets = _inputs()
    x.requires_grad_(True)
    loss = model(x * 1.0, targets)  # the stage input: a non-leaf, as a received activation's use is
    with _CountMatmuls() as counted:
        with passes.backward_pass(passes.INPUT):
            (dx,), groups = stage_backward_input([loss], None, [x], model.parameters())
        with passes.backward_pass(passes.WEIGHT):
            stage_backward_weight(model.parameters(), groups)
    return [p.grad.clone() for p in model.parameters()], dx, counted.count


def test_the_two_passes_give_the_full_backwards_gradients_computing_each_once():
    if not weight_pass_takes_functions():
        # torch 2.11: its weight pass cannot start at a Python Function, so loom's driver runs plain
        # ops and the full logits under a split backward (lean_ops.use_plain_ops), never these
        with pytest.raises(RuntimeError):
            _split(_Head())
        return
    full_grads, full_dx, full_mm = _full(_Head())
    split_grads, split_dx, split_mm = _split(_Head())
    torch.testing.assert_close(split_dx, full_dx, rtol=1e-6, atol=1e-7)
    for a, b in zip(split_grads, full_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # each pass recomputes the chunks' logits (one matmul a chunk); nothing else runs twice
    assert split_mm == full_mm + TOKENS // CHUNK, (split_mm, full_mm)


def test_outside_a_split_pass_every_gradient_is_taken():
    assert passes.takes_inputs() and passes.takes_weights()
    with passes.backward_pass(passes.INPUT):
        assert passes.takes_inputs() and not passes.takes_weights()
        with passes.backward_pass(passes.WEIGHT):
            assert passes.takes_weights() and not passes.takes_inputs()
        assert not passes.takes_weights()
    assert passes.takes_inputs() and passes.takes_weights()
    with pytest.raises(ValueError, match="unknown backward pass"):
        with passes.backward_pass("both"):
            pass


def test_the_pipeline_stage_runs_each_backward_in_its_pass(monkeypatch):
    """_Stage.backward_maybe_with_nosync, which torch calls for every backward of a stage, sets the pass
    it names around torch's own."""
    seen = []

    def torchs(self, backward_type, bwd_kwargs, last_backward=False):
        seen.append((backward_type, passes.takes_inputs(), passes.takes_weights()))
        return (), None

    monkeypatch.setattr(_Stage.__mro__[1], "backward_maybe_with_nosync", torchs)
    stage = object.__new__(_Stage)  # only the override is under test: no process group needed
    for kind in ("input", "weight", "full"):
        stage.backward_maybe_with_nosync(kind, {})
    assert seen == [("input", True, False), ("weight", False, True), ("full", True, True)]
    assert passes.takes_inputs() and passes.takes_weights()
