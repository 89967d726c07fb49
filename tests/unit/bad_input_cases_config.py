"""Bad-input cases of config values, the launch and DeepSpeed JSON (docs/bad-input.md, "Config
values"): every field's type and range (finite numbers, positive sizes, seeds, timeouts, choices,
paths that are not blank), the device, model shapes too big to build, the keys of a DeepSpeed JSON
that loom derives itself, and an error raised inside the ranks, which reaches the user as one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import torch
from bad_input import ROOT, TINY, Ctx, case

DS = ("parallel.engine=deepspeed",)


def _ds_json(c: Ctx, text: str) -> str:
    path = c.tmp / "ds.json"
    path.write_text(text)
    return c.config(*DS, f'parallel.deepspeed_config="{path}"')


# ---------------------------------------------------------------------------------------------
# numbers: finite, in range


@case("config-lr-inf")
def _(c: Ctx) -> str:
    return c.train("--set", "train.lr=inf")


@case("config-weight-decay-inf")
def _(c: Ctx) -> str:
    path = c.tmp / "run.toml"
    path.write_text("[train]\nweight_decay = inf\n")  # TOML's own literal
    return c.train(str(path))


@case("config-grad-clip-nan")
def _(c: Ctx) -> str:
    return c.train("--set", "train.grad_clip=nan")


@case("config-seed-negative")
def _(c: Ctx) -> str:
    return c.train("--set", "train.seed=-1")


@case("config-seed-too-big")
def _(c: Ctx) -> str:
    return c.train("--set", f"train.seed={2**32}")


@case("config-timeout-inf")
def _(c: Ctx) -> str:
    return c.train("--set", "train.collective_timeout_s=inf")


@case("config-fsdp-unit-nan")
def _(c: Ctx) -> str:
    return c.config("parallel.fsdp_unit_mb=nan")


@case("config-ddp-bucket-inf")
def _(c: Ctx) -> str:
    return c.config("parallel.ddp_bucket_mb=inf")


@case("config-steps-huge")
def _(c: Ctx) -> str:
    return c.train("--set", "train.steps=10000000000")


@case("config-workers-huge")
def _(c: Ctx) -> str:
    return c.config("data.num_workers=100000")


@case("config-mix-weight-inf")
def _(c: Ctx) -> str:
    return c.train("--set", f'data.mix=[{{source = "{c.corpus}", weight = inf}}]')


@case("config-file-wrong-type")
def _(c: Ctx) -> str:
    path = c.tmp / "run.toml"
    path.write_text('[model]\nn_kv_heads = "8"\n')
    return c.train(str(path))


# ---------------------------------------------------------------------------------------------
# model shapes too big to build: refused before the data is read or anything allocated


@case("config-d-model-huge")
def _(c: Ctx) -> str:
    return c.train("--set", "model.d_model=99999999999")


@case("config-model-too-big")
def _(c: Ctx) -> str:
    return c.train("--set", "model.d_model=131072", "--set", "model.n_layers=1024",
                   "--set", "model.ffn_hidden=1048576")


# ---------------------------------------------------------------------------------------------
# paths and names: never blank


@case("config-source-empty")
def _(c: Ctx) -> str:
    (c.tmp / "id_rsa").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")  # what "" would have read
    return c.train("--set", 'data.source=""')


@case("config-source-nul")
def _(c: Ctx) -> str:
    return c.train("--set", 'data.source="corpus\\u0000.txt"')


@case("config-tokenizer-empty")
def _(c: Ctx) -> str:
    return c.train("--set", 'data.tokenizer=""')


@case("config-init-from-blank")
def _(c: Ctx) -> str:
    return c.train("--set", 'model.init_from="  "')


# ---------------------------------------------------------------------------------------------
# the device


@case("config-device-cuda-absent")
def _(c: Ctx) -> str:
    c.monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU host, wherever this runs
    return c.train("--set", "train.device=cuda")


@case("config-device-unknown")
def _(c: Ctx) -> str:
    return c.train("--set", "train.device=mps")


# ---------------------------------------------------------------------------------------------
# DeepSpeed JSON: loom's own keys refused, the others type-checked


@case("engine-deepspeed-config-derived-key")
def _(c: Ctx) -> str:
    return _ds_json(c, '{"zero_optimization": {"stage": 3}}')


@case("engine-deepspeed-config-optimizer")
def _(c: Ctx) -> str:
    return _ds_json(c, '{"optimizer": {"type": "Adam", "params": {"lr": 0.001}}}')


@case("engine-deepspeed-config-monitor")
def _(c: Ctx) -> str:
    return _ds_json(c, '{"wandb": {"enabled": true, "project": "x"}}')


@case("engine-deepspeed-config-section-value")
def _(c: Ctx) -> str:
    return _ds_json(c, '{"zero_optimization": true}')


@case("engine-deepspeed-config-flag-type")
def _(c: Ctx) -> str:
    return _ds_json(c, '{"wall_clock_breakdown": "yes"}')


@case("engine-deepspeed-config-typo")
def _(c: Ctx) -> str:
    return _ds_json(c, '{"zero_optimisation": {"overlap_comm": false}}')


@case("engine-deepspeed-config-invalid-value")
def _(c: Ctx) -> str:
    return _ds_json(c, '{"fp16": {"loss_scale_window": "often"}}')


@case("engine-deepspeed-config-on-torch")
def _(c: Ctx) -> str:
    path = c.tmp / "ds.json"
    path.write_text("{}")
    return c.config(f'parallel.deepspeed_config="{path}"')


# ---------------------------------------------------------------------------------------------
# the launch


@case("launch-nnodes-negative")
def _(c: Ctx) -> str:
    return c.train("--nnodes", "-1")


@case("rank-error-one-line")
def _(c: Ctx) -> str:
    """Two ranks under torchrun each fail to read a damaged checkpoint payload (a LoomError, not
    agreed between them): the user sees one line, not a line per rank and torchrun's report."""
    step = shutil.copytree(c.step_2, c.tmp / "base" / "checkpoints" / "step_2")
    payload = next(step.glob("*.distcp"))
    data = bytearray(payload.read_bytes())
    for i in range(100, len(data), 997):  # same size, every entry's bytes garbled
        data[i] ^= 0x5A
    payload.write_bytes(bytes(data))
    args = ["train", "--nproc", "2", "--out", str(c.tmp / "run"), *TINY, "--set", f'data.source="{c.corpus}"',
            "--set", "train.steps=4", "--resume", str(step)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("LOOM_FAULTS", None)
    r = subprocess.run([sys.executable, "-m", "loom.cli", *args], capture_output=True, text=True, env=env,
                       timeout=300)
    errors = [line for line in r.stderr.splitlines() if line.startswith("loom: error: ")]
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "ChildFailedError" not in r.stderr, r.stderr[-3000:]
    assert len(errors) == 1, r.stderr[-3000:]
    return errors[0].removeprefix("loom: error: ")
