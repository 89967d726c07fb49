"""Data: corpus sources, tokenizers, token windows and the layout-independent global-batch sampler."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from loom.checked import translated
from loom.data import sources, token_files
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
from loom.hf_config import MAX_VOCAB

SAMPLE = "def add(a, b):\n    return a + b\n\n# héllo wörld — ünïcode ✓ 日本語\n" * 40


def one_line_error(exc_type: type[Exception], fn, *args, **kwargs) -> str:
    """Run fn, expect exc_type, and check the message is a single line."""
    with pytest.raises(exc_type) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert msg and "\n" not in msg
    return msg


# ---------------------------------------------------------------- corpus


@pytest.mark.alone  # timed (tests/conftest.py)
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


def test_blank_sources_name_nothing_never_the_working_directory(tmp_path: Path, monkeypatch):
    (tmp_path / "id_rsa").write_text("-----BEGIN OPENSSH PRIVATE KEY-----")
    monkeypatch.chdir(tmp_path)
    for spec in ("", "  ", "\t"):
        assert "names no file" in one_line_error(LoomError, resolve_source, spec)
        assert "names no file" in one_line_error(LoomError, sources.resolve, spec)


def test_folders_skip_hidden_files_and_folders(tmp_path: Path):
    for name in ("a.txt", "sub/b.txt", ".hidden.txt", ".git/config", ".ssh/id_rsa", "sub/.cache/c.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    assert resolve_source(str(tmp_path)) == [tmp_path / "a.txt", tmp_path / "sub" / "b.txt"]
    assert sources.resolve(str(tmp_path)).files == (tmp_path / "a.txt", tmp_path / "sub" / "b.txt")


def test_links_may_stay_inside_a_folder_or_glob_never_leave_it(tmp_path: Path):
    corpus, home = tmp_path / "corpus", tmp_path / "home"
    corpus.mkdir()
    home.mkdir()
    (corpus / "a.txt").write_text("aa")
    (corpus / "again.txt").symlink_to(corpus / "a.txt")  # inside: read like any file
    assert resolve_source(str(corpus)) == [corpus / "a.txt", corpus / "again.txt"]
    (home / "id_rsa").write_text("secret")
    (corpus / "b.txt").symlink_to(home / "id_rsa")
    for spec in (str(corpus), str(corpus / "*.txt"), str(corpus / "**" / "b*")):
        msg = one_line_error(LoomError, resolve_source, spec)
        assert "b.txt links outside" in msg and "id_rsa" in msg
        one_line_error(LoomError, sources.resolve, spec)
    assert len(resolve_source(str(tmp_path / "*" / "*"))) == 4  # the glob's folder holds home/ too
    (corpus / "b.txt").unlink()
    (corpus / "linked").symlink_to(home, target_is_directory=True)  # a linked folder is not entered
    assert resolve_source(str(corpus)) == [corpus / "a.txt", corpus / "again.txt"]
    assert resolve_source(str(home / "id_rsa")) == [home / "id_rsa"]  # a file named itself: the user's choice
    repo = tmp_path / "hub" / "datasets--org--notes"  # a Hub cache snapshot: links into ../../blobs
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "9f2c").write_text("notes")
    (repo / "snapshots" / "abc").mkdir(parents=True)
    (repo / "snapshots" / "abc" / "notes.txt").symlink_to(Path("..") / ".." / "blobs" / "9f2c")
    assert resolve_source(str(repo / "snapshots" / "abc")) == [repo / "snapshots" / "abc" / "notes.txt"]


def test_check_ids_finds_the_id_and_its_position_in_any_chunk(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(token_files, "_CHECK_CHUNK", 10)  # several chunks for 35 ids
    tokens = np.arange(35, dtype=np.int32) % 7
    token_files.check_ids(tokens, 7, "t", "fix")
    for position, bad, shown in ((0, 7, "7"), (23, 9, "9"), (34, -1, "-1"), (12, 2**31 - 1, "2147483647")):
        broken = tokens.copy()
        broken[position] = bad
        msg = one_line_error(LoomError, token_files.check_ids, broken, 7, "t", "fix")
        assert f"token id {shown} (at position {position})" in msg and "0..6" in msg
    floats = tokens.astype(np.float32)
    assert "float32" in one_line_error(LoomError, token_files.check_ids, floats, 7, "t", "fix")
    token_files.check_ids(np.zeros(0, dtype=np.uint16), 7, "t", "fix")


def test_open_npy_refuses_what_is_not_a_list_of_ids(tmp_path: Path):
    np.save(tmp_path / "ok.npy", np.arange(5, dtype=np.uint16))
    assert token_files.open_npy(tmp_path / "ok.npy", "fix").tolist() == [0, 1, 2, 3, 4]
    np.save(tmp_path / "2d.npy", np.zeros((2, 2), dtype=np.uint16))
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with open(tmp_path / "zip.npy", "wb") as f:
        np.savez(f, a=np.zeros(2))
    (tmp_path / "cut.npy").write_bytes((tmp_path / "ok.npy").read_bytes()[:-4])
    for name, said in (("2d", "shape [2, 2]"), ("obj", "Python objects"), ("zip", "archive"),
                       ("cut", "readable"), ("missing", "readable")):
        msg = one_line_error(LoomError, token_files.open_npy, tmp_path / f"{name}.npy", "fix it")
        assert name in msg and said in msg and msg.endswith("fix it")


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


class _FailingWindows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 37:
            raise LoomError("window 37 of the data is damaged; fix it")
        return torch.zeros(9, dtype=torch.long)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_worker_loom_error_reaches_the_user_as_its_one_line(num_workers: int):
    sampler = GlobalBatchSampler(64, 8, 0, 1, 1, SEED, num_steps=8)
    with pytest.raises(LoomError) as info:
        list(make_loader(_FailingWindows(), sampler, num_workers, prefetch_factor=2, pin_memory=False))
    assert str(info.value) == "window 37 of the data is damaged; fix it"


# ---------------------------------------------------------------- third-party errors


def test_bpe_vocab_beyond_any_model_is_refused_before_the_trainer_allocates(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(BPETokenizer, "_train", lambda *a: pytest.fail("the trainer ran"))
    msg = one_line_error(ConfigError, BPETokenizer, SAMPLE, MAX_VOCAB + 1, tmp_path)
    assert f"{MAX_VOCAB + 1:,}" in msg and "at most" in msg


def test_library_errors_and_rust_panics_are_one_line_but_interrupts_are_not():
    PanicException = type("PanicException", (BaseException,), {})  # pyo3's, as tokenizers raises it

    def raising(error: BaseException):
        with translated("training the tokenizer failed", "use a smaller vocabulary"):
            raise error

    msg = one_line_error(LoomError, raising, PanicException("capacity overflow\nbacktrace…"))
    assert msg == ("training the tokenizer failed (the library panicked: PanicException: capacity "
                   "overflow); use a smaller vocabulary")
    msg = one_line_error(LoomError, raising, Exception("data did not match any variant"))
    assert msg == "training the tokenizer failed (data did not match any variant); use a smaller vocabulary"
    with pytest.raises(KeyboardInterrupt):
        raising(KeyboardInterrupt())
    with pytest.raises(LoomError, match="^mine$"):
        raising(LoomError("mine"))  # already one line: passed through as it is
