"""Bad-input cases of the data files (docs/bad-input.md, "Data files"): a prepared folder's
index.json and shards, tokenizer.json and tokenizer_config.json, chat templates, JSONL and Parquet
records, the tokenizing cache, `loom data prepare`'s job file, a directory source's links, and a
LoomError raised in a DataLoader worker.

`prepared`, `tokenizer_folder` and `chat_records` make small valid inputs, shared with
tests/unit/test_fuzz_data.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from bad_input import Ctx, case, cli
from fuzz import bounded

import loom.cli
from loom.config import load_config
from loom.data.prepare import INDEX_FILE, prepare
from loom.data.run_data import build_run_data

WORDS = "the cat sat on a mat hello world how are you fine thanks user assistant".split()
CHAT_TEMPLATE = "{% for m in messages %}{{ m.role }} {{ m.content }} {% endfor %}"


def prepared(folder: Path, cache: Path, docs: int = 12) -> Path:
    """`loom data prepare` of `docs` text files (byte tokenizer, 4 documents a shard) into folder."""
    texts = folder.parent / f"{folder.name}-texts"
    texts.mkdir(parents=True, exist_ok=True)
    for i in range(docs):
        (texts / f"d{i:02d}.txt").write_text(f"hello world {i} " * 30)
    prepare(str(texts), folder, shard_docs=4, workers=1, cache_dir=cache, progress=None)
    return folder


def tokenizer_folder(folder: Path, template: str | None = CHAT_TEMPLATE, extra: dict | None = None) -> Path:
    """A word-level tokenizer.json over WORDS (EOS `</s>`) and its tokenizer_config.json; `extra`
    adds words at the ids given (gaps allowed)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "</s>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["</s>"])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if extra:  # written into the file (tokenizers' own save takes ~20 s to write an id of 2**31)
        saved = json.loads((folder / "tokenizer.json").read_text())
        saved["model"]["vocab"].update(extra)
        (folder / "tokenizer.json").write_text(json.dumps(saved))
    config = {"eos_token": "</s>"} | ({"chat_template": template} if template else {})
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder / "tokenizer.json"


def chat_records(n: int = 40) -> list[dict]:
    return [{"messages": [{"role": "user", "content": "hello how are you"},
                          {"role": "assistant", "content": f"fine thanks {WORDS[i % len(WORDS)]}"}]}
            for i in range(n)]


def _jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _train(c: Ctx, source: Path | str, *args: str) -> str:
    return c.train("--set", f'data.source="{source}"', "--set", f'data.cache_dir="{c.tmp / "cache"}"', *args)


def _train_prepared(c: Ctx, edit) -> str:
    """Train on a prepared folder after `edit(folder, index)` changed it (index.json rewritten)."""
    folder = prepared(c.tmp / "prepared", c.tmp / "cache")
    index = json.loads((folder / INDEX_FILE).read_text())
    edit(folder, index)
    (folder / INDEX_FILE).write_text(json.dumps(index))
    return _train(c, folder)


def _with_tokenizer(c: Ctx, records: list, *args: str, template: str | None = CHAT_TEMPLATE,
                    extra: dict | None = None) -> str:
    tok = tokenizer_folder(c.tmp / "tok", template, extra)
    return _train(c, _jsonl(c.tmp / "chat.jsonl", records), "--set", f'data.tokenizer="{tok}"', *args)


def _chat(c: Ctx, template: str, *args: str) -> str:
    return _with_tokenizer(c, chat_records(), "--set", "data.format=sft", *args, template=template)


# ---------------------------------------------------------------------------------------------
# a prepared folder: index.json and its shards


@case("data-index-absolute-shard")
def _(c: Ctx) -> str:
    np.save(c.tmp / "x.npy", np.full(1000, 7, dtype=np.uint16))
    return _train_prepared(c, lambda folder, index: index["shards"][0].update(tokens=str(c.tmp / "x.npy")))


@case("data-index-escapes")
def _(c: Ctx) -> str:
    return _train_prepared(c, lambda folder, index: index["shards"][0].update(tokens="../../x.npy"))


@case("data-index-link-escapes")
def _(c: Ctx) -> str:
    def link(folder: Path, index: dict) -> None:
        np.save(c.tmp / "elsewhere.npy", np.full(1000, 7, dtype=np.uint16))
        shard = folder / index["shards"][0]["tokens"]
        shard.unlink()
        os.symlink(c.tmp / "elsewhere.npy", shard)
    return _train_prepared(c, link)


@case("data-index-no-shards")
def _(c: Ctx) -> str:
    return _train_prepared(c, lambda folder, index: index.pop("shards"))


@case("data-index-counts")
def _(c: Ctx) -> str:
    return _train_prepared(c, lambda folder, index: index.update(num_tokens=5))


@case("data-index-dtype")
def _(c: Ctx) -> str:
    return _train_prepared(c, lambda folder, index: index.update(dtype="float32"))


def _rewrite_shard(folder: Path, index: dict, tokens: np.ndarray) -> None:
    np.save(folder / index["shards"][1]["tokens"], tokens)


@case("data-shard-id-over-vocab")
def _(c: Ctx) -> str:
    def edit(folder: Path, index: dict) -> None:
        tokens = np.load(folder / index["shards"][1]["tokens"])
        tokens[5] = 300  # the tiny model's vocabulary is 256
        _rewrite_shard(folder, index, tokens)
    return _train_prepared(c, edit)


@case("data-shard-id-negative")
def _(c: Ctx) -> str:
    def edit(folder: Path, index: dict) -> None:
        tokens = np.load(folder / index["shards"][1]["tokens"]).astype(np.int16)
        tokens[5] = -3
        _rewrite_shard(folder, index, tokens)
    return _train_prepared(c, edit)


@case("data-shard-not-npy")
def _(c: Ctx) -> str:
    return _train_prepared(c, lambda folder, index: (folder / index["shards"][1]["tokens"]).write_bytes(
        b"\x93NUMPY not really"))


@case("data-prepare-job-damaged")
def _(c: Ctx) -> str:
    folder = prepared(c.tmp / "prepared", c.tmp / "cache")
    job = json.loads((folder / "prepare.json").read_text())
    (folder / INDEX_FILE).unlink()  # as a killed run leaves it
    (folder / "prepare.json").write_text(json.dumps(job | {"docs_per_shard": "4"}))
    return cli("data", "prepare", str(c.tmp / "prepared-texts"), str(folder), "--shard-docs", "4",
               "--workers", "1", "--cache-dir", str(c.tmp / "cache"), capsys=c.capsys)


# ---------------------------------------------------------------------------------------------
# tokenizers


@case("data-tokenizer-ids-over-vocab")
def _(c: Ctx) -> str:
    return _with_tokenizer(c, [{"text": "hello world " * 40}] * 20, "--set", "model.vocab_size=256",
                           extra={"sky": 999}, template=None)  # (unset, the model takes the tokenizer's)


@case("data-tokenizer-ids-huge")
def _(c: Ctx) -> str:
    return _with_tokenizer(c, [{"text": "hello world"}], extra={"sky": 2**31}, template=None)


@case("data-tokenizer-not-utf8")
def _(c: Ctx) -> str:
    tok = tokenizer_folder(c.tmp / "tok")
    tok.write_bytes(tok.read_bytes().replace(b'"hello"', b'"hel\xfflo"'))
    return _train(c, _jsonl(c.tmp / "a.jsonl", [{"text": "hello"}]), "--set", f'data.tokenizer="{tok}"')


@case("data-tokenizer-config-type")
def _(c: Ctx) -> str:
    tok = tokenizer_folder(c.tmp / "tok")
    (tok.parent / "tokenizer_config.json").write_text(json.dumps({"eos_token": 5}))
    return _train(c, _jsonl(c.tmp / "a.jsonl", [{"text": "hello"}]), "--set", f'data.tokenizer="{tok}"')


@case("data-bpe-vocab-huge")
def _(c: Ctx) -> str:
    return _train(c, c.corpus, "--set", "data.tokenizer=bpe", "--set", "data.bpe_vocab_size=4294967296")


# ---------------------------------------------------------------------------------------------
# chat templates


@case("data-template-zero-division")
def _(c: Ctx) -> str:
    return _chat(c, "{{ 1 // 0 }}")


@case("data-template-range")
def _(c: Ctx) -> str:
    return _chat(c, "{% for i in range(10**6) %}x{% endfor %}")


@case("data-template-unbounded")
def _(c: Ctx) -> str:
    c.monkeypatch.setattr("loom.data.chat_template.MAX_SECONDS", 0.3)  # the bound, not its size, is tested
    with bounded(seconds=60, extra_bytes=8 << 30):  # without loom's bound: this one ends it, as another line
        return _chat(c, "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")


@case("data-template-huge-value")
def _(c: Ctx) -> str:
    return _chat(c, "{{ 'x' * 10**10 }}")


@case("data-template-syntax")
def _(c: Ctx) -> str:
    return _chat(c, "{% for m in messages %}{{ m.content }")


# ---------------------------------------------------------------------------------------------
# records


@case("data-jsonl-not-utf8")
def _(c: Ctx) -> str:
    path = _jsonl(c.tmp / "notes.jsonl", [{"text": "hello world"}] * 3)
    path.write_bytes(path.read_bytes() + b'{"text": "caf\xe9"}\n')
    return _train(c, path)


@case("data-jsonl-not-json")
def _(c: Ctx) -> str:
    path = _jsonl(c.tmp / "notes.jsonl", [{"text": "hello world"}] * 3)
    path.write_text(path.read_text() + '{"text": "unfinished\n')
    return _train(c, path)


@case("data-jsonl-text-not-string")
def _(c: Ctx) -> str:
    return _train(c, _jsonl(c.tmp / "notes.jsonl", [{"text": "hello world"}, {"text": 5}]))


@case("data-jsonl-type-changes")
def _(c: Ctx) -> str:
    path = _jsonl(c.tmp / "notes.jsonl", [{"text": "hello world"}] * 3)
    path.write_text(path.read_text() + "\n\n" + json.dumps({"text": 5}) + "\n")
    return _train(c, path)


@case("data-jsonl-messages-string")
def _(c: Ctx) -> str:
    return _with_tokenizer(c, [*chat_records(3), {"messages": "x"}], "--set", "data.format=sft")


@case("data-parquet-broken")
def _(c: Ctx) -> str:
    path = c.tmp / "notes.parquet"
    pq.write_table(pa.Table.from_pylist([{"text": "hello world " * 20}] * 40), path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return _train(c, path)


# ---------------------------------------------------------------------------------------------
# sources, the tokenizing cache, DataLoader workers


@case("data-source-link-escapes")
def _(c: Ctx) -> str:
    (c.tmp / "corpus").mkdir()
    (c.tmp / "corpus" / "a.txt").write_text("hello world " * 100)
    (c.tmp / "home").mkdir()
    (c.tmp / "home" / "id_rsa").write_text("-----BEGIN OPENSSH PRIVATE KEY-----")
    os.symlink(c.tmp / "home" / "id_rsa", c.tmp / "corpus" / "b.txt")
    return _train(c, c.tmp / "corpus")


@case("data-cache-meta-damaged")
def _(c: Ctx) -> str:
    tok = tokenizer_folder(c.tmp / "tok")
    source = _jsonl(c.tmp / "a.jsonl", [{"text": "hello world " * 40}] * 20)
    args = ("--set", f'data.tokenizer="{tok}"', "--set", "model.vocab_size=256")
    build_run_data(load_config(None, [*c.base()[1::2], f'data.source="{source}"',  # fills the cache
                                      f'data.cache_dir="{c.tmp / "cache"}"', *args[1::2]]))
    (meta,) = (c.tmp / "cache" / "tokens").glob("*.json")
    meta.write_text(meta.read_text()[:-1])
    return _train(c, source, *args)


@case("data-worker-error")
def _(c: Ctx) -> str:
    # The launcher reads the stream's first batch of records; the worker meets the bad one at step 4.
    records = [{"text": "hello"}] * 1100 + [{"text": 5}] + [{"text": "hello"}] * 100
    tok = tokenizer_folder(c.tmp / "tok", template=None)
    c.capsys.readouterr()
    settings = [f'data.source="{_jsonl(c.tmp / "late.jsonl", records)}"',
                f'data.cache_dir="{c.tmp / "cache"}"', f'data.tokenizer="{tok}"', "data.streaming=true",
                "data.num_workers=1", "data.eval_fraction=0", "data.seq_len=128", "train.steps=30",
                "model.vocab_size=256"]
    rc = loom.cli.main(["train", "--nproc", "1", "--out", str(c.tmp / "run"), *c.base(),
                        *(a for s in settings for a in ("--set", s))])
    err = c.capsys.readouterr().err
    *progress, last = err.strip().splitlines()
    assert rc == 2 and "Traceback" not in err, err
    assert all(line.lstrip().startswith("step ") for line in progress), err  # progress lines, then the error
    return last.removeprefix("loom: error: ")
