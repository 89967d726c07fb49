"""Fuzzing the readers of the user-files part (tests/fuzz.py): the tokenizer record export trusts
(meta.json's tokenizer_files), the stop record the launcher reads (stopped.json) and the metrics a
resumed run keeps (metrics.jsonl) give their result or loom's one-line error, never another
exception; and export never reads a file outside the checkpoint's tokenizer/ folder."""

from __future__ import annotations

import hashlib
import json

from fuzz import FUZZ, must_read, perturbed, perturbed_bytes, write_json
from hypothesis import given

import loom.cli
from loom.train import tokenizer_copy
from loom.train.meters import kept_metrics

TOKENIZER = b'{"model": {"type": "WordLevel"}}'
RECORD = {"tokenizer_files": {"tokenizer.json": hashlib.sha256(TOKENIZER).hexdigest()}, "step": 2}


@FUZZ
@given(meta=perturbed(RECORD))
def test_tokenizer_record(meta, tmp_path_factory):
    step = tmp_path_factory.mktemp("step_2")
    (step / "tokenizer").mkdir()
    (step / "tokenizer" / "tokenizer.json").write_bytes(TOKENIZER)
    (step.parent / "outside.json").write_text("{}")
    files = must_read(lambda: tokenizer_copy.carried(step, meta))
    if files is not None:  # only the checkpoint's own copies, each as recorded
        assert set(files) <= set(tokenizer_copy.NAMES)
        recorded = meta.get("tokenizer_files", {})
        assert all(hashlib.sha256(data).hexdigest() == recorded[name] for name, data in files.items())


@FUZZ
@given(record=perturbed({"signal": 15, "step": 2, "checkpoint": None, "note": None, "launches": ["L"]}))
def test_stop_record(record, tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    write_json(run / "stopped.json", record)
    stopped = must_read(lambda: loom.cli._stop_record(run, "L"), names=["stopped.json"])
    if stopped is not None:
        assert isinstance(stopped["signal"], int) and isinstance(stopped["note"], str | None)


METRICS = "".join(json.dumps({"step": s, "loss": 5.0 - s}) + "\n" for s in range(1, 6)).encode()


@FUZZ
@given(data=perturbed_bytes(METRICS))
def test_kept_metrics(data, tmp_path_factory):
    path = tmp_path_factory.mktemp("run") / "metrics.jsonl"
    path.write_bytes(data)
    kept = must_read(lambda: kept_metrics(path, 3), names=["metrics.jsonl"])
    if kept is not None:
        assert all(json.loads(line)["step"] <= 3 for line in kept)
