"""Bad-input cases: the user's files, third pass (docs/bad-input.md, "Your files").

`--resume auto` writes only into a run directory of loom's (or a new or empty folder), never the
working or home directory; a linked checkpoints folder is written and cleaned up only when it is
this run's; a folder export never writes into the working or home directory; `loom analyze`
replaces only its own earlier outputs; a trace that links out of its folder is never read. Each
case checks that the files it set up are exactly as they were (tests/unit/bad_input_cases_user_files.py).
"""

from __future__ import annotations

import os
from pathlib import Path

from bad_input import Ctx, case, cli
from bad_input_cases_user_files import loom_run, project, unchanged
from test_compare import write_run

from loom.train.checkpoint import OWNER

# What a run directory of loom's holds, and the user's files of the same names.
RUN_FILES = ("summary.json", "memory.json", "metrics.jsonl", "plan.json")


def own_folder(folder: Path, *names: str) -> Path:
    """A folder of the user's (no .loom-run marker) holding files of the names loom writes."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in names or (*RUN_FILES, "notes.md"):
        (folder / name).write_text(f"the user's own {name}\n")
    return folder


# ---------------------------------------------------------------------------------------------
# --resume auto: only into a run directory of loom's


@case("resume-auto-not-a-loom-run")
def _(c: Ctx) -> str:
    thesis = own_folder(c.tmp / "thesis")
    with unchanged(thesis):
        return c.train("--resume", "auto", out=thesis)


@case("resume-auto-home")
def _(c: Ctx) -> str:
    project(c)
    home = own_folder(c.tmp / "home", *RUN_FILES, ".bashrc")
    with unchanged(home):
        return c.train("--resume", "auto", out=home)


@case("resume-auto-cwd")
def _(c: Ctx) -> str:
    folder = project(c)  # marked as loom's by an earlier `--out .`, and full of the user's files
    with unchanged(folder):
        return c.train("--resume", "auto", out=Path("."))


@case("resume-auto-out-is-file")
def _(c: Ctx) -> str:
    notes = own_folder(c.tmp / "notes", "notes.txt")
    with unchanged(notes):
        return c.train("--resume", "auto", out=notes / "notes.txt")


@case("out-not-writable")
def _(c: Ctx) -> str:
    notes = own_folder(c.tmp / "notes", "notes.txt")
    with unchanged(notes):
        return c.train(out=notes / "notes.txt" / "run")


@case("checkpoints-is-a-file")
def _(c: Ctx) -> str:
    run = loom_run(c.tmp / "run", "metrics.jsonl", "checkpoints")
    with unchanged(run):
        return c.train("--resume", "auto", out=run)


@case("checkpoints-link-foreign")
def _(c: Ctx) -> str:
    scratch = c.tmp / "scratch"
    loom_run(scratch / "ckpts", "step_2/meta.json", ".tmp-step_4/rng_rank0.json", "latest")
    run = loom_run(c.tmp / "run", "metrics.jsonl")
    (run / "checkpoints").symlink_to(scratch / "ckpts", target_is_directory=True)
    with unchanged(scratch, run):
        return c.train("--resume", "auto", out=run)


@case("checkpoints-link-other-run")
def _(c: Ctx) -> str:
    scratch = c.tmp / "scratch"
    loom_run(scratch / "ckpts", "step_2/meta.json", "latest")
    (scratch / "ckpts" / OWNER).write_text(f"{c.tmp / 'other-run'}\n")
    run = loom_run(c.tmp / "run", "metrics.jsonl")
    (run / "checkpoints").symlink_to(scratch / "ckpts", target_is_directory=True)
    with unchanged(scratch, run):
        return c.train("--resume", "auto", out=run)


@case("checkpoints-link-dangling")
def _(c: Ctx) -> str:
    run = loom_run(c.tmp / "run", "metrics.jsonl")
    (run / "checkpoints").symlink_to(c.tmp / "scratch" / "gone", target_is_directory=True)
    with unchanged(run):
        return c.train("--resume", "auto", out=run)


# ---------------------------------------------------------------------------------------------
# loom export: a folder export never into the home or working directory


@case("export-adapter-home")
def _(c: Ctx) -> str:
    project(c)
    home = own_folder(c.tmp / "home", "config.json", "tokenizer.json", "embeddings.safetensors",
                      "vocab.json", "merges.txt")
    with unchanged(home):
        return cli("export", str(c.step_2), str(home), "--lora", "adapter", "--overwrite", capsys=c.capsys)


@case("export-hf-home")
def _(c: Ctx) -> str:
    project(c)
    home = own_folder(c.tmp / "home", "embeddings.safetensors", "vocab.json", "model.safetensors")
    with unchanged(home):
        return cli("export", str(c.step_2), str(home / "model.safetensors"), "--layout", "hf", "--overwrite",
                   capsys=c.capsys)


@case("export-hf-cwd")
def _(c: Ctx) -> str:
    folder = project(c)
    with unchanged(folder):
        return cli("export", str(c.step_2), "model.safetensors", "--layout", "hf", capsys=c.capsys)


# ---------------------------------------------------------------------------------------------
# loom analyze: its outputs replace only its own; a trace is a file of the folder


@case("analyze-outputs-not-loom")
def _(c: Ctx) -> str:
    run = own_folder(c.tmp / "run", "report.html", "ledger.json")
    write_run(run / "traces")
    with unchanged(run):
        return cli("analyze", str(run / "traces"), capsys=c.capsys)


@case("trace-link-outside")
def _(c: Ctx) -> str:
    secret = own_folder(c.tmp / "etc", "passwd")
    traces = write_run(c.tmp / "run" / "traces")
    (traces / "rank1.json").symlink_to(secret / "passwd")
    with unchanged(secret, traces):
        message = cli("analyze", str(traces), capsys=c.capsys)
    assert "the user's own" not in message
    return message


@case("trace-not-regular")
def _(c: Ctx) -> str:
    traces = write_run(c.tmp / "run" / "traces")
    os.mkfifo(traces / "rank1.json")  # reading it would block for ever
    with unchanged(traces):
        return cli("analyze", str(traces), capsys=c.capsys)
