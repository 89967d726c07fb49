"""Bad-input cases of Muon (docs/bad-input.md, "Muon"): the [muon] keys, and what train.optimizer =
"muon" cannot run with."""

from __future__ import annotations

from bad_input import Ctx, case


@case("muon-fused")
def _(c: Ctx) -> str:
    return c.train("--set", "train.optimizer=muon", "--set", "train.optimizer_impl=fused")


@case("muon-ns-steps-zero")
def _(c: Ctx) -> str:
    return c.train("--set", "train.optimizer=muon", "--set", "muon.ns_steps=0")


@case("muon-momentum-negative")
def _(c: Ctx) -> str:
    return c.train("--set", "train.optimizer=muon", "--set", "muon.momentum=-0.9")


@case("muon-keys-without-muon")
def _(c: Ctx) -> str:
    return c.train("--set", "muon.lr=0.02")


@case("muon-deepspeed")
def _(c: Ctx) -> str:
    return c.config("train.optimizer=muon", "parallel.engine=deepspeed")


@case("muon-zero1-tp")
def _(c: Ctx) -> str:
    return c.config("train.optimizer=muon", "parallel.strategy=zero1", "parallel.tp=2", world=2)


@case("muon-optimizer-unknown")
def _(c: Ctx) -> str:
    return c.train("--set", "train.optimizer=lion")


@case("muon-offload")
def _(c: Ctx) -> str:
    return c.config("train.optimizer=muon", "parallel.strategy=zero3", "parallel.offload=cpu")
