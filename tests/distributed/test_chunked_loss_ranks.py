"""The chunked loss (train.loss_chunk) on spawned gloo ranks: the same losses, gradient norms and
trained weights as the single-process reference and as loss_chunk = 0, under zero3 with a unit per
block (the head its own FSDP2 unit, gathered only inside its call), SFT masks and token weighting,
and DeepSpeed's ZeRO-3; ddp under autocast and zero3 in bf16 within bf16's noise. Eval losses too.
Under every layout (tp2 vocabulary-parallel, with sequence parallelism, pp2 under zero3 and ddp,
SFT masks, DeepSpeed) the same loss, eval loss and every parameter's gradient as loss_chunk = 0
within fp32 rounding, and no fp32 [tokens, vocab] (or [tokens, vocab / tp]) tensor saved for
backward. A micro-batch holds 2 × 32 = 64 tokens here: a chunk of 24 gives three chunks, the last
one short."""

from __future__ import annotations

import importlib.util

import pytest
import test_strategies as S
import torch
from distributed import run_ranks
from optional import DEEPSPEED, TEST_EXTRA, require_module

from loom.parallel.mesh import local_view
from loom.train.driver import train

CHUNK = "train.loss_chunk=24"
FULL = "train.loss_chunk=0"


def _rank_train(cfg):
    r = train(cfg, None, return_state=True, quiet=True)
    return r.losses, r.state_dict, r.memory, r.grad_norms, r.eval_loss


CASES = [("zero3", 2, (S.UNITS,)), ("ddp", 2, ("train.precision=bf16",)),
         ("zero3", 2, (S.UNITS, "train.precision=bf16"))]
IDS = ["zero3-units", "ddp-bf16", "zero3-units-bf16"]


@pytest.mark.parametrize("strategy,world,extra", CASES, ids=IDS)
def test_chunked_loss_trains_as_the_full_logits(corpus, strategy, world, extra):
    chunked = run_ranks(_rank_train, world, S.make_config(corpus, strategy, *extra, CHUNK))
    full = run_ranks(_rank_train, world, S.make_config(corpus, strategy, *extra, FULL))
    if extra == (S.UNITS,):  # the whole model on each rank's gathered state: the reference's too
        ref_losses, _, ref_state = S._reference_run(corpus)
        S.assert_matches_reference(chunked, ref_losses, ref_state, S._reference_norms(corpus))
        S.assert_matches_reference(full, ref_losses, ref_state, S._reference_norms(corpus))
    rtol = 1e-5 if "train.precision=bf16" not in extra else 2e-2  # bf16 logits on both paths
    for c, f in zip(chunked, full, strict=True):
        for a, b in zip(c[0] + c[3] + [c[4]], f[0] + f[3] + [f[4]], strict=True):  # losses, norms, eval
            assert abs(a - b) <= rtol * abs(b), (c[0], f[0], c[3], f[3], c[4], f[4])


def _losses(cfg):
    r = train(cfg, None, quiet=True)
    return r.losses, r.eval_loss


@pytest.mark.parametrize("extra", [("parallel.strategy=zero3", S.UNITS, "train.grad_accum=2"),
                                   ("parallel.strategy=zero3", "parallel.engine=deepspeed")],
                         ids=["zero3-units-accum2", "deepspeed-zero3"])
def test_sft_chunked_loss_matches_the_full_logits(tmp_path_factory, extra):
    require_module("datasets", TEST_EXTRA)
    if "parallel.engine=deepspeed" in extra:
        require_module("deepspeed", DEEPSPEED)
    import test_sft

    data = test_sft.sft_data.__wrapped__(tmp_path_factory)
    ref = run_ranks(_losses, 1, test_sft._config(data, "parallel.strategy=ddp", FULL))[0]
    for chunk in (CHUNK, FULL):
        for losses, eval_loss in run_ranks(_losses, 2, test_sft._config(data, *extra, chunk)):
            assert len(losses) == len(ref[0]) and ref[0][-1] < ref[0][0]
            for a, b in zip(losses + [eval_loss], ref[0] + [ref[1]], strict=True):
                assert abs(a - b) <= 1e-4 * abs(b), (chunk, losses, eval_loss, ref)


# Every layout, chunked and not, in one spawned world of 2 (one spawn: each run is a few seconds).
LAYOUTS = {
    "tp2": ("zero3", "parallel.tp=2"),
    "tp2-sp": ("zero3", "parallel.tp=2", "parallel.sequence_parallel=true", S.UNITS),
    "pp2": ("zero3", "parallel.pp=2", S.UNITS),
    "pp2-ddp-1f1b": ("ddp", "parallel.pp=2", "parallel.pp_schedule=1f1b"),
    "deepspeed": ("zero3", "parallel.engine=deepspeed"),
}
SFT_LAYOUTS = {  # (SFT data) masked targets and the loss-token weighting, chunked on the shard / last stage
    "sft-tp2-sp": ("parallel.strategy=zero3", "parallel.tp=2", "parallel.sequence_parallel=true",
                   "train.grad_accum=2"),
    "sft-pp2": ("parallel.strategy=zero3", "parallel.pp=2", S.UNITS),
}
VOCAB = 256  # the tiny preset's
EXACT = 1e-6  # fp32 rounding of sums over the vocabulary (relative to the largest entry)


def _rank_layouts(runs: dict):
    """Each config trained on this rank: its losses, eval loss, final gathered weights, the first
    step's gradients (this rank's part of every parameter's) and the fp32 logits-sized tensors
    saved for backward."""
    from loom.train import step as step_module

    out, optimizer_step = {}, step_module._optimizer_step
    for name, cfg in runs.items():
        grads, logits = [], []
        tp = cfg.parallel.tp

        def record(optimizer, scheduler, scaler, params, *args):
            if not grads:
                grads.extend(local_view(p.grad).detach().clone() for p in params)
            return optimizer_step(optimizer, scheduler, scaler, params, *args)

        def pack(x):
            local = local_view(x)
            if (x.dtype == torch.float32 and local.dim() >= 2 and local.shape[-1] in (VOCAB, VOCAB // tp)
                    and local.numel() >= 32 * (VOCAB // tp)):  # one sequence of logits, or more
                logits.append(tuple(local.shape))
            return x

        step_module._optimizer_step = record
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
                r = train(cfg, None, return_state=True, quiet=True)
        finally:
            step_module._optimizer_step = optimizer_step
        out[name] = (r.losses, r.eval_loss, r.grad_norms, r.state_dict, grads, logits)
    return out


@pytest.fixture(scope="module")
def layout_runs(corpus, tmp_path_factory):
    runs = {}
    for name, (strategy, *extra) in LAYOUTS.items():
        if "parallel.engine=deepspeed" in extra and importlib.util.find_spec("deepspeed") is None:
            continue
        for chunk in (CHUNK, FULL):
            runs[name, chunk] = S.make_config(corpus, strategy, *extra, chunk)
    if importlib.util.find_spec("datasets") is not None:
        import test_sft

        data = test_sft.sft_data.__wrapped__(tmp_path_factory)
        for name, extra in SFT_LAYOUTS.items():
            for chunk in (CHUNK, FULL):
                runs[name, chunk] = test_sft._config(data, *extra, chunk)
    return run_ranks(_rank_layouts, 2, runs, timeout=600)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a - b).abs().max().item() <= EXACT * max(b.abs().max().item(), 1e-12)


@pytest.mark.parametrize("layout", [*LAYOUTS, *SFT_LAYOUTS])
def test_chunked_loss_is_exact_under_every_layout(layout_runs, layout):
    if layout == "deepspeed":
        require_module("deepspeed", DEEPSPEED)
    if layout.startswith("sft"):
        require_module("datasets", TEST_EXTRA)
    saw_logits = False
    for rank, results in enumerate(layout_runs):
        chunked, full = results[layout, CHUNK], results[layout, FULL]
        losses, eval_loss, norms, state, grads, logits = chunked
        f_losses, f_eval, f_norms, f_state, f_grads, f_logits = full
        assert len(losses) == len(f_losses) and f_losses[-1] < f_losses[0], (rank, f_losses)
        for a, b in zip([*losses, eval_loss, *norms], [*f_losses, f_eval, *f_norms], strict=True):
            assert abs(a - b) <= EXACT * abs(b), (rank, losses, f_losses, eval_loss, f_eval, norms, f_norms)
        assert len(grads) == len(f_grads) and (grads or layout == "deepspeed")  # DeepSpeed steps itself
        for i, (a, b) in enumerate(zip(grads, f_grads, strict=True)):
            assert _close(a, b), (rank, i, tuple(b.shape), (a - b).abs().max().item(), b.abs().max().item())
        # A few Adam steps on (which amplify rounding): the weights too. SFT's masked targets leave
        # gradients near zero whose Adam steps amplify it most; the chunked path's gradients are
        # scaled after their matmuls (computed in forward): 1.8e-5 on sft-pp2's w2.
        rtol = 3 * S.RTOL if layout.startswith("sft") else S.RTOL
        for key, b in f_state.items():
            assert ((state[key] - b).norm() / b.norm()).item() < rtol, (rank, key)
        assert not logits, (rank, logits)  # the lean path keeps no logits for backward
        saw_logits |= bool(f_logits)
    assert saw_logits  # the full path does, where the head is: the check sees them
