"""Gradient clipping against norms computed here: the global norm over every gradient, and the
gradients scaled to max_norm when (and only when) it is above it."""

from __future__ import annotations

import torch

from loom.train.optim import clip_grad_norm


def _params(*grads: list[float]) -> list[torch.nn.Parameter]:
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros(len(g)))
        p.grad = torch.tensor(g)
        params.append(p)
    return params


def test_clip_scales_to_max_norm_and_returns_the_norm_before():
    params = _params([3.0, 0.0], [0.0, 4.0])  # global norm 5
    assert clip_grad_norm(params, 1.0).item() == 5.0
    scaled = torch.cat([p.grad for p in params])  # × 1/(5 + 1e-6): torch's clip adds 1e-6
    assert torch.allclose(scaled, torch.tensor([0.6, 0.0, 0.0, 0.8]), rtol=1e-6, atol=0)
    below = _params([0.3, 0.4])  # norm 0.5 < 1: untouched
    assert clip_grad_norm(below, 1.0).item() == 0.5 and torch.equal(below[0].grad, torch.tensor([0.3, 0.4]))
    off = _params([30.0, 40.0])  # grad_clip = 0: the norm only
    assert clip_grad_norm(off, 0.0).item() == 50.0 and torch.equal(off[0].grad, torch.tensor([30.0, 40.0]))
