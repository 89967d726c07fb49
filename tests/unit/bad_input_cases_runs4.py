"""Bad-input cases, fourth pass: exports into checkpoints, run directories loom cannot finish in,
`loom plan`'s own layout against the model it plans (docs/bad-input.md: Planning, Planner and
analysis inputs, Run directory, Your files, Checkpoint files, Pretrained models).

A folder loom may not write is made by refusing the file loom probes it with (tempfile.mkstemp):
the suite runs as root in CI, whom chmod does not stop.
"""

from __future__ import annotations

import errno
import shutil
import tempfile
from pathlib import Path

from bad_input import Ctx, case, cli
from bad_input_cases_data import _train
from bad_input_cases_data4 import _corpus, denied
from bad_input_cases_user_files import unchanged

import loom.cli
from loom.files import lock_run_dir, release_run_dir
from loom.train import safe_load


def unwritable(c: Ctx, folder: Path) -> None:
    """`folder` refuses new files, as a read-only folder refuses a user who is not root."""
    make = tempfile.mkstemp

    def refusing(*args, dir=None, **kwargs):  # noqa: A002 - mkstemp's own name
        if dir is not None and Path(dir).resolve() == folder.resolve():
            raise PermissionError(errno.EACCES, "Permission denied", str(Path(dir) / "x"))
        return make(*args, dir=dir, **kwargs)

    c.monkeypatch.setattr(tempfile, "mkstemp", refusing)


def run_copy(c: Ctx) -> Path:
    """A copy of the catalogue's run (its checkpoint included), to continue or export into."""
    run = c.tmp / "run"
    shutil.copytree(c.ckpt_run, run, symlinks=True)
    return run


# ---------------------------------------------------------------------------------------------
# loom export: never into the checkpoint it reads, nor into a run's checkpoints folder


@case("export-into-its-checkpoint")
def _(c: Ctx) -> str:
    step = run_copy(c) / "checkpoints" / "step_2"
    with unchanged(step):
        return cli("export", str(step), str(step / "__0_0.distcp"), "--overwrite", capsys=c.capsys)


@case("export-into-checkpoints")
def _(c: Ctx) -> str:
    run = run_copy(c)
    with unchanged(run):
        return cli("export", str(run), str(run / "checkpoints" / "model.safetensors"), capsys=c.capsys)


@case("export-output-read-only")
def _(c: Ctx) -> str:
    folder = c.tmp / "models"
    folder.mkdir()
    unwritable(c, folder)
    with unchanged(folder):
        return cli("export", str(c.step_2), str(folder / "model.safetensors"), capsys=c.capsys)


# ---------------------------------------------------------------------------------------------
# a run loom could not finish in: learnt before the ranks start


@case("resume-run-dir-read-only")
def _(c: Ctx) -> str:
    run = run_copy(c)
    unwritable(c, run)
    with unchanged(run):
        return c.train("--resume", "auto", "--set", "train.steps=3", out=run)


@case("resume-checkpoints-read-only")
def _(c: Ctx) -> str:
    run = run_copy(c)
    unwritable(c, run / "checkpoints")
    with unchanged(run):
        return c.train("--resume", "auto", "--set", "train.steps=3", out=run)


@case("resume-run-file-is-a-folder")
def _(c: Ctx) -> str:
    run = run_copy(c)
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").mkdir()
    with unchanged(run):
        return c.train("--resume", "auto", "--set", "train.steps=3", out=run)


@case("resume-profile-too-long")
def _(c: Ctx) -> str:
    run = run_copy(c)  # its checkpoint at step 2
    with unchanged(run):
        return c.train("--resume", "auto", "--set", "train.steps=6", "--set", "profile.enabled=true", out=run)


@case("run-dir-in-use")
def _(c: Ctx) -> str:
    run = run_copy(c)
    held = lock_run_dir(run)  # another loom train's launcher, training there now
    try:
        with unchanged(run):
            return c.train("--resume", "auto", "--set", "train.steps=3", out=run)
    finally:
        release_run_dir(held)


@case("run-dir-overwrite-in-use")
def _(c: Ctx) -> str:
    run = run_copy(c)
    held = lock_run_dir(run)
    try:
        with unchanged(run):
            return c.train("--overwrite", out=run)
    finally:
        release_run_dir(held)


# ---------------------------------------------------------------------------------------------
# a checkpoint that is whole but not readable by this user, a model folder's weights file


@case("ckpt-not-readable")
def _(c: Ctx) -> str:
    denied = PermissionError(errno.EACCES, "Permission denied", str(c.step_2 / "__0_0.distcp"))
    return str(safe_load.unreadable(c.step_2, denied))


@case("model-init-from-folder-weights")
def _(c: Ctx) -> str:
    folder = c.tmp / "hf"
    folder.mkdir()
    assert loom.cli.main(["export", str(c.step_2), str(folder / "model.safetensors"), "--layout", "hf"]) == 0
    return c.train("--set", f"model.init_from={folder / 'model.safetensors'}")


@case("model-init-from-other-tokenizer")
def _(c: Ctx) -> str:
    return c.train("--set", f"model.init_from={c.step_2}", "--set", "data.tokenizer=bpe",
                   "--set", "data.bpe_vocab_size=300")


@case("data-glob-subfolder-unreadable")
def _(c: Ctx) -> str:
    folder = c.tmp / "texts"
    (folder / "more").mkdir(parents=True)
    _corpus(folder / "a.txt")
    _corpus(folder / "more" / "b.txt")
    with denied(folder / "more"):  # glob skipped it: half the data, and exit 0
        return _train(c, Path(f"{folder}/**/*.txt"))


# ---------------------------------------------------------------------------------------------
# a launcher's variables left in the shell: no rank of a group that does not exist


def bare_train(c: Ctx, **env: str) -> str:
    """`loom train` without --nproc (as a rank would be started), `env` in its environment."""
    for name, value in env.items():
        c.monkeypatch.setenv(name, value)
    c.monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    return cli("train", "--out", str(c.tmp / "run"), *c.base(), capsys=c.capsys)


@case("env-rank-not-a-number")
def _(c: Ctx) -> str:
    return bare_train(c, RANK="junk")


@case("env-rank-alone")
def _(c: Ctx) -> str:
    return bare_train(c, RANK="0")


@case("env-slurm-ntasks-no-task")
def _(c: Ctx) -> str:
    c.monkeypatch.delenv("SLURM_PROCID", raising=False)
    return bare_train(c, SLURM_NTASKS="4")


@case("env-rank-with-nproc")
def _(c: Ctx) -> str:
    launched = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29556"}
    for name, value in launched.items():  # a whole env:// set, left in the shell
        c.monkeypatch.setenv(name, value)
    mine = c.tmp / "myproj"
    mine.mkdir()
    (mine / "config.toml").write_text("my own config\n")
    with unchanged(mine):
        return c.train(out=mine)


# ---------------------------------------------------------------------------------------------
# loom bench: where it writes, what it runs


@case("bench-out-empty")
def _(c: Ctx) -> str:
    folder = c.tmp / "project"
    folder.mkdir()
    (folder / "results.md").write_text("# my own results\n")
    c.monkeypatch.chdir(folder)
    with unchanged(folder):
        return cli("bench", "--quick", "--only", "checkpoint", "--out", "", capsys=c.capsys)


@case("bench-gpu-only-cpu")
def _(c: Ctx) -> str:
    return cli("bench", "--gpu", "--only", "checkpoint", "--out", str(c.tmp / "bench"), capsys=c.capsys)


# ---------------------------------------------------------------------------------------------
# where a calibration writes the device profile: checked before minutes of measuring


def calibrate_into(c: Ctx, target: Path) -> str:
    import loom.observe.calibrate as calibrate

    def work(*args, **kwargs):
        raise AssertionError("loom plan calibrated before checking where the profile goes")

    c.monkeypatch.setenv("LOOM_DEVICE_PROFILE", str(target))
    c.monkeypatch.setattr(calibrate, "calibrate", work)
    return cli("plan", "--calibrate", "--quick", "--model", "tiny", capsys=c.capsys)


@case("plan-calibrate-over-other-file")
def _(c: Ctx) -> str:
    (c.tmp / "notes.txt").write_text("my notes\n")
    with unchanged(c.tmp):
        return calibrate_into(c, c.tmp / "notes.txt")


@case("plan-calibrate-into-folder")
def _(c: Ctx) -> str:
    (c.tmp / "profiles").mkdir()
    return calibrate_into(c, c.tmp / "profiles")


# ---------------------------------------------------------------------------------------------
# loom plan: the config's own layout on the model it plans, as loom train checks it


def plan(c: Ctx, *args: str) -> str:
    return cli("plan", "--gpu", "H100-SXM", *args, capsys=c.capsys)


@case("plan-set-pp-over-layers")
def _(c: Ctx) -> str:
    return plan(c, "--model", "tiny", "--set", "parallel.pp=4")


@case("plan-set-tp-heads")
def _(c: Ctx) -> str:
    return plan(c, "--model", "tiny", "--set", "parallel.tp=8")


@case("plan-set-ep-dense")
def _(c: Ctx) -> str:
    return plan(c, "--model", "tiny", "--set", "parallel.ep=2")


@case("plan-model-and-set-model")
def _(c: Ctx) -> str:
    return plan(c, "--model", "8b", "--set", "model.n_layers=2")


@case("plan-explain-json")
def _(c: Ctx) -> str:
    return plan(c, "--model", "tiny", "--format", "json", "--explain", "3")
