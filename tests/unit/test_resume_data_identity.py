"""A resume compares the data by what it is (loom/data/source_identity.py: the resolved path and a
fingerprint of the content), not by how the config names it: the same file by an absolute path,
or the same content in another folder, resumes; a relative data.source that, from another working
folder, names other content is refused in one line (it used to train on it silently)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from in_process import world_of_one

import loom.cli
from loom.config import load_config
from loom.data import source_identity

TINY = ["model.preset=tiny", "data.seq_len=32", "train.batch_size=4", "data.num_workers=0",
        "train.device=cpu", "parallel.strategy=ddp", "train.log_every=100", "train.eval_batches=0",
        "train.ckpt_every_min=0"]


def _train(run: Path, source: str, steps: int, *args: str) -> int:
    sets = [a for o in (*TINY, f'data.source="{source}"', f"train.steps={steps}") for a in ("--set", o)]
    with world_of_one():
        return loom.cli.main(["train", "--nproc", "1", "--out", str(run), *sets, *args])


@pytest.fixture
def relative_run(tmp_path, corpus, monkeypatch) -> tuple[Path, Path]:
    """A 2-step run started in folder `a` with data.source = "corpus.txt" (relative)."""
    a = tmp_path / "a"
    a.mkdir()
    shutil.copy(corpus, a / "corpus.txt")
    monkeypatch.chdir(a)
    run = tmp_path / "run"
    assert _train(run, "corpus.txt", 2) == 0
    return run, a


def _sources(run: Path, step: int) -> list[dict]:
    return json.loads((run / "checkpoints" / f"step_{step}" / "meta.json").read_text())["data"]["sources"]


def test_the_checkpoint_records_the_source_by_path_and_content(relative_run):
    run, a = relative_run
    (recorded,) = _sources(run, 2)
    assert recorded["spec"] == "corpus.txt" and recorded["path"] == str(a / "corpus.txt")
    assert len(recorded["fingerprint"]) == 16


def test_the_same_file_by_its_absolute_path_resumes(relative_run, capsys):
    run, a = relative_run
    assert _train(run, str(a / "corpus.txt"), 3, "--resume", "auto") == 0, capsys.readouterr().err
    assert json.loads((run / "checkpoints" / "step_3" / "meta.json").read_text())["step"] == 3


def _resume_line(run: Path, capsys) -> tuple[int, str]:
    """`loom train --resume auto` with data.source = "corpus.txt", from the working folder."""
    capsys.readouterr()
    rc = _train(run, "corpus.txt", 3, "--resume", "auto")
    return rc, capsys.readouterr().err.strip()


def test_a_relative_source_naming_other_content_from_another_folder_is_refused(relative_run, tmp_path,
                                                                                monkeypatch, capsys):
    run, a = relative_run
    b = tmp_path / "b"
    b.mkdir()
    (b / "corpus.txt").write_text((a / "corpus.txt").read_text()[:-100] + "x" * 100)  # same size, other end
    monkeypatch.chdir(b)
    rc, err = _resume_line(run, capsys)
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert (f"data source 'corpus.txt' ({b / 'corpus.txt'}) holds other content (fingerprint " in err
            and f"than the checkpoint trained on, {a / 'corpus.txt'} (fingerprint " in err), err
    assert not (run / "checkpoints" / "step_3").exists()


def test_the_same_content_in_another_folder_resumes(relative_run, tmp_path, monkeypatch, capsys):
    run, a = relative_run
    b = tmp_path / "b"
    b.mkdir()
    shutil.copy(a / "corpus.txt", b / "corpus.txt")
    monkeypatch.chdir(b)
    rc, err = _resume_line(run, capsys)
    assert rc == 0, err
    assert _sources(run, 3)[0]["path"] == str(b / "corpus.txt")


def test_the_fingerprint_reads_both_ends_and_the_size(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    body = "".join(f"line {i}\n" for i in range(40_000))  # > 2 × 64 KiB: a middle the sample skips
    cfg = load_config(None, ['data.source="c.txt"'])

    def fingerprint(text: str) -> str:
        (tmp_path / "c.txt").write_text(text)
        source_identity._fingerprinted.cache_clear()  # (the cache's key: size and mtime, which may not tick)
        return source_identity.identity(cfg.data)[0]["fingerprint"]

    first = fingerprint(body)
    assert fingerprint(body) == first
    assert fingerprint("X" + body[1:]) != first  # the head
    assert fingerprint(body[:-2] + "X\n") != first  # the tail
    assert fingerprint(body + "more\n") != first  # the size


def test_each_mix_entry_is_recorded_in_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text("alpha " * 100)
    (tmp_path / "b.txt").write_text("beta " * 100)
    cfg = load_config(None, ['data.mix=[{source = "a.txt", weight = 3}, {source = "b.txt", weight = 1}]'])
    a, b = source_identity.identity(cfg.data)
    assert (a["spec"], a["path"], b["spec"], b["path"]) == ("a.txt", str(tmp_path / "a.txt"),
                                                              "b.txt", str(tmp_path / "b.txt"))
    assert a["fingerprint"] != b["fingerprint"]
