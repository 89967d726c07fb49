"""Bad-input cases of checkpoint files (docs/bad-input.md, "Checkpoint files"): DCP's index
(`.metadata`) whose chunks would leave a tensor partly unwritten or read the wrong bytes, a
`latest` marker or a `step_N` link that leads out of the run, and wrong types in meta.json and
rng_rank<r>.json. Each starts from the catalogue's real 2-step checkpoint (`c.step_2`)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from bad_input import Ctx, case, cli


def _resume_crafted(c: Ctx, kind: str) -> str:
    from crafted import craft

    path = craft(kind, c.step_2, c.tmp / "old" / "checkpoints" / "step_2", c.tmp / "MARKER")
    return c.train("--resume", str(path), "--set", "train.steps=4")


@case("ckpt-chunks-empty")
def _(c: Ctx) -> str:
    return _resume_crafted(c, "chunks-empty")


@case("ckpt-chunks-empty-export")
def _(c: Ctx) -> str:
    from crafted import craft

    path = craft("chunks-empty", c.step_2, c.tmp / "old" / "checkpoints" / "step_2", c.tmp / "MARKER")
    message = cli("export", str(path), str(c.tmp / "model.safetensors"), capsys=c.capsys)
    assert not (c.tmp / "model.safetensors").exists()
    return message


@case("ckpt-chunks-overlap")
def _(c: Ctx) -> str:
    return _resume_crafted(c, "chunks-overlap")


@case("ckpt-chunks-gap-and-overlap")
def _(c: Ctx) -> str:
    return _resume_crafted(c, "chunks-misplaced")


@case("ckpt-chunk-outside")
def _(c: Ctx) -> str:
    return _resume_crafted(c, "chunk-outside")


@case("ckpt-storage-missing")
def _(c: Ctx) -> str:
    return _resume_crafted(c, "storage-missing")


@case("ckpt-entry-no-properties")
def _(c: Ctx) -> str:
    return _resume_crafted(c, "entry-no-properties")


@case("ckpt-entry-size-type")
def _(c: Ctx) -> str:
    return _resume_crafted(c, "size-wrong-type")


@case("ckpt-payload-shared")
def _(c: Ctx) -> str:
    return _resume_crafted(c, "payload-shared")


@case("ckpt-payload-short")
def _(c: Ctx) -> str:
    return _resume_crafted(c, "payload-short")


# ---------------------------------------------------------------------------------------------
# `latest` and step_N: a resume never leaves the run's checkpoints/ folder


def _run_copy(c: Ctx) -> Path:
    """A copy of the catalogue's run (continued below with --resume auto), and a valid checkpoint
    outside it, at ELSEWHERE/step_2, that a link or a `latest` could lead to."""
    run = c.tmp / "run"
    shutil.copytree(c.ckpt_run, run, symlinks=True)
    shutil.copytree(c.step_2, c.tmp / "elsewhere" / "step_2")
    return run


@case("ckpt-latest-escapes")
def _(c: Ctx) -> str:
    run = _run_copy(c)
    (run / "checkpoints" / "latest").write_text("../../elsewhere/step_2\n")
    return c.train("--resume", "auto", "--set", "train.steps=4")


@case("ckpt-latest-not-utf8")
def _(c: Ctx) -> str:
    run = _run_copy(c)
    (run / "checkpoints" / "latest").write_bytes(b"\xffstep_2\n")
    return c.train("--resume", "auto", "--set", "train.steps=4")


@case("ckpt-step-symlink")
def _(c: Ctx) -> str:
    run = _run_copy(c)
    step = run / "checkpoints" / "step_2"
    shutil.rmtree(step)
    os.symlink(c.tmp / "elsewhere" / "step_2", step)
    return c.train("--resume", "auto", "--set", "train.steps=4")


# ---------------------------------------------------------------------------------------------
# meta.json and rng_rank<r>.json: typed fields, one line naming the file and the field


def _edited(c: Ctx, name: str, edit) -> Path:
    copy = c.tmp / "old" / "checkpoints" / "step_2"
    shutil.copytree(c.step_2, copy)
    doc = json.loads((copy / name).read_text())
    edit(doc)
    (copy / name).write_text(json.dumps(doc))
    return copy


@case("ckpt-meta-wrong-type")
def _(c: Ctx) -> str:
    path = _edited(c, "meta.json", lambda m: m.update(step="2"))
    return c.train("--resume", str(path), "--set", "train.steps=4")


@case("ckpt-meta-config-not-toml")
def _(c: Ctx) -> str:
    path = _edited(c, "meta.json", lambda m: m.update(config="[train\nsteps = 2\n"))
    return c.train("--resume", str(path), "--set", "train.steps=4")


@case("ckpt-meta-schedule-nan")
def _(c: Ctx) -> str:
    path = _edited(c, "meta.json", lambda m: m["scheduler"].update(base_lrs=[float("nan")] * 2))
    return c.train("--resume", str(path), "--set", "train.steps=4")


@case("ckpt-meta-step-edited")
def _(c: Ctx) -> str:
    path = _edited(c, "meta.json", lambda m: m.update(step=1))
    return c.train("--resume", str(path), "--set", "train.steps=4")


@case("ckpt-meta-step-huge")
def _(c: Ctx) -> str:
    path = _edited(c, "meta.json", lambda m: m.update(step=10**30))
    return c.train("--resume", str(path), "--set", "train.steps=4")


@case("ckpt-adam-step-ahead")
def _(c: Ctx) -> str:
    def back_to_step_1(meta: dict) -> None:  # every counter of meta.json edited alike; Adam's says 2
        meta.update(step=1)
        meta["scheduler"].update(last_epoch=1, _step_count=2)
        meta["data"].update(next_global_batch=1, samples_seen=4, tokens_seen=128)

    path = _edited(c, "meta.json", back_to_step_1)
    return c.train("--resume", str(path), "--set", "train.steps=4")


@case("ckpt-data-other-content")
def _(c: Ctx) -> str:
    other = c.tmp / "elsewhere" / "corpus.txt"
    other.parent.mkdir()
    other.write_text(Path(c.corpus).read_text().upper())
    return c.train("--resume", str(c.step_2), "--set", f'data.source="{other}"', "--set", "train.steps=4")


def _with_a_nan_weight(c: Ctx) -> Path:
    """c.step_2 rewritten with one NaN in model.norm.weight (its meta and RNG files as they were)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from loom.train import checkpoint

    state = checkpoint.read_tensors(c.step_2, "")
    state["model.norm.weight"][3] = float("nan")
    path = c.tmp / "old" / "checkpoints" / "step_2"
    path.mkdir(parents=True)
    with torch.no_grad():
        dcp.save(state, checkpoint_id=path, no_dist=True)
    for f in c.step_2.glob("*.json"):
        shutil.copy(f, path / f.name)
    return path


@case("ckpt-weight-nan")
def _(c: Ctx) -> str:
    return c.train("--resume", str(_with_a_nan_weight(c)), "--set", "train.steps=4")


@case("ckpt-init-from-weight-nan")
def _(c: Ctx) -> str:
    return c.train("--set", f'model.init_from="{_with_a_nan_weight(c)}"', "--set", "train.steps=2")


def _before_any_rank(c: Ctx, path: Path) -> str:
    """`loom train --resume path`, failing if a rank (here: the world of one) starts training:
    every rank's RNG file is read by the launcher first."""
    import loom.train.driver

    def no_rank(*args, **kwargs):
        raise AssertionError("a rank started: the RNG files were not checked before launch")

    c.monkeypatch.setattr(loom.train.driver, "train", no_rank)
    return c.train("--resume", str(path), "--set", "train.steps=4")


@case("ckpt-rng-wrong-type")
def _(c: Ctx) -> str:
    def words_as_text(rng: dict) -> None:
        rng["python"][1] = [str(x) for x in rng["python"][1]]

    return _before_any_rank(c, _edited(c, "rng_rank0.json", words_as_text))


@case("ckpt-rng-wrong-length")
def _(c: Ctx) -> str:
    return _before_any_rank(c, _edited(c, "rng_rank0.json", lambda r: r.update(torch=r["torch"][:40])))
