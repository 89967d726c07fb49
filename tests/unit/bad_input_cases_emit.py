"""Bad-input cases: a config `loom plan --emit` wrote (docs/bad-input.md, "Data"): its data and
tokenizer are placeholders, refused by `loom train` in one line until set."""

from __future__ import annotations

from bad_input import Ctx, case, cli

import loom.cli


@case("data-placeholder")
def _(c: Ctx) -> str:
    emitted = c.tmp / "run.toml"
    assert loom.cli.main(["plan", "--model", "8b", "--gpu", "H100-SXM", "--emit", str(emitted)]) == 0
    return cli("train", str(emitted), "--nproc", "1", "--out", str(c.tmp / "out"), capsys=c.capsys)
