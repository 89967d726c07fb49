"""Muon with AdamW (loom/train/muon.py) in one process against torch's own: the Newton-Schulz
iteration bit for bit, the optimizer step for step (a stacked expert tensor as its experts one by
one), which parameters go to which optimizer, the state dict round trip, and the start line."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.optim._muon as torch_muon
from hypothesis import given, settings
from hypothesis import strategies as st
from in_process import world_of_one

import loom.cli
from loom.config import Config, LoRAConfig, MuonConfig, TrainConfig, load_config
from loom.models.gpt.config import preset
from loom.models.gpt.model import build_model
from loom.models.lora import apply_lora, blocks_of
from loom.train.checkpoint import read_tensors
from loom.train.muon import MuonAdamW, assignment, is_muon_matrix, muon_groups, newton_schulz, update_scale
from loom.train.safe_load import trained_entries

COEFFICIENTS = (3.4445, -4.775, 2.0315)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 40), cols=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_newton_schulz_is_torchs_bit_for_bit(rows, cols, seed):
    g = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    want = torch_muon._zeropower_via_newtonschulz(g, COEFFICIENTS, 5, 1e-7)
    assert torch.equal(newton_schulz(g, 5, torch.bfloat16), want)


def test_newton_schulz_orthogonalizes():
    """In fp32 the singular values land in the quintic's band around 1 (about 0.7 to 1.2)."""
    g = torch.randn(48, 96, generator=torch.Generator().manual_seed(0))
    s = torch.linalg.svdvals(newton_schulz(g, 5, torch.float32))
    assert s.min() > 0.6 and s.max() < 1.25, s
    stacked = torch.stack([g, 2 * g, -g])  # each matrix alone: the scale drops out, the sign stays
    out = newton_schulz(stacked, 5, torch.float32)
    assert torch.allclose(out[0], out[1], atol=1e-5) and torch.allclose(out[0], -out[2], atol=1e-5)


def test_update_scale():
    assert update_scale("match_rms_adamw", torch.Size([64, 256])) == pytest.approx(0.2 * 16)
    assert update_scale("original", torch.Size([256, 64])) == pytest.approx(2.0)
    assert update_scale("original", torch.Size([64, 256])) == 1.0
    for rule, torch_rule in (("match_rms_adamw", "match_rms_adamw"), ("original", "original")):
        for shape in ((64, 256), (256, 64), (8, 3, 5)):
            want = torch_muon._adjust_lr(1.0, torch_rule, torch.Size(shape[-2:]))
            assert update_scale(rule, torch.Size(shape)) == pytest.approx(want)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(11, 8)
        self.up = torch.nn.Linear(8, 12)
        self.experts = torch.nn.Parameter(torch.randn(3, 12, 8) * 0.1)  # stacked [E, rows, cols]
        self.norm = torch.nn.LayerNorm(8)
        self.output = torch.nn.Linear(8, 11, bias=False)

    def forward(self, x):
        h = self.up(self.tok_embeddings(x))
        h = torch.einsum("btr,erc->btc", h, self.experts)
        return self.output(self.norm(h))


def _loss(net, seed):
    x = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(seed))
    return net(x).logsumexp(-1).mean()


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("scale", ["match_rms_adamw", "original"])
def test_steps_equal_torch_muon_and_adamw(nesterov, scale):
    torch.manual_seed(0)
    ours, ref = _Net(), None
    ref = copy.deepcopy(ours)
    t = TrainConfig(lr=0.01, weight_decay=0.1)
    m = MuonConfig(lr=0.02, nesterov=nesterov, update_scale=scale)
    opt = MuonAdamW(muon_groups(ours, t, m), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, foreach=True)
    # torch's: Muon on each 2-D matrix, the stacked experts as 3 separate matrices; AdamW on the rest
    experts = [torch.nn.Parameter(e.detach().clone()) for e in ref.experts]
    ref_muon = torch.optim.Muon([ref.up.weight, *experts], lr=0.02, weight_decay=0.1, momentum=0.95,
                                nesterov=nesterov, adjust_lr_fn=scale)
    matrices = [ref.tok_embeddings.weight, ref.output.weight]
    vectors = [ref.up.bias, ref.norm.weight, ref.norm.bias]
    ref_adamw = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1},
                                   {"params": vectors, "weight_decay": 0.0}],
                                  lr=0.01, betas=(t.beta1, t.beta2), eps=t.eps, foreach=True)
    for step in range(4):
        opt.zero_grad()
        _loss(ours, step).backward()
        opt.step()
        for o in (ref_muon, ref_adamw):
            o.zero_grad()
        ref.experts.data = torch.stack([e.data for e in experts])
        ref.experts.grad = None
        _loss(ref, step).backward()
        for e, g in zip(experts, ref.experts.grad):
            e.grad = g.clone()
        ref_muon.step()
        ref_adamw.step()
    ref.experts.data = torch.stack([e.data for e in experts])
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), name
    assert ours.up.weight.sub(_Net().up.weight).abs().max() > 0  # (it trained)


def test_state_dict_round_trip_continues_exactly():
    torch.manual_seed(0)
    a = _Net()
    b = copy.deepcopy(a)
    t, m = TrainConfig(lr=0.01), MuonConfig()

    def optimizer(net):
        return MuonAdamW(muon_groups(net, t, m), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, foreach=True)

    opt_a, opt_b = optimizer(a), optimizer(b)
    for step in range(2):
        for net, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            _loss(net, step).backward()
            opt.step()
    saved = copy.deepcopy(opt_b.state_dict())
    assert {k for s in saved["state"].values() for k in s} == {"momentum_buffer", "step", "exp_avg",
                                                               "exp_avg_sq"}
    opt_b = optimizer(b)
    opt_b.load_state_dict(saved)
    for step in range(2, 4):
        for net, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            _loss(net, step).backward()
            opt.step()
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(x, y), name


def test_which_parameters_go_where():
    model = build_model(preset("tiny-moe"), device="meta")
    sides = assignment(model)
    attention = [f"layers.*.attention.w{x}.weight" for x in "qkvo"]
    experts = [f"layers.*.feed_forward.experts.w{i}" for i in (1, 3, 2)]
    shared = [f"layers.*.feed_forward.shared.w{i}.weight" for i in (1, 3, 2)]
    assert sorted(sides["muon"]["names"]) == sorted(attention + experts + shared)
    assert sides["adamw"]["names"] == [
        "tok_embeddings.weight", "layers.*.attention_norm.weight", "layers.*.ffn_norm.weight",
        "layers.*.feed_forward.router.weight", "norm.weight", "output.weight"]
    total = sum(p.numel() for p in model.parameters())
    assert sides["muon"]["params"] + sides["adamw"]["params"] == total
    for hf_name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate.weight"):
        assert not is_muon_matrix(hf_name, torch.empty(4, 4))
    assert is_muon_matrix("model.layers.0.mlp.gate_proj.weight", torch.empty(4, 4))


def test_lora_adapters_go_to_muon():
    model = build_model(preset("tiny"), device="cpu")
    apply_lora(model, blocks_of(model.layers), LoRAConfig(rank=4), torch.float32, 0)
    sides = assignment(model)
    assert sides["adamw"]["names"] == []
    assert sides["muon"]["names"] and all(n.endswith(("lora_A", "lora_B")) for n in sides["muon"]["names"])


def test_groups_take_the_muon_keys_and_train_defaults():
    cfg: Config = load_config(None, ["train.optimizer=muon", "train.lr=0.004", "muon.momentum=0.9",
                                     "muon.ns_steps=3"])
    model = build_model(preset("tiny"), device="meta")
    muon, decay, no_decay = muon_groups(model, cfg.train, cfg.muon)
    assert muon["lr"] == 0.004 and muon["weight_decay"] == cfg.train.weight_decay
    assert muon["momentum"] == 0.9 and muon["ns_steps"] == 3
    assert decay["weight_decay"] == cfg.train.weight_decay and no_decay["weight_decay"] == 0.0
    assert all(p.ndim == 1 for p in no_decay["params"])


def test_a_muon_run_resumes_through_the_cli(tmp_path, corpus):
    """The pre-launch check expects Muon's momentum for the matrices and AdamW's states for the
    rest (an AdamW expectation refused every Muon checkpoint), and the resumed run goes on."""
    run = tmp_path / "run"
    sets = ["model.preset=tiny", f'data.source="{corpus}"', "data.seq_len=32", "train.batch_size=4",
            "data.num_workers=0", "train.device=cpu", "parallel.strategy=ddp", "train.eval_batches=0",
            "train.ckpt_every_min=0", "train.optimizer=muon"]
    argv = ["train", "--nproc", "1", "--out", str(run), *[a for s in sets for a in ("--set", s)]]
    with world_of_one():
        assert loom.cli.main([*argv, "--set", "train.steps=2"]) == 0
        held = read_tensors(run / "checkpoints" / "step_2", "")
        assert "optim.layers.0.attention.wq.weight.momentum_buffer" in held
        assert "optim.layers.0.attention.wq.weight.exp_avg" not in held
        assert "optim.tok_embeddings.weight.exp_avg_sq" in held
        assert set(held) == set(trained_entries(build_model(preset("tiny"), "meta"), "muon"))
        assert loom.cli.main([*argv, "--set", "train.steps=3", "--resume", "auto"]) == 0
    assert (run / "checkpoints" / "step_3").is_dir()


def _fused_muon(net):
    t, m = TrainConfig(lr=0.01, weight_decay=0.1), MuonConfig(lr=0.02)
    return MuonAdamW(muon_groups(net, t, m), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, fused=True)


def _snapshot(net, opt):
    return copy.deepcopy(([p.detach() for p in net.parameters()], opt.state_dict()["state"]))


def test_a_flagged_step_changes_nothing_even_with_nan_gradients():
    """found_inf (the training step's device flag for a non-finite loss or norm): Muon's matrices,
    momenta and the fused AdamW's parameters and moments are left exactly as they were."""
    torch.manual_seed(0)
    net = _Net()
    opt = _fused_muon(net)
    assert opt.takes_found_inf()
    _loss(net, 0).backward()
    opt.step()  # the states exist
    before = _snapshot(net, opt)
    opt.zero_grad()
    _loss(net, 1).backward()
    for p in net.parameters():
        p.grad[..., 0] = float("nan")
    opt.found_inf = torch.ones(())
    opt.step()
    after = _snapshot(net, opt)
    for a, b in zip(before[0], after[0]):
        assert torch.equal(a, b)
    for k, state in before[1].items():
        for name, v in state.items():
            assert torch.equal(v, after[1][k][name]), (k, name)


def test_an_unflagged_step_is_the_plain_step():
    torch.manual_seed(0)
    nets = [_Net(), None]
    nets[1] = copy.deepcopy(nets[0])
    opts = [_fused_muon(n) for n in nets]
    for step in range(2):
        for i, (net, opt) in enumerate(zip(nets, opts)):
            opt.zero_grad()
            _loss(net, step).backward()
            if i:
                opt.found_inf = torch.zeros(())
            opt.step()
    for a, b in zip(nets[0].parameters(), nets[1].parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fused", [True, False])
def test_the_training_step_skips_on_the_device(fused):
    """loom's optimizer step hands Muon (beside a fused AdamW) the non-finite flag: no host read of it;
    beside a foreach AdamW the flag is read on the host (free on a CPU, where that one runs)."""
    import sys
    from pathlib import Path

    from loom.train import step as step_module

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from host_reads import host_reads

    torch.manual_seed(0)
    net = _Net()
    t, m = TrainConfig(lr=0.01, weight_decay=0.1), MuonConfig(lr=0.02)
    opt = MuonAdamW(muon_groups(net, t, m), lr=t.lr, **({"fused": True} if fused else {"foreach": True}))
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    loss = _loss(net, 0)
    loss.backward()
    reads = []
    with host_reads(lambda: reads.append(1)):
        step_module._optimizer_step(opt, scheduler, None, list(net.parameters()), t, None, loss.detach())
    assert (len(reads) == 0) == fused, reads
