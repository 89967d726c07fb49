"""`loom data prepare`: shards equal to tokenizing in memory, parallel workers, a progress line,
resuming after a kill (complete shards kept), training on the shards memory-mapped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from fuzz import bounded

from loom.cli import main
from loom.config import Config
from loom.data.prepare import INDEX_FILE, load_prepared, prepare
from loom.data.run_data import build_run_data
from loom.data.tokenizer import token_dtype
from loom.errors import ConfigError, LoomError

ROOT = Path(__file__).resolve().parents[2]
WORDS = "the cat sat on mat a dog ran far away hello hi how are you fine thanks".split()


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("tok")
    vocab = {w: i for i, w in enumerate(["<unk>", "<|endoftext|>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(folder / "tokenizer.json"))  # no tokenizer_config.json: EOS found by its name
    return folder / "tokenizer.json"


def texts(n: int) -> list[str]:
    return [" ".join(WORDS[(i * 5 + j) % len(WORDS)] for j in range(i % 9 + 2)) for i in range(n)]


def expected_stream(docs: list[str]) -> list[int]:
    vocab = {w: i for i, w in enumerate(["<unk>", "<|endoftext|>", *WORDS])}
    return [t for d in docs for t in [vocab[w] for w in d.split()] + [1]]


def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d, "n": i}) + "\n" for i, d in enumerate(docs)))
    return path


def shards_concatenated(out: Path) -> tuple[list[int], list[int]]:
    """The shards end to end, and every document's start in that stream."""
    index = json.loads((out / INDEX_FILE).read_text())
    tokens, starts, offset = [], [], 0
    for shard in index["shards"]:
        part = np.load(out / shard["tokens"])
        assert part.dtype == np.uint16
        tokens += part.tolist()
        starts += (np.load(out / shard["docs"]) + offset).tolist()
        offset += len(part)
    return tokens, starts


def run_cli(*args: str, env: dict | None = None, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "loom.cli", "data", "prepare", *args], cwd=ROOT,
                            env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kwargs)


def test_shards_equal_the_in_memory_tokenization_and_train_memory_mapped(tmp_path: Path,
                                                                         tokenizer_json: Path):
    docs = texts(23)
    write_jsonl(tmp_path / "a.jsonl", docs)
    out = tmp_path / "prepared"
    index = prepare(str(tmp_path / "a.jsonl"), out, tokenizer=str(tokenizer_json), shard_docs=5, workers=1,
                    cache_dir=tmp_path / "cache", progress=None)
    assert len(index["shards"]) == 5 and index["num_docs"] == 23 and index["dtype"] == "uint16"
    assert [s["num_docs"] for s in index["shards"]] == [5, 5, 5, 5, 3]
    tokens, starts = shards_concatenated(out)
    want = expected_stream(docs)
    assert tokens == want
    lengths = [len(d.split()) + 1 for d in docs]
    assert starts == np.concatenate(([0], np.cumsum(lengths)[:-1])).tolist()

    # training reads the shards memory-mapped, windows crossing shard edges
    cfg = Config()
    cfg.data.source, cfg.data.seq_len, cfg.data.eval_fraction = str(out), 6, 0.0
    cfg.data.tokenizer = str(tokenizer_json)
    data = build_run_data(cfg)
    assert data.vocab_size == len(WORDS) + 2
    assert all(isinstance(p, np.memmap) for p in data.train.tokens.pieces)
    cut = [data.train[i].tolist() for i in range(len(data.train))]
    assert cut == [want[i:i + 7] for i in range(0, len(want) // 7 * 7, 7)]
    docs_, _ = load_prepared(out)
    assert docs_.num_docs == 23

    # the same prepared folder, mixed with itself: documents stay whole
    cfg.data.mix = [{"source": str(out)}, {"source": str(out), "weight": 2}]
    mixed = build_run_data(cfg)
    assert len(mixed.train.tokens) > 0 and mixed.vocab_size == data.vocab_size


def test_cli_prepares_text_in_parallel_with_a_progress_line(tmp_path: Path):
    folder = tmp_path / "texts"
    folder.mkdir()
    docs = [f"file {i}: " + "x" * (i * 37 % 200) for i in range(12)]
    for i, d in enumerate(docs):
        (folder / f"{i:02d}.txt").write_text(d)
    out = tmp_path / "out"
    proc = run_cli(str(folder), str(out), "--shard-docs", "2", "--workers", "2")
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert "docs/s" in stderr and "tokens/s" in stderr and "ETA" in stderr
    assert "12 documents in 6 shards" in stdout
    tokens, starts = shards_concatenated(out)
    want = [b for d in docs for b in list(d.encode()) + [0]]  # byte ids, each file ending in NUL
    assert tokens == want
    assert len(starts) == 12


def test_killed_run_resumes_keeping_complete_shards(tmp_path: Path, tokenizer_json: Path):
    docs = texts(20)
    write_jsonl(tmp_path / "a.jsonl", docs)
    out = tmp_path / "out"
    args = (str(tmp_path / "a.jsonl"), str(out), "--tokenizer", str(tokenizer_json), "--shard-docs", "2",
            "--workers", "1", "--cache-dir", str(tmp_path / "cache"))
    # the planted delay holds the run after each shard, so it is killed with shards left to do
    proc = run_cli(*args, env={"LOOM_TEST_PREPARE_SHARD_DELAY_S": "1"}, start_new_session=True)
    first = out / "shard_00000.tokens.npy"
    deadline = time.monotonic() + 60
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert first.exists(), proc.communicate()[1]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    assert not (out / INDEX_FILE).exists()
    kept = sorted(out.glob("shard_*.npy"))
    assert 0 < len(kept) < 20
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in kept}
    (out / ".tmp-shard_00009.tokens.npy.abc").write_bytes(b"half a shard")  # as a kill mid-write leaves

    proc = run_cli(*args)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    after = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in kept}
    assert after == before  # complete shards kept as they were
    assert not list(out.glob(".tmp-*"))
    tokens, _ = shards_concatenated(out)
    assert tokens == expected_stream(docs)
    assert len(list(out.glob("shard_*.tokens.npy"))) == 10


def test_bad_prepare_inputs_are_one_line(tmp_path: Path, tokenizer_json: Path, capsys: pytest.CaptureFixture):
    write_jsonl(tmp_path / "a.jsonl", texts(6))
    out = tmp_path / "out"
    prepare(str(tmp_path / "a.jsonl"), out, shard_docs=3, workers=1, cache_dir=tmp_path / "cache",
            progress=None)
    with pytest.raises(LoomError, match="another source, tokenizer"):
        prepare(str(tmp_path / "a.jsonl"), out, shard_docs=4, workers=1, cache_dir=tmp_path / "cache")
    with pytest.raises(LoomError, match="no field 'body'"):
        prepare(str(tmp_path / "a.jsonl"), tmp_path / "o2", text_field="body", cache_dir=tmp_path / "cache")
    with pytest.raises(ConfigError, match="not both"):
        prepare(str(tmp_path / "a.jsonl"), tmp_path / "o3", shard_docs=3, shard_tokens=10)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("keep me")
    with pytest.raises(LoomError, match="not a `loom data prepare` folder"):
        prepare(str(tmp_path / "a.jsonl"), tmp_path / "full", cache_dir=tmp_path / "cache")

    assert main(["data", "prepare", str(tmp_path / "a.jsonl"), str(tmp_path / "o4"), "--format", "sft"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "SFT data is tokenized at the start of the run" in err
    assert main(["data", "prepare", str(tmp_path / "a.jsonl"), str(tmp_path / "o5"), "--tokenizer",
                 str(tmp_path / "nope.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err

    cfg = Config()
    cfg.data.source, cfg.data.format = str(out), "sft"
    with pytest.raises(LoomError, match="SFT data is tokenized at the start of the run"):
        build_run_data(cfg)


def _prepare(tmp_path: Path, out: Path, docs: list[str] | None = None, **kwargs) -> dict:
    if docs is not None:
        write_jsonl(tmp_path / "a.jsonl", docs)
    return prepare(str(tmp_path / "a.jsonl"), out, workers=1, cache_dir=tmp_path / "cache", progress=None,
                   **kwargs)


def test_a_damaged_index_or_shard_is_one_line_naming_the_file(tmp_path: Path, tokenizer_json: Path):
    out, docs = tmp_path / "out", texts(12)
    good = _prepare(tmp_path, out, docs, shard_docs=4, tokenizer=str(tokenizer_json))
    vocab, first = good["vocab_size"], good["shards"][0]["num_tokens"]

    def refused(edit, said: str, shard_file: str | None = None, array=None) -> None:
        index = json.loads(json.dumps(good))
        edit(index)
        (out / INDEX_FILE).write_text(json.dumps(index))
        saved = (out / shard_file).read_bytes() if shard_file else b""
        if shard_file:
            np.save(out / shard_file, array)
        try:
            with pytest.raises(LoomError) as info:
                load_prepared(out)
        finally:
            if shard_file:
                (out / shard_file).write_bytes(saved)
        assert "\n" not in str(info.value) and said in str(info.value), str(info.value)

    refused(lambda i: i.update(format="v0"), "index.json: format must be one of 'loom-prepared-v1'")
    refused(lambda i: i.update(eos_id=vocab), f"eos_id must be an integer in [0, {vocab - 1}], got {vocab}")
    refused(lambda i: i.update(vocab_size=100_000), "dtype must be wide enough for vocab_size 100000")
    refused(lambda i: i["shards"][0].update(tokens=7), "shards[0].tokens must be a string, got 7 (int)")
    refused(lambda i: i["shards"].append("x"), "shards must be a list of objects")
    refused(lambda i: (i["shards"][0].update(num_tokens=3), i.update(num_tokens=i["num_tokens"] - first + 3)),
            f"shard_00000.tokens.npy has {first} tokens but index.json says 3")
    starts = np.load(out / "shard_00001.docs.npy")
    refused(lambda i: None, "shard_00001.docs.npy does not hold rising document starts",
            "shard_00001.docs.npy", starts[::-1].copy())
    refused(lambda i: None, "shard_00001.docs.npy has 3 documents but index.json says 4",
            "shard_00001.docs.npy", starts[:3].copy())
    (out / INDEX_FILE).write_text(json.dumps(good))
    tokens, _ = load_prepared(out)[0].streams()
    assert np.asarray(tokens).tolist() == expected_stream(docs)  # put back: read as before


def test_a_rerun_with_a_damaged_job_file_is_one_line(tmp_path: Path):
    out = tmp_path / "out"
    _prepare(tmp_path, out, texts(6), shard_docs=3)
    (out / INDEX_FILE).unlink()  # as a killed run leaves it
    job = json.loads((out / "prepare.json").read_text())
    for edit, said in (({"num_docs": 10**18}, "num_docs = 1000000000000000000, but the source has 6"),
                       ({"dtype": "int8"}, "dtype must be one of 'uint16', 'uint32'"),
                       ({"shard_docs": None}, "another source, tokenizer, text field or shard size")):
        (out / "prepare.json").write_text(json.dumps(job | edit))
        with pytest.raises(LoomError, match=said), bounded(seconds=60):  # never a loop over 10¹⁸ documents
            _prepare(tmp_path, out, shard_docs=3)
    (out / "prepare.json").write_bytes(b"\xff")
    with pytest.raises(LoomError, match="prepare.json is not UTF-8 text"):
        _prepare(tmp_path, out, shard_docs=3)


def test_token_dtype_fits_the_vocabulary():
    assert token_dtype(256) == np.uint16 and token_dtype(65_536) == np.uint16
    assert token_dtype(65_537) == np.uint32 and token_dtype(128_256) == np.uint32
