"""A checkpoint the file system cannot take (issue 16): free space checked against the bytes to
write before writing; a write that fails anyway (ENOSPC, EDQUOT, EROFS, EIO) is one line naming
the path, the bytes needed and free, and the intact previous checkpoint; the partial folder is
removed; the run stops, or goes on under train.on_ckpt_error = "continue"."""

from __future__ import annotations

import errno
import json
import pickle
import re
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

import loom.cli
from loom.train import checkpoint

TINY = ["model.preset=tiny", "data.seq_len=32", "train.batch_size=4", "data.num_workers=0",
        "train.device=cpu", "parallel.strategy=ddp", "train.steps=6", "train.ckpt_every=2",
        "train.ckpt_every_min=0", "train.keep_last=5", "train.eval_batches=0"]
ONE_LINE = re.compile(r"checkpoint step_(\d+) could not be written to (\S+): (.+?); it needs ([\d.]+ \w+), "
                      r"the file system has ([\d.]+ \w+) free; nothing of it is left, and the previous "
                      r"checkpoint step_(\d+) is intact")


def _train(run: Path, corpus: Path, *overrides: str) -> int:
    sets = [a for o in [*TINY, f'data.source="{corpus}"', *overrides] for a in ("--set", o)]
    return loom.cli.main(["train", "--nproc", "1", "--out", str(run), *sets])


def _full_from_step(monkeypatch, step: int) -> None:
    """The file system reports almost no free space from checkpoint `step` on."""
    real = checkpoint._free_bytes

    def free(path: Path) -> int:
        saved = [int(p.name[5:]) for p in path.glob("step_*")] if path.is_dir() else []
        return 1000 if saved and max(saved) >= step - 2 else real(path)

    monkeypatch.setattr(checkpoint, "_free_bytes", free)


def test_no_room_stops_with_one_line_before_writing(corpus, tmp_path, world_of_one, monkeypatch, capsys):
    _full_from_step(monkeypatch, 4)
    run = tmp_path / "run"
    assert _train(run, corpus) == 2
    out = capsys.readouterr().err
    err = [line for line in out.splitlines() if line.startswith("loom:")]
    assert len(err) == 1 and "Traceback" not in out, out
    m = ONE_LINE.search(err[0])
    assert m, err[0]
    assert (m.group(1), m.group(2), m.group(3), m.group(5), m.group(6)) == \
        ("4", str(run / "checkpoints"), "no space left on the device (ENOSPC)", "1000 B", "2")
    assert "set train.on_ckpt_error = \"continue\"" in err[0]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_2"]
    assert json.loads((run / "checkpoints" / "step_2" / "meta.json").read_text())["step"] == 2
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 4  # it did not train on


def test_needed_bytes_cover_what_is_written(corpus, tmp_path, world_of_one, monkeypatch, capsys):
    """The estimate (each tensor's bytes, plus a record per tensor) is at least the folder's size,
    and not much more."""
    _full_from_step(monkeypatch, 4)
    run = tmp_path / "run"
    _train(run, corpus)
    needed = ONE_LINE.search(capsys.readouterr().err).group(4)
    value, unit = needed.split()
    needed_bytes = float(value) * {"KiB": 1024, "MiB": 1024 ** 2}[unit]
    written = sum(f.stat().st_size for f in (run / "checkpoints" / "step_2").iterdir())
    assert written <= needed_bytes <= 1.1 * written


def test_continue_warns_and_trains_on(corpus, tmp_path, world_of_one, monkeypatch, capsys):
    _full_from_step(monkeypatch, 4)
    run = tmp_path / "run"
    assert _train(run, corpus, 'train.on_ckpt_error="continue"') == 0
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("loom: warning: checkpoint")]
    assert len(warnings) == 2  # step 4 and step 6 (the end) could not be written
    assert warnings[0].endswith('training goes on without it (train.on_ckpt_error = "continue")')
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 6
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_2"]


def test_errno_found_in_a_failure_that_crossed_ranks():
    """DCP pickles each rank's failure to every rank, which drops the exception's cause: the errno
    is then found in the text; on this rank, in the exception's chain."""
    try:
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos 704 vs 598")
    except RuntimeError as e:
        local = e
    assert checkpoint._errno_of(local) == errno.EDQUOT
    remote = pickle.loads(pickle.dumps(CheckpointException("write", {1: _wrap_exception(
        OSError(errno.EROFS, "Read-only file system"))})))
    assert checkpoint._errno_of(remote) == errno.EROFS
    assert checkpoint._errno_of(CheckpointException("write", {0: _wrap_exception(local)})) == errno.EDQUOT
    assert checkpoint._errno_of(RuntimeError("unexpected pos 704 vs 598")) is None


def test_checkpoint_bytes_count_a_replicated_tensor_once():
    weight, state = torch.zeros(10, 10), torch.zeros(5)
    per_rank = [checkpoint._bytes_to_write({"model.w": weight, "optim.w.exp_avg": state, "step": 3}),
                checkpoint._bytes_to_write({"model.w": weight})]
    assert checkpoint._checkpoint_bytes(per_rank) == \
        400 + 20 + 3 * checkpoint._PIECE_OVERHEAD + 2 * checkpoint._RANK_OVERHEAD


def test_a_full_disk_at_the_latest_marker_leaves_the_scan_to_find_the_newest(corpus, tmp_path, world_of_one,
                                                                            monkeypatch):
    """The 'latest' marker is written after the checkpoint is published; when even that fails,
    the marker goes and a scan finds the newest step_N (not the older one a stale marker names)."""
    real = checkpoint.atomic_write

    def marker_fails_after_step_2(path, data, durable=False):
        if path.name == checkpoint.LATEST and data != b"step_2\n":
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data, durable)

    monkeypatch.setattr(checkpoint, "atomic_write", marker_fails_after_step_2)
    run = tmp_path / "run"
    assert _train(run, corpus) == 0
    assert not (run / "checkpoints" / "latest").exists()
    assert checkpoint.latest_checkpoint(run).name == "step_6"
