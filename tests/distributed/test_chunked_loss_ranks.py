"""The chunked loss (train.loss_chunk) on spawned gloo ranks: the same losses, gradient norms and
trained weights as the single-process reference and as loss_chunk = 0, under zero3 with a unit per
block (the head its own FSDP2 unit, gathered only inside its call), SFT masks and token weighting,
and DeepSpeed's ZeRO-3; ddp under autocast and zero3 in bf16 within bf16's noise; tp2 and pp2 (the
full logits whatever loss_chunk says) unchanged. Eval losses too. A micro-batch holds 2 × 32 = 64
tokens here: a chunk of 24 gives three chunks, the last one short."""

from __future__ import annotations

import pytest
import test_strategies as S
from distributed import run_ranks
from optional import DEEPSPEED, TEST_EXTRA, require_module

from loom.train.driver import train

CHUNK = "train.loss_chunk=24"
FULL = "train.loss_chunk=0"


def _rank_train(cfg):
    r = train(cfg, None, return_state=True, quiet=True)
    return r.losses, r.state_dict, r.memory, r.grad_norms, r.eval_loss


# tp2 and pp2 keep the full logits whatever loss_chunk says (README): they must still train alike.
CASES = [("zero3", 2, (S.UNITS,)), ("ddp", 2, ("train.precision=bf16",)),
         ("zero3", 2, (S.UNITS, "train.precision=bf16")), ("zero3", 2, ("parallel.tp=2",)),
         ("zero3", 2, ("parallel.pp=2",))]
IDS = ["zero3-units", "ddp-bf16", "zero3-units-bf16", "tp2", "pp2"]


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
