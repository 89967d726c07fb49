"""Nothing of the user's is lost or escaped into (issue 38, third pass): what is not an error.

The refusals are catalogue cases (tests/unit/bad_input_cases_userfiles3.py). Here: `--resume auto`
still starts fresh in a new or empty folder and continues a run of loom's; a linked checkpoints
folder that is this run's is written, and cleaned up (stale writes, keep_last) without touching a
neighbouring run's checkpoints; an export with --overwrite replaces only the files of the names
it writes; loom analyze replaces its own earlier outputs, and the user's under --overwrite; a
run directory loom cannot make is one line.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch
from bad_input_cases_user_files import loom_run, tree
from test_compare import write_run

import loom.cli
from loom.config import load_config
from loom.errors import LoomError
from loom.files import RUN_MARKER, claim_run_dir
from loom.train import checkpoint as ckpt
from loom.train import export


def test_resume_auto_starts_fresh_in_a_new_or_empty_folder_and_continues_a_loom_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    loom_run(tmp_path / "run", "config.toml", "metrics.jsonl", "checkpoints/step_2/meta.json")
    for out in (tmp_path / "new", tmp_path / "empty", tmp_path / "run"):
        loom.cli._check_continued_dir(out)  # no refusal
    assert not (tmp_path / "new").exists()



def test_resume_auto_continues_a_working_folder_that_holds_only_a_run_of_its_own(tmp_path, monkeypatch):
    """`loom train --out .` in an empty folder prints `--resume auto --out .`: that hint continues; the
    same marked folder with a file of the user's beside the run is refused."""
    monkeypatch.chdir(tmp_path)
    loom_run(tmp_path, "config.toml", "metrics.jsonl", "summary.json", "checkpoints/step_2/meta.json")
    loom.cli._check_continued_dir(Path("."))  # no refusal
    (tmp_path / "notes.md").write_text("mine")
    with pytest.raises(LoomError, match=r"which is the working directory"):
        loom.cli._check_continued_dir(Path("."))

def test_claim_never_marks_a_folder_of_the_users(tmp_path):
    """The marker's own guard (what --overwrite trusts), for a caller that skipped the CLI's checks."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.md").write_text("mine")
    claim_run_dir(tmp_path / "mine")
    claim_run_dir(tmp_path / "new")
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.md"]
    assert [p.name for p in (tmp_path / "new").iterdir()] == [RUN_MARKER]


def test_a_run_directory_loom_cannot_make_is_one_line(tmp_path, monkeypatch):
    def refused(self, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", refused)
    with pytest.raises(LoomError, match=r"cannot write the run directory .*/locked/run: Permission denied "
                                        r"\(.*/locked/run\); pick an --out you can write to"):
        loom.cli._take_run_dir(tmp_path / "locked" / "run", replace=False)


# ---------------------------------------------------------------------------------------------
# A linked checkpoints folder: this run's, written and cleaned up; another run's, never


def test_checkpoints_folder_owner_follows_the_run(tmp_path):
    run = loom_run(tmp_path / "run")
    scratch = tmp_path / "scratch" / "run"
    scratch.mkdir(parents=True)
    (run / "checkpoints").symlink_to(scratch, target_is_directory=True)
    ckpt.check_checkpoints_dir(run)  # an empty folder: this run may take it
    ckpt.claim_checkpoints_dir(run)
    assert (scratch / ckpt.OWNER).read_text() == f"{run.resolve()}\n"
    (scratch / "step_2").mkdir()
    ckpt.check_checkpoints_dir(run)  # its own checkpoints: continued
    (tmp_path / "other").mkdir()  # another run linked to the same folder: refused
    (tmp_path / "other" / "checkpoints").symlink_to(scratch, target_is_directory=True)
    with pytest.raises(LoomError, match=f"holds the checkpoints of the run {run.resolve()}; "):
        ckpt.check_checkpoints_dir(tmp_path / "other")
    moved = tmp_path / "moved"  # a run moved whole, its checkpoints folder inside it: its own, unmarked
    run.rename(moved)
    (moved / "checkpoints").unlink()
    (moved / "checkpoints").mkdir()
    (moved / "checkpoints" / ckpt.OWNER).write_text(f"{run}\n")
    ckpt.claim_checkpoints_dir(moved)
    assert (moved / "checkpoints" / ckpt.OWNER).read_text() == f"{run}\n"
    ckpt.claim_checkpoints_dir(tmp_path / "fresh")
    assert [p.name for p in (tmp_path / "fresh" / "checkpoints").iterdir()] == []
    (tmp_path / "dangling").mkdir()  # a scratch disk not mounted: one line, nothing made through the link
    (tmp_path / "dangling" / "checkpoints").symlink_to(tmp_path / "unmounted" / "ckpts")
    with pytest.raises(LoomError, match=r"checkpoints is a symbolic link to .*/unmounted/ckpts, which does "
                                        r"not exist; create that folder"):
        ckpt.claim_checkpoints_dir(tmp_path / "dangling")
    assert not (tmp_path / "unmounted").exists()


def test_linked_checkpoints_cleanup_and_keep_last_touch_only_this_runs(tmp_path, gloo_world_of_one):
    scratch = tmp_path / "scratch"
    neighbour = loom_run(scratch / "other", "step_1/meta.json", "step_2/meta.json", ".tmp-step_3/x")
    mine = scratch / "mine"
    mine.mkdir()
    run = loom_run(tmp_path / "run")
    (run / "checkpoints").symlink_to(mine, target_is_directory=True)
    before = tree(neighbour)
    cfg = load_config(None, [])
    saver = ckpt.Checkpointer(run, cfg, gloo_world_of_one, keep_last=2, async_save=False)
    for n in (1, 2, 3):
        (mine / f"step_{n}").mkdir()
    (mine / ".tmp-step_4").mkdir()
    saver._publish(4)  # keep_last = 2: step_1 and step_2 go, in this run's folder only
    assert sorted(p.name for p in mine.iterdir()) == [".loom-owner", "latest", "step_3", "step_4"]
    assert tree(neighbour) == before
    (run / "checkpoints").unlink()  # now linked to the neighbour's: refused before anything is removed
    (run / "checkpoints").symlink_to(neighbour, target_is_directory=True)
    with pytest.raises(LoomError, match="holds files not marked as this run's"):
        ckpt.Checkpointer(run, cfg, gloo_world_of_one, keep_last=1, async_save=False)
    assert tree(neighbour) == before


# ---------------------------------------------------------------------------------------------
# Export: --overwrite replaces only the files of the names it writes


def test_adapter_export_overwrite_replaces_only_the_adapter_files(tmp_path):
    folder = tmp_path / "adapter"
    folder.mkdir()
    theirs = {"config.json": "{}", "tokenizer.json": "{}", "embeddings.safetensors": "e", "vocab.json": "{}",
              "merges.txt": "a b\n", "adapter_config.json": "{\"old\": true}"}
    for name, text in theirs.items():
        (folder / name).write_text(text)
    written = export._write_adapter(folder, {"a": torch.zeros(2)}, {"r": 4}, overwrite=True)
    assert sorted(p.name for p in written) == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((folder / "adapter_config.json").read_text()) == {"r": 4}
    for name, text in theirs.items():
        if name != "adapter_config.json":
            assert (folder / name).read_text() == text, name


def test_hf_export_overwrite_keeps_files_it_does_not_write(tmp_path):
    folder = tmp_path / "llama"
    folder.mkdir()
    old = {"model.safetensors.index.json": "{}", "model-00001-of-00002.safetensors": "x",
           "tokenizer_config.json": "{}", "config.json": "{}"}
    kept = {"embeddings.safetensors": "e", "vocab.json": "{}", "merges.txt": "a b\n", "notes.md": "mine\n"}
    for name, text in {**old, **kept}.items():
        (folder / name).write_text(text)
    replaced = export._replaced_model_files(folder)
    assert sorted(p.name for p in replaced) == sorted(old)
    export._write_model_folder(folder, {"model.safetensors": b"w", "config.json": b"{}"}, replaced)
    assert sorted(p.name for p in folder.iterdir()) == sorted(["config.json", "model.safetensors", *kept])
    assert all((folder / n).read_text() == t for n, t in kept.items())


# ---------------------------------------------------------------------------------------------
# loom analyze: its own earlier outputs are replaced; the user's only under --overwrite


def test_analyze_replaces_its_own_outputs_and_the_users_only_with_overwrite(tmp_path, capsys):
    run = tmp_path / "run"
    write_run(run / "traces")
    assert loom.cli.main(["analyze", str(run / "traces")]) == 0
    assert loom.cli.main(["analyze", str(run / "traces")]) == 0  # its own: replaced again
    (run / "report.html").write_text("<html>my thesis figures</html>\n")
    assert loom.cli.main(["analyze", str(run / "traces")]) == 2
    assert (run / "report.html").read_text() == "<html>my thesis figures</html>\n"
    assert loom.cli.main(["analyze", str(run / "traces"), "--overwrite"]) == 0
    assert (run / "report.html").read_text().startswith("<!DOCTYPE html>")
    assert json.loads((run / "ledger.json").read_text())["ranks"]


def test_a_scratch_disk_linked_before_the_first_run_takes_its_checkpoints(tmp_path, corpus):
    """`mkdir run; ln -s /scratch/run run/checkpoints; loom train --out run`: the run starts (the
    folder holds only the link to an empty folder), its checkpoints land on the scratch disk, marked
    as this run's; checkpoints moved there by hand and marked with the printed command continue."""
    from in_process import world_of_one

    scratch = tmp_path / "scratch" / "run"
    scratch.mkdir(parents=True)
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(scratch, target_is_directory=True)
    sets = ["model.preset=tiny", f'data.source="{corpus}"', "data.seq_len=32", "train.batch_size=4",
            "data.num_workers=0", "train.device=cpu", "parallel.strategy=ddp", "train.eval_batches=0",
            "train.ckpt_every_min=0"]
    argv = ["train", "--nproc", "1", "--out", str(run), *[a for s in sets for a in ("--set", s)]]
    with world_of_one():
        assert loom.cli.main([*argv, "--set", "train.steps=2"]) == 0
    assert (scratch / "step_2" / "meta.json").is_file()
    assert (scratch / ckpt.OWNER).read_text().strip() == str(run.resolve())
    moved = tmp_path / "scratch2"  # the run's checkpoints moved to another disk, linked, not yet marked
    scratch.rename(moved)
    (moved / ckpt.OWNER).unlink()
    (run / "checkpoints").unlink()
    (run / "checkpoints").symlink_to(moved, target_is_directory=True)
    with pytest.raises(LoomError, match="mark them: echo") as refused:
        ckpt.check_checkpoints_dir(run)
    command = str(refused.value).rsplit("mark them: ", 1)[1]
    assert command == f"echo {run.resolve()} > {moved.resolve() / ckpt.OWNER}"
    (moved / ckpt.OWNER).write_text(f"{run.resolve()}\n")  # what the command does
    with world_of_one():
        assert loom.cli.main([*argv, "--set", "train.steps=3", "--resume", "auto"]) == 0
    assert (moved / "step_3").is_dir()
