"""DualPipeV's overlapped forward and backward under expert parallelism (loom/parallel/fb_overlap.py) on
gloo ranks: the same run with `parallel.dualpipev_overlap` on and off gives the same losses, gradient
norms and weights, bit for bit (each micro-batch's forward and backward run the same ops in the same
order; only which thread runs them, and when, differs), and the overlapped run did overlap. At pp 2 ×
ep 2 the sides run free (the backward's all-to-alls over its own group), under activation
checkpointing the backward's recomputed forward exchanges over that group too, and with tp 2 + SP the
compute segments take turns. That the schedule itself matches the single process is
tests/distributed/test_zero_bubble.py's moe-ep2 case (overlapped, the default)."""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks
from test_moe_ranks import MOE
from test_strategies import STEPS, make_config

from loom.train.driver import train

LAYOUT = ("parallel.pp=2", "parallel.pp_schedule=dualpipev", "parallel.ep=2", "model.n_layers=4",
          "parallel.microbatches=4", "train.batch_size=16")


def _rank_runs(cfgs: list) -> list:
    """On one rank: each config trained in turn, with the overlapped actions it ran and the exchanges
    that went over the backward side's own group."""
    from loom.parallel import expert_parallel, fb_overlap

    own_group = []

    def counted(group):
        chosen = fb_overlap.exchange_group(group)
        own_group.append(chosen is not group)
        return chosen

    expert_parallel.exchange_group = counted
    out = []
    for cfg in cfgs:
        before, own_group[:] = fb_overlap.overlapped_actions(), []
        r = train(cfg, None, return_state=True, quiet=True)
        overlapped = fb_overlap.overlapped_actions() - before
        out.append((r.losses, r.grad_norms, r.state_dict, overlapped, sum(own_group)))
    return out


def _assert_same(on, off, what: str) -> None:
    losses, norms, state, overlapped, own_group = on
    assert overlapped > 0 and off[3] == 0, f"{what}: {overlapped} actions overlapped, {off[3]} without"
    assert own_group > 0 and off[4] == 0, f"{what}: {own_group} exchanges over the backward's group, {off[4]}"
    assert len(losses) == STEPS and losses == off[0] and norms == off[1], f"{what}: {losses} vs {off[0]}"
    assert state.keys() == off[2].keys()
    for name, value in state.items():
        assert torch.equal(value, off[2][name]), f"{what}: {name} differs"


@pytest.mark.parametrize("world, extra", [
    (4, ((), ("parallel.activation_checkpointing=full",))),
    (8, (("parallel.tp=2", "parallel.sequence_parallel=true"),)),
], ids=["ep2-free-and-ac", "ep2xtp2-turns"])
def test_overlap_changes_no_bit(corpus, world, extra):
    cfgs = [make_config(corpus, "zero3", *MOE, *LAYOUT, *keys, f"parallel.dualpipev_overlap={flag}")
            for keys in extra for flag in ("true", "false")]
    results = run_ranks(_rank_runs, world, cfgs)
    for rank, runs in enumerate(results):
        for i, keys in enumerate(extra):
            _assert_same(runs[2 * i], runs[2 * i + 1], f"rank {rank} {' '.join(keys) or 'ep2'}")
