"""Bad-input cases: the user's files (docs/bad-input.md, "Your files").

`--overwrite` removes only a run directory loom made that holds nothing the run reads, and only
once every other check has passed; `loom export` and `loom plan --emit` replace nothing without
`--overwrite`; export copies only the tokenizer files a checkpoint carries by hash. Every case
also checks that the folders it set up are exactly as they were (each file's sha256), so that a
refusal that comes after the damage fails too. Cases that name the working or home directory
first move both into the case's own temporary folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path

from bad_input import Ctx, case, cli

from loom.files import RUN_MARKER


def tree(folder: Path) -> dict[str, str]:
    """Every entry under `folder`: a file by its content's sha256, a link by its target."""
    found = {}
    for top, dirs, files in os.walk(folder):  # never into a linked folder
        for name in dirs + files:
            path = Path(top) / name
            rel = str(path.relative_to(folder))
            if path.is_symlink():
                found[rel] = "-> " + os.readlink(path)
            elif path.is_file():
                found[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                found[rel] = "folder"
    return found


@contextlib.contextmanager
def unchanged(*folders: Path):
    before = [tree(f) for f in folders]
    yield
    after = [tree(f) for f in folders]
    assert after == before, f"a refusal changed the user's files: {before} -> {after}"


def loom_run(folder: Path, *files: str) -> Path:
    """A folder carrying loom's run marker and a few files of a past run."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / RUN_MARKER).write_text("a loom run directory\n")
    for name in files or ("config.toml", "metrics.jsonl"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(f"{name} of an earlier run\n")
    return folder


def project(c: Ctx, name: str = "project") -> Path:
    """The case's working directory: a project folder with files worth keeping (loom-marked, as an
    earlier `loom train --out .` in it would have left it)."""
    folder = loom_run(c.tmp / name, "notes.md", "src/model.py", "data/corpus.txt")
    c.monkeypatch.chdir(folder)
    c.monkeypatch.setenv("HOME", str(c.tmp / "home"))
    return folder


# ---------------------------------------------------------------------------------------------
# --overwrite: what it never removes


@case("overwrite-empty-out")
def _(c: Ctx) -> str:
    folder = project(c)
    with unchanged(folder):
        return cli("train", "--nproc", "1", "--out", "", *c.base(), "--overwrite", capsys=c.capsys)


@case("overwrite-cwd")
def _(c: Ctx) -> str:
    folder = project(c)
    with unchanged(folder):
        return c.train("--overwrite", out=Path("."))


@case("overwrite-home")
def _(c: Ctx) -> str:
    project(c)
    home = loom_run(c.tmp / "home", ".bashrc", ".ssh/id_ed25519")
    with unchanged(home):
        return c.train("--overwrite", out=home)


@case("overwrite-parent-of-cwd")
def _(c: Ctx) -> str:
    folder = project(c)
    c.monkeypatch.chdir(folder / "src")
    with unchanged(folder):
        return c.train("--overwrite", out=folder)


@case("overwrite-holds-data")
def _(c: Ctx) -> str:
    run = loom_run(c.tmp / "run")
    shutil.copy(c.corpus, run / "corpus.txt")
    with unchanged(run):
        return c.train("--overwrite", "--set", f'data.source="{run / "corpus.txt"}"', out=run)


@case("overwrite-holds-data-glob")
def _(c: Ctx) -> str:
    run = loom_run(c.tmp / "run")
    (run / "data").mkdir()
    shutil.copy(c.corpus, run / "data" / "a.txt")
    with unchanged(run):
        return c.train("--overwrite", "--set", f'data.source="{run / "data" / "*.txt"}"', out=run)


@case("overwrite-holds-model")
def _(c: Ctx) -> str:
    run = loom_run(c.tmp / "run", "models/llama/config.json")
    with unchanged(run):
        return c.train("--overwrite", "--set", f'model.init_from="{run / "models" / "llama"}"', out=run)


@case("overwrite-holds-tokenizer")
def _(c: Ctx) -> str:
    run = loom_run(c.tmp / "run", "tokenizer.json")
    with unchanged(run):
        return c.train("--overwrite", "--set", f'data.tokenizer="{run / "tokenizer.json"}"', out=run)


@case("overwrite-holds-config")
def _(c: Ctx) -> str:
    run = loom_run(c.tmp / "run")
    (run / "mine.toml").write_text("[train]\nsteps = 2\n")
    with unchanged(run):
        return c.train(str(run / "mine.toml"), "--overwrite", out=run)


@case("overwrite-not-a-loom-run")
def _(c: Ctx) -> str:
    folder = c.tmp / "thesis"
    folder.mkdir()
    (folder / "chapter1.tex").write_text("\\section{Introduction}\n")
    with unchanged(folder):
        return c.train("--overwrite", out=folder)


@case("overwrite-link")
def _(c: Ctx) -> str:
    run = loom_run(c.tmp / "real-run")
    (c.tmp / "run").symlink_to(run)
    with unchanged(c.tmp):
        return c.train("--overwrite", out=c.tmp / "run")


@case("overwrite-after-checks")
def _(c: Ctx) -> str:
    """Removed only after the resume check: before, the victim was gone when it refused."""
    victim = loom_run(c.tmp / "victim", "config.toml", "checkpoints/step_1/meta.json", "summary.json")
    with unchanged(victim):
        return c.train("--overwrite", "--resume", str(c.step_2), "--set", "train.steps=2", out=victim)


@case("resume-metrics-not-utf8")
def _(c: Ctx) -> str:
    run = c.tmp / "run"
    shutil.copytree(c.ckpt_run, run)
    (run / "metrics.jsonl").write_bytes(b'{"step": 1}\n\xff\xfe{"step": 2}\n')
    with unchanged(run):
        return c.train("--resume", "auto", "--set", "train.steps=4", out=run)


# ---------------------------------------------------------------------------------------------
# loom export: nothing replaced without --overwrite; only the tokenizer files a checkpoint carries


@case("export-exists")
def _(c: Ctx) -> str:
    corpus = c.tmp / "corpus.txt"
    shutil.copy(c.corpus, corpus)
    with unchanged(c.tmp):
        return cli("export", str(c.step_2), str(corpus), capsys=c.capsys)


@case("export-model-folder")
def _(c: Ctx) -> str:
    folder = c.tmp / "models" / "llama"
    folder.mkdir(parents=True)
    for name in ("config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
                 "tokenizer.json"):
        (folder / name).write_text("{}")
    with unchanged(folder):
        return cli("export", str(c.step_2), str(folder / "model.safetensors"), "--layout", "hf",
                   capsys=c.capsys)


@case("export-hf-output-name")
def _(c: Ctx) -> str:
    return cli("export", str(c.step_2), str(c.tmp / "config.json"), "--layout", "hf", capsys=c.capsys)


def _handed(c: Ctx, record: dict, files: dict[str, bytes]) -> Path:
    """A copy of step_2 whose meta.json records `record` as its tokenizer files."""
    step = c.tmp / "handed" / "step_2"
    shutil.copytree(c.step_2, step)
    for name, data in files.items():
        (step / "tokenizer").mkdir(exist_ok=True)
        (step / "tokenizer" / name).write_bytes(data)
    meta = json.loads((step / "meta.json").read_text())
    meta["tokenizer_files"] = record
    (step / "meta.json").write_text(json.dumps(meta))
    return step


@case("export-tokenizer-record")
def _(c: Ctx) -> str:
    secret = c.tmp / "elsewhere" / "credentials.json"
    secret.parent.mkdir()
    secret.write_text('{"token": "hunter2"}')
    digest = hashlib.sha256(secret.read_bytes()).hexdigest()
    step = _handed(c, {"../../elsewhere/credentials.json": digest}, {})
    (c.tmp / "out").mkdir()
    with unchanged(c.tmp / "out"):
        return cli("export", str(step), str(c.tmp / "out" / "model.safetensors"), "--layout", "hf",
                   capsys=c.capsys)


@case("export-tokenizer-altered")
def _(c: Ctx) -> str:
    step = _handed(c, {"tokenizer.json": hashlib.sha256(b'{"model": {}}').hexdigest()},
                   {"tokenizer.json": b'{"model": {}, "added": "later"}'})
    (c.tmp / "out").mkdir()
    with unchanged(c.tmp / "out"):
        return cli("export", str(step), str(c.tmp / "out" / "model.safetensors"), "--layout", "hf",
                   capsys=c.capsys)


# ---------------------------------------------------------------------------------------------
# loom plan --emit


@case("emit-exists")
def _(c: Ctx) -> str:
    mine = c.tmp / "myplan.toml"
    mine.write_text("# my own plan\n[train]\nsteps = 10\n")
    with unchanged(c.tmp):
        return cli("plan", "--gpu", "H100-SXM", "--model", "tiny", "--emit", str(mine), capsys=c.capsys)


@case("emit-folder")
def _(c: Ctx) -> str:
    (c.tmp / "plans").mkdir()
    return cli("plan", "--gpu", "H100-SXM", "--model", "tiny", "--emit", str(c.tmp / "plans"),
               capsys=c.capsys)
