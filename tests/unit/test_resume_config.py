"""A resume continues the run as it was configured (issue 25): the run's config.toml is the base,
only what the command gives goes on top (each change told in one line), config.toml stays what the
run trains, and every hint loom prints is a command that works as printed, which these tests run.

The runs are worlds of one in this process (the tiny model on a small corpus): `--nproc 1`, or
`default_nproc` made 1 (`one_rank`)."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import tomllib
from pathlib import Path

import pytest
from in_process import world_of_one

import loom.cli
import loom.launch
from loom.config import TrainConfig, config_changes, load_config, to_toml
from loom.files import claim_run_dir
from loom.train import faults, stop
from loom.train.optim import lr_lambda

TINY = ["model.preset=tiny", "data.seq_len=32", "train.batch_size=4", "data.num_workers=0",
        "train.device=cpu", "train.log_every=100", "train.eval_batches=0", "train.ckpt_every_min=0"]


def _sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def _loom(argv: list[str], capsys) -> tuple[int, str, str]:
    with world_of_one():
        rc = loom.cli.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def _printed(command: str) -> list[str]:
    """A printed `loom ...` command as main's argv, to run it exactly as a user would paste it."""
    argv = shlex.split(command)
    assert argv[0] == "loom", command
    return argv[1:]


def _metrics(run: Path) -> dict[int, dict]:
    return {m["step"]: m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def _config_toml(run: Path) -> dict:
    return tomllib.loads((run / "config.toml").read_text())


def _lr(steps: int, lr: float, step: int, warmup: int = 10) -> float:
    """The LR step `step` of a run of `steps` trains at (loom/train/optim.py's schedule)."""
    return lr * lr_lambda(TrainConfig(steps=steps, lr=lr, warmup_steps=warmup))(step - 1)


@pytest.fixture
def one_rank(monkeypatch):
    """This machine launches one rank by default: a printed hint runs in this process."""
    monkeypatch.setattr(loom.launch, "default_nproc", lambda: 1)


# ---------------------------------------------------------------------------------------------
# The base and the changes, without training


def test_a_config_over_a_base_changes_only_what_it_gives():
    base = load_config(None, ["train.steps=200", "train.lr=1e-3", 'train.log_to=["tensorboard"]'])
    cfg = load_config(None, ["train.steps=400"], base=base)
    assert (cfg.train.steps, cfg.train.lr, cfg.train.log_to) == (400, 1e-3, ["tensorboard"])
    assert base.train.steps == 200  # the base itself is untouched
    assert config_changes(base, cfg) == [("train.steps", 200, 400)]


def test_resume_auto_starts_from_the_runs_config_toml(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    saved = load_config(None, [*TINY, "train.steps=200", "train.lr=1e-3"])
    (run / "config.toml").write_text(to_toml(saved))
    args = loom.cli.build_parser().parse_args(["train", "--resume", "auto", "--out", str(run)])
    args.out = Path(args.out)
    cfg, base, note = loom.cli._run_config(args)
    assert (cfg.train.steps, cfg.train.lr, cfg.model.preset, cfg.data.seq_len) == (200, 1e-3, "tiny", 32)
    assert note is None and config_changes(base, cfg) == []
    # the same settings as a config file on top: nothing changes
    mine = tmp_path / "my.toml"
    mine.write_text(to_toml(saved))
    args = loom.cli.build_parser().parse_args(["train", str(mine), "--resume", "auto", "--out", str(run),
                                               "--set", "train.steps=400"])
    args.out = Path(args.out)
    cfg, base, _ = loom.cli._run_config(args)
    assert config_changes(base, cfg) == [("train.steps", 200, 400)]


def test_a_damaged_config_toml_is_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    claim_run_dir(run)  # a run of loom's (--resume auto writes into no other folder)
    (run / "config.toml").write_text("[train\nsteps = 200\n")
    rc, _, err = _loom(["train", "--resume", "auto", "--out", str(run)], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{run / 'config.toml'} is not valid TOML" in err
    assert "config.toml is the run's config, which --resume continues: fix it, or delete it to start the " \
           "run again from your config and --set" in err


def test_resume_auto_without_out_is_one_line(capsys):
    rc, _, err = _loom(["train", "--resume", "auto"], capsys)
    assert rc == 2
    assert err == "loom: error: --resume auto continues the run --out names; pass --out RUN_DIR\n"


# ---------------------------------------------------------------------------------------------
# Real runs, continued with the commands loom printed


def test_the_stop_hint_continues_the_run_as_it_was_configured(tmp_path, corpus, capsys, monkeypatch):
    """A 6-step run at train.lr=1e-3 with TensorBoard, stopped by Ctrl-C at step 2: the printed
    command trains steps 3..6 of the same run (its LR schedule, its trackers), and a later resume
    that extends it and changes the LR says so and is what the run then trains."""
    run = tmp_path / "run"
    first = [*TINY, f'data.source="{corpus}"', "train.steps=6", "train.lr=1e-3",
             'train.log_to=["tensorboard"]']

    def ctrl_c_at_step_2(step: int, rank: int) -> None:
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(faults, "at_step_start", ctrl_c_at_step_2)
    monkeypatch.setattr(stop, "_received", 0)  # (this process's record of the signal: undone after)
    rc, _, err = _loom(["train", "--nproc", "1", "--out", str(run), *_sets(first)], capsys)
    assert rc == 130, err
    hint = re.search(r"continue with: (.*)", err).group(1)
    assert hint == f"loom train --resume auto --out {run} --nproc 1"
    monkeypatch.undo()

    rc, out, err = _loom(_printed(hint), capsys)
    assert rc == 0, err
    assert "resume changes" not in out  # the run's own config: nothing changed
    assert "training steps 3..6" in out
    metrics = _metrics(run)
    assert sorted(metrics) == [1, 2, 3, 4, 5, 6]
    assert [metrics[k]["lr"] for k in (3, 6)] == pytest.approx([_lr(6, 1e-3, 3), _lr(6, 1e-3, 6)], rel=1e-12)
    saved = _config_toml(run)["train"]
    assert (saved["steps"], saved["lr"], saved["log_to"]) == (6, 1e-3, ["tensorboard"])
    assert len(list((run / "tensorboard").iterdir())) == 2  # the resumed run logged too

    rc, out, err = _loom(["train", "--resume", "auto", "--out", str(run), "--set", "train.steps=8",
                          "--set", "train.lr=2e-3"], capsys)
    assert rc == 0, err
    assert "loom: resume changes train.steps 6 → 8 (the LR schedule follows the new total: it now decays " \
           "to step 8)\nloom: resume changes train.lr 0.001 → 0.002\n" in out
    metrics = _metrics(run)
    assert sorted(metrics) == list(range(1, 9))
    assert [metrics[k]["lr"] for k in (7, 8)] == pytest.approx([_lr(8, 2e-3, 7), _lr(8, 2e-3, 8)], rel=1e-12)
    saved = _config_toml(run)["train"]
    assert (saved["steps"], saved["lr"]) == (8, 2e-3)


def test_the_end_hint_extends_the_run_and_init_from_is_kept(tmp_path, corpus, capsys, one_rank, monkeypatch):
    """A run from a loom checkpoint (model.init_from, another model than the default preset's)
    ends with a command that extends it, which works as printed; dropping model.init_from on a
    resume is one line that says so (not that the checkpoint looks altered). Both printed commands
    run as pasted, the run's folder named with a space."""
    source, run = tmp_path / "source", tmp_path / "my run"
    data = [f'data.source="{corpus}"', "data.seq_len=32", "train.batch_size=4", "data.num_workers=0",
            "train.device=cpu", "train.eval_batches=0", "train.ckpt_every_min=0"]
    rc, _, err = _loom(["train", "--out", str(source), *_sets([*TINY, *data, "train.steps=2"])], capsys)
    assert rc == 0, err
    start = source / "checkpoints" / "step_2"
    rc, out, err = _loom(["train", "--out", str(run), *_sets([*data, f"model.init_from={start}",
                                                              "train.steps=2"])], capsys)
    assert rc == 0, err
    hint, weights = re.search(r"\(continue: (.*?); weights: (.*)\)$", out, re.M).groups()
    assert hint == f"loom train --resume auto --out '{run}' --set train.steps=4 --nproc 1"
    monkeypatch.chdir(tmp_path)
    rc, _, err = _loom(_printed(weights), capsys)
    assert rc == 0 and (tmp_path / "model.safetensors").is_file(), err

    rc, out, err = _loom(_printed(hint), capsys)
    assert rc == 0, err
    assert "loom: resume changes train.steps 2 → 4" in out
    assert sorted(_metrics(run)) == [1, 2, 3, 4]
    assert _config_toml(run)["model"]["init_from"] == str(start)

    rc, _, err = _loom(["train", "--resume", "auto", "--out", str(run), "--set", "train.steps=6",
                        "--set", "model.init_from="], capsys)
    assert rc == 2
    assert err == (f"loom: error: cannot resume from {run}/checkpoints/step_4: model.init_from = '{start}' "
                   f"in the checkpoint, '' now (d_model 64 in the checkpoint, 256 now; ffn_hidden 128 in the "
                   f"checkpoint, 768 now; max_seq_len 128 in the checkpoint, 256 now); keep "
                   f"model.init_from = '{start}' (the run's config.toml has it), or start a new run from "
                   f"these weights with --set model.init_from={run}/checkpoints/step_4 and no --resume\n")

    # without its config.toml, the run continues as its checkpoint was configured, and says so
    (run / "config.toml").unlink()
    args = loom.cli.build_parser().parse_args(["train", "--resume", "auto", "--out", str(run)])
    args.out = Path(args.out)
    cfg, _, note = loom.cli._run_config(args)
    assert note == f"{run} has no config.toml; continuing with the config saved in {run}/checkpoints/step_4"
    assert (cfg.model.init_from, cfg.train.steps) == (str(start), 4)
