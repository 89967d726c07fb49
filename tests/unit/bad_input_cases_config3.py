"""Bad-input cases: config files and plan inputs (docs/bad-input.md, "Config", "Planning")."""

from __future__ import annotations

import subprocess

import pytest
from bad_input import Ctx, case, cli


@case("config-array-of-tables")
def _(c: Ctx) -> str:
    path = c.tmp / "array.toml"
    path.write_text("[[train]]\nsteps = 3\n")
    return c.train(str(path))


@case("plan-params-and-model")
def _(c: Ctx) -> str:
    return cli("plan", "--gpu", "H100-SXM", "--params", "7e9", "--model", "70b", capsys=c.capsys)


@case("analyze-out-is-a-file")
def _(c: Ctx) -> str:
    (c.tmp / "notes.txt").write_text("mine\n")
    return cli("analyze", str(c.tmp / "traces"), "--out", str(c.tmp / "notes.txt"), capsys=c.capsys)


@case("bench-out-is-a-file")
def _(c: Ctx) -> str:
    (c.tmp / "notes.txt").write_text("mine\n")

    def work(*args, **kwargs):  # calibrating (minutes) comes after the --out check, never before
        raise AssertionError(f"loom bench began work before checking --out: {args[:1]}")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess, "run", work)
        message = cli("bench", "--quick", "--out", str(c.tmp / "notes.txt" / "bench"), capsys=c.capsys)
    assert (c.tmp / "notes.txt").read_text() == "mine\n"
    return message


@case("plan-first-preset-unknown")
def _(c: Ctx) -> str:
    import loom.observe.calibrate as calibrate

    def work(*args, **kwargs):  # the first plan's calibration comes after its own arguments are read
        raise AssertionError("loom plan calibrated before checking --model")

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LOOM_DEVICE_PROFILE", str(c.tmp / "device.json"))
        patch.setattr(calibrate, "calibrate", work)
        message = cli("plan", "--model", "llama-70b", capsys=c.capsys)
    assert not (c.tmp / "device.json").exists()
    return message


@case("config-source-beside-mix")
def _(c: Ctx) -> str:
    return c.config(f"data.source={c.corpus}", f'data.mix=[{{source = "{c.corpus}", weight = 1}}]')
