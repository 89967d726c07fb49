"""The LR schedule and the weight-decay groups, checked against values written down here, not
against loom's own functions (which the single-process reference in test_strategies shares)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from loom.config import load_config
from loom.models.gpt.config import preset
from loom.models.gpt.model import build_model
from loom.train.optim import build_optimizer, build_scheduler


def closed_form_lr(k: int, lr: float, warmup: int, steps: int, floor: float) -> float:
    """Step k (1-based) of `steps`: linear warmup to lr at step `warmup`, then cosine to lr·floor
    at the last step."""
    if k <= warmup:
        return lr * k / warmup
    progress = (k - warmup) / (steps - warmup)
    return lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


@pytest.mark.parametrize("warmup, steps, floor", [(10, 60, 0.1), (3, 8, 0.0), (1, 5, 0.5), (4, 4, 0.1)])
def test_schedule_is_warmup_then_cosine_to_the_floor(warmup, steps, floor):
    lr = 3e-3
    t = load_config(None, [f"train.lr={lr}", f"train.warmup_steps={warmup}", f"train.steps={steps}",
                           f"train.min_lr_ratio={floor}"]).train
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = build_scheduler(opt, t)
    used = []
    for _ in range(steps):
        used.append(sched.get_last_lr()[0])  # what the step trains with
        opt.step()
        sched.step()
    expected = [closed_form_lr(k, lr, warmup, steps, floor) for k in range(1, steps + 1)]
    assert used == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert used[0] == pytest.approx(lr / warmup)  # first warmup step
    assert used[warmup - 1] == pytest.approx(lr)  # the peak, at the end of warmup
    if steps > warmup:
        assert used[-1] == pytest.approx(lr * floor)  # the floor, at the last step
        assert all(a > b for a, b in zip(used[warmup - 1:], used[warmup:]))  # decays every step


def test_weight_decay_reaches_matrices_and_embeddings_not_norm_gains():
    """With zero gradients AdamW's update is weight decay alone: a decayed parameter shrinks by
    exactly (1 − lr·wd), an undecayed one does not move. Which is which is written down here."""
    model = build_model(preset("tiny", tie_embeddings=False), device="cpu")
    model.init_weights(0)
    lr, wd = 0.5, 0.1
    t = load_config(None, [f"train.lr={lr}", f"train.weight_decay={wd}"]).train
    opt = build_optimizer(model, t, "ddp", SimpleNamespace(device=torch.device("cpu")))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    decayed = {n for n, p in model.named_parameters() if torch.allclose(p, before[n] * (1 - lr * wd), rtol=0,
                                                                           atol=1e-7)}
    kept = {n for n, p in model.named_parameters() if torch.equal(p, before[n])}
    names = set(before)
    gains = {n for n in names if n.endswith("norm.weight")}  # attention_norm, ffn_norm, the final norm
    assert gains and kept == gains, sorted(kept ^ gains)
    assert decayed == names - gains, sorted(decayed ^ (names - gains))
    assert {"tok_embeddings.weight", "output.weight", "layers.0.attention.wq.weight",
            "layers.1.feed_forward.w2.weight"} <= decayed
