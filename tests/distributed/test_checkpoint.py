"""Checkpoints and resume on gloo ranks: bit-exact continuation in the same layout, resharding
into another strategy or world size (checked tensor by tensor), every rank's RNG streams restored
(a model with dropout), an async save writing while the next step runs, publishing, pruning, and
the non-finite step policy."""

from __future__ import annotations

import json
import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from torch import nn

from loom.config import load_config
from loom.errors import LoomError
from loom.train import checkpoint
from loom.train.driver import train

BASE = ["model.preset=tiny", "data.seq_len=32", "train.batch_size=8", "data.num_workers=0",
        "train.warmup_steps=2", "train.keep_last=10"]


def _train(overrides: list[str], run_dir: str, resume: str | None = None, faults: str = ""):
    os.environ["LOOM_FAULTS"] = faults
    r = train(load_config(None, BASE + overrides), Path(run_dir), quiet=True, resume=resume)
    return r.losses, r.extra


def _resume_pair(overrides: list[str], root: str):
    """An uninterrupted 6-step run saving at 3, then a run resumed from step 3 (same ranks)."""
    full, _ = _train(overrides + ["train.steps=6", "train.ckpt_every=3"], f"{root}/full")
    resumed, extra = _train(overrides + ["train.steps=6"], f"{root}/resumed",
                            f"{root}/full/checkpoints/step_3")
    return full, resumed, extra["start_step"]


SAME_LAYOUT = {  # world 2; each case is one uninterrupted run and one resumed run on the same ranks
    "zero3-async": ["parallel.strategy=zero3", "train.ckpt_async=true"],
    "ddp": ["parallel.strategy=ddp"],
    "zero1": ["parallel.strategy=zero1"],
    "pp2": ["parallel.strategy=ddp", "parallel.pp=2"],
    "tp2-dp1": ["parallel.strategy=zero2", "parallel.tp=2"],  # TP alone (dp 1); dp × tp: the 4-rank test
}


def _resume_pairs(cases: dict[str, list[str]], root: str):
    return {name: _resume_pair(overrides, f"{root}/{name}") for name, overrides in cases.items()}


def _check_bit_exact(results: dict) -> None:
    for name, (full, resumed, start) in results.items():
        assert start == 3, name
        assert resumed == full[3:], name  # step for step, exactly
        assert len(set(full)) == 6, name  # the run did train


def test_resume_in_the_same_layout_is_bit_exact(tmp_path):
    _check_bit_exact(run_ranks(_resume_pairs, 2, SAME_LAYOUT, str(tmp_path))[-1])


def test_resume_tp_x_data_parallel_is_bit_exact(tmp_path):
    # 4 ranks = dp 2 × tp 2, so the data-parallel dimension really shards: ZeRO-1 under TP saves
    # each owner's Adam states as DTensors on the TP mesh; zero3 × tp2 holds 2-D DTensors.
    _check_bit_exact(run_ranks(_resume_pairs, 4, {"tp2xzero1": ["parallel.strategy=zero1", "parallel.tp=2"],
                                                  "tp2xzero3": ["parallel.strategy=zero3", "parallel.tp=2"]},
                               str(tmp_path))[-1])


def _load_and_resave(overrides: list[str], source: str, out: str, continued: str):
    """_resave; then resume training from `source` in this layout."""
    return _resave(overrides, source, out), _train_from(overrides, continued, source, 4)


def _resave(overrides: list[str], source: str, out: str):
    """Build this layout, load `source` into it and save it again unchanged (what the layout
    holds); returns the LR schedule's last LR."""
    from loom.config import validate
    from loom.parallel.mesh import init_distributed
    from loom.train.driver import build_training
    from loom.train.task import config_task

    cfg = load_config(None, BASE + overrides + ["train.steps=4"])
    d = init_distributed(lambda world: validate(cfg, world), "cpu")
    built = build_training(cfg, d, config_task(cfg))
    meta = checkpoint.load(Path(source), built.model, built.optimizer, built.scheduler, cfg, d)
    saver = checkpoint.Checkpointer(Path(out), cfg, d, keep_last=1, async_save=False)
    saver.save(meta["step"], built.model, built.optimizer, built.scheduler,
               {"layout": {"strategy": "resaved"}})
    saver.close()
    return built.scheduler.get_last_lr()


def _train_from(overrides: list[str], run_dir: str, resume: str | None, steps: int):
    return _train(overrides + [f"train.steps={steps}", "train.ckpt_every=2"], run_dir, resume)[0]


@pytest.mark.parametrize("before, after", [
    ((4, ["parallel.strategy=zero3"]), (2, ["parallel.strategy=ddp"])),
    ((2, ["parallel.strategy=ddp"]), (2, ["parallel.strategy=ddp", "parallel.tp=2"])),
    ((2, ["parallel.strategy=ddp", "parallel.pp=2"]), (2, ["parallel.strategy=zero3"])),
    ((2, ["parallel.strategy=ddp"]), (4, ["parallel.strategy=zero3", "parallel.tp=2"])),
    ((4, ["parallel.strategy=zero3", "parallel.tp=2"]), (2, ["parallel.strategy=ddp"])),
    ((2, ["parallel.strategy=zero3", "parallel.cp=2"]), (2, ["parallel.strategy=zero3"])),
    ((2, ["parallel.strategy=ddp"]), (4, ["parallel.strategy=zero3", "parallel.cp=2",
                                          "parallel.cp_mode=alltoall"])),
], ids=["zero3x4-to-ddpx2", "ddp-to-tp2", "pp2-to-zero3", "ddp-to-zero3xtp2x4", "zero3xtp2x4-to-ddpx2",
        "zero3-cp2-to-zero3x2", "ddp-to-zero3-cp2xdp2"])
def test_resume_under_another_strategy_reshards_exactly(tmp_path, before, after):
    (world_a, a), (world_b, b) = before, after
    full = run_ranks(_train_from, world_a, a, str(tmp_path / "a"), None, 4)[-1]
    source = tmp_path / "a" / "checkpoints" / "step_2"
    lrs, continued = run_ranks(_load_and_resave, world_b, b, str(source), str(tmp_path / "b"),
                               str(tmp_path / "c"))[-1]

    saved = checkpoint.read_tensors(source, "")
    held = checkpoint.read_tensors(tmp_path / "b" / "checkpoints" / "step_2", "")
    assert set(held) == set(saved) and any(k.startswith("optim.") for k in saved)
    for name, tensor in saved.items():  # every weight and Adam state, as the other layout holds it
        assert torch.equal(held[name], tensor), name
    meta = checkpoint.read_meta(source)
    assert lrs == meta["scheduler"]["_last_lr"]
    # Continuing: the next step trains global batch 2 (the data position), as the first run did.
    np.testing.assert_allclose(continued, full[2:], rtol=0, atol=2e-5)


def _keep_last(run_dir: str):
    return _train(["parallel.strategy=ddp", "train.steps=5", "train.ckpt_every=2", "train.keep_last=2"],
                  run_dir)[0]


def test_checkpoints_are_published_whole_and_pruned(tmp_path):
    run_ranks(_keep_last, 2, str(tmp_path))
    root = tmp_path / "checkpoints"
    # saved at 2, 4 and the end (5); the oldest pruned; nothing half-written left visible
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_4", "step_5"]
    assert (root / "latest").read_text().strip() == "step_5"
    assert checkpoint.latest_checkpoint(tmp_path) == root / "step_5"
    step5 = root / "step_5"
    assert {p.name for p in step5.iterdir()} >= {".metadata", "meta.json", "rng_rank0.json", "rng_rank1.json"}
    meta = checkpoint.read_meta(step5)
    assert meta["step"] == 5 and meta["world_size"] == 2 and meta["layout"]["strategy"] == "ddp"
    (source,) = meta["data"].pop("sources")  # what the data is (loom/data/source_identity.py)
    assert source["spec"] == source["path"] == "stdlib" and len(source["fingerprint"]) == 16
    assert meta["data"] == {"next_global_batch": 5, "samples_seen": 40, "tokens_seen": 1280, "seed": 0}
    assert meta["scheduler"]["last_epoch"] == 5
    assert "[parallel]" in meta["config"]
    # Adam's step count and every parameter are in the checkpoint.
    optim = checkpoint.read_tensors(step5, "optim.")
    assert all(float(v) == 5 for k, v in optim.items() if k.endswith(".step"))
    # A crash mid-write leaves only a .tmp- folder, which `latest` never names and a new run removes.
    (root / ".tmp-step_6").mkdir()
    assert checkpoint.latest_checkpoint(tmp_path) == step5
    # Loading reads DCP's pickled metadata with an allow-list: no code runs from a checkpoint.
    (step5 / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(LoomError, match=r"pickle asks for posix\.system, which is not allowed in a "
                                        r"checkpoint's metadata; refusing to load it"):
        checkpoint.read_tensors(step5)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def _nonfinite(run_dir: str):
    """skip with a foreach AdamW (checked on the host), skip with a fused one (on the device),
    and stop; rank 1's loss at step 3 is NaN."""
    out = {}
    for policy, impl, strategy in (("skip", "foreach", "zero2"), ("skip", "fused", "zero2"),
                                   ("skip", "fused", "zero1"), ("stop", "foreach", "zero2")):
        try:
            out[policy, impl, strategy] = _train([f"parallel.strategy={strategy}", "train.steps=5",
                                                  "train.ckpt_every=2", f"train.on_nonfinite={policy}",
                                                  f"train.optimizer_impl={impl}"],
                                                 f"{run_dir}/{policy}-{impl}-{strategy}", faults="nan@3:1")
        except LoomError as e:
            out[policy, impl, strategy] = str(e)
    return out


def test_nonfinite_steps_are_skipped_or_stop_the_run(tmp_path):
    ranks = run_ranks(_nonfinite, 2, str(tmp_path))
    # zero1 × fused: ZeRO-1's local fused AdamW skips on the device too
    for impl, strategy in (("foreach", "zero2"), ("fused", "zero2"), ("fused", "zero1")):
        losses, extra = ranks[0]["skip", impl, strategy]
        run = tmp_path / f"skip-{impl}-{strategy}"
        assert np.isnan(losses[2]) and np.isfinite(losses[3:]).all(), impl
        assert extra["skipped_steps"] == [3]
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["skipped"] for r in records] == [False, False, True, False, False]
        assert records[-1]["nonfinite_steps"] == 1
        # The skipped update left no trace: 4 Adam steps in 5 optimizer steps, finite weights.
        step5 = run / "checkpoints" / "step_5"
        optim = checkpoint.read_tensors(step5, "optim.")
        assert {float(v) for k, v in optim.items() if k.endswith(".step")} == {4.0}, impl
        assert all(torch.isfinite(v).all() for v in checkpoint.read_tensors(step5).values())
    for rank in ranks:  # every rank stops, with the same one-line message
        message = rank["stop", "foreach", "zero2"]
        assert "step 3: loss nan" in message and "train.on_nonfinite = stop" in message
        assert "checkpoints/step_2" in message and "\n" not in message
    assert not (tmp_path / "stop-foreach-zero2" / "checkpoints" / "step_4").exists()


class _Noisy(nn.Module):
    """A tiny LM that draws from every RNG a checkpoint restores: dropout (torch's) and a scale from
    numpy's and Python's at each forward. loom's GPT draws from none, so a bit-exact resume of it
    cannot tell whether the states were restored."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.drop, self.head = nn.Embedding(64, 32), nn.Dropout(0.5), nn.Linear(32, 64)
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(2))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.embed(tokens)) * (1 + 0.1 * np.random.rand() + 0.1 * random.random())
        for layer in self.layers:
            h = torch.relu(layer(h))
        return self.head(h)


def _noisy_loss(model, batch):
    return F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())


def _noisy_pair(root: str) -> dict:
    """The noisy model for 4 steps saving at 2 and 4, then resumed from step 2 in the same run
    directory; this rank's RNG states at step 4 and the metrics, before and after."""
    from loom.data.loader import TokenWindows
    from loom.train.task import Task

    tokens = np.random.default_rng(0).integers(0, 64, 17 * 64)
    task = Task(model_fn=_Noisy, loss_fn=_noisy_loss, train_data=TokenWindows(tokens, 16),
                tokens_per_sample=16)
    cfg = load_config(None, BASE + ["parallel.strategy=ddp", "train.steps=4", "train.ckpt_every=2"])
    run = Path(root)
    rng = run / "checkpoints" / "step_4" / f"rng_rank{int(os.environ['RANK'])}.json"
    full = train(cfg, run, quiet=True, task=task).losses
    # read before this rank resumes: step 4 is saved again only once every rank has trained it
    before = {"rng": json.loads(rng.read_text()), "metrics": (run / "metrics.jsonl").read_text()}
    resumed = train(cfg, run, quiet=True, task=task, resume=f"{root}/checkpoints/step_2").losses
    after = {"rng": json.loads(rng.read_text()), "metrics": (run / "metrics.jsonl").read_text()}
    return {"losses": (full, resumed), "before": before, "after": after}


def _rng_and_async(root: str) -> dict:
    """Both cases on the same two ranks (one spawn)."""
    return {"rng": _noisy_pair(f"{root}/rng"), "async": _async_write_overlaps(f"{root}/async")}


@pytest.fixture(scope="module")
def rng_and_async(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("rng_and_async")
    return root, run_ranks(_rng_and_async, 2, str(root))


def test_resume_restores_every_rng_stream_of_every_rank(rng_and_async):
    """Step 4's torch, numpy and Python RNG states on each rank, resumed from step 2, are those of
    the run never stopped (numpy's and Python's streams are each process's own: per rank), and
    the dropout of steps 3-4 is the same: the same losses, bit for bit."""
    _, ranks = rng_and_async
    full, resumed = ranks[0]["rng"]["losses"]
    assert resumed == full[2:] and len(set(full)) == 4
    for rank, got in enumerate(r["rng"] for r in ranks):
        for stream in ("torch", "numpy", "python"):
            assert got["after"]["rng"][stream] == got["before"]["rng"][stream], (rank, stream)
    assert ranks[0]["rng"]["before"]["rng"]["numpy"] != ranks[1]["rng"]["before"]["rng"]["numpy"]  # per rank
    # metrics.jsonl: steps 1-2 kept from before the resume, 3-4 trained again; each step once
    records = [json.loads(line) for line in ranks[0]["rng"]["after"]["metrics"].splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["loss"] for r in records] == pytest.approx(full, rel=1e-6)
    assert ranks[0]["rng"]["before"]["metrics"].splitlines()[:2] == \
        ranks[0]["rng"]["after"]["metrics"].splitlines()[:2]


def _async_write_overlaps(run_dir: str) -> dict:
    """A zero3 run saving asynchronously at step 2, whose storage writer waits (10 s at most) for
    step 3 to start before it writes: with a background write step 3 starts at once; a save that
    writes in the step would wait out the 10 s, step 3 not started."""
    import threading
    import time

    from loom.train import faults

    marks: dict = {"steps": {}}
    step_3 = threading.Event()
    at_step_start, checkpoint_writer = faults.at_step_start, faults.checkpoint_writer

    def starting(step: int, rank: int) -> None:
        marks["steps"][step] = time.perf_counter()
        if step == 3:
            step_3.set()
        at_step_start(step, rank)

    def slowed(step: int, rank: int, path):
        writer = checkpoint_writer(step, rank, path)
        if step == 2:
            write_data = writer.write_data

            def write_after_step_3(plan, planner):
                marks["step_3_began"] = step_3.wait(timeout=10)
                marks["written"] = time.perf_counter()
                return write_data(plan, planner)

            writer.write_data = write_after_step_3
        return writer

    faults.at_step_start, faults.checkpoint_writer = starting, slowed
    try:
        _train(["parallel.strategy=zero3", "train.ckpt_async=true", "train.steps=4", "train.ckpt_every=2"],
               run_dir)
    finally:
        faults.at_step_start, faults.checkpoint_writer = at_step_start, checkpoint_writer
    return marks


def test_async_checkpoint_writes_while_the_next_step_runs(rng_and_async):
    root, ranks = rng_and_async
    for rank in ranks:
        marks = rank["async"]
        assert marks["step_3_began"], "the save of step 2 blocked the training loop: train.ckpt_async is sync"
        assert marks["written"] > marks["steps"][3]
    meta = checkpoint.read_meta(root / "async" / "checkpoints" / "step_2")  # published once written
    assert meta["step"] == 2
