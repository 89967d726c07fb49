"""Bad-input cases of LoRA fine-tuning (docs/bad-input.md, "LoRA fine-tuning"): the [lora] keys, a
target naming nothing, and a LoRA checkpoint (the adapters alone) where a whole model is needed."""

from __future__ import annotations

import os
from pathlib import Path

from bad_input import Ctx, case, cli

import loom.cli

_RUNS: dict[str, Path] = {}


def _lora_run(c: Ctx) -> Path:
    """A real 2-step LoRA run's checkpoint (made once per session)."""
    if "run" not in _RUNS:
        out = c.request.getfixturevalue("tmp_path_factory").mktemp("lora") / "run"
        env = dict(os.environ)  # an in-process run sets RANK and the like: the next command is no rank
        try:
            assert loom.cli.main(["train", "--nproc", "1", "--out", str(out), *c.base(), "--set",
                                  "train.steps=2", "--set", "lora.rank=4"]) == 0
        finally:
            os.environ.clear()
            os.environ.update(env)
        _RUNS["run"] = out
    return _RUNS["run"] / "checkpoints" / "step_2"


@case("lora-rank-zero")
def _(c: Ctx) -> str:
    return c.train("--set", "lora.rank=0")


@case("lora-without-rank")
def _(c: Ctx) -> str:
    return c.train("--set", "lora.alpha=8")


@case("lora-targets-empty")
def _(c: Ctx) -> str:
    return c.train("--set", "lora.rank=4", "--set", "lora.targets=[]")


@case("lora-target-no-match")
def _(c: Ctx) -> str:
    return c.train("--set", "lora.rank=4", "--set", 'lora.targets=["q", "q_proj_typo"]')


@case("lora-base-dtype-precision")
def _(c: Ctx) -> str:
    return c.train("--set", "lora.rank=4", "--set", "lora.base_dtype=bf16")


@case("lora-deepspeed")
def _(c: Ctx) -> str:
    return c.config("lora.rank=4", "parallel.engine=deepspeed")


@case("lora-init-from-adapters")
def _(c: Ctx) -> str:
    return c.train("--set", f'model.init_from="{_lora_run(c)}"')


@case("lora-export-needs-mode")
def _(c: Ctx) -> str:
    message = cli("export", str(_lora_run(c)), str(c.tmp / "model.safetensors"), capsys=c.capsys)
    assert not (c.tmp / "model.safetensors").exists()
    return message


@case("lora-export-full-model")
def _(c: Ctx) -> str:
    message = cli("export", str(c.step_2), str(c.tmp / "adapter"), "--lora", "adapter", capsys=c.capsys)
    assert not any((c.tmp / "adapter").glob("*"))
    return message
