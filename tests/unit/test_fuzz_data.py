"""The data readers under hostile edits (tests/fuzz.py): a perturbed prepared index.json and
damaged shard bytes (`load_prepared`), a perturbed tokenizer.json and tokenizer_config.json (loom's
HF tokenizer loader, then encoding), perturbed JSONL records and damaged JSONL and Parquet bytes
(the run's data, as `loom train` builds it), and random chat templates of loops, arithmetic and
string growth (rendered in loom's bounded sandbox). Each gives a valid result or loom's one-line
error naming the file, within the time and memory bounds; a template that passes a bound is
refused by that bound, never by running out of memory."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from bad_input_cases_data import CHAT_TEMPLATE, chat_records, prepared, tokenizer_folder
from fuzz import FUZZ, bounded, must_read, one_line, perturbed, perturbed_bytes, write_json
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.config import Config
from loom.data import chat_template
from loom.data.chat_template import ChatTemplate
from loom.data.hf_tokenizer import HFTokenizer
from loom.data.prepare import INDEX_FILE, load_prepared
from loom.data.run_data import build_run_data
from loom.errors import LoomError

TEXTS = ["hello world how are you", "fine thanks", "the cat sat on a mat", "you are the cat"]
CONVERSATION = chat_records(1)[0]["messages"]


@pytest.fixture(scope="module")
def prepared_dir(tmp_path_factory) -> Path:
    return prepared(tmp_path_factory.mktemp("prep") / "prepared", tmp_path_factory.mktemp("cache"), docs=10)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return tokenizer_folder(tmp_path_factory.mktemp("tok") / "tok").parent


def _copy(folder: Path, tmp_path_factory) -> Path:
    copy = tmp_path_factory.mktemp("f") / folder.name
    shutil.copytree(folder, copy)
    return copy


def _stream(folder: Path) -> tuple[list[int], int]:
    docs, _ = load_prepared(folder)
    tokens, _ = docs.streams()
    return np.asarray(tokens).tolist(), docs.vocab_size


# ---------------------------------------------------------------------------------------------
# a prepared folder


@FUZZ
@given(doc=st.data())
def test_perturbed_index_gives_the_same_stream_or_one_line(doc, prepared_dir, tmp_path_factory):
    valid = json.loads((prepared_dir / INDEX_FILE).read_text())
    folder = _copy(prepared_dir, tmp_path_factory)
    write_json(folder / INDEX_FILE, doc.draw(perturbed(valid)))
    got = must_read(lambda: _stream(folder), names=[str(folder)])
    if got is not None:  # what is left valid reads the same shards
        expected, vocab = _stream(prepared_dir)
        assert got[0] == expected and got[1] >= vocab


@settings(FUZZ, max_examples=60)
@given(doc=st.data())
def test_damaged_shard_bytes_give_ids_below_the_vocabulary_or_one_line(doc, prepared_dir, tmp_path_factory):
    folder = _copy(prepared_dir, tmp_path_factory)
    name = doc.draw(st.sampled_from(sorted(p.name for p in folder.glob("shard_*.npy"))))
    (folder / name).write_bytes(doc.draw(perturbed_bytes((folder / name).read_bytes())))
    got = must_read(lambda: _stream(folder), names=[str(folder / name)])
    if got is not None:
        ids, vocab = got
        assert len(ids) == len(_stream(prepared_dir)[0]) and 0 <= min(ids) and max(ids) < vocab


# ---------------------------------------------------------------------------------------------
# tokenizers


def _encode(folder: Path) -> tuple[int, list[list[int]]]:
    tok = HFTokenizer(folder / "tokenizer.json")
    encoded = [ids.tolist() for ids in tok.encode_batch(TEXTS)]
    tok.decode(encoded[0])
    return tok.vocab_size, encoded


@settings(FUZZ, max_examples=120)
@given(doc=st.data())
def test_perturbed_tokenizer_json_encodes_below_its_vocabulary_or_one_line(doc, tokenizer_dir,
                                                                           tmp_path_factory):
    folder = _copy(tokenizer_dir, tmp_path_factory)
    valid = json.loads((folder / "tokenizer.json").read_text())
    write_json(folder / "tokenizer.json", doc.draw(perturbed(valid)))
    got = must_read(lambda: _encode(folder), names=[str(folder / "tokenizer.json")])
    if got is not None:
        vocab, encoded = got
        assert all(0 <= i < vocab for ids in encoded for i in ids)


@settings(FUZZ, max_examples=80)
@given(doc=st.data())
def test_perturbed_tokenizer_config_reads_or_refuses_in_one_line(doc, tokenizer_dir, tmp_path_factory):
    folder = _copy(tokenizer_dir, tmp_path_factory)
    valid = json.loads((folder / "tokenizer_config.json").read_text()) | {"bos_token": {"content": "<unk>"}}
    write_json(folder / "tokenizer_config.json", doc.draw(perturbed(valid)))
    got = must_read(lambda: _encode(folder), names=[str(folder)])
    if got is not None:
        assert got == _encode(tokenizer_dir)  # the same ids: the config names the EOS and the template


# ---------------------------------------------------------------------------------------------
# records, as the run's data


def _run_data(source: Path, tokenizer: Path, fmt: str = "text") -> list[int]:
    cfg = Config()
    d = cfg.data
    d.source, d.tokenizer, d.format, d.seq_len, d.eval_fraction = str(source), str(tokenizer), fmt, 4, 0.0
    d.cache_dir = str(source.parent / "cache")
    data = build_run_data(cfg)
    tokens = data.train.tokens
    return np.asarray(tokens[0:len(tokens)]).tolist()


def _write_jsonl(path: Path, records) -> Path:
    lines = records if isinstance(records, list) else [records]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


RECORDS = [{"text": t, "n": i} for i, t in enumerate(TEXTS * 3)]


@settings(FUZZ, max_examples=40)
@given(records=perturbed(RECORDS))
def test_perturbed_jsonl_records_tokenize_or_refuse_in_one_line(records, tokenizer_dir, tmp_path_factory):
    path = _write_jsonl(tmp_path_factory.mktemp("r") / "notes.jsonl", records)
    must_read(lambda: _run_data(path, tokenizer_dir / "tokenizer.json"), names=[])


@settings(FUZZ, max_examples=30)
@given(records=perturbed(chat_records(6)))
def test_perturbed_chat_records_tokenize_or_refuse_in_one_line(records, tokenizer_dir, tmp_path_factory):
    path = _write_jsonl(tmp_path_factory.mktemp("r") / "chat.jsonl", records)
    must_read(lambda: _run_data(path, tokenizer_dir / "tokenizer.json", "sft"), names=[])


@settings(FUZZ, max_examples=40)
@given(data=perturbed_bytes("".join(json.dumps(r) + "\n" for r in RECORDS).encode()))
def test_damaged_jsonl_bytes_tokenize_or_name_the_file(data, tokenizer_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("r") / "notes.jsonl"
    path.write_bytes(data)
    must_read(lambda: _run_data(path, tokenizer_dir / "tokenizer.json"), names=[str(path)])


def _parquet() -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(RECORDS), buf)
    return buf.getvalue()


@settings(FUZZ, max_examples=25)
@given(data=perturbed_bytes(_parquet()))
def test_damaged_parquet_bytes_tokenize_or_refuse_in_one_line(data, tokenizer_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("r") / "notes.parquet"
    path.write_bytes(data)
    must_read(lambda: _run_data(path, tokenizer_dir / "tokenizer.json"), names=[])


# ---------------------------------------------------------------------------------------------
# chat templates

SIZES = ["0", "1", "-1", "7", "1000", "10**5", "10**6", "10**9", "2**64"]
PIECES = ["{{ 1 // N }}", "{{ N % 0 }}", "{% for i in range(N) %}", "{% endfor %}", "{{ 'x' * N }}",
          "{{ N ** N }}", "{{ messages[0].content * N }}", "{% set ns = namespace(s='ab', l=[1]) %}",
          "{% set ns.s = ns.s ~ ns.s %}", "{% set ns.l = ns.l + ns.l %}", "{{ ns.s|length }}",
          "{% if N > 1 %}", "{% endif %}", "{{ messages|tojson }}", "{{ range(N)|list|join(',') }}",
          "{{ '%*d' % (N, 1) }}", "{{ '{:>N}'.format(1) }}", "{{ messages[0].content|indent(N) }}",
          "{{ messages[0].content.replace('', 'x' * N) }}", "{{ (messages * N)|map(attribute='role')|join }}",
          "{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}{{ m(0) }}", "{{ messages[N].content }}",
          "{{ raise_exception('no') }}", "{{ loop.index }}", "{{ ''.__class__ }}", "{{ lipsum(N) }}",
          "{% for m in messages %}{{ m.role ~ m.content }}{% endfor %}", CHAT_TEMPLATE, "{{", "%}", "x"]


@st.composite
def templates(draw) -> str:
    pieces = draw(st.lists(st.sampled_from(PIECES), min_size=1, max_size=6))
    return "".join(p.replace("N", draw(st.sampled_from(SIZES))) for p in pieces)


@settings(FUZZ, max_examples=150)
@given(template=templates(), generation=st.booleans())
def test_random_chat_templates_render_or_are_refused_by_a_bound(template, generation, monkeypatch):
    monkeypatch.setattr(chat_template, "MAX_SECONDS", 0.25)  # the bound, not its size, is what is tested

    def render() -> str:
        return ChatTemplate(template, {"eos_token": "</s>"}, "/m/chat_template.jinja").render(
            CONVERSATION, generation, "record 1")

    try:
        with bounded(seconds=5, extra_bytes=1 << 30):
            text = render()
    except LoomError as e:
        assert "MemoryError" not in one_line(e, ["/m/chat_template.jinja"])  # a bound refused it first
    else:
        assert len(text) <= chat_template.MAX_CHARS
