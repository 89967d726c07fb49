"""The deepspeed engine against loom's torch engine on 2 gloo ranks: the same losses for ZeRO 1-3,
offload to CPU and NVMe that changes nothing but where the states live, checkpoints that resume
bit for bit (in the same layout, on 4 ranks, across engines) and export, and a ZeRO-3 model that
is never whole on a rank while it is built."""

from __future__ import annotations

import ctypes.util
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from distributed import run_ranks
from optional import DEEPSPEED, require, require_module
from safetensors.torch import load_file

from loom.config import load_config

require_module("deepspeed", DEEPSPEED)

TINY = ["model.preset=tiny", "data.seq_len=32", "train.batch_size=8", "train.grad_accum=2", "train.steps=4",
        "data.num_workers=0", "train.log_every=100", "train.eval_batches=1"]
# Big enough that ZeRO-3's optimizer sub-groups reach DeepSpeed's smallest NVMe swap (1 MB).
MEDIUM = ["model.preset=tiny", "model.d_model=512", "model.n_heads=8", "model.n_kv_heads=4",
          "model.ffn_hidden=1536", "model.n_layers=4", "model.vocab_size=8192", "data.seq_len=32",
          "train.batch_size=4", "train.steps=3", "data.num_workers=0", "train.log_every=100",
          "train.eval_batches=0"]
DS = ["parallel.engine=deepspeed"]


def _runs(cases: dict[str, list[str]], corpus: str, root: str) -> dict:
    """Each case trained in turn on these ranks: its losses and memory (rank 0's view)."""
    from loom.train.driver import train

    out = {}
    for name, overrides in cases.items():
        cfg = load_config(None, [*overrides, f'data.source="{corpus}"'])
        r = train(cfg, Path(root) / name, quiet=True, return_state=True)
        out[name] = {"losses": r.losses, "memory": r.memory, "state": r.state_dict, "extra": r.extra}
    if any("parallel.engine=deepspeed" in o for o in cases.values()):
        from deepspeed.comm import comm

        out["shm_op_built"] = comm.cdb.shm_comm_op is not None  # the shared-memory all-reduce
    return out


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_zero_stages_match_the_torch_engine(corpus, tmp_path):
    stages = ("ddp", "zero1", "zero2", "zero3")
    cases = {"torch-zero2": TINY + ["parallel.strategy=zero2"],
             **{f"ds-{s}": TINY + DS + [f"parallel.strategy={s}"] for s in stages}}
    runs = run_ranks(_runs, 2, cases, str(corpus), str(tmp_path))[0]
    # DeepSpeed's CPU backend builds no shared-memory all-reduce (only its inference path would call it):
    # no minute of compiling on a fresh machine
    assert runs.pop("shm_op_built") is False
    ref = runs["torch-zero2"]["losses"]
    assert len(ref) == 4 and ref[-1] < ref[0]
    for name in cases:
        # Same AdamW, groups, clipping and schedule on the same batches: only the order of float
        # additions in the reductions differs (measured: ≤ 1e-7 relative).
        assert _rel(runs[name]["losses"], ref) < 1e-4, (name, runs[name]["losses"], ref)
        for key, tensor in runs["torch-zero2"]["state"].items():  # the trained weights, gathered
            torch.testing.assert_close(runs[name]["state"][key], tensor, rtol=1e-4, atol=1e-6)
    # What each rank holds at rest, by hand: fp32 weights (4Ψ, ZeRO-3: 4Ψ/2) and the optimizer's fp32
    # master, m and v (12Ψ/2); ZeRO-0 steps the weights (m, v: 8Ψ); gradients freed after a step.
    psi = runs["ds-zero2"]["memory"][0]["num_params"]
    formula = {"ds-ddp": 12 * psi, "ds-zero1": 4 * psi + 6 * psi, "ds-zero2": 4 * psi + 6 * psi,
               "ds-zero3": 8 * psi}
    for name, expected in formula.items():
        for m in runs[name]["memory"]:
            assert abs(m["model_state_bytes"] - expected) <= 0.01 * expected, (name, m, expected)
    config = json.loads((tmp_path / "ds-zero3" / "deepspeed_config.json").read_text())
    assert config["zero_optimization"]["stage"] == 3 and config["gradient_accumulation_steps"] == 2
    assert config["train_micro_batch_size_per_gpu"] == 2 and config["gradient_clipping"] == 1.0


def _engines(cases: dict[str, list[str]], corpus: str) -> dict:
    """Each case built as `loom train` builds it (train/driver.build_training), then the backwards of
    a step's two micro-steps (grad_accum 2): what DeepSpeed really runs (its ZeRO stage, whether its
    optimizer partitions gradients and offloads, the Adam that steps, where the fp32 master
    partitions live) and the gradients this rank holds after each backward."""
    from loom.config import validate
    from loom.data.loader import build_loaders
    from loom.observe.rank_memory import storage_bytes
    from loom.parallel import deepspeed_engine
    from loom.parallel.mesh import init_distributed
    from loom.train.driver import build_training
    from loom.train.task import config_task

    out = {}
    for name, overrides in cases.items():
        cfg = load_config(None, [*overrides, f'data.source="{corpus}"'])
        d = init_distributed(lambda world: validate(cfg, world), "cpu")
        task = config_task(cfg)
        b = build_training(cfg, d, task)
        engine, zero = b.model, b.model.optimizer
        loaders = build_loaders(cfg, task.train_data, None, d.dp_mesh.get_local_rank(), d.dp_mesh.size(),
                                False, 0)
        batches = iter(loaders.train)
        engine.backward(task.loss_fn(engine, next(batches)))
        # ZeRO-1 accumulates whole gradients until the step's last micro-step; ZeRO-2 moves each
        # into its reduce buckets at once (reduced into this rank's partition), freeing the whole ones.
        whole = storage_bytes(q.grad for q in engine.module.parameters())
        engine.step()  # not the boundary: DeepSpeed counts the micro-step
        engine.backward(task.loss_fn(engine, next(batches)))
        averaged = getattr(zero, "averaged_gradients", None) or {}  # ZeRO 1-2: this rank's partition
        partition = sum(t.numel() for ts in averaged.values() for t in ts)
        out[name] = {"stage": engine.zero_optimization_stage(), "zero": type(zero).__name__,
                     "partitions_grads": getattr(zero, "partition_gradients", None),
                     "offloads": getattr(zero, "cpu_offload", None) or getattr(zero, "offload_optimizer",
                                                                                  None),
                     "adam": type(b.optimizer).__name__,
                     "masters_on": sorted({str(t.device) for t in deepspeed_engine.master_weights(engine)}),
                     "whole_grad_bytes": whole, "partition_grads": partition, "params": b.num_params}
    return out


def test_engine_runs_the_stage_and_offload_it_was_asked_for(corpus):
    """The losses cannot tell ZeRO-1 from ZeRO-2, nor an offloaded optimizer from one that is not
    (the same AdamW either way): DeepSpeed's own engine and optimizer can. Here the accelerator is
    the CPU, so the master partitions are on "cpu" either way; the optimizer's offload flag and its
    CPU Adam say that it was offloaded."""
    cpu = ["parallel.offload_optimizer=cpu"]
    cases = {f"zero{k}{'-cpu' if off else ''}": TINY + DS + [f"parallel.strategy=zero{k}", *off]
             for k in (1, 2, 3) for off in ([], cpu)}
    for rank, runs in enumerate(run_ranks(_engines, 2, cases, str(corpus))):
        psi = runs["zero1"]["params"]
        for name, got in runs.items():
            stage, offloaded = int(name[4]), name.endswith("-cpu")
            assert got["stage"] == stage, (rank, name, got)
            assert got["zero"] == "DeepSpeedZeroOptimizer" + ("_Stage3" if stage == 3 else ""), got
            assert bool(got["offloads"]) == offloaded, (rank, name, got)
            assert got["adam"] == ("DeepSpeedCPUAdam" if offloaded else "AdamW"), (rank, name, got)
            assert got["masters_on"] == ["cpu"], (rank, name, got)
            if stage < 3:
                assert got["partitions_grads"] == (stage == 2), (rank, name, got)
        # fp32 gradients after the first micro-step: ZeRO-1 holds them whole (4Ψ), ZeRO-2 none (in
        # its buckets, to be reduced into its partition); after the last, both this rank's half.
        assert runs["zero1"]["whole_grad_bytes"] == 4 * psi, runs["zero1"]
        assert runs["zero2"]["whole_grad_bytes"] == 0, runs["zero2"]
        assert runs["zero1"]["partition_grads"] == runs["zero2"]["partition_grads"] == psi // 2, runs


def _require_libaio() -> None:
    require("libaio", ctypes.util.find_library("aio") is not None,
            "DeepSpeed's NVMe offload reads and writes through it: apt-get install libaio-dev")


def test_offload_moves_the_states_and_changes_nothing_else(corpus, tmp_path):
    _require_libaio()
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    zero3 = MEDIUM + DS + ["parallel.strategy=zero3"]
    cases = {"none": zero3, "optimizer-cpu": zero3 + ["parallel.offload_optimizer=cpu"],
             "optimizer-nvme": zero3 + ["parallel.offload_optimizer=nvme", f'parallel.nvme_path="{nvme}"'],
             "params-cpu": zero3 + ["parallel.offload_params=cpu"],
             "params-nvme": zero3 + ["parallel.offload_params=nvme", f'parallel.nvme_path="{nvme}"']}
    runs = run_ranks(_runs, 2, cases, str(corpus), str(tmp_path), timeout=900)[0]
    ref = runs["none"]["losses"]
    for name in cases:
        assert _rel(runs[name]["losses"], ref) < 1e-4, (name, runs[name]["losses"], ref)
    # The optimizer's fp32 master and Adam states (12 bytes a parameter, this rank's half) were on
    # NVMe during the run (measured at step 2), and the run's swap folder is gone after it.
    states = 12 * runs["none"]["memory"][0]["num_params"] / 2
    on_nvme = runs["optimizer-nvme"]["memory"]
    assert all(m["nvme_bytes"] >= 0.9 * states for m in on_nvme), (on_nvme, states)
    assert all(m["resident_bytes"] > 0 for m in on_nvme)
    assert runs["params-nvme"]["memory"][0]["nvme_bytes"] > 0
    assert runs["none"]["memory"][0]["nvme_bytes"] is None
    assert list(nvme.iterdir()) == []


def test_nvme_offload_lowers_resident_memory(corpus, tmp_path):
    """The same ZeRO-3 run as two `loom train` processes, without and with the optimizer on NVMe:
    each rank's resident memory after step 2 is lower by most of the optimizer's fp32 master and
    Adam states (12 bytes a parameter, this rank's half); the rest are DeepSpeed's swap buffers."""
    _require_libaio()
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    big = [*MEDIUM, "model.d_model=768", "model.ffn_hidden=2304", *DS, "parallel.strategy=zero3",
           f'data.source="{corpus}"']
    held = {}
    offload = ["parallel.offload_optimizer=nvme", f'parallel.nvme_path="{nvme}"']
    for name, extra in (("none", []), ("nvme", offload)):
        args = [x for o in [*big, *extra] for x in ("--set", o)]
        r = subprocess.run([sys.executable, "-m", "loom.cli", "train", "--nproc", "2", "--out",
                            str(tmp_path / name), *args], capture_output=True, text=True, timeout=600,
                           env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
        assert r.returncode == 0, r.stderr[-3000:]
        assert "resident (RSS) after step 2" in r.stdout, r.stdout[-2000:]  # printed in the summary
        held[name] = json.loads((tmp_path / name / "memory.json").read_text())["ranks"]
    states = 12 * held["none"]["0"]["num_params"] / 2
    # DeepSpeed swaps the gradient partitions with the optimizer (16 bytes a parameter): as planned,
    # but for the sub-groups under its smallest swap (1 MB), which stay in memory (1.5% here)
    summary = json.loads((tmp_path / "nvme" / "summary.json").read_text())
    for row in summary["measured_vs_planned"]:
        got, planned = row["nvme_bytes"]
        assert planned == pytest.approx(states * 16 / 12) and 0.97 * planned < got <= planned, row
    for rank in ("0", "1"):
        drop = held["none"][rank]["resident_bytes"] - held["nvme"][rank]["resident_bytes"]
        assert held["nvme"][rank]["nvme_bytes"] >= states, (rank, held["nvme"][rank], states)
        assert 0.5 * states < drop < 1.2 * states, (rank, drop / 2**20, states / 2**20)


def _full_runs(pairs: dict[str, tuple[list[str], list[str]]], corpus: str, root: str) -> dict:
    """Each case's uninterrupted run under its first layout, saving at step 2: its losses."""
    from loom.train.driver import train

    out = {}
    for name, (first, _) in pairs.items():
        cfg = load_config(None, [*first, f'data.source="{corpus}"', "train.steps=4", "train.ckpt_every=2"])
        out[name] = train(cfg, Path(root) / name / "full", quiet=True).losses
    return out


def _resumed(pairs: dict[str, tuple[list[str], list[str]]], corpus: str, root: str) -> dict:
    """Each case resumed from its step_2 under its second layout: the losses of steps 3-4."""
    from loom.train.driver import train

    out = {}
    for name, (_, second) in pairs.items():
        cfg = load_config(None, [*second, f'data.source="{corpus}"', "train.steps=4"])
        out[name] = train(cfg, Path(root) / name / "resumed", quiet=True,
                          resume=str(Path(root) / name / "full" / "checkpoints" / "step_2")).losses
    return out


def test_checkpoints_resume_in_any_layout_and_engine_and_export(corpus, tmp_path):
    ds3, torch3 = TINY + DS + ["parallel.strategy=zero3"], TINY + ["parallel.strategy=zero3"]
    pairs = {"ds-same": (ds3, ds3), "ds-to-4-ranks": (ds3, ds3), "ds-to-torch": (ds3, torch3),
             "torch-to-ds": (torch3, ds3), "ds-zero1-same": (TINY + DS + ["parallel.strategy=zero1"],) * 2}
    full = run_ranks(_full_runs, 2, pairs, str(corpus), str(tmp_path))[0]
    same = {k: v for k, v in pairs.items() if k != "ds-to-4-ranks"}
    resumed = run_ranks(_resumed, 2, same, str(corpus), str(tmp_path))[0]
    resumed.update(run_ranks(_resumed, 4, {"ds-to-4-ranks": pairs["ds-to-4-ranks"]}, str(corpus),
                             str(tmp_path))[0])
    for name in pairs:
        if name == "ds-to-4-ranks":  # another world size sums the batch in another order
            np.testing.assert_allclose(resumed[name], full[name][2:], rtol=0, atol=2e-5)
        else:
            assert resumed[name] == full[name][2:], (name, resumed[name], full[name])  # bit for bit
    # loom export reads a deepspeed checkpoint as any other: the weights the run trained
    from loom.train.export import export

    step = tmp_path / "ds-same" / "full" / "checkpoints" / "step_4"
    export(step, tmp_path / "model.safetensors", "loom")
    exported = load_file(tmp_path / "model.safetensors")
    from loom.train import checkpoint

    assert exported.keys() == checkpoint.read_tensors(step).keys()
    state = run_ranks(_runs, 2, {"again": TINY + DS + ["parallel.strategy=zero3"]}, str(corpus),
                      str(tmp_path / "again"))[0]["again"]["state"]
    for key, tensor in state.items():
        assert torch.equal(exported[key], tensor), key


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _build_partitioned(overrides: list[str]) -> dict:
    """Peak resident memory while ZeRO-3 builds the model as `loom train` does (zero.Init, then each
    rank writes its slices of loom's initial values), sampled every 5 ms."""
    from loom.config import validate
    from loom.models.gpt.model import build_model
    from loom.models.registry import adapter_for
    from loom.observe.rank_memory import count_params
    from loom.parallel import deepspeed_engine
    from loom.parallel.mesh import init_distributed
    from loom.train.task import Task, model_config, next_token_loss

    cfg = load_config(None, overrides)
    init_distributed(lambda world: validate(cfg, world), "cpu")
    gpt = model_config(cfg, 256)
    task = Task(model_fn=lambda device="meta": build_model(gpt, device), loss_fn=next_token_loss,
                train_data=[])
    import deepspeed  # noqa: F401 - the library's own import is not the model's memory

    deepspeed_engine.join_process_group()
    before, peak, done = _rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    ds = deepspeed_engine.deepspeed_config(cfg, 1)
    with deepspeed_engine.model_context(ds):
        model = task.model_fn(device="cpu")
    deepspeed_engine.initialize_weights(model, adapter_for(model), 0, partitioned=True)
    done.set()
    sampler.join()
    return {"growth": peak[0] - before, "params": count_params(model)}


def test_zero3_never_holds_the_whole_model_while_building(tmp_path):
    big = ["model.preset=tiny", "model.d_model=1024", "model.n_heads=16", "model.n_kv_heads=8",
           "model.ffn_hidden=2816", "model.n_layers=8", "model.vocab_size=8192", "model.max_seq_len=64",
           "data.seq_len=32", "train.batch_size=4", "parallel.engine=deepspeed", "parallel.strategy=zero3"]
    ranks = run_ranks(_build_partitioned, 4, big, timeout=600)
    whole = 4 * ranks[0]["params"]  # the fp32 model, about 445 MB
    assert whole > 300e6
    # Each of 4 ranks holds its quarter and, while a module is built, that module's whole weights:
    # measured about 0.4 of the whole, which a build that materializes the model needs at least
    # once. DeepSpeed's own buffers come later, in deepspeed.initialize.
    for r in ranks:
        assert r["growth"] < 0.6 * whole, (r["growth"] / 1e6, whole / 1e6)
    assert {r["params"] for r in ranks} == {ranks[0]["params"]}  # every rank counts the whole model


def _built_dtype(overrides: list[str]) -> str:
    """The dtype of a ZeRO-3 model built under model_context on an accelerator that reports no fp16
    (a CPU without AVX-512 FP16), with and without bf16 training."""
    from deepspeed.accelerator import get_accelerator

    from loom.config import validate
    from loom.models.gpt.model import build_model
    from loom.parallel import deepspeed_engine
    from loom.parallel.mesh import init_distributed
    from loom.train.task import model_config

    cfg = load_config(None, overrides)
    init_distributed(lambda world: validate(cfg, world), "cpu")
    accelerator = get_accelerator()
    accelerator.is_fp16_supported = lambda: False
    deepspeed_engine.join_process_group()
    with deepspeed_engine.model_context(deepspeed_engine.deepspeed_config(cfg, 4)):
        model = build_model(model_config(cfg, 256), "cpu")
    return str(next(model.parameters()).dtype)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero3_builds_in_fp32_where_the_device_has_no_fp16(precision):
    """DeepSpeed 0.19.8's zero.Init ignores dtype= where the accelerator lacks fp16 and builds in
    bf16: fp32 training ran in bf16 on such a CPU (losses 3e-4 off the torch engine)."""
    overrides = [*TINY, *DS, "parallel.strategy=zero3", f"train.precision={precision}"]
    assert run_ranks(_built_dtype, 1, overrides) == ["torch.float32"]
