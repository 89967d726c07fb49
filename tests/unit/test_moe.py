"""The MoE block on one process: routing, dispatch and combine against a per-token loop, the auxiliary
loss and the bias update against their closed forms on planted routings, capacity's dropped tokens,
parameter counts, and the experts' initialization independent of which experts a rank holds."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from loom.models.gpt.config import PRESETS, preset
from loom.models.gpt.model import RandomInit, build_model
from loom.models.gpt.moe import MoE, MoEStats
from loom.train import moe_step


def _moe(seed: int = 0, **fields) -> MoE:
    cfg = dataclasses.replace(preset("tiny-moe"), **fields)
    torch.manual_seed(seed)
    block = MoE(cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return block


def _per_token(block: MoE, x: torch.Tensor) -> torch.Tensor:
    """The block's output token by token: Σ over its top k of weight × expert(token), + shared."""
    flat = x.reshape(-1, x.shape[-1])
    scores, chosen, weights = block.route(flat)
    out = torch.zeros_like(flat)
    e = block.experts
    for t in range(flat.shape[0]):
        for slot in range(block.top_k):
            i = int(chosen[t, slot])
            h = torch.nn.functional.silu(e.w1[i] @ flat[t]) * (e.w3[i] @ flat[t])
            out[t] += weights[t, slot] * (e.w2[i] @ h)
    out = out.view_as(x)
    if block.shared is not None:
        gate = torch.sigmoid(block.shared_gate(x)) if block.shared_gate is not None else 1
        out = out + gate * block.shared(x)
    return out


ROUTINGS = [{}, {"moe_score": "sigmoid", "moe_norm_topk": True, "moe_route_scale": 2.5},
            {"moe_top_k": 1, "moe_shared_experts": 0}, {"moe_shared_gate": True}]


@pytest.mark.parametrize("fields", ROUTINGS)
def test_dropless_equals_a_per_token_loop(fields):
    block = _moe(**fields).eval()
    x = torch.randn(2, 16, 64)
    with torch.no_grad():
        assert torch.allclose(block(x), _per_token(block, x), atol=1e-5)


def test_aux_loss_closed_form_on_a_planted_routing():
    block = _moe(moe_experts=4, moe_top_k=1)
    # one sequence of 4 tokens: three choose expert 0, one expert 1; the scores planted
    scores = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.4, 0.4, 0.1, 0.1], [0.5, 0.2, 0.2, 0.1],
                           [0.1, 0.6, 0.2, 0.1]])
    chosen = torch.tensor([[0], [0], [0], [1]])
    f = [3 / 4, 1 / 4, 0, 0]
    p = [(0.7 + 0.4 + 0.5 + 0.1) / 4, (0.1 + 0.4 + 0.2 + 0.6) / 4, 0.15, 0.1]
    assert float(block.aux_loss(scores, chosen, 1)) == pytest.approx(4 * sum(a * b for a, b in zip(f, p)))
    # two sequences: the mean of each one's; a balanced one gives 1 with uniform scores
    uniform = torch.full((4, 4), 0.25)
    both = torch.cat([scores, uniform])
    chosen2 = torch.cat([chosen, torch.tensor([[0], [1], [2], [3]])])
    want = (4 * sum(a * b for a, b in zip(f, p)) + 1.0) / 2
    assert float(block.aux_loss(both, chosen2, 2)) == pytest.approx(want)


def test_aux_loss_gradient_joins_with_its_weight():
    """The router's gradient with the aux loss on equals that of output.sum() + weight × aux loss."""
    x = torch.randn(2, 8, 64)
    on = _moe(moe_aux_loss_coef=0.5).train()
    on.aux_weight = 50.0
    on(x).sum().backward()
    off = _moe(moe_aux_loss_coef=0.0).train()
    scores, chosen, _ = off.route(x.reshape(-1, 64))
    (off(x).sum() + 50.0 * off.aux_loss(scores, chosen, 2)).backward()
    assert torch.allclose(on.router.weight.grad, off.router.weight.grad, rtol=1e-5, atol=1e-4)
    assert not torch.allclose(on.router.weight.grad, _router_grad_without_aux(x), rtol=1e-5, atol=1e-4)


def _router_grad_without_aux(x: torch.Tensor) -> torch.Tensor:
    plain = _moe(moe_aux_loss_coef=0.0).train()
    plain(x).sum().backward()
    return plain.router.weight.grad


def test_bias_update_closed_form():
    block = _moe(moe_experts=4, moe_bias_update_rate=0.01)
    block.stats = MoEStats(4, torch.device("cpu"))
    block.stats.load += torch.tensor([10.0, 2.0, 5.0, 3.0])  # mean 5
    block.stats.calls = 1
    values = moe_step.after_step(block, None, 4)
    assert block.expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.01])
    # the step's tally: imbalance = busiest over mean, the tokens per expert
    assert values[2].item() == pytest.approx(2.0) and values[3:].tolist() == [10.0, 2.0, 5.0, 3.0]
    assert block.stats is None  # the next step counts afresh


def test_bias_chooses_but_does_not_weigh():
    block = _moe(moe_experts=4, moe_top_k=1, moe_norm_topk=False).eval()
    x = torch.randn(1, 8, 64)
    scores, _, _ = block.route(x.reshape(-1, 64))
    block.expert_bias.copy_(torch.tensor([100.0, 0, 0, 0]))
    biased_scores, chosen, weights = block.route(x.reshape(-1, 64))
    assert (chosen == 0).all()  # every token now picks expert 0
    assert torch.allclose(weights[:, 0], scores[:, 0])  # with its unbiased score as weight


def test_capacity_drops_the_closed_form_count():
    block = _moe(moe_experts=4, moe_top_k=1, moe_capacity_factor=1.0)
    # one sequence of 8: capacity ceil(1 · 1 · 8 / 4) = 2; expert 0 chosen 5 times, 1 twice, 2 once
    chosen = torch.tensor([0, 0, 1, 0, 0, 2, 1, 0]).view(1, 8, 1)
    keep = block.capacity_keep(chosen).flatten()
    assert keep.tolist() == [True, True, True, False, False, True, True, False]  # expert 0's first two
    # a planted imbalance through the model: every token to expert 0 (bias), two sequences of 16
    block.train()
    block.expert_bias.copy_(torch.tensor([100.0, 0, 0, 0]))
    block(torch.randn(2, 16, 64))
    capacity = math.ceil(1.0 * 1 * 16 / 4)
    assert block.stats.dropped.item() == 2 * (16 - capacity)
    assert block.stats.load.tolist() == [32.0, 0, 0, 0]


@pytest.mark.parametrize("mode", ["full", "op"])
def test_recompute_is_not_tallied_again(mode):
    """Activation checkpointing replays the block's forward in backward: its routing counts once."""
    from torch.utils.checkpoint import checkpoint

    from loom.parallel.activation_checkpointing import op_context_fn

    block = _moe().train()
    x = torch.randn(2, 8, 64, requires_grad=True)
    kwargs = {"context_fn": op_context_fn} if mode == "op" else {}
    checkpoint(block, x, use_reentrant=False, **kwargs).sum().backward()
    assert block.stats.calls == 1 and block.stats.load.sum().item() == 2 * 8 * 2


def test_infinite_capacity_equals_dropless():
    x = torch.randn(2, 16, 64)
    dropless, roomy = _moe().eval(), _moe(moe_capacity_factor=1e6).eval()
    with torch.no_grad():
        assert torch.equal(dropless(x), roomy(x))


def test_dropped_tokens_pass_the_residual_alone():
    block = _moe(moe_experts=4, moe_top_k=1, moe_capacity_factor=0.25, moe_shared_experts=0).eval()
    block.expert_bias.copy_(torch.tensor([100.0, 0, 0, 0]))
    with torch.no_grad():
        out = block(torch.randn(1, 16, 64))  # capacity ceil(0.25 · 16 / 4) = 1: tokens 1..15 dropped
    assert out[0, 0].abs().sum() > 0 and out[0, 1:].abs().sum() == 0


@pytest.mark.parametrize("name", [n for n, c in PRESETS.items() if c.moe_experts])
def test_parameter_counts(name):
    cfg = PRESETS[name]
    assert cfg.num_params(active=True) < cfg.num_params()
    if name == "tiny-moe":
        model = build_model(cfg, "meta")
        assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
        experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        idle = experts * (1 - cfg.moe_top_k / cfg.moe_experts)  # the experts a token does not reach
        assert cfg.num_params() - cfg.num_params(active=True) == idle


def test_dense_first_and_every():
    cfg = dataclasses.replace(preset("tiny-moe"), n_layers=6, moe_dense_first=1, moe_every=2)
    assert [cfg.is_moe(i) for i in range(6)] == [False, True, False, True, False, True]
    model = build_model(cfg, "meta")
    assert [isinstance(b.feed_forward, MoE) for b in model.layers] == [cfg.is_moe(i) for i in range(6)]


def test_experts_initialize_alike_whichever_a_rank_holds():
    model = build_model(preset("tiny-moe"), "meta")
    source = RandomInit(model, 7)
    name, shape = "layers.1.feed_forward.experts.w1", (8, 32, 64)
    whole = model.initial_value(7, name, shape)
    part = source.read(name, shape, (2, 0, 16), (4, 32, 16))  # experts 2..5, some columns
    assert torch.equal(part, whole[2:6, :, 16:32])
    assert whole.std().item() == pytest.approx(0.02, rel=0.1)


def test_trackers_get_the_routing_scalars():
    """TensorBoard / wandb get metrics.jsonl's MoE scalars (not the per-expert list)."""
    from loom.train.tracking import Trackers

    trackers = Trackers.__new__(Trackers)
    trackers.mfu_scale, logged = None, {}
    trackers._log = lambda scalars, step: logged.update(scalars)
    trackers.step({"step": 3, "loss": 2.0, "moe_aux_loss": 1.25, "moe_load_imbalance": 1.5, "moe_dropped": 4,
                   "moe_expert_tokens": [5, 7], "ep_bytes": 1024, "ep_wait_s": 0.5}, {})
    assert {k: logged[k] for k in logged if k.startswith(("moe/", "comm/ep"))} == {
        "moe/aux_loss": 1.25, "moe/load_imbalance": 1.5, "moe/dropped": 4.0, "comm/ep_bytes": 1024.0,
        "comm/ep_wait_s": 0.5}
