"""Data readers that trained on garbage or crashed (issue 38, data): UTF-16 and binary text files,
empty records, a Parquet column whose type changes between files, chat contents as lists of parts,
a JSONL record nested too deep for pyarrow, and a cache folder that is a file. The one-line
messages themselves are docs/bad-input.md's rows (tests/unit/bad_input_cases_data3.py); these check
what is read when the input is good, and the properties of the readers."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from bad_input_cases_data import chat_records
from fuzz import FUZZ
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.data import records, sft
from loom.data.chat_template import ChatTemplate
from loom.data.corpus import read_text
from loom.data.documents import NonEmpty, cache_folder, tokenize_source
from loom.data.hf_tokenizer import load_document_tokenizer
from loom.data.records import RecordFields
from loom.data.run_data import _stream_documents
from loom.data.sources import resolve
from loom.errors import LoomError

CASES = settings(FUZZ, max_examples=60)


# ---------------------------------------------------------------------------------------------
# text files: UTF-8 reads back, UTF-16 and binary are refused


@CASES
@given(text=st.text(st.characters(blacklist_characters="\0", blacklist_categories=("Cs",)), max_size=300))
def test_utf8_text_reads_back_as_written(text, tmp_path_factory):
    path = tmp_path_factory.mktemp("t") / "a.txt"
    path.write_bytes(text.encode("utf-8"))
    assert read_text(path) == text


@CASES
@given(text=st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=4, max_size=300),
       encoding=st.sampled_from(["utf-16", "utf-16-le", "utf-16-be", "utf-32"]))
def test_utf16_and_utf32_text_is_refused_saying_convert(text, encoding, tmp_path_factory):
    path = tmp_path_factory.mktemp("t") / "a.txt"
    path.write_bytes(text.encode(encoding))
    with pytest.raises(LoomError, match="convert it to UTF-8"):
        read_text(path)


@CASES
@given(data=st.binary(min_size=1, max_size=400), at=st.integers(0, 400))
def test_bytes_with_a_nul_are_refused(data, at, tmp_path_factory):
    path = tmp_path_factory.mktemp("t") / "a.txt"
    at = min(at, len(data))
    path.write_bytes(data[:at] + b"\0" + data[at:])
    with pytest.raises(LoomError, match="(is not text|convert it to UTF-8)"):
        read_text(path)


def test_latin1_accents_in_utf8_text_are_not_taken_for_binary(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(("caf\u00e9 au lait, " * 50).encode("latin-1"))  # a few bad bytes: still text
    assert read_text(path).startswith("caf\ufffd au lait")


# ---------------------------------------------------------------------------------------------
# empty records


def _docs(lengths: list[int]) -> list:
    return [(np.arange(n + 1, dtype=np.uint16), None) for n in lengths]  # n ids, then the EOS


def test_empty_documents_are_skipped_and_counted():
    docs = NonEmpty(_docs([3, 0, 5, 0, 0]), "notes.jsonl", "text")
    assert [len(ids) for ids, _ in docs] == [4, 6]
    assert docs.skipped == 3
    assert docs.note() == "data.source 'notes.jsonl': skipped 3 records with an empty 'text'"


def test_only_empty_documents_are_refused_with_their_count():
    with pytest.raises(LoomError, match="all 200 records have an empty 'text'"):
        list(NonEmpty(_docs([0] * 200), "notes.jsonl", "text"))


def test_sft_documents_are_never_skipped():
    sft_doc = (np.array([1], dtype=np.uint16), np.array([1], dtype=np.uint8))
    assert len(list(NonEmpty([sft_doc], "chat.jsonl", "text"))) == 1


def test_tokenizing_a_jsonl_keeps_only_its_nonempty_texts(tmp_path, capsys):
    path = tmp_path / "notes.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["ab", "", "cde", ""]))
    docs = tokenize_source(resolve(str(path)), load_document_tokenizer("byte"), RecordFields(), tmp_path)
    assert docs.num_docs == 2 and docs.num_tokens == 3 + 4  # each with its EOS
    assert "skipped 2 records with an empty 'text'" in capsys.readouterr().out


def test_streaming_a_jsonl_skips_its_empty_texts(tmp_path):
    path = tmp_path / "notes.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["", "ab", "", "cde"]))
    docs = _stream_documents(resolve(str(path)), load_document_tokenizer("byte"), RecordFields(), tmp_path)
    assert [len(ids) for ids, _ in docs] == [3, 4]


# ---------------------------------------------------------------------------------------------
# nesting deeper than pyarrow's JSON reader survives


@settings(FUZZ, max_examples=20)
@given(depth=st.integers(1, 900), bracket=st.sampled_from(["[]", "{}"]))
def test_records_nested_within_the_bound_pass(depth, bracket, tmp_path_factory):
    inner = "[" * depth + "]" * depth if bracket == "[]" else '{"a": ' * depth + "1" + "}" * depth
    path = tmp_path_factory.mktemp("j") / "a.jsonl"
    path.write_text('{"text": "x"}\n' + '{"text": "y", "deep": ' + inner + "}\n")
    st_ = path.stat()
    assert records._too_deep_in(path, st_.st_size, st_.st_mtime_ns) is None


@settings(FUZZ, max_examples=10)
@given(depth=st.integers(1200, 200_000), line=st.integers(1, 5))
def test_records_nested_past_the_bound_name_their_line(depth, line, tmp_path_factory):
    path = tmp_path_factory.mktemp("j") / "a.jsonl"
    lines = ['{"text": "[[[ a string of brackets is no nesting"}'] * 5
    lines[line - 1] = '{"text": "y", "deep": ' + "[" * depth + "]" * depth + "}"
    path.write_text("\n".join(lines) + "\n")
    st_ = path.stat()
    assert records._too_deep_in(path, st_.st_size, st_.st_mtime_ns) == line


def test_brackets_inside_strings_are_no_nesting(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"text": "[" * 5000}) + "\n")
    st_ = path.stat()
    assert records._too_deep_in(path, st_.st_size, st_.st_mtime_ns) is None


# ---------------------------------------------------------------------------------------------
# Parquet files of one source agree on their columns' types


def test_parquet_files_with_the_same_types_pass(tmp_path):
    for name in ("a", "b"):
        pq.write_table(pa.Table.from_pylist([{"text": name, "n": 1}]), tmp_path / f"{name}.parquet")
    records._check_parquet(resolve(str(tmp_path)))


def test_parquet_column_type_change_names_the_file_and_types(tmp_path):
    pq.write_table(pa.Table.from_pylist([{"text": "a"}]), tmp_path / "a.parquet")
    pq.write_table(pa.Table.from_pylist([{"text": 1.5}]), tmp_path / "b.parquet")
    with pytest.raises(LoomError, match=r"b\.parquet: column 'text' is double, but .*a\.parquet has it as "
                                        r"string"):
        records._check_parquet(resolve(str(tmp_path)))


# ---------------------------------------------------------------------------------------------
# chat contents as lists of parts


@CASES
@given(parts=st.lists(st.text(max_size=20), min_size=1, max_size=6))
def test_text_parts_are_joined(parts):
    assert sft._content([{"type": "text", "text": p} for p in parts], "r") == "".join(parts)


def test_parts_and_strings_give_the_same_segments(tmp_path):
    template = ChatTemplate("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}", {}, "t")
    fields = RecordFields(format="sft")
    plain = chat_records(1)[0]["messages"]
    parted = [{**m, "content": [{"type": "text", "text": w} for w in m["content"].partition(" ")]}
              for m in plain]
    assert sft.chat(parted, template, fields, "r") == sft.chat(plain, template, fields, "r")
    assert "[{" not in "".join(text for text, _ in sft.chat(parted, template, fields, "r"))


@pytest.mark.parametrize(("message", "expected"), [
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
     "r: messages[0]: content[0] is a 'image_url' part"),
    ({"role": "user", "content": []}, "r: messages[0] has a list as its content"),
    ({"role": "user", "content": None}, "r: messages[0] has no content"),
    ({"role": None, "content": "hi"}, "r: messages[0] has null None as its role"),
])
def test_bad_messages_are_one_line_naming_the_message(message, expected):
    template = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", {}, "t")
    with pytest.raises(LoomError) as e:
        sft.chat([message, {"role": "assistant", "content": "ok"}], template, RecordFields(format="sft"), "r")
    assert str(e.value).startswith(expected)


# ---------------------------------------------------------------------------------------------
# the cache folder


def test_cache_folder_under_a_file_is_refused(tmp_path):
    (tmp_path / "notes").write_text("x")
    with pytest.raises(LoomError, match=r"data.cache_dir '.*notes/cache' is under .*notes, a file, not a "
                                        r"folder"):
        cache_folder(tmp_path / "notes" / "cache")
    assert cache_folder(tmp_path / "new" / "cache") == tmp_path / "new" / "cache"  # made when written

