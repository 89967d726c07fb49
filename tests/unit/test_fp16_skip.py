"""fp16's step (a GradScaler) beside a fused AdamW skips a non-finite loss on the device: the loss's
flag joins the scaler's overflow flags, which the fused kernel takes; nothing is read on the host
(loom/train/step.py::_optimizer_step)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from loom.config import TrainConfig
from loom.train import step as step_module

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from host_reads import host_reads  # noqa: E402


def _setup(fused: bool = True):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(net.parameters(), lr=0.01, **({"fused": True} if fused else {"foreach": True}))
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return net, opt, scheduler, torch.amp.GradScaler("cpu", init_scale=2.0**8)


def _step(net, opt, scheduler, scaler, loss_scale: float = 1.0, reads: list | None = None,
          reported: float | None = None):
    """One step; `reported`: the global loss the step is told (a NaN beside finite gradients: the
    case the scaler's own overflow check cannot see)."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    loss = net(x).square().mean() * loss_scale
    opt.zero_grad()
    scaler.scale(loss).backward()
    told = loss.detach() if reported is None else torch.tensor(reported)
    with host_reads(lambda: reads.append(1)) if reads is not None else torch.no_grad():
        params = list(net.parameters())
        return step_module._optimizer_step(opt, scheduler, scaler, params, TrainConfig(), None, told)


def test_a_fused_step_reads_nothing_on_the_host():
    net, opt, scheduler, scaler = _setup()
    reads: list = []
    _step(net, opt, scheduler, scaler, reads=reads)
    assert reads == []
    net, opt, scheduler, scaler = _setup(fused=False)
    reads = []
    _step(net, opt, scheduler, scaler, reads=reads)
    assert reads  # the foreach AdamW's path reads the flag (and the scaler its own)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("how", ["nan-gradients", "nan-loss-only"])
def test_a_non_finite_loss_leaves_the_weights(fused, how):
    net, opt, scheduler, scaler = _setup(fused)
    _step(net, opt, scheduler, scaler)  # the states exist
    before = copy.deepcopy([p.detach() for p in net.parameters()])
    if how == "nan-gradients":
        _, skipped, _ = _step(net, opt, scheduler, scaler, loss_scale=float("nan"))
    else:
        _, skipped, _ = _step(net, opt, scheduler, scaler, reported=float("nan"))
    assert skipped.item() == 1.0
    for a, b in zip(before, net.parameters()):
        assert torch.equal(a, b)


def test_a_finite_step_is_the_scalers_own():
    """Beside a finite loss the joined flags change nothing: the step is GradScaler.step's."""
    net, opt, scheduler, scaler = _setup()
    ref_net, ref_opt, _, ref_scaler = _setup()
    for _ in range(3):
        _step(net, opt, scheduler, scaler)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
        ref_opt.zero_grad()
        ref_scaler.scale(ref_net(x).square().mean()).backward()
        ref_scaler.unscale_(ref_opt)
        torch.nn.utils.clip_grad_norm_(ref_net.parameters(), TrainConfig().grad_clip)
        ref_scaler.step(ref_opt)
        ref_scaler.update()
    for a, b in zip(net.parameters(), ref_net.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert scaler.get_scale() == ref_scaler.get_scale()
