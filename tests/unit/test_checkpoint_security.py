"""Resuming or exporting never runs code from a checkpoint, nor fills a tensor from memory no
payload wrote (docs/security.md).

Each crafted checkpoint (tests/crafted.py) goes through the three ways loom reads one: `loom train
--resume` (the check before launch, then the rank's load), the Python API's `train(resume=...)`
(the rank's own checks, no CLI in front) and `loom export`, each in this process (a world of one).
Each is refused with one line naming what is wrong, and the marker file a payload would create
never appears.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
from crafted import KINDS, craft
from in_process import world_of_one

import loom.cli
from loom.config import load_config
from loom.errors import LoomError
from loom.train import checkpoint, safe_load

TINY = ["model.preset=tiny", "data.seq_len=32", "train.batch_size=4", "data.num_workers=0",
        "train.device=cpu", "parallel.strategy=ddp"]

REFUSED = {  # what each crafted kind is refused with (all end "; refusing to load it (...)")
    "byte-entry": r"holds a non-tensor entry 'optim\.[\w.]+\.step' \(BytesStorageMetadata\); refusing to "
                  r"load it",
    "wrong-dtype": r"holds 'model\.norm\.weight' as float64 \[64\] where this model has float32 \[64\]; "
                   r"refusing",
    "wrong-shape": r"holds 'model\.norm\.weight' as float32 \[128\] where this model has float32 \[64\]; "
                   r"refusing",
    "extra-entry": r"holds an entry this model does not have \('model\.extra\.weight'\); refusing to load it",
    "pickled-payload": r"holds a payload that is not a plain tensor \(torch's weights-only loader: "
                       r".*(posix|os)\.system",
    "metadata-global": r"has an index \(\.metadata\) whose pickle asks for "
                       r"torch\.distributed\.checkpoint\.filesystem"
                       r"\.os\.system, which is not allowed in a checkpoint's metadata; refusing to load it",
    "payload-outside": r"stores entry 'model\.norm\.weight' in '\.\./outside\.distcp', which is not a file "
                       r"in the checkpoint; refusing to load it",
    # index edits that would leave elements unwritten (uninitialised memory) or read the wrong bytes
    "chunks-empty": r"describes entry 'model\.norm\.weight' of size \[64\] with chunks that leave 64 of its "
                    r"64 elements unwritten; refusing",
    "chunks-overlap": r"describes entry 'model\.tok_embeddings\.weight' of size \[256, 64\] with chunks that "
                      r"overlap \(they hold 20480 elements for its 16384\); refusing",
    "chunks-misplaced": r"describes entry 'model\.tok_embeddings\.weight' of size \[256, 64\] with chunks "
                        r"that overlap and leave a gap; refusing",
    "chunk-outside": r"describes a chunk of entry 'model\.norm\.weight' outside its size \[64\] \(offsets "
                     r"\[1\], sizes \[64\]\); refusing",
    "storage-missing": r"stores no payload for the chunk of entry 'model\.norm\.weight' at offsets \[0\]; "
                       r"refusing",
    "entry-no-properties": r"describes entry 'model\.norm\.weight' without a tensor dtype \(its properties: "
                           r"None\); refusing",
    "size-wrong-type": r"describes entry 'model\.norm\.weight' with size '64', not a list of non-negative "
                       r"integers; refusing",
    "payload-shared": r"stores entries 'model\.layers\.0\.attention_norm\.weight' and 'model\.norm\.weight' "
                      r"in the same bytes of __0_0\.distcp; refusing",
    "payload-short": r"stores entry 'model\.norm\.weight' in 100 bytes, fewer than the 256 its chunk holds; "
                     r"refusing",
}


def _sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


@pytest.fixture(scope="module")
def source(tmp_path_factory, corpus) -> Path:
    """A real 2-step run of the tiny model (world of one): its checkpoints/step_2."""
    run = tmp_path_factory.mktemp("source") / "run"
    with world_of_one():
        rc = loom.cli.main(["train", "--nproc", "1", "--out", str(run),
                            *_sets(TINY + [f'data.source="{corpus}"', "train.steps=2"])])
    assert rc == 0
    return run / "checkpoints" / "step_2"


@pytest.fixture(scope="module")
def crafted(source, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("crafted")
    out = {}
    for kind in KINDS:
        marker = root / f"MARKER-{kind}"
        out[kind] = craft(kind, source, root / kind / "checkpoints" / "step_2", marker), marker
    return out


def _cli_error(capsys, *argv: str) -> str:
    capsys.readouterr()
    rc = loom.cli.main(list(argv))
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("loom: error: "), err
    return lines[0]


@pytest.mark.parametrize("kind", KINDS)
def test_loom_train_resume_refuses_a_crafted_checkpoint(crafted, corpus, tmp_path, capsys, kind):
    path, marker = crafted[kind]
    with world_of_one():
        line = _cli_error(capsys, "train", "--nproc", "1", "--out", str(tmp_path / "run"),
                          "--resume", str(path), *_sets(TINY + [f'data.source="{corpus}"', "train.steps=4"]))
    assert f"checkpoint {path}" in line
    assert re.search(REFUSED[kind], line), line
    assert not marker.exists()


@pytest.mark.parametrize("kind", KINDS)
def test_loom_export_refuses_a_crafted_checkpoint(crafted, tmp_path, capsys, kind):
    path, marker = crafted[kind]
    for layout in ("loom", "hf"):
        line = _cli_error(capsys, "export", str(path), str(tmp_path / "model.safetensors"),
                          "--layout", layout)
        assert re.search(REFUSED[kind], line), line
    assert not marker.exists() and not list(tmp_path.iterdir())


def test_the_training_api_refuses_a_crafted_checkpoint_by_itself(crafted, corpus, tmp_path):
    """The Python API, no CLI in front: the rank's own load() refuses (a world of one here; every
    rank runs the same checks)."""
    from loom.train.driver import train

    for kind, (path, marker) in crafted.items():
        cfg = load_config(None, TINY + [f'data.source="{corpus}"', "train.steps=4"])
        with world_of_one(), pytest.raises(LoomError) as e:
            train(cfg, tmp_path / kind, quiet=True, resume=str(path))
        said = str(e.value)
        assert "\n" not in said and f"checkpoint {path}" in said, said
        assert re.search(REFUSED[kind], said), said
        assert not marker.exists(), kind


def test_an_untouched_checkpoint_still_loads_and_exports(source, tmp_path):
    """The guard refuses only what loom did not write: the source checkpoint reads whole."""
    metadata = safe_load.read_metadata(source)
    assert all(isinstance(m, torch.distributed.checkpoint.metadata.TensorStorageMetadata)
               for m in metadata.state_dict_metadata.values())
    from loom.models.gpt.config import preset
    from loom.models.gpt.model import build_model

    expected = safe_load.trained_entries(build_model(preset("tiny"), "meta"))
    safe_load.check_entries(source, metadata, expected)  # exactly the model's and AdamW's tensors
    assert set(metadata.state_dict_metadata) == set(expected)
    tensors = checkpoint.read_tensors(source, "")
    assert set(tensors) == set(expected)
    from loom.train.export import export

    export(source, tmp_path / "model.safetensors", "loom")
    assert (tmp_path / "model.safetensors").stat().st_mode & 0o044  # readable by others, like any file


def test_metadata_unpickler_admits_only_dcp_classes(tmp_path):
    """Plain names from the allow-list only: no dotted path, no other module, no callable."""
    from loom.train.safe_load import _Forbidden, _MetadataUnpickler

    class Call:
        def __reduce__(self):
            return (print, ("ran",))

    for payload in (pickle.dumps(Call()), pickle.dumps(os.getcwd), pickle.dumps(Path.write_text)):
        with pytest.raises(_Forbidden):
            _MetadataUnpickler(io.BytesIO(payload)).load()
    assert _MetadataUnpickler(io.BytesIO(pickle.dumps(torch.Size([2, 3])))).load() == torch.Size([2, 3])
    assert _MetadataUnpickler(io.BytesIO(pickle.dumps(torch.bfloat16))).load() is torch.bfloat16
    # Python 3.11 pickles DCP's memory-format enum as getattr(class, member): that, and only that
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING, Metadata

    class Attribute:
        def __init__(self, owner, name):
            self.owner, self.name = owner, name

        def __reduce__(self):
            return (getattr, (self.owner, self.name))

    member = _MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST
    assert _MetadataUnpickler(io.BytesIO(pickle.dumps(Attribute(_MEM_FORMAT_ENCODING, member.name)))).load() \
        is member
    for owner, name in ((Metadata, "__init__"), (_MEM_FORMAT_ENCODING, "_member_map_"), (torch.Size, "mro")):
        with pytest.raises(_Forbidden):
            _MetadataUnpickler(io.BytesIO(pickle.dumps(Attribute(owner, name)))).load()


# ---------------------------------------------------------------------------------------------
# Chunks cover each tensor exactly once


def _box(offsets, sizes):
    return tuple(offsets), tuple(sizes)


@pytest.mark.parametrize("size, chunks", [
    ((10, 4), [_box((0, 0), (3, 4)), _box((3, 0), (3, 4)), _box((6, 0), (3, 4)), _box((9, 0), (1, 4)),
               _box((10, 0), (0, 4))]),  # FSDP's uneven row shards, one rank's empty
    ((4, 6), [_box((r, c), (2, 3)) for r in (0, 2) for c in (0, 3)]),  # a TP × FSDP grid
    ((4, 4), [_box((0, 0), (2, 3)), _box((0, 3), (1, 1)), _box((1, 3), (3, 1)),
              _box((2, 0), (2, 3))]),  # a tiling that is no grid
    ((), [_box((), ())]),  # a scalar (Adam's step)
    ((0, 8), [_box((0, 0), (0, 8))]),  # an empty tensor
], ids=["fsdp-rows", "grid", "staircase", "scalar", "empty"])
def test_exact_covers_are_accepted(size, chunks):
    assert safe_load._cover_error(size, chunks) is None


@pytest.mark.parametrize("size, chunks, wrong", [
    ((64,), [], "leave 64 of its 64 elements unwritten"),
    ((10, 4), [_box((0, 0), (5, 4)), _box((6, 0), (4, 4))], "leave 4 of its 40 elements unwritten"),
    ((10, 4), [_box((0, 0), (6, 4)), _box((5, 0), (5, 4))], "overlap (they hold 44 elements for its 40)"),
    ((10, 4), [_box((0, 0), (5, 4)), _box((0, 0), (5, 4))], "overlap and leave a gap"),  # a duplicate
    ((4, 4), [_box((0, 0), (2, 4)), _box((1, 0), (2, 4)), _box((3, 0), (1, 4))],
     "overlap (they hold 20 elements for its 16)"),
    ((4, 4), [_box((0, 0), (2, 4)), _box((1, 0), (2, 4))],
     "overlap and leave a gap"),  # as many elements as the tensor: row 1 twice, row 3 never
    ((), [], "leave 1 of its 1 elements unwritten"),
    ((), [_box((), ())] * 2, "overlap (they hold 2 elements for its 1)"),
])
def test_gaps_and_overlaps_are_named(size, chunks, wrong):
    assert safe_load._cover_error(size, chunks) == wrong


def test_the_cover_check_is_linear_in_the_chunks():
    """100,000 row chunks (and a grid of 200 × 200) are checked in about a second each (measured:
    0.9 s, 0.7 s), and nothing of the tensor's size (here up to 2^57 elements) is allocated."""
    import time

    rows = [_box((i, 0), (1, 1 << 40)) for i in range(100_000)]
    grid = [_box((i, j), (1 << 20, 1 << 20)) for i in range(0, 200 << 20, 1 << 20)
            for j in range(0, 200 << 20, 1 << 20)]
    for size, chunks in (((100_000, 1 << 40), rows), ((200 << 20, 200 << 20), grid)):
        start = time.perf_counter()
        assert safe_load._cover_error(size, chunks) is None
        assert time.perf_counter() - start < 3.0
    assert safe_load._cover_error((100_001, 1 << 40), rows) == f"leave {1 << 40} of its {100_001 << 40} " \
                                                               f"elements unwritten"


# ---------------------------------------------------------------------------------------------
# `latest` and step_N: nothing leads a resume, or retention, out of the run's checkpoints/


def _steps(root: Path, *steps: int) -> Path:
    for n in steps:
        (root / "checkpoints" / f"step_{n}").mkdir(parents=True)
        (root / "checkpoints" / f"step_{n}" / "meta.json").write_text("{}")
    return root / "checkpoints"


def test_latest_names_a_step_folder_of_the_run_or_is_refused(tmp_path):
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    ckpts = _steps(run, 2, 4)
    _steps(elsewhere, 9)
    assert checkpoint.latest_checkpoint(run) == ckpts / "step_4"  # no marker: the newest by a scan
    (ckpts / "latest").write_text("step_2\n")
    assert checkpoint.latest_checkpoint(run) == ckpts / "step_2"
    (ckpts / "latest").write_text("step_7\n")  # a step removed since: the scan again
    assert checkpoint.latest_checkpoint(run) == ckpts / "step_4"
    for text, said in ((b"../../elsewhere/checkpoints/step_9", "names '../../elsewhere/checkpoints/step_9', "
                                                               "not a step_N folder of"),
                       (str(elsewhere / "checkpoints" / "step_9").encode(), "not a step_N folder of"),
                       (b"\xff\xfe", "is not UTF-8 text (byte 0)"), (b"step_2" * 100, "more than the 256"),
                       (b"step_2/../step_4", "not a step_N folder")):
        (ckpts / "latest").write_bytes(text)
        with pytest.raises(LoomError, match=re.escape(said)) as e:
            checkpoint.latest_checkpoint(run)
        assert f"delete {ckpts / 'latest'} to resume from the newest step_N folder" in str(e.value)
    (ckpts / "latest").unlink()
    os.symlink(elsewhere / "checkpoints" / "step_9", ckpts / "step_8")  # newest, and a link
    with pytest.raises(LoomError, match=r"step_8 is a symbolic link \(to .*elsewhere/checkpoints/step_9\)"):
        checkpoint.latest_checkpoint(run)
    with pytest.raises(LoomError, match="is a symbolic link"):
        checkpoint.resolve_resume(str(ckpts / "step_8"), None)
    assert checkpoint.checkpoint_steps(ckpts) == [(2, ckpts / "step_2"), (4, ckpts / "step_4")]
    os.symlink(tmp_path / "notes.txt", ckpts / "latest")
    with pytest.raises(LoomError, match="latest is not a plain file"):
        checkpoint.latest_checkpoint(run)


def test_retention_never_follows_or_deletes_through_a_step_link(source, corpus, tmp_path):
    """keep_last removes only the run's own step_N folders: a link named step_1 stays, and a link
    at the name of a new checkpoint is replaced; the folders they point to keep every file."""
    run = tmp_path / "run"
    shutil.copytree(source.parent.parent, run, symlinks=True)
    victims = {name: tmp_path / name for name in ("old", "new")}
    for folder in victims.values():
        folder.mkdir()
        (folder / "precious.txt").write_text("keep me")
    os.symlink(victims["old"], run / "checkpoints" / "step_1")
    os.symlink(victims["new"], run / "checkpoints" / "step_6")
    with world_of_one():
        rc = loom.cli.main(["train", "--nproc", "1", "--out", str(run), "--resume", "auto",
                            *_sets(TINY + [f'data.source="{corpus}"', "train.steps=6", "train.ckpt_every=2",
                                           "train.ckpt_every_min=0", "train.keep_last=1"])])
    assert rc == 0
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_1", "step_6"]
    assert (ckpts / "step_1").is_symlink() and not (ckpts / "step_6").is_symlink()
    assert checkpoint.read_meta(ckpts / "step_6")["step"] == 6
    for folder in victims.values():
        assert [p.name for p in folder.iterdir()] == ["precious.txt"]
        assert (folder / "precious.txt").read_text() == "keep me"


def test_a_non_finite_adam_step_is_refused_when_loaded(source, corpus, tmp_path):
    """A payload's value the index cannot show: Adam's step count, a NaN of which would make every
    update NaN, is checked once read (every engine's loader)."""
    from loom.train.driver import train

    state = checkpoint.read_tensors(source, "")
    name = next(k for k in state if k.startswith("optim.") and k.endswith(".step"))
    state[name] = torch.tensor(float("nan"))
    path = tmp_path / "nan" / "checkpoints" / "step_2"
    path.mkdir(parents=True)
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=path, no_dist=True)
    for f in source.glob("*.json"):
        shutil.copy(f, path / f.name)
    cfg = load_config(None, TINY + [f'data.source="{corpus}"', "train.steps=4"])
    with world_of_one(), pytest.raises(LoomError, match=rf"holds {re.escape(name)} = nan, not a step "
                                                              rf"count \(a whole number ≥ 0\)"):
        train(cfg, tmp_path / "run", quiet=True, resume=str(path))
