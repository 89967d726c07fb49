"""`loom data prepare` skips empty records as training does (issue 38, prepare): its shards hold the
non-empty texts alone, each with its EOS, the index counts those documents, a note counts the
skipped records, a shard of empty records alone is an empty shard (kept on a rerun, read back), and
a source of nothing but empty texts is refused (docs/bad-input.md, `data-prepare-all-empty`)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

from loom.data.documents import tokenize_source
from loom.data.hf_tokenizer import load_document_tokenizer
from loom.data.prepare import INDEX_FILE, load_prepared, prepare, shard_files
from loom.data.records import RecordFields
from loom.data.sources import resolve

EOS = 0  # the byte tokenizer's


def _jsonl(path: Path, texts: list[str]) -> str:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


def _stream(texts: list[str]) -> list[int]:
    """The byte tokenizer's ids of the non-empty texts, each followed by its EOS."""
    return [i for t in texts if t for i in [*t.encode(), EOS]]


def _prepare(source: str, out: Path, **kwargs) -> dict:
    return prepare(source, out, tokenizer="byte", workers=1, cache_dir=out.parent / "cache", **kwargs)


def test_prepare_writes_only_the_nonempty_records_and_notes_the_skipped(tmp_path, capsys):
    texts = ["ab", "", "cde", "", "", "fghi", ""]
    progress = io.StringIO()
    index = _prepare(_jsonl(tmp_path / "notes.jsonl", texts), tmp_path / "out", shard_docs=3,
                     progress=progress)
    tokens = np.concatenate([np.load(tmp_path / "out" / s["tokens"]) for s in index["shards"]])
    assert tokens.tolist() == _stream(texts)
    assert len(tokens) == 2 + 3 + 4 + 3 and int((tokens == EOS).sum()) == 3  # one EOS per kept text
    assert [s["num_docs"] for s in index["shards"]] == [2, 1, 0]  # ab, cde | fghi | (one empty record)
    assert [s["num_tokens"] for s in index["shards"]] == [7, 5, 0]
    assert index["num_docs"] == 3 and index["num_tokens"] == 12
    assert json.loads((tmp_path / "out" / INDEX_FILE).read_text()) == index
    out = capsys.readouterr().out
    assert f"note: data.source '{tmp_path / 'notes.jsonl'}': skipped 4 records with an empty 'text'\n" in out
    assert "7/7 documents" in progress.getvalue()  # the progress counts the source's records


def test_prepared_shards_equal_what_training_tokenizes(tmp_path, capsys):
    texts = ["", "hello", "", "world", "x"] * 3
    source = _jsonl(tmp_path / "notes.jsonl", texts)
    _prepare(source, tmp_path / "out", shard_docs=4)
    prepared, index = load_prepared(tmp_path / "out")
    trained = tokenize_source(resolve(source), load_document_tokenizer("byte"), RecordFields(), tmp_path)
    assert np.asarray(prepared.streams()[0]).tolist() == trained.pieces[0].tolist() == _stream(texts)
    assert prepared.num_docs == trained.num_docs == index["num_docs"] == 9
    table = prepared.table()  # (shard, start, stop) of each document, from the shards' starts
    assert (table[:, 2] - table[:, 1]).tolist() == [6, 6, 2] * 3  # hello, world, x: each with its EOS
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert [n.split(": skipped ")[1] for n in notes] == ["6 records with an empty 'text'"] * 2


def test_a_rerun_keeps_shards_that_skipped_records(tmp_path, capsys):
    texts = ["ab", "", "cd", "ef", "", "", "gh"]
    source = _jsonl(tmp_path / "notes.jsonl", texts)
    first = _prepare(source, tmp_path / "out", shard_docs=2)
    kept = [shard_files(tmp_path / "out", s)[0] for s in range(3)]
    stamps = [p.stat().st_mtime_ns for p in kept]
    (tmp_path / "out" / INDEX_FILE).unlink()  # as if killed before the last shard and the index
    shard_files(tmp_path / "out", 3)[0].unlink()
    again = _prepare(source, tmp_path / "out", shard_docs=2)
    assert [p.stat().st_mtime_ns for p in kept] == stamps  # complete, though shorter than 2 documents
    assert again == first and again["num_docs"] == 4
    assert [s["num_docs"] for s in again["shards"]] == [1, 2, 0, 1]  # shard 2: two empty records
    prepared, _ = load_prepared(tmp_path / "out")
    assert np.asarray(prepared.streams()[0]).tolist() == _stream(texts)
    assert capsys.readouterr().out.count("skipped 3 records with an empty 'text'") == 2
