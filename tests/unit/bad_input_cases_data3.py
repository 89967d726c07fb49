"""Bad-input cases of data readers that trained on garbage or crashed (docs/bad-input.md, "Data" and
"Data files"): UTF-16 and binary text files, empty records, a Parquet column whose type changes
between files, chat contents as lists of parts, a message without content or with a number as its
role, a JSONL record nested deeper than pyarrow's reader survives, `data prepare --shard-docs 0`
and a `data.cache_dir` that is a file."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from bad_input import Ctx, case, cli
from bad_input_cases_data import _jsonl, _train, _with_tokenizer, chat_records

TEXT = "hello world, this is a small text file to train on. " * 40


@case("data-text-utf16")
def _(c: Ctx) -> str:
    (c.tmp / "notes.txt").write_bytes(TEXT.encode("utf-16"))  # with its byte-order mark
    return _train(c, c.tmp / "notes.txt")


@case("data-text-utf16-no-bom")
def _(c: Ctx) -> str:
    (c.tmp / "notes.txt").write_bytes(TEXT.encode("utf-16-le"))
    return _train(c, c.tmp / "notes.txt")


@case("data-text-binary")
def _(c: Ctx) -> str:
    corpus = c.tmp / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(TEXT)
    np.save(corpus / "b.npy", np.arange(1000, dtype=np.int64))
    return _train(c, corpus)


@case("data-text-random-bytes")
def _(c: Ctx) -> str:
    data = bytes(np.random.default_rng(0).integers(128, 256, 4000, dtype=np.uint8))  # no NUL, not UTF-8
    (c.tmp / "noise.txt").write_bytes(data)
    return _train(c, c.tmp / "noise.txt")


@case("data-records-all-empty")
def _(c: Ctx) -> str:
    return _train(c, _jsonl(c.tmp / "notes.jsonl", [{"text": ""}] * 200))


@case("data-parquet-column-type-changes")
def _(c: Ctx) -> str:
    folder = c.tmp / "parquet"
    folder.mkdir()
    pq.write_table(pa.Table.from_pylist([{"text": TEXT}] * 40), folder / "a.parquet")
    pq.write_table(pa.Table.from_pylist([{"text": 12345}] * 40), folder / "b.parquet")
    return _train(c, folder)


def _chat_with(c: Ctx, messages: list) -> str:
    return _with_tokenizer(c, [*chat_records(3), {"messages": messages}], "--set", "data.format=sft")


@case("data-chat-image-part")
def _(c: Ctx) -> str:
    return _chat_with(c, [{"role": "user", "content": [{"type": "text", "text": "hello"},
                                                       {"type": "image", "text": None}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "fine"}]}])


@case("data-chat-no-content")
def _(c: Ctx) -> str:
    return _chat_with(c, [{"role": "user"}, {"role": "assistant", "content": "fine"}])


@case("data-chat-role-not-string")
def _(c: Ctx) -> str:
    return _chat_with(c, [{"role": 5, "content": "hello"}, {"role": "assistant", "content": "fine"}])


@case("data-jsonl-nested-deep")
def _(c: Ctx) -> str:
    path = _jsonl(c.tmp / "notes.jsonl", [{"text": TEXT}] * 3)
    deep = "[" * 100_000 + "]" * 100_000  # pyarrow's reader segfaults on it (rc 139, no output)
    path.write_text(path.read_text() + '{"text": "x", "a": ' + deep + "}\n")
    return _train(c, path)


@case("data-prepare-shard-docs-zero")
def _(c: Ctx) -> str:
    (c.tmp / "a.txt").write_text(TEXT)
    return cli("data", "prepare", str(c.tmp / "a.txt"), str(c.tmp / "out"), "--shard-docs", "0",
               "--cache-dir", str(c.tmp / "cache"), capsys=c.capsys)


@case("data-cache-dir-is-file")
def _(c: Ctx) -> str:
    (c.tmp / "cache.txt").write_text("my notes\n")
    return c.train("--set", f'data.source="{_jsonl(c.tmp / "a.jsonl", [{"text": TEXT}] * 40)}"',
                   "--set", f'data.cache_dir="{c.tmp / "cache.txt"}"')
