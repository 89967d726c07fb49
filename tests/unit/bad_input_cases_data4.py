"""Bad-input cases of the data a run reads and writes (docs/bad-input.md, "Data", "Data files" and
"Pretrained models"): a run directory or `loom data prepare` OUT inside the source folder, a damaged
BPE token cache (made again), .bin ids of another width, a pipe or device as data.source, files and
folders loom may not read, cache folders and OUTs it may not write, and a tokenizer.json that is a
folder.

The permission cases need a user whom permissions stop: as root, this thread gives up its power to
ignore them (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH) while the case runs; they skip where neither
can be had."""

from __future__ import annotations

import contextlib
import ctypes
import os
import stat
import tempfile
from pathlib import Path

import numpy as np
import pytest
from bad_input import Ctx, case, cli
from bad_input_cases_data import _jsonl, _train
from bad_input_cases_model_folder import llama_folder

import loom.cli

TEXT = "hello world, this is a small text file to train on. " * 40
_BPE = ("--set", "data.tokenizer=bpe", "--set", "data.bpe_vocab_size=300")
_DAC = (1 << 1) | (1 << 2)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def _set_dac(on: bool) -> bool:
    """Raise or drop this thread's effective DAC capabilities (kept permitted, so they come back)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        header, data = _CapHeader(0x20080522, 0), (_CapData * 2)()  # _LINUX_CAPABILITY_VERSION_3
        if libc.capget(ctypes.byref(header), data) != 0:
            return False
        data[0].effective = (data[0].effective | _DAC) if on else (data[0].effective & ~_DAC)
        return libc.capset(ctypes.byref(header), data) == 0
    except (OSError, AttributeError):
        return False


def _stopped(path: Path, mode: int) -> bool:
    """Whether this user is now refused what `mode` takes away: writing into a read-only folder,
    listing a folder, reading a file."""
    try:
        if path.is_dir() and mode & 0o400:
            fd, name = tempfile.mkstemp(dir=path)
            os.close(fd)
            os.unlink(name)
        elif path.is_dir():
            os.listdir(path)
        else:
            open(path, "rb").close()
    except OSError:
        return True
    return False


@contextlib.contextmanager
def denied(path: Path, mode: int = 0):
    """`path` chmod-ed to `mode` while the block runs, for a user whom permissions stop."""
    saved = stat.S_IMODE(path.stat().st_mode)
    path.chmod(mode)
    dropped = os.geteuid() == 0 and _set_dac(False)
    try:
        if not _stopped(path, mode):
            pytest.skip("permissions do not stop this user (root whose capabilities cannot be dropped)")
        yield
    finally:
        if dropped:
            _set_dac(True)
        path.chmod(saved)


def _corpus(path: Path) -> Path:
    path.write_text(TEXT)
    return path


# ---------------------------------------------------------------------------------------------
# What loom writes, inside what it reads


@case("data-out-inside-source")
def _(c: Ctx) -> str:
    folder = c.tmp / "texts"
    folder.mkdir()
    _corpus(folder / "a.txt")
    return c.train("--set", f'data.source="{folder}"', "--set", "train.steps=2", out=folder / "run")


@case("data-prepare-out-inside-source")
def _(c: Ctx) -> str:
    folder = c.tmp / "texts"
    folder.mkdir()
    _corpus(folder / "a.txt")
    message = cli("data", "prepare", str(folder), str(folder / "prep"), "--workers", "1",
                  "--cache-dir", str(c.tmp / "cache"), capsys=c.capsys)
    assert sorted(p.name for p in folder.iterdir()) == ["a.txt"]  # nothing written into the source
    return message


# ---------------------------------------------------------------------------------------------
# The BPE token cache: derived data, made again when damaged


def _bpe_cache(c: Ctx, edit) -> str:
    """Train's checks (--dry-run) with the BPE tokenizer once, `edit(tokens.npy)`, and again: the
    note it prints; the cache is made again as it was."""
    corpus = _corpus(c.tmp / "notes.txt")
    args = ["train", "--dry-run", "--nproc", "1", "--out", str(c.tmp / "run"), *c.base(),
            "--set", f'data.source="{corpus}"', "--set", f'data.cache_dir="{c.tmp / "cache"}"', *_BPE]
    assert loom.cli.main(args) == 0
    cached = next((c.tmp / "cache").glob("bpe-*.tokens.npy"))
    good = cached.read_bytes()
    edit(cached)
    c.capsys.readouterr()
    assert loom.cli.main(args) == 0, c.capsys.readouterr().err
    out = c.capsys.readouterr().out
    assert cached.read_bytes() == good  # made again, whole
    notes = [line for line in out.splitlines() if line.startswith("note: ") and str(cached) in line]
    assert len(notes) == 1, out
    return notes[0].removeprefix("note: ")


@case("data-bpe-cache-truncated")
def _(c: Ctx) -> str:
    return _bpe_cache(c, lambda path: path.write_bytes(path.read_bytes()[:60]))


@case("data-bpe-cache-id-over-vocab")
def _(c: Ctx) -> str:
    def plant(path: Path) -> None:
        tokens = np.load(path).copy()
        tokens[7] = 5000
        np.save(path, tokens)
    return _bpe_cache(c, plant)


# ---------------------------------------------------------------------------------------------
# .bin files of another width, and what is not a file


@case("data-bin-id-past-max-vocab")
def _(c: Ctx) -> str:
    np.array([1, 2, 4_000_000_000], dtype=np.uint32).tofile(c.tmp / "big.bin")
    return _train(c, c.tmp / "big.bin", "--set", "data.bin_dtype=uint32")


@case("data-bin-wrong-dtype")
def _(c: Ctx) -> str:
    (np.arange(5000, dtype=np.uint16) % 200).tofile(c.tmp / "tokens.bin")  # uint16 ids, read as uint32
    return _train(c, c.tmp / "tokens.bin", "--set", "data.bin_dtype=uint32")


@case("data-bin-id-over-model-vocab")
def _(c: Ctx) -> str:
    (np.arange(5000, dtype=np.uint16) % 200).tofile(c.tmp / "tokens.bin")
    return _train(c, c.tmp / "tokens.bin", "--set", "model.vocab_size=100")


@case("data-source-fifo")
def _(c: Ctx) -> str:
    os.mkfifo(c.tmp / "pipe.txt")
    return _train(c, c.tmp / "pipe.txt")


@case("data-source-device")
def _(c: Ctx) -> str:
    if not Path("/dev/zero").exists():
        pytest.skip("no /dev/zero here")
    return _train(c, "/dev/zero")


# ---------------------------------------------------------------------------------------------
# What loom may not read


@case("data-text-unreadable")
def _(c: Ctx) -> str:
    corpus = _corpus(c.tmp / "notes.txt")
    with denied(corpus):
        return _train(c, corpus)


@case("data-bin-unreadable")
def _(c: Ctx) -> str:
    (np.arange(5000, dtype=np.uint16) % 200).tofile(c.tmp / "tokens.bin")
    with denied(c.tmp / "tokens.bin"):
        return _train(c, c.tmp / "tokens.bin")


@case("data-folder-unreadable")
def _(c: Ctx) -> str:
    folder = c.tmp / "texts"
    folder.mkdir()
    _corpus(folder / "a.txt")
    with denied(folder):
        return _train(c, folder)


@case("data-subfolder-unreadable")
def _(c: Ctx) -> str:
    folder = c.tmp / "texts"
    (folder / "more").mkdir(parents=True)
    _corpus(folder / "a.txt")
    _corpus(folder / "more" / "b.txt")
    with denied(folder / "more"):  # os.walk skipped it: half the data, and exit 0
        return _train(c, folder)


@case("data-prepare-source-unreadable")
def _(c: Ctx) -> str:
    corpus = _corpus(c.tmp / "notes.txt")
    with denied(corpus):
        return cli("data", "prepare", str(corpus), str(c.tmp / "out"), "--workers", "1",
                   "--cache-dir", str(c.tmp / "cache"), capsys=c.capsys)


# ---------------------------------------------------------------------------------------------
# What loom may not write


@case("data-prepare-out-read-only")
def _(c: Ctx) -> str:
    corpus = _corpus(c.tmp / "notes.txt")
    (c.tmp / "shared").mkdir()
    with denied(c.tmp / "shared", mode=0o555):
        message = cli("data", "prepare", str(corpus), str(c.tmp / "shared" / "prep"), "--workers", "1",
                      "--cache-dir", str(c.tmp / "cache"), capsys=c.capsys)
    assert not any((c.tmp / "shared").iterdir())
    return message


@case("data-cache-dir-read-only-bpe")
def _(c: Ctx) -> str:
    (c.tmp / "cache").mkdir()
    with denied(c.tmp / "cache", mode=0o555):
        return _train(c, _corpus(c.tmp / "notes.txt"), *_BPE)


@case("data-cache-dir-read-only-records")
def _(c: Ctx) -> str:
    (c.tmp / "cache").mkdir()
    records = _jsonl(c.tmp / "notes.jsonl", [{"text": TEXT}] * 40)
    with denied(c.tmp / "cache", mode=0o555):
        return _train(c, records)


# ---------------------------------------------------------------------------------------------
# A model folder's tokenizer.json


@case("model-tokenizer-json-folder")
def _(c: Ctx) -> str:
    folder = llama_folder(c.tmp / "m")
    (folder / "tokenizer.json").mkdir()
    return c.train("--set", f'model.init_from="{folder}"')
