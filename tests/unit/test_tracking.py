"""train.log_to: TensorBoard and wandb (offline) beside metrics.jsonl, written by rank 0 from the
same per-step entries (loom/train/tracking.py), read back here with each tool's own reader."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import loom.cli
from loom.config import load_config, validate
from loom.errors import ConfigError
from loom.models.gpt.config import preset
from loom.plan.hardware import Cluster, lookup
from loom.plan.search import config_candidate, config_workload, estimate
from loom.plan.shapes import from_gpt_config
from loom.train import tracking
from loom.train.tracking import Trackers, mfu_scale

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model.preset=tiny", "data.seq_len=32", "train.batch_size=4", "data.num_workers=0",
        "train.device=cpu", "parallel.strategy=ddp", "train.steps=4", "train.eval_every=2",
        "train.ckpt_every=0"]
STEP_TAGS = ["train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/step_time_s",
             "train/data_wait_s", "ledger/data", "ledger/forward", "ledger/backward", "ledger/optimizer"]


def _sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_tensorboard_gets_every_step_of_metrics_jsonl(corpus, tmp_path, world_of_one):
    """`loom train` with train.log_to = ["tensorboard"]: one value per step for each tag, the
    losses metrics.jsonl has, eval at eval_every and the final one, memory at the end, the config."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    rc = loom.cli.main(["train", "--nproc", "1", "--out", str(run),
                        *_sets(TINY + [f'data.source="{corpus}"', 'train.log_to=["tensorboard"]'])])
    assert rc == 0
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = set(acc.Tags()["scalars"])
    assert set(STEP_TAGS) <= scalars
    assert "train/mfu" in scalars  # the CPU's calibrated profile (tests/data) has a peak FLOP rate
    metrics = _metrics(run)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for tag in STEP_TAGS:
        assert [e.step for e in acc.Scalars(tag)] == [1, 2, 3, 4], tag
    for tag, key in (("train/loss", "loss"), ("train/lr", "lr"), ("train/grad_norm", "grad_norm")):
        logged = [e.value for e in acc.Scalars(tag)]
        assert logged == pytest.approx([m[key] for m in metrics], rel=1e-6, abs=1e-6), tag
    for e in acc.Scalars("ledger/data"):
        phases = ("data", "forward", "backward", "optimizer")
        shares = [acc.Scalars(f"ledger/{p}")[e.step - 1].value for p in phases]
        assert sum(shares) == pytest.approx(1.0, abs=1e-5)
    summary = json.loads((run / "summary.json").read_text())
    evals = {e.step: e.value for e in acc.Scalars("eval/loss")}
    assert evals == pytest.approx({2: metrics[1]["eval_loss"], 4: summary["eval_loss"]}, rel=1e-6)
    memory = json.loads((run / "memory.json").read_text())["ranks"]["0"]
    for key in ("peak_bytes", "resident_bytes", "model_state_bytes", "optimizer_bytes"):
        (value,) = acc.Scalars(f"memory/rank0/{key}")
        assert value.step == 4 and value.value == pytest.approx(memory[key], rel=1e-6), key
    (text,) = acc.Tensors("config/text_summary")
    config = text.tensor_proto.string_val[0].decode()
    assert "[train]" in config and 'log_to = ["tensorboard"]' in config and "steps = 4" in config
    assert "_hparams_/session_start_info" in acc.PluginTagToContent("hparams")  # the config as hparams
    assert not (run / "wandb").exists()


def _wandb_records(path: Path):
    """The protobuf records of a .wandb file (LevelDB's log format: 32 KiB blocks of
    [crc32 4][length 2][type 1] chunks after a 7-byte ':W&B' header), parsed."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_wandb_offline_run_holds_the_losses(corpus, tmp_path, world_of_one, monkeypatch):
    """The Python API with train.log_to = ["wandb"], offline: a run under RUN_DIR/wandb whose
    history has every step's loss, the final eval and memory, and whose config is loom's."""
    from loom.train.driver import train

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    cfg = load_config(None, TINY + [f'data.source="{corpus}"', 'train.log_to=["wandb"]'])
    run = tmp_path / "run"
    result = train(cfg, run, quiet=True)
    (offline,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    history: dict[int, dict] = {}
    config: dict[str, object] = {}
    for record in _wandb_records(offline):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            history.setdefault(items.pop("_step"), {}).update(items)
        elif kind in ("run", "config"):  # the run record carries wandb.init's config
            updates = (record.run.config if kind == "run" else record.config).update
            config.update({i.key: json.loads(i.value_json) for i in updates})
    assert sorted(history) == [1, 2, 3, 4]
    metrics = _metrics(run)
    assert [history[m["step"]]["train/loss"] for m in metrics] == pytest.approx([m["loss"] for m in metrics],
                                                                               rel=1e-6)
    assert history[2]["eval/loss"] == pytest.approx(metrics[1]["eval_loss"], rel=1e-6)
    assert history[4]["eval/loss"] == pytest.approx(result.eval_loss, rel=1e-6)
    assert history[4]["memory/rank0/peak_bytes"] == result.memory[0]["peak_bytes"]
    assert config["train"]["log_to"] == ["wandb"] and config["model"]["preset"] == "tiny"
    assert not (run / "tensorboard").exists()


def test_a_run_stopped_by_a_nonfinite_loss_closes_its_trackers(corpus, tmp_path, world_of_one, monkeypatch):
    """train.on_nonfinite = stop raises at step 3: the trackers are closed, steps 1-3 readable."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from loom.errors import LoomError
    from loom.train import faults
    from loom.train.driver import train

    monkeypatch.setenv("LOOM_FAULTS", "nan@3")
    faults.planted.cache_clear()
    cfg = load_config(None, TINY + [f'data.source="{corpus}"', 'train.log_to=["tensorboard"]',
                                    "train.on_nonfinite=stop"])
    try:
        with pytest.raises(LoomError, match="not finite; stopped"):
            train(cfg, tmp_path / "run", quiet=True)
    finally:
        monkeypatch.delenv("LOOM_FAULTS")
        faults.planted.cache_clear()
    assert Trackers._current is None
    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3]


def test_no_trackers_import_neither_package(corpus, tmp_path):
    """train.log_to = [] (the default): a run loads neither tensorboard nor wandb."""
    code = ("import sys; from loom.config import load_config; from loom.train.driver import train; "
            f"cfg = load_config(None, {TINY + [f'data.source={str(corpus)!r}']!r}); "
            f"train(cfg, __import__('pathlib').Path({str(tmp_path / 'run')!r}), quiet=True); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'tensorboard', 'wandb'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert not (tmp_path / "run" / "tensorboard").exists() and not (tmp_path / "run" / "wandb").exists()


def test_trackers_open_only_on_rank_0_with_a_run_directory(tmp_path):
    cfg = load_config(None, ['train.log_to=["tensorboard"]'])
    assert Trackers.open(load_config(None, []), tmp_path, main=True) is None
    assert Trackers.open(cfg, tmp_path, main=False) is None
    assert Trackers.open(cfg, None, main=True) is None
    assert not (tmp_path / "tensorboard").exists()


def test_a_misspelt_tracker_is_one_line():
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, ['train.log_to=["tensorbord"]']), 1)
    said = str(e.value)
    assert "\n" not in said and "train.log_to" in said and "tensorboard" in said, said


@pytest.mark.parametrize("name", ["tensorboard", "wandb"])
def test_a_missing_package_is_one_line_naming_it(monkeypatch, name):
    real = tracking.importlib.util.find_spec
    monkeypatch.setattr(tracking.importlib.util, "find_spec",
                        lambda n, *a: None if n == name else real(n, *a))
    with pytest.raises(ConfigError) as e:
        tracking.require_trackers(["tensorboard", "wandb"])
    said = str(e.value)
    assert "\n" not in said and f"pip install {name}" in said and "train.log_to" in said, said


def test_mfu_is_the_planners_on_a_known_gpu_and_absent_on_cpu(tmp_path):
    """MFU = tokens/s × FLOPs per token / (GPUs × bf16 peak), as the planner prices it; logged
    only where the plan knows the GPU."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = load_config(None, ["model.preset=tiny", "data.seq_len=32", 'train.log_to=["tensorboard"]'])
    shape = from_gpt_config(preset("tiny"), "tiny")
    w, c = config_workload(cfg, shape), config_candidate(cfg, 1, 1, 1, 1)
    assert mfu_scale(estimate(w, c, Cluster(None, 1, 1))) is None
    gpu = lookup("H100")
    plan = estimate(w, c, Cluster(gpu, 1, 1))
    expected = 1e5 * shape.flops_per_token(32) / (gpu.bf16_tflops * 1e12)
    assert 1e5 * mfu_scale(plan) == pytest.approx(expected, rel=1e-9)

    trackers = Trackers.open(cfg, tmp_path, main=True, plan=plan)
    phases = {"data_s": 0.1, "forward_s": 0.3, "backward_s": 0.6, "pipeline_s": 0.0, "optimizer_s": 0.0}
    trackers.step({"step": 1, "loss": 2.5, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1e5,
                   "step_time_s": 0.01, "data_wait_s": 0.0}, phases)
    trackers.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert acc.Scalars("train/mfu")[0].value == pytest.approx(expected, rel=1e-6)
    assert acc.Scalars("ledger/backward")[0].value == pytest.approx(0.6)
    assert "ledger/pipeline" not in acc.Tags()["scalars"]  # phases that did not run


def test_a_failed_runs_trackers_are_closed_by_the_next(tmp_path):
    """A run that raised before closing its trackers: the next run in the process closes them."""
    cfg = load_config(None, ['train.log_to=["tensorboard"]'])
    first = Trackers.open(cfg, tmp_path / "a", main=True)
    second = Trackers.open(cfg, tmp_path / "b", main=True)
    assert first.tensorboard is None and second.tensorboard is not None
    second.close()
    second.close()  # closing twice is harmless
