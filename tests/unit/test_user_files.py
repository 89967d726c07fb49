"""Nothing of the user's is lost: what loom writes, and what it leaves alone.

The refusals (an `--overwrite` of a folder that is not loom's, an export over a file, ...) are
catalogue cases (tests/unit/bad_input_cases_user_files.py), each checking that the folders it set
up are unchanged. Here, what is not an error: a run directory is marked as loom's and replaced
whole; writes into a run directory replace a planted symbolic link instead of writing through it;
an hf export with --overwrite leaves a consistent model folder; export copies only the tokenizer
files the checkpoint carries, by hash; a planted stopped.json does not make a finished run
"interrupted".
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from bad_input import TINY
from bad_input_cases_user_files import tree
from test_compare import write_run

import loom.cli
from loom.errors import LoomError
from loom.files import RUN_MARKER, atomic_write, open_append
from loom.parallel.mesh import shutdown
from loom.train.meters import MetricsFile


def train(out: Path, *args: str) -> int:
    """`loom train` in this process; the variables a world of one sets are undone (a module
    fixture's run would leave the next one looking like a torchrun rank)."""
    saved = dict(os.environ)
    try:
        return loom.cli.main(["train", "--nproc", "1", "--out", str(out), *TINY, *args])
    finally:
        shutdown()
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus) -> Path:
    """A real 2-step run (read-only to the tests: they copy it)."""
    out = tmp_path_factory.mktemp("run") / "run"
    assert train(out, "--set", f'data.source="{corpus}"', "--set", "train.steps=2") == 0
    return out


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


WORDS = "the cat sat on a mat and the dog ran far away to the park".split()


def write_tokenizer(folder: Path) -> Path:
    """A word-level tokenizer.json over WORDS, with its tokenizer_config.json (the EOS)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", "</s>", *dict.fromkeys(WORDS)])},
                                     unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["</s>"])
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return folder / "tokenizer.json"


# ---------------------------------------------------------------------------------------------
# The run directory: marked as loom's, replaced whole


def test_a_run_directory_is_marked_and_overwrite_replaces_it_whole(run, corpus, tmp_path):
    assert (run / RUN_MARKER).is_file()
    again = tmp_path / "run"
    shutil.copytree(run, again)
    (again / "notes-of-the-old-run.txt").write_text("gone with it")
    assert train(again, "--overwrite", "--set", f'data.source="{corpus}"', "--set", "train.steps=1") == 0
    assert not (again / "notes-of-the-old-run.txt").exists()
    assert (again / RUN_MARKER).is_file()
    steps = [json.loads(line)["step"] for line in (again / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1]  # the new run's only step: nothing of the old run's two is left


def test_a_folder_of_the_users_is_never_marked(tmp_path, corpus):
    """`--resume auto` into a folder that holds files loom did not write is refused, the folder left
    as it was and unmarked (so a later --overwrite refuses it too: resume-auto-not-a-loom-run)."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.md").write_text("mine")
    assert train(mine, "--resume", "auto", "--set", f'data.source="{corpus}"', "--set", "train.steps=1") == 2
    assert [p.name for p in mine.iterdir()] == ["notes.md"] and (mine / "notes.md").read_text() == "mine"


# ---------------------------------------------------------------------------------------------
# Planted symbolic links: replaced, their targets untouched


def test_a_resumed_run_replaces_planted_links_and_leaves_their_targets(run, corpus, tmp_path):
    again = tmp_path / "run"
    shutil.copytree(run, again)
    victims = tmp_path / "home"
    victims.mkdir()
    names = ("config.toml", "plan.json", "summary.json", "memory.json", "metrics.jsonl")
    for name in names:
        (victims / name).write_text(f"the user's own {name}\n")
        (again / name).unlink()
        (again / name).symlink_to(victims / name)
    before = tree(victims)
    assert train(again, "--resume", "auto", "--set", f'data.source="{corpus}"', "--set", "train.steps=3") == 0
    assert tree(victims) == before
    for name in names:
        assert not (again / name).is_symlink() and (again / name).stat().st_size > 0, name
    assert json.loads((again / "summary.json").read_text())["steps"] == 1
    steps = [json.loads(line)["step"] for line in (again / "metrics.jsonl").read_text().splitlines()]
    assert steps == [3]  # what the link pointed to was not taken as the run's earlier steps


def test_analyze_and_compare_replace_planted_links(tmp_path, capsys):
    runs = {name: tmp_path / name for name in ("a", "b")}
    for folder in runs.values():
        write_run(folder / "traces")
    victim = tmp_path / "bashrc"
    victim.write_text("export PATH=$HOME/bin:$PATH\n")
    for link in (runs["a"] / "ledger.json", runs["a"] / "report.html", tmp_path / "out" / "compare.json",
                 tmp_path / "out" / "compare.html"):
        link.parent.mkdir(exist_ok=True)
        link.symlink_to(victim)
    assert loom.cli.main(["analyze", str(runs["a"] / "traces")]) == 0
    assert loom.cli.main(["analyze", "--compare", str(runs["a"]), str(runs["b"]), "--out",
                          str(tmp_path / "out")]) == 0
    assert victim.read_text() == "export PATH=$HOME/bin:$PATH\n"
    assert json.loads((runs["a"] / "ledger.json").read_text())["ranks"]
    assert (tmp_path / "out" / "compare.html").read_text().startswith("<!DOCTYPE html>")
    assert not any(p.is_symlink() for p in (runs["a"] / "ledger.json", tmp_path / "out" / "compare.json"))


def test_appends_and_writes_refuse_a_link(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(LoomError, match="is a symbolic link"):
        open_append(run / "metrics.jsonl")
    metrics = MetricsFile(run / "metrics.jsonl")  # rewrites it first: the link is replaced
    metrics.write({"step": 1})
    metrics.close()
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'
    (run / "flight_recorder").symlink_to(tmp_path, target_is_directory=True)  # a linked folder in the run
    with pytest.raises(LoomError, match="flight_recorder is a symbolic link"):
        atomic_write(run / "flight_recorder" / "victim.txt", b"dump", inside=run)
    assert victim.read_text() == "precious\n"


# ---------------------------------------------------------------------------------------------
# Export: a consistent model folder; only the tokenizer files the checkpoint carries


def test_export_overwrite_replaces_a_model_folder_consistently(run, tmp_path):
    folder = tmp_path / "models" / "llama"
    folder.mkdir(parents=True)
    old = {"config.json": "{}", "model.safetensors.index.json": '{"weight_map": {}}',
           "model-00001-of-00002.safetensors": "x", "model-00002-of-00002.safetensors": "y",
           "tokenizer.json": "{}", "tokenizer_config.json": "{}", "generation_config.json": "{}",
           "README.md": "# my model card\n"}
    for name, text in old.items():
        (folder / name).write_text(text)
    assert loom.cli.main(["export", str(run), str(folder / "model.safetensors"), "--layout", "hf",
                          "--overwrite"]) == 0
    # the byte-tokenizer run carries no tokenizer: the old model's files are all gone, the card kept
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert (folder / "README.md").read_text() == "# my model card\n"
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_export_copies_only_the_tokenizer_files_the_checkpoint_recorded(tmp_path):
    tokenizer = write_tokenizer(tmp_path / "tok")
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(" ".join(WORDS[(i + j) % len(WORDS)] for j in range(12)) for i in range(600)))
    out = tmp_path / "run"
    assert train(out, "--set", f'data.source="{text}"', "--set", f'data.tokenizer="{tokenizer}"',
                 "--set", "train.steps=1") == 0
    step = out / "checkpoints" / "step_1"
    meta = json.loads((step / "meta.json").read_text())
    carried = {"tokenizer.json": sha(tokenizer), "tokenizer_config.json": sha(tokenizer.parent /
                                                                              "tokenizer_config.json")}
    assert meta["tokenizer_files"] == carried
    assert {p.name: sha(p) for p in (step / "tokenizer").iterdir()} == carried

    # Handed on: the tokenizer's old place now holds something else, and meta.json's config names
    # a credentials file. Export copies the checkpoint's own copies, never a path from meta.json.
    tokenizer.write_text('{"not": "the run\'s tokenizer"}')
    secret = tmp_path / "elsewhere" / "credentials.json"
    secret.parent.mkdir()
    secret.write_text('{"token": "hunter2"}')
    (secret.parent / "tokenizer_config.json").write_text('{"eos_token": "leaked"}')
    meta["config"] = meta["config"].replace(str(tokenizer), str(secret))
    assert str(secret) in meta["config"]
    (step / "meta.json").write_text(json.dumps(meta))
    export = tmp_path / "export"
    export.mkdir()
    assert loom.cli.main(["export", str(step), str(export / "model.safetensors"), "--layout", "hf"]) == 0
    assert sorted(p.name for p in export.iterdir()) == ["config.json", "generation_config.json",
                                                         "model.safetensors", "tokenizer.json",
                                                         "tokenizer_config.json"]
    assert {n: sha(export / n) for n in carried} == carried
    assert "hunter2" not in (export / "tokenizer.json").read_text()


# ---------------------------------------------------------------------------------------------
# plan --emit --overwrite: no alternative of an older plan left among the new ones


def test_emit_overwrite_removes_the_older_plans_alternatives_only(tmp_path):
    target = tmp_path / "run.toml"
    mine = tmp_path / "run.notes.toml"
    mine.write_text("# my notes\n")
    stale = tmp_path / "run.9999.toml"
    stale.write_text("# loom plan: an older plan\n")
    assert loom.cli.main(["plan", "--gpu", "H100-SXM", "--model", "1b", "--emit", str(target)]) == 0
    first = sorted(tmp_path.glob("run.*.toml"))
    assert loom.cli.main(["plan", "--gpu", "H100-SXM", "--model", "tiny", "--emit", str(target),
                          "--overwrite"]) == 0
    assert not stale.exists() and mine.read_text() == "# my notes\n"
    emitted = [p for p in sorted(tmp_path.glob("run.*.toml")) if p != mine]
    assert emitted and all(p.read_text().startswith("# loom plan:") for p in emitted)
    assert len(first) > 1 and all("model" in p.read_text() for p in emitted)
    assert 'preset = "tiny"' in target.read_text()


# ---------------------------------------------------------------------------------------------
# stopped.json: only this launch's


def test_a_stop_record_counts_only_for_the_launch_that_wrote_it(tmp_path):
    import time

    stopped = tmp_path / "stopped.json"
    stopped.write_text(json.dumps({"signal": 15, "step": 2, "checkpoint": None, "note": None}))
    later = time.time() + 3600  # the old check trusted any file newer than the launch
    os.utime(stopped, (later, later))
    assert loom.cli._stop_record(tmp_path, "this-launch") is None
    stopped.write_text(json.dumps({"signal": 15, "step": 2, "launches": ["another-launch"]}))
    assert loom.cli._stop_record(tmp_path, "this-launch") is None
    stopped.write_bytes(b"\xff{")
    assert loom.cli._stop_record(tmp_path, "this-launch") is None
    stopped.write_text(json.dumps({"signal": "TERM", "launches": "this-launch"}))  # planted: not an error
    assert loom.cli._stop_record(tmp_path, "this-launch") is None
    record = {"signal": 15, "step": 2, "note": "requeued", "launches": ["other-node", "this-launch"]}
    stopped.write_text(json.dumps(record))
    assert loom.cli._stop_record(tmp_path, "this-launch") == {"signal": 15, "note": "requeued"}
    stopped.write_text(json.dumps({"signal": "15", "launches": ["this-launch"]}))
    with pytest.raises(LoomError, match="signal must be an integer"):
        loom.cli._stop_record(tmp_path, "this-launch")
