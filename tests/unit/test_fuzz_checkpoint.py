"""Checkpoints under hostile edits (tests/fuzz.py): a real checkpoint's DCP index (`.metadata`,
edited as parsed objects and as bytes), its meta.json, rng_rank0.json and `latest` marker. Each
edit is either accepted, and then loading gives exactly the tensors that were saved, or refused
with loom's one-line error: never another exception, never a tensor element no payload wrote
(uninitialised memory), never a checkpoint outside the run."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import pickle
import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from fuzz import FUZZ, HOSTILE_STRINGS, hostile, must_read, perturbed, perturbed_bytes, write_json
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

import loom.cli
from loom.config import load_config_text
from loom.models.gpt.config import preset
from loom.models.gpt.model import build_model
from loom.parallel.mesh import shutdown
from loom.train import checkpoint, safe_load

TINY = ["model.preset=tiny", "data.seq_len=32", "train.batch_size=4", "data.num_workers=0",
        "train.device=cpu", "parallel.strategy=ddp", "train.steps=2"]
PAYLOAD, SECOND = "__0_0.distcp", "__1_0.distcp"


@pytest.fixture(scope="module")
def saved(tmp_path_factory, corpus) -> dict:
    """A real 2-step checkpoint of the tiny model (world of one), its index, files and tensors."""
    run = tmp_path_factory.mktemp("fuzz-ckpt") / "run"
    env = dict(os.environ)
    try:
        rc = loom.cli.main(["train", "--nproc", "1", "--out", str(run),
                            *[a for o in [*TINY, f'data.source="{corpus}"'] for a in ("--set", o)]])
    finally:
        shutdown()
        os.environ.clear()
        os.environ.update(env)
    assert rc == 0
    step = run / "checkpoints" / "step_2"
    tensors = checkpoint.read_tensors(step, "")
    expected = safe_load.trained_entries(build_model(preset("tiny"), "meta"))
    return {"step": step, "index": (step / ".metadata").read_bytes(), "tensors": tensors,
            "split": _split_rows(step, tensors), "expected": expected}


SPLIT = ("model.tok_embeddings.weight", "model.norm.weight")


def _split_rows(step: Path, tensors: dict) -> bytes:
    """The index of the same checkpoint with SPLIT's tensors in two chunks each (their first and
    second halves of dim 0, payloads in a second file), as a 2-rank FSDP checkpoint holds them."""
    metadata = pickle.loads((step / ".metadata").read_bytes())
    data = io.BytesIO()
    for name in SPLIT:
        whole, entry = tensors[name], metadata.state_dict_metadata[name]
        half = whole.shape[0] // 2
        entry.chunks = []
        del metadata.storage_data[next(k for k in metadata.storage_data if k.fqn == name)]
        for start, rows in ((0, half), (half, whole.shape[0] - half)):
            offsets = torch.Size([start] + [0] * (whole.dim() - 1))
            entry.chunks.append(ChunkStorageMetadata(offsets, torch.Size([rows, *whole.shape[1:]])))
            at = data.tell()
            torch.save(whole[start:start + rows].clone(), data)
            metadata.storage_data[MetadataIndex(name, offsets)] = _StorageInfo(SECOND, at, data.tell() - at)
    (step / SECOND).write_bytes(data.getvalue())
    return pickle.dumps(metadata)


def _copy(saved: dict, folder: Path, index: bytes) -> Path:
    """A step_2 folder with its own `.metadata` and the saved payload and JSON files (hard links:
    nothing reads them for writing)."""
    step = folder / "checkpoints" / "step_2"
    if step.exists():
        shutil.rmtree(step)
    step.mkdir(parents=True)
    for f in saved["step"].iterdir():
        if f.name != ".metadata" and f.is_file():
            os.link(f, step / f.name)
    (step / ".metadata").write_bytes(index)
    return step


@contextlib.contextmanager
def _poisoned_empty() -> Iterator[None]:
    """torch.empty gives NaN-filled tensors: memory it reuses may hold the very values an earlier
    read left there, which would hide an element no payload wrote."""
    empty = torch.empty

    def poisoned(*size, dtype=None, **kwargs):
        t = empty(*size, dtype=dtype, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-1)

    torch.empty = poisoned
    try:
        yield
    finally:
        torch.empty = empty


def _read(step: Path, expected=None):
    with _poisoned_empty():
        return checkpoint.read_tensors(step, "", expected)


def _exactly_saved(got: dict, saved: dict) -> None:
    want = saved["tensors"]
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


# ---------------------------------------------------------------------------------------------
# The index, edited as DCP's own objects


NUMBER = st.one_of(st.integers(-2, 300),
                   st.sampled_from([2**63, 2**64 + 1, True, 1.0, float("nan"), None, "0"]))
SHAPE = st.one_of(st.lists(NUMBER, max_size=3), st.lists(NUMBER, max_size=3).map(tuple), hostile())
OPS = ["chunks-clear", "chunk-duplicate", "chunk-split", "chunk-offsets", "chunk-sizes", "entry-size",
       "entry-dtype", "entry-attr", "entry-replace", "storage-delete", "storage-path", "storage-offset",
       "storage-length", "storage-other", "storage-transform", "storage-key", "top", "same-as-lists",
       "same-as-lists", "drop-chunk", "move-chunk", "move-chunk"]
DTYPES = [torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool, torch.int32]


class Index(bytes):
    """A pickled index, shown briefly in Hypothesis' reports."""

    def __repr__(self) -> str:
        return f"<.metadata, {len(self)} bytes>"


@st.composite
def edited_index(draw, raw: Index):
    """DCP's index with one to three hostile edits of its entries, chunks and storage places."""
    m = pickle.loads(raw)
    entries, storage = m.state_dict_metadata, m.storage_data
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(OPS))
        if not isinstance(entries, dict) or not isinstance(storage, dict) or not entries or not storage:
            break
        name = draw(st.sampled_from(sorted(entries)))
        entry = entries[name]
        key = draw(st.sampled_from(sorted(storage, key=lambda k: (k.fqn, tuple(k.offset or ())))))
        chunks = getattr(entry, "chunks", None)
        chunk = chunks[0] if isinstance(chunks, list) and chunks and hasattr(chunks[0], "offsets") else None
        if op in ("drop-chunk", "move-chunk") and isinstance(chunks, list) and chunks:
            # edits that keep the index consistent (each chunk keyed to its payload): only the
            # cover check sees the element no payload writes, or the one two payloads write
            split = [n for n in SPLIT if len(getattr(entries.get(n), "chunks", None) or ()) > 1]
            if split:  # mostly a tensor of two chunks, which one can move onto the other
                name = draw(st.sampled_from(split))
                entry = entries[name]
                chunks = entry.chunks
            i = draw(st.integers(0, len(chunks) - 1))
            old = getattr(chunks[i], "offsets", None)
            info = storage.pop(MetadataIndex(name, old), None) if isinstance(old, torch.Size) else None
            if op == "drop-chunk" or info is None:
                del chunks[i]
            else:
                new = [draw(st.sampled_from([0, 1, x, x // 2, x + 1])) for x in old] if len(old) else []
                others = [c.offsets for c in chunks if isinstance(getattr(c, "offsets", None), torch.Size)]
                chunks[i].offsets = torch.Size(draw(st.sampled_from([new, *others])))
                storage[MetadataIndex(name, chunks[i].offsets)] = info
        elif op == "same-as-lists" and chunk is not None and isinstance(chunk.offsets, torch.Size):
            # the same values in plain lists and tuples (what another writer might pickle): accepted
            chunk.offsets, chunk.sizes = list(chunk.offsets), tuple(chunk.sizes)
            if isinstance(getattr(entry, "size", None), torch.Size):
                entry.size = list(entry.size)
        elif op == "chunks-clear" and isinstance(chunks, list):
            chunks.clear()
        elif op == "chunk-duplicate" and chunk is not None:
            chunks.append(copy.deepcopy(chunk))
        elif op == "chunk-split" and chunk is not None and isinstance(chunk.sizes, torch.Size) \
                and isinstance(chunk.offsets, torch.Size) and len(chunk.sizes) and chunk.sizes[0] > 1:
            half = chunk.sizes[0] // 2
            rest = list(chunk.offsets)
            rest[0] += half
            entry.chunks = [ChunkStorageMetadata(chunk.offsets, torch.Size([half, *chunk.sizes[1:]])),
                            ChunkStorageMetadata(torch.Size(rest), torch.Size([chunk.sizes[0] - half,
                                                                               *chunk.sizes[1:]]))]
        elif op in ("chunk-offsets", "chunk-sizes") and chunk is not None:
            field = "offsets" if op == "chunk-offsets" else "sizes"
            values = getattr(chunk, field)
            values = list(values) if isinstance(values, (list, tuple)) else []
            if values and draw(st.booleans()):
                values[draw(st.integers(0, len(values) - 1))] = draw(NUMBER)
                setattr(chunk, field, values)
            else:
                setattr(chunk, field, draw(SHAPE))
        elif op == "entry-size":
            entry.size = draw(SHAPE)
        elif op == "entry-dtype" and hasattr(getattr(entry, "properties", None), "dtype"):
            entry.properties.dtype = draw(st.one_of(st.sampled_from(DTYPES), hostile()))
        elif op == "entry-attr" and hasattr(entry, "__dict__"):
            attr = draw(st.sampled_from(["properties", "size", "chunks"]))
            if attr in vars(entry):
                delattr(entry, attr)
        elif op == "entry-replace":
            entries[name] = draw(hostile())
        elif op == "storage-delete":
            del storage[key]
        elif op == "storage-path":
            path = draw(st.one_of(st.sampled_from(["meta.json", ".metadata", "rng_rank0.json", "nope.distcp",
                                                   f"../{PAYLOAD}", f"./{PAYLOAD}", "/etc/passwd"]),
                                  st.sampled_from(HOSTILE_STRINGS), hostile()))
            storage[key] = _StorageInfo(path, storage[key].offset, storage[key].length)
        elif op in ("storage-offset", "storage-length"):
            info = storage[key]
            offset, length = info.offset, info.length
            shift = draw(st.one_of(st.integers(-2000, 2000), NUMBER))
            if op == "storage-offset":
                offset = offset + shift if type(shift) is type(offset) is int else shift
            else:
                length = length + shift if type(shift) is type(length) is int else shift
            storage[key] = _StorageInfo(info.relative_path, offset, length)
        elif op == "storage-other":  # one payload's place given to another entry as well
            storage[key] = storage[draw(st.sampled_from(sorted(storage, key=lambda k: k.fqn)))]
        elif op == "storage-transform":
            storage[key] = _StorageInfo(storage[key].relative_path, storage[key].offset, storage[key].length,
                                        transform_descriptors=["gzip"])
        elif op == "storage-key":
            storage[MetadataIndex(key.fqn, draw(st.lists(st.integers(-1, 3), max_size=2)))] = storage.pop(key)
        elif op == "top":
            setattr(m, draw(st.sampled_from(["state_dict_metadata", "storage_data"])), draw(hostile()))
    return pickle.dumps(m)


@settings(FUZZ, max_examples=300)
@given(data=st.data())
def test_an_edited_index_loads_exactly_or_is_refused(saved, tmp_path_factory, data):
    index = data.draw(edited_index(Index(saved[data.draw(st.sampled_from(["index", "split"]))])))
    step = _copy(saved, tmp_path_factory.mktemp("idx"), index)
    got = must_read(lambda: _read(step), names=[str(step)])
    if got is not None:
        _exactly_saved(got, saved)


@settings(FUZZ, max_examples=200)
@given(data=st.data())
def test_a_damaged_index_file_loads_exactly_or_is_refused(saved, tmp_path_factory, data):
    """Bytes cut, flipped or inserted in the pickle: checked against the model's entries, as a
    resume does (a flipped byte in a name would otherwise rename a tensor)."""
    index = data.draw(perturbed_bytes(Index(saved["index"])))
    step = _copy(saved, tmp_path_factory.mktemp("raw"), index)
    got = must_read(lambda: _read(step, saved["expected"]), names=[str(step)])
    if got is not None:
        _exactly_saved(got, saved)


def test_the_untouched_copies_load_exactly(saved, tmp_path):
    for index in ("index", "split"):  # one chunk per tensor; SPLIT's in two
        _exactly_saved(_read(_copy(saved, tmp_path / index, saved[index])), saved)
    split = safe_load.read_metadata(_copy(saved, tmp_path / "split", saved["split"]))
    assert [len(split.state_dict_metadata[name].chunks) for name in SPLIT] == [2, 2]


# ---------------------------------------------------------------------------------------------
# meta.json, rng_rank0.json, latest


def _scheduler():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW([{"params": [model.weight]}, {"params": [model.bias]}], lr=3e-3)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


@st.composite
def top_field_edited(draw, valid: dict) -> dict:
    """meta.json with one of the fields loom reads deleted, replaced or perturbed inside."""
    doc = copy.deepcopy(valid)
    key = draw(st.sampled_from(["step", "world_size", "config", "scheduler", "layout", "data", "model_config",
                                "saved_at", "lora_base"]))
    op = draw(st.sampled_from(["delete", "replace", "perturb"]))
    if key not in doc:  # a LoRA run's base, absent from this full run's meta.json: added, hostile
        doc[key] = draw(hostile())
    elif op == "delete":
        del doc[key]
    else:
        doc[key] = draw(hostile() if op == "replace" else perturbed(doc[key]))
    return doc


@settings(FUZZ, max_examples=80)  # each example parses the saved config twice (~0.1 s each)
@given(data=st.data())
def test_meta_json_is_typed_or_refused(saved, tmp_path_factory, data):
    valid = json.loads((saved["step"] / "meta.json").read_text())
    step = _copy(saved, tmp_path_factory.mktemp("meta"), saved["index"])
    (step / "meta.json").unlink()
    write_json(step / "meta.json", data.draw(st.one_of(perturbed(valid), top_field_edited(valid))))
    meta = must_read(lambda: checkpoint.read_meta(step), names=["meta.json"])
    if meta is None:
        return
    assert type(meta["step"]) is int and meta["step"] >= 0 and type(meta["world_size"]) is int
    cfg = load_config_text(valid["config"])
    _, scheduler = _scheduler()
    must_read(lambda: checkpoint.check_resumable(meta, cfg, step))  # a changed config: one line
    state = must_read(lambda: checkpoint._scheduler_state(step, meta["scheduler"], scheduler),
                      names=["meta.json"])
    if state is not None:
        scheduler.load_state_dict(state)
        assert all(np.isfinite(scheduler.get_last_lr()))


@settings(FUZZ, max_examples=150)
@given(data=st.data())
def test_rng_json_is_typed_or_refused(saved, tmp_path_factory, data):
    valid = json.loads((saved["step"] / "rng_rank0.json").read_text())
    path = write_json(tmp_path_factory.mktemp("rng") / "rng_rank0.json", data.draw(perturbed(valid)))
    state = must_read(lambda: checkpoint._read_rng(path), names=["rng_rank0.json"])
    if state is None:
        return
    before = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    try:
        checkpoint._set_rng_state(state)  # what it accepted, the generators take
    finally:
        torch.set_rng_state(before[0])
        np.random.set_state(before[1])
        random.setstate(before[2])


LATEST = st.one_of(perturbed_bytes(b"step_2\n"), st.sampled_from(HOSTILE_STRINGS).map(str.encode),
                   st.sampled_from([b"../step_2", b"step_02", b"step_-1", b"step_2\x00", b"./step_2",
                                    b"step_9", b"../../elsewhere/step_2", b"STEP_2", b" step_2 \n\n",
                                    b"step_2/"]))


@settings(FUZZ, max_examples=150)
@given(text=LATEST)
def test_latest_leads_only_to_a_step_folder_of_the_run(saved, tmp_path_factory, text):
    root = tmp_path_factory.mktemp("latest")
    run, elsewhere = root / "run", root / "elsewhere" / "step_2"
    _copy(saved, run, saved["index"])
    elsewhere.mkdir(parents=True)
    (elsewhere / "meta.json").write_text("{}")
    (run / "checkpoints" / "latest").write_bytes(text)
    found = must_read(lambda: checkpoint.latest_checkpoint(run), names=["latest"])
    assert found in (None, run / "checkpoints" / "step_2")
    if found is not None:
        assert found.is_dir() and not found.is_symlink()
