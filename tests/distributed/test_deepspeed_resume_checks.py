"""The deepspeed engine's loader refuses what every loader refuses (docs/security.md): a checkpoint
whose index leaves a tensor partly unwritten (the case that once trained on uninitialised memory,
loss ln 256) or reads one payload for two tensors, or whose Adam step is not a count, is the same
one line on every rank of `train(resume=...)` (the ranks' own checks, no CLI in front); the
intact checkpoint resumes to the torch engine's losses."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import torch
from distributed import run_ranks
from optional import DEEPSPEED, require_module

from loom.config import load_config

require_module("deepspeed", DEEPSPEED)  # missing: fails, unless LOOM_TEST_WITHOUT=deepspeed

TINY = ["model.preset=tiny", "data.seq_len=32", "train.batch_size=4", "data.num_workers=0",
        "train.device=cpu", "parallel.strategy=zero2", "train.log_every=100", "train.eval_batches=0"]
REFUSED = {
    "chunks-empty": "describes entry 'model.norm.weight' of size [64] with chunks that leave 64 of its 64 "
                    "elements unwritten; refusing to load it",
    "payload-shared": "stores entries 'model.layers.0.attention_norm.weight' and 'model.norm.weight' in the "
                      "same bytes of __0_0.distcp; refusing to load it",
    "adam-step-nan": "= nan, not a step count (a whole number ≥ 0)",
}


def _resume_each(paths: dict[str, str], corpus: str, root: str) -> dict:
    """Each checkpoint resumed on these ranks (deepspeed; "torch": the torch engine), to step 4:
    its losses, or the one-line error it was refused with."""
    from loom.errors import LoomError
    from loom.train.driver import train

    out = {}
    for name, path in paths.items():
        engine = [] if name == "torch" else ["parallel.engine=deepspeed"]
        cfg = load_config(None, [*TINY, *engine, f'data.source="{corpus}"', "train.steps=4"])
        try:
            out[name] = train(cfg, Path(root) / name, quiet=True, resume=path).losses
        except LoomError as e:
            out[name] = str(e)
    return out


def _source(corpus: Path, root: Path) -> str:
    """A 2-step checkpoint of the torch engine (ZeRO-2 on 2 ranks): its step_2."""
    from loom.train.driver import train

    cfg = load_config(None, [*TINY, f'data.source="{corpus}"', "train.steps=2"])
    train(cfg, root, quiet=True)
    return str(root / "checkpoints" / "step_2")


def test_the_deepspeed_loader_refuses_what_every_loader_refuses(corpus, tmp_path):
    import torch.distributed.checkpoint as dcp
    from crafted import craft

    from loom.train import checkpoint

    source = Path(run_ranks(_source, 2, corpus, tmp_path / "source")[0])
    paths = {kind: str(craft(kind, source, tmp_path / kind / "checkpoints" / "step_2", tmp_path / "MARKER"))
             for kind in ("chunks-empty", "payload-shared")}
    state = checkpoint.read_tensors(source, "")
    step = next(k for k in state if k.startswith("optim.") and k.endswith(".step"))
    state[step] = torch.tensor(float("nan"))
    nan = tmp_path / "adam-step-nan" / "checkpoints" / "step_2"
    nan.mkdir(parents=True)
    dcp.save(state, checkpoint_id=nan, no_dist=True)
    for f in source.glob("*.json"):
        shutil.copy(f, nan / f.name)
    paths.update({"adam-step-nan": str(nan), "ds": str(source), "torch": str(source)})

    ranks = run_ranks(_resume_each, 2, paths, str(corpus), str(tmp_path / "resumed"))
    for kind, said in REFUSED.items():
        messages = [r[kind] for r in ranks]
        assert all(isinstance(m, str) and said in m and "\n" not in m for m in messages), (kind, messages)
        assert messages[0] == messages[1]  # the same line on every rank
    ds, ref = ranks[0]["ds"], ranks[0]["torch"]
    assert len(ds) == len(ref) == 2 and all(math.isfinite(x) for x in ds)
    assert max(abs(a - b) / b for a, b in zip(ds, ref)) < 1e-4, (ds, ref)  # the saved weights, not noise
