"""Bad-input cases: config values, files and arguments a tester found passing (docs/bad-input.md,
"Config", "Config values", "Data", "LoRA fine-tuning", "Muon", "Checkpoints and resume")."""

from __future__ import annotations

import os

from bad_input import Ctx, case, cli


@case("config-show-unknown-preset")
def _(c: Ctx) -> str:
    return cli("config", "show", "--set", "model.preset=nope", capsys=c.capsys)


@case("config-set-section-without-key")
def _(c: Ctx) -> str:
    return c.config("train.=3")


@case("config-section-as-value")
def _(c: Ctx) -> str:
    path = c.tmp / "flat.toml"
    path.write_text("train = 3\n")
    return c.train(str(path))


@case("config-section-as-empty-array")
def _(c: Ctx) -> str:
    path = c.tmp / "flat.toml"
    path.write_text("train = []\n")
    return c.train(str(path))


@case("config-file-is-a-folder")
def _(c: Ctx) -> str:
    (c.tmp / "adir").mkdir()
    return c.train(str(c.tmp / "adir"))


@case("config-file-is-a-fifo")
def _(c: Ctx) -> str:
    os.mkfifo(c.tmp / "pipe")  # (opened, it would block until something writes to it)
    return c.train(str(c.tmp / "pipe"))


@case("config-file-dev-null")
def _(c: Ctx) -> str:
    return c.train("/dev/null")


@case("config-set-date-is-text")
def _(c: Ctx) -> str:
    return c.train("--set", "data.source=2024-01-01")


@case("config-list-example-own-key")
def _(c: Ctx) -> str:
    return c.config("lora.rank=4", "lora.targets=q")


@case("config-lr-huge")
def _(c: Ctx) -> str:
    return c.config("train.lr=1e39")


@case("config-weight-decay-huge")
def _(c: Ctx) -> str:
    return c.config("train.weight_decay=1e300")


@case("muon-lr-huge")
def _(c: Ctx) -> str:
    return c.config("train.optimizer=muon", "muon.lr=100")


@case("config-mix-text-field-empty")
def _(c: Ctx) -> str:
    return c.config(f'data.mix=[{{source = "{c.corpus}", weight = 1, text_field = ""}}]')


@case("data-eval-fraction-leaves-too-few")
def _(c: Ctx) -> str:
    return c.train("--set", "data.eval_fraction=0.999999")


@case("lora-rank-above-matrices")
def _(c: Ctx) -> str:
    return c.train("--set", "lora.rank=1000")


@case("resume-empty")
def _(c: Ctx) -> str:
    message = c.train("--resume", "")
    assert not (c.tmp / "run").exists(), "the run directory was made before --resume was checked"
    return message
