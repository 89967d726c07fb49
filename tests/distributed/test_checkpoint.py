"""Checkpoints and resume on gloo ranks: bit-exact continuation in the same layout, resharding
into another strategy or world size (checked tensor by tensor), publishing, pruning, and the
non-finite step policy."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from distributed import run_ranks

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
    """Build this layout, load `source` into it and save it again unchanged (what the layout
    holds); then resume training from `source` in this layout."""
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
    return built.scheduler.get_last_lr(), _train_from(overrides, continued, source, 4)


def _train_from(overrides: list[str], run_dir: str, resume: str | None, steps: int):
    return _train(overrides + [f"train.steps={steps}", "train.ckpt_every=2"], run_dir, resume)[0]


@pytest.mark.parametrize("before, after", [
    ((4, ["parallel.strategy=zero3"]), (2, ["parallel.strategy=ddp"])),
    ((2, ["parallel.strategy=ddp"]), (2, ["parallel.strategy=ddp", "parallel.tp=2"])),
    ((2, ["parallel.strategy=ddp", "parallel.pp=2"]), (2, ["parallel.strategy=zero3"])),
    ((2, ["parallel.strategy=ddp"]), (4, ["parallel.strategy=zero3", "parallel.tp=2"])),
    ((4, ["parallel.strategy=zero3", "parallel.tp=2"]), (2, ["parallel.strategy=ddp"])),
], ids=["zero3x4-to-ddpx2", "ddp-to-tp2", "pp2-to-zero3", "ddp-to-zero3xtp2x4", "zero3xtp2x4-to-ddpx2"])
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
