"""train.optimizer = "muon" on every layout, on gloo ranks, against the single process.

The reference is the plain loop (test_strategies.reference_run) stepping torch's own Muon
(torch.optim._muon.muon, the functional step of torch.optim.Muon) on each whole matrix, a stacked
expert tensor's experts one by one, and AdamW on the rest. Its Newton-Schulz runs in fp32 (this
file's own iteration), as the runs here do with muon.ns_dtype = "fp32": in bf16 a last-bit
difference of the summed gradients flips roundings (tests/unit/test_muon.py checks loom's bf16
iteration against torch's bit for bit). Every layout's losses, gradient norms and final weights
match within 1e-5 (MoE weights 5e-5); the optimizer states per rank are ≤ 0.55× AdamW's; resume
is bit-exact with the momentum; a checkpoint reshards from zero3 to tp2 and to ddp."""

from __future__ import annotations

import functools
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.optim._muon as torch_muon
from distributed import run_ranks
from test_lora_ranks import LORA, assert_lora_matches
from test_moe_ranks import MOE, moe_reference
from test_moe_ranks import assert_matches as assert_moe_matches
from test_strategies import HSDP, UNITS, _run, assert_matches_reference, make_config, reference_run
from test_strategies import _reference_run as adamw_reference_run

MUON = ("train.optimizer=muon", "muon.ns_dtype=fp32", "muon.lr=0.02")
ADAMW_MODULES = {"tok_embeddings", "output", "router"}  # the matrices Muon leaves to AdamW


def _fp32_newton_schulz(g, coefficients, steps, eps):
    """The quintic iteration (torch's op for op) without its cast to bf16."""
    a, b, c = coefficients
    x = g.T if g.size(0) > g.size(1) else g
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if g.size(0) > g.size(1) else x


class _TorchMuon(torch.optim.Optimizer):
    """torch's Muon step on each matrix (each expert's view of a stacked tensor)."""

    def __init__(self, params, lr, weight_decay, momentum):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum))

    @torch.no_grad()
    def step(self):
        with mock.patch.object(torch_muon, "_zeropower_via_newtonschulz", _fp32_newton_schulz):
            for group in self.param_groups:
                for p in group["params"]:
                    buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                    for pm, gm, bm in zip(p.view(-1, *p.shape[-2:]), p.grad.view(-1, *p.shape[-2:]),
                                          buf.view(-1, *p.shape[-2:])):
                        torch_muon.muon([pm], [gm], [bm], lr=group["lr"], weight_decay=group["weight_decay"],
                                        momentum=group["momentum"], nesterov=True,
                                        ns_coefficients=(3.4445, -4.775, 2.0315), ns_steps=5, eps=1e-7,
                                        adjust_lr_fn="match_rms_adamw", has_complex=False)


def torch_muon_and_adamw(model, t):
    muon, decay, no_decay = [], [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            matrix = p.ndim >= 2 and not ADAMW_MODULES.intersection(name.split("."))
            (muon if matrix else decay if p.ndim >= 2 else no_decay).append(p)
    adamw = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                               {"params": no_decay, "weight_decay": 0.0}],
                              lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, foreach=True)
    return [_TorchMuon(muon, lr=0.02, weight_decay=t.weight_decay, momentum=0.95), adamw]


@functools.cache
def _reference(corpus: Path, kind: str = "dense"):
    if kind == "moe":
        return moe_reference(corpus, MUON, optimizers=torch_muon_and_adamw)
    return reference_run(make_config(corpus, "ddp", *MUON), optimizers=torch_muon_and_adamw)


CASES = {  # name: (strategy, ranks, overrides)
    "ddp": ("ddp", 2, ()),
    "zero1": ("zero1", 2, ()),
    "zero2": ("zero2", 2, (UNITS,)),
    "zero3-units": ("zero3", 2, (UNITS,)),
    "zero3-3ranks": ("zero3", 3, (UNITS, "train.batch_size=12")),
    "hsdp": ("hsdp", 4, (*HSDP, UNITS)),
    "tp2-sp": ("zero3", 4, ("parallel.tp=2", "parallel.sequence_parallel=true")),
    "pp2": ("zero3", 4, ("parallel.pp=2", UNITS)),
    "cp2": ("zero3", 2, ("parallel.cp=2", UNITS)),
    "moe-ep2": ("zero3", 2, (*MOE, "parallel.ep=2")),
}


def _merged(results) -> list:
    """Each rank's (losses, the stages' weights together, memory, norms)."""
    merged = {}
    for _, state, _, _ in results:
        merged.update(state)
    return [(losses, merged, mem, norms) for losses, _, mem, norms in results]


@pytest.mark.parametrize("case", list(CASES))
def test_layout_matches_torch_muon(corpus, case):
    strategy, world, extra = CASES[case]
    moe = case.startswith("moe")
    ref_losses, ref_norms, ref_state = _reference(corpus, "moe" if moe else "dense")
    if "train.batch_size=12" in extra:
        cfg = make_config(corpus, "ddp", *MUON, "train.batch_size=12")
        ref_losses, ref_norms, ref_state = reference_run(cfg, optimizers=torch_muon_and_adamw)
    results = _merged(_run(corpus, strategy, world, (*MUON, *extra)))
    if moe:  # the MoE check: weights within WEIGHTS_RTOL
        assert_moe_matches(results, ref_losses, ref_norms, ref_state)
    else:
        assert_matches_reference(results, ref_losses, ref_state, ref_norms)


def test_reference_is_not_adamw(corpus):
    """The Muon reference moves the blocks' matrices differently from AdamW (a run that ignored
    train.optimizer would fail the layouts above), and leaves the rest as AdamW would at step 1."""
    _, _, muon_state = _reference(corpus)
    _, _, adamw_state = adamw_reference_run(corpus)
    wq = "layers.0.attention.wq.weight"
    assert (muon_state[wq] - adamw_state[wq]).norm() > 0.1 * adamw_state[wq].norm()


def test_lora_adapters_on_muon(corpus):
    """Muon steps LoRA's A and B (the base frozen) under zero3, as torch's Muon does on one process."""
    extra = (*LORA, *MUON)
    results = _run(corpus, "zero3", 2, (*extra, UNITS))
    assert_lora_matches(results, corpus, MUON, optimizers=torch_muon_and_adamw)


def test_optimizer_states_are_at_most_055_of_adamw(corpus):
    """zero3 on 2 ranks: Muon's one momentum per matrix, AdamW's two moments for the rest. With 12
    blocks the matrices are 93% of the parameters (at 2 blocks, the tiny vocabulary's embedding and
    head are a third, and the ratio is 0.65)."""
    deep = (UNITS, "model.n_layers=12")
    muon = _run(corpus, "zero3", 2, (*MUON, *deep))
    adamw = _run(corpus, "zero3", 2, deep)
    for rank in range(2):
        ratio = muon[0][2][rank]["optimizer_bytes"] / adamw[0][2][rank]["optimizer_bytes"]
        assert ratio <= 0.55, (rank, ratio)


def test_bf16_tracks_the_fp32_reference(corpus):
    """bf16 autocast and Muon's bf16 iteration (the defaults) on zero3: the losses within 2e-2."""
    ref_losses, _, _ = _reference(corpus)
    bf16 = ("train.optimizer=muon", "muon.lr=0.02", "train.precision=bf16", UNITS)
    results = _run(corpus, "zero3", 2, bf16)
    for rank, (losses, *_rest) in enumerate(results):
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        assert rel < 2e-2, (rank, losses, ref_losses)


def test_resume_is_bit_exact(tmp_path):
    """Stopped at step 3 and resumed, each layout's losses equal the uninterrupted run's, bit for
    bit: the momentum came back (a fresh one would change step 4)."""
    from test_checkpoint import _check_bit_exact, _resume_pairs

    cases = {s: [f"parallel.strategy={s}", *MUON] for s in ("zero3", "zero1", "ddp")}
    _check_bit_exact(run_ranks(_resume_pairs, 2, cases, str(tmp_path))[-1])


@pytest.mark.parametrize("before, after", [
    ((2, ["parallel.strategy=zero3", *MUON]), (4, ["parallel.strategy=zero3", "parallel.tp=2", *MUON])),
    ((2, ["parallel.strategy=zero3", *MUON]), (2, ["parallel.strategy=zero1", *MUON])),
    ((4, ["parallel.strategy=zero2", "parallel.pp=2", *MUON]), (2, ["parallel.strategy=ddp", *MUON])),
], ids=["zero3-to-tp2", "zero3-to-zero1", "pp2-to-ddp"])
def test_checkpoints_reshard_with_the_momentum(tmp_path, before, after):
    """Every weight, Muon momentum and Adam state as the other layout holds it, and the continued
    run's losses (test_checkpoint's check)."""
    from test_checkpoint import test_resume_under_another_strategy_reshards_exactly as resharded_exactly

    resharded_exactly(tmp_path, before, after)


def test_exchange_and_states_as_planned(corpus):
    """zero3 on 2 ranks: each rank's Muon all-to-alls (count and payload) and optimizer states as
    the planner prices them (plan/muon.py)."""
    from loom.plan.comm import comm_per_step
    from loom.plan.memory import stage_memory
    from loom.plan.search import config_candidate, config_workload
    from loom.plan.shapes import from_preset

    cfg = make_config(corpus, "zero3", *MUON, UNITS)
    w, c = config_workload(cfg, from_preset("tiny")), config_candidate(cfg, 1, 2, 1, 1)
    planned, _ = comm_per_step(w, c, 8)
    states = stage_memory(w, c, 0, device="cpu").optimizer
    for rank, m in enumerate(_run(corpus, "zero3", 2, (*MUON, UNITS))[0][2]):
        seen = m["comm_by_kind"]["all_to_all"]
        assert seen["count"] == planned.count_by_kind["all_to_all"] == 14, (rank, seen)
        assert seen["payload_bytes"] == pytest.approx(planned.payload_by_kind["all_to_all"], rel=0.02), rank
        assert m["optimizer_bytes"] == pytest.approx(states, rel=0.01), (rank, m["optimizer_bytes"], states)
