"""Data: corpus sources, tokenizers, token windows and the layout-independent global-batch sampler."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from loom.data.corpus import load_tokens, resolve_source
from loom.data.loader import (
    GlobalBatchSampler,
    TokenWindows,
    make_loader,
    micro_batch_size,
    split_train_eval,
)
from loom.data.tokenizer import BPETokenizer, ByteTokenizer, _chunks, make_tokenizer
from loom.errors import ConfigError, LoomError

SAMPLE = "def add(a, b):\n    return a + b\n\n# héllo wörld — ünïcode ✓ 日本語\n" * 40


def one_line_error(exc_type: type[Exception], fn, *args, **kwargs) -> str:
    """Run fn, expect exc_type, and check the message is a single line."""
    with pytest.raises(exc_type) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert msg and "\n" not in msg
    return msg


# ---------------------------------------------------------------- corpus


def test_stdlib_corpus_loads_fast_deterministic_and_capped():
    t0 = time.perf_counter()
    tokens, vocab = load_tokens("stdlib")
    elapsed = time.perf_counter() - t0
    assert elapsed < 3.0
    assert vocab == 256
    assert tokens.ndim == 1
    assert 1_000_000 < tokens.size <= 8_000_000 + 10_000  # bytes ≈ tokens; the "\n" separators add a few
    assert int(tokens.max()) < 256
    again, _ = load_tokens("stdlib")
    np.testing.assert_array_equal(tokens, again)


def test_stdlib_files_are_sorted_source_without_tests():
    files = resolve_source("stdlib")
    assert isinstance(files, list) and files
    assert all(f.suffix == ".py" for f in files)
    assert not any({"site-packages", "test", "tests", "idlelib"} & set(f.parts) for f in files)
    assert sum(f.stat().st_size for f in files) <= 8_000_000
    small = resolve_source("stdlib", max_bytes=200_000)
    assert small == files[:len(small)]  # a smaller cap takes a prefix of the same order
    assert sum(f.stat().st_size for f in small) <= 200_000


def test_text_file_dir_and_glob_sources(tmp_path: Path):
    (tmp_path / "b.txt").write_text("bbb", encoding="utf-8")
    (tmp_path / "a.txt").write_text("aa", encoding="utf-8")
    assert resolve_source(str(tmp_path / "*.txt")) == [tmp_path / "a.txt", tmp_path / "b.txt"]
    assert resolve_source(str(tmp_path)) == [tmp_path / "a.txt", tmp_path / "b.txt"]
    tokens, vocab = load_tokens(str(tmp_path / "*.txt"))
    assert ByteTokenizer().decode(tokens) == "aa\nbbb"  # files joined by "\n", in sorted order
    tokens, _ = load_tokens(str(tmp_path / "a.txt"))
    assert tokens.tolist() == [97, 97]


def test_bad_sources_raise_one_line_errors(tmp_path: Path):
    msg = one_line_error(LoomError, load_tokens, str(tmp_path / "missing.txt"))
    assert "missing.txt" in msg and "does not exist" in msg
    msg = one_line_error(LoomError, load_tokens, str(tmp_path / "nothing" / "*.txt"))
    assert "matched no files" in msg and "stdlib" in msg
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")
    msg = one_line_error(LoomError, load_tokens, str(tmp_path / "empty.txt"))
    assert "empty" in msg
    (tmp_path / "emptydir").mkdir()
    one_line_error(LoomError, load_tokens, str(tmp_path / "emptydir"))
    one_line_error(ConfigError, load_tokens, str(tmp_path / "empty.txt"), tokenizer_kind="wordpiece")


# ---------------------------------------------------------------- .bin token files


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_memmap_loads(tmp_path: Path, dtype: str):
    ids = np.arange(1000, dtype=dtype) % 500
    path = tmp_path / "tokens.bin"
    ids.tofile(path)
    tokens, vocab = load_tokens(str(path), vocab_size=512, bin_dtype=dtype)
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.dtype(dtype)
    assert vocab == 512
    np.testing.assert_array_equal(tokens, ids)


def test_bin_errors(tmp_path: Path):
    path = tmp_path / "tokens.bin"
    np.array([1, 2, 70_000], dtype=np.uint32).tofile(path)
    msg = one_line_error(LoomError, load_tokens, str(path), vocab_size=50_000, bin_dtype="uint32")
    assert "70000" in msg and "70001" in msg
    msg = one_line_error(ConfigError, load_tokens, str(path), bin_dtype="int64")
    assert "uint16" in msg and "uint32" in msg
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x02\x03")
    one_line_error(LoomError, load_tokens, str(odd))
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    one_line_error(LoomError, load_tokens, str(empty))


# ---------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "plain ascii, ünïcode ✓ 日本語 🙂"
    ids = tok.encode(text)
    assert tok.vocab_size == 256
    assert ids.tolist() == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids.astype(np.int64))) == text
    assert tok.decode([0xFF]) == "\ufffd"  # invalid UTF-8 decodes with replacement, not an error


def test_bpe_trains_round_trips_and_is_deterministic(tmp_path: Path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SAMPLE, encoding="utf-8")
    tok = make_tokenizer("bpe", [corpus], 300, tmp_path / "cache1")
    assert isinstance(tok, BPETokenizer) and not tok.loaded_from_cache
    assert 256 < tok.vocab_size <= 300
    ids = tok.encode(SAMPLE)
    assert ids.size < len(SAMPLE.encode("utf-8"))  # merges compress
    assert tok.decode(ids) == SAMPLE
    unseen = "zebra QUIZ 🙂\tjump"  # bytes never seen in training still encode
    assert tok.decode(tok.encode(unseen)) == unseen

    other = make_tokenizer("bpe", [corpus], 300, tmp_path / "cache2")
    assert other.cache_path.read_text() == tok.cache_path.read_text()
    np.testing.assert_array_equal(other.encode(SAMPLE), ids)


def test_bpe_second_call_loads_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SAMPLE, encoding="utf-8")
    first = BPETokenizer([corpus], 300, tmp_path / "cache")
    mtime = first.cache_path.stat().st_mtime_ns

    def no_training(*args, **kwargs):
        raise AssertionError("training ran although the cache exists")

    monkeypatch.setattr(BPETokenizer, "_train", staticmethod(no_training))
    second = BPETokenizer([corpus], 300, tmp_path / "cache")
    assert second.loaded_from_cache and second.cache_path == first.cache_path
    assert first.cache_path.stat().st_mtime_ns == mtime
    np.testing.assert_array_equal(second.encode(SAMPLE), first.encode(SAMPLE))
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.suffix == ".tmp"] == []
    monkeypatch.undo()

    # A different vocab size or changed corpus is a different key: it trains again.
    assert not BPETokenizer([corpus], 320, tmp_path / "cache").loaded_from_cache
    corpus.write_text(SAMPLE + "more text\n", encoding="utf-8")
    assert not BPETokenizer([corpus], 300, tmp_path / "cache").loaded_from_cache


def test_bpe_load_tokens_and_long_text_chunking(tmp_path: Path):
    corpus = tmp_path / "corpus.txt"
    long_text = ("x = 1\ny = 2\n" + SAMPLE) * 60  # > 64 KiB with cut points, so encode() chunks it
    assert len(_chunks(long_text)) > 1
    corpus.write_text(long_text, encoding="utf-8")
    tokens, vocab = load_tokens(str(corpus), "bpe", 300, cache_dir=tmp_path / "cache")
    tok = BPETokenizer([corpus], 300, tmp_path / "cache")
    assert vocab == tok.vocab_size and int(tokens.max()) < vocab
    assert tok.decode(tokens) == long_text
    # Chunked encoding gives exactly the ids of encoding the whole text at once.
    assert np.asarray(tokens).tolist() == tok._tok.encode(long_text).ids
    again, _ = load_tokens(str(corpus), "bpe", 300, cache_dir=tmp_path / "cache")
    np.testing.assert_array_equal(again, tokens)


def test_tokenizer_config_errors(tmp_path: Path):
    msg = one_line_error(ConfigError, make_tokenizer, "sentencepiece", ["x"], 256, tmp_path)
    assert "'byte' or 'bpe'" in msg
    one_line_error(ConfigError, make_tokenizer, "bpe", ["x"], 100, tmp_path)


# ---------------------------------------------------------------- windows


def test_token_windows_shift_and_do_not_overlap():
    tokens = np.arange(100, dtype=np.uint16)
    ds = TokenWindows(tokens, seq_len=9)
    assert len(ds) == 10
    seen: list[int] = []
    for i in range(len(ds)):
        item = ds[i]
        assert item.dtype == torch.long and item.shape == (10,)
        inputs, targets = item[:-1], item[1:]
        assert torch.equal(targets, inputs + 1)  # targets are the next tokens
        seen.extend(item.tolist())
    assert seen == list(range(100))  # windows tile the tokens with no overlap
    with pytest.raises(IndexError):
        ds[10]


def test_split_train_eval_is_disjoint():
    tokens = np.arange(1000, dtype=np.uint16)
    train, evals = split_train_eval(tokens, seq_len=9, eval_fraction=0.1)
    assert (len(train), len(evals)) == (90, 10)
    train_ids = {t for i in range(len(train)) for t in train[i].tolist()}
    eval_ids = {t for i in range(len(evals)) for t in evals[i].tolist()}
    assert not train_ids & eval_ids
    assert evals[0][0].item() == 900  # the held-out windows are the last ones
    _, tiny_eval = split_train_eval(tokens, seq_len=9, eval_fraction=0.001)
    assert len(tiny_eval) == 1
    train_all, no_eval = split_train_eval(tokens, seq_len=9, eval_fraction=0.0)
    assert (len(train_all), len(no_eval)) == (100, 0)
    one_line_error(LoomError, split_train_eval, tokens[:15], 9, 0.5)
    one_line_error(ConfigError, split_train_eval, tokens, 9, 1.5)


# ---------------------------------------------------------------- sampler


def step_batches(sampler: GlobalBatchSampler, steps: int) -> list[list[list[int]]]:
    """Group a rank's micro-batches by step: result[step][micro] = indices."""
    micro = list(itertools.islice(iter(sampler), steps * sampler.grad_accum))
    return [micro[s * sampler.grad_accum:(s + 1) * sampler.grad_accum] for s in range(steps)]


NUM_WINDOWS, GLOBAL, SEED = 70, 8, 1234  # 8 steps per epoch, so 20 steps cross two epoch boundaries


def test_reference_global_batches_cover_each_epoch_once():
    ref = GlobalBatchSampler(NUM_WINDOWS, GLOBAL, 0, 1, 1, SEED, num_steps=20)
    batches = [b for [b] in step_batches(ref, 20)]
    assert all(len(b) == GLOBAL for b in batches)
    epoch0 = [i for b in batches[:8] for i in b]
    assert len(set(epoch0)) == 64  # no window repeats within an epoch
    assert batches[8] != batches[0]  # the next epoch uses a new permutation
    assert batches[3] == ref.global_batch_indices(3)


@pytest.mark.parametrize("dp_size", [1, 2, 4])
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_every_layout_sees_the_same_global_batches(dp_size: int, grad_accum: int):
    steps = 20
    ref = [b for [b] in step_batches(GlobalBatchSampler(NUM_WINDOWS, GLOBAL, 0, 1, 1, SEED), steps)]
    per_rank = [step_batches(GlobalBatchSampler(NUM_WINDOWS, GLOBAL, r, dp_size, grad_accum, SEED), steps)
                for r in range(dp_size)]
    for k in range(steps):
        rank_sets = []
        for r in range(dp_size):
            micro = per_rank[r][k]
            assert len(micro) == grad_accum
            assert all(len(m) == GLOBAL // (dp_size * grad_accum) for m in micro)
            rank_sets.append([i for m in micro for i in m])
        union = [i for s in rank_sets for i in s]
        assert union == ref[k]  # same sequences, same order, whatever the layout
        for a, b in itertools.combinations(rank_sets, 2):
            assert not set(a) & set(b)  # ranks are disjoint


def test_seed_and_start_step():
    a = step_batches(GlobalBatchSampler(NUM_WINDOWS, GLOBAL, 0, 1, 1, seed=1), 12)
    b = step_batches(GlobalBatchSampler(NUM_WINDOWS, GLOBAL, 0, 1, 1, seed=2), 12)
    assert a != b
    for k in (0, 5, 8, 11):  # 8 is the first step of epoch 1
        resumed = step_batches(GlobalBatchSampler(NUM_WINDOWS, GLOBAL, 0, 1, 1, seed=1, start_step=k), 12 - k)
        assert resumed == a[k:]
    resumed_rank = step_batches(GlobalBatchSampler(NUM_WINDOWS, GLOBAL, 1, 2, 2, seed=1, start_step=9), 1)[0]
    assert [i for m in resumed_rank for i in m] == a[9][0][4:]


def test_sampler_length():
    s = GlobalBatchSampler(NUM_WINDOWS, GLOBAL, 0, 2, 2, SEED, num_steps=5)
    assert len(s) == 10 and len(list(s)) == 10
    with pytest.raises(TypeError):
        len(GlobalBatchSampler(NUM_WINDOWS, GLOBAL, 0, 2, 2, SEED))


def test_batch_size_errors():
    msg = one_line_error(ConfigError, GlobalBatchSampler, 100, 6, 0, 4, 2, SEED)
    assert "batch_size=6" in msg and "= 8" in msg and "8 or 16" in msg
    msg = one_line_error(ConfigError, micro_batch_size, 10, 2, 2)
    assert "8 or 12" in msg
    assert micro_batch_size(16, 2, 4) == 2
    msg = one_line_error(ConfigError, GlobalBatchSampler, 3, 8, 0, 1, 1, SEED, seq_len=64)
    assert "3 windows of 65 tokens" in msg and "needs 8" in msg
    one_line_error(ConfigError, GlobalBatchSampler, 100, 8, 2, 2, 1, SEED)  # rank outside dp_size


# ---------------------------------------------------------------- DataLoader


def test_loader_workers_match_in_process_loading():
    tokens = np.random.default_rng(0).integers(0, 256, size=65 * 64, dtype=np.uint16)
    ds = TokenWindows(tokens, seq_len=64)

    def batches(num_workers: int) -> list[torch.Tensor]:
        sampler = GlobalBatchSampler(len(ds), 8, 1, 2, 2, SEED, num_steps=6)
        loader = make_loader(ds, sampler, num_workers, prefetch_factor=2, pin_memory=True)
        return list(loader)

    plain, workers = batches(0), batches(2)
    assert len(plain) == len(workers) == 12
    assert all(b.shape == (2, 65) and b.dtype == torch.long for b in plain)
    for a, b in zip(plain, workers):
        assert torch.equal(a, b)
    one_line_error(ConfigError, make_loader, ds, GlobalBatchSampler(len(ds), 8, 0, 1, 1, SEED),
                   -1, None, False)
