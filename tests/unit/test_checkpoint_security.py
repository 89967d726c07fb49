"""Resuming or exporting never runs code from a checkpoint (docs/security.md).

Each crafted checkpoint (tests/crafted.py) goes through the three ways loom reads one: `loom train
--resume` (the check before launch, then the rank's load), the Python API's `train(resume=...)`
(the rank's own checks, no CLI in front) and `loom export`, each in this process (a world of one).
Each is refused with one line naming what is wrong, and the marker file a payload would create
never appears.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
from pathlib import Path

import pytest
import torch
from crafted import KINDS, craft

import loom.cli
from loom.config import load_config
from loom.errors import LoomError
from loom.parallel.mesh import shutdown
from loom.train import checkpoint, faults, safe_load

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
}


def _sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


@contextlib.contextmanager
def _world_of_one_here():
    """`loom train --nproc 1` in this process sets RANK, MASTER_PORT, ... and a process group:
    undo both, or the next test's `loom train` would think it is a torchrun rank."""
    saved = dict(os.environ)
    os.environ.pop("LOOM_FAULTS", None)
    faults.planted.cache_clear()
    try:
        yield
    finally:
        shutdown()
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="module")
def source(tmp_path_factory, corpus) -> Path:
    """A real 2-step run of the tiny model (world of one): its checkpoints/step_2."""
    run = tmp_path_factory.mktemp("source") / "run"
    with _world_of_one_here():
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
    with _world_of_one_here():
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
        with _world_of_one_here(), pytest.raises(LoomError) as e:
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

    expected = safe_load.adamw_entries(build_model(preset("tiny"), "meta"))
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
