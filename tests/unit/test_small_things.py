"""A new user's first hour: the layout line, --version, the known-harmless warnings silenced (and
only them), the offload figures labelled, tokens/s said to exclude warm-up, hsdp over one replica
refused, a tokenizer folder accepted (and its vocabulary taken), examples/hf_llama.py keeping an
earlier run, the sample config, the batch error's nearest sizes."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import re
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from optional import TEST_EXTRA, require_module

from loom.config import Config, ParallelConfig, load_config, validate
from loom.errors import ConfigError
from loom.files import claim_run_dir
from loom.models.gpt.config import preset
from loom.parallel import known_warnings
from loom.train import record
from loom.train.driver import layout_text
from loom.train.task import model_config

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "examples" / "train.toml"


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout)


# ---------------------------------------------------------------------------------------------
# The layout line, --version


def test_layout_line_names_tp_and_pp():
    assert layout_text(ParallelConfig(), 1, 2) == "dp=2 [replicate 1 × shard 2]"
    assert layout_text(ParallelConfig(tp=2), 1, 2) == "dp=2 [replicate 1 × shard 2] × tp=2"
    both = ParallelConfig(tp=2, pp=2, sequence_parallel=True)
    assert layout_text(both, 2, 1) == "pp=2 × dp=2 [replicate 2 × shard 1] × tp=2 (sequence parallel)"


def test_version_is_the_packages():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    out = _run("-m", "loom.cli", "--version")
    assert (out.returncode, out.stdout.strip()) == (0, f"loom {version}"), out


# ---------------------------------------------------------------------------------------------
# Known-harmless warnings: silenced by their message, at their source, and nothing else


def _future_warnings(silenced: bool) -> list[str]:
    """What torch's renamed collectives (as DeepSpeed calls them) warn, with or without the filter."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if silenced:
            known_warnings.silence_deepspeed_collective_names()
        out, x = torch.zeros(1), torch.ones(1)
        dist.all_gather_into_tensor(out, x)
        dist.reduce_scatter_tensor(out, x)
        warnings.warn("another FutureWarning", FutureWarning)  # still shown
    return [str(w.message) for w in seen if issubclass(w.category, FutureWarning)]


def test_deepspeeds_collective_names_are_silenced_and_nothing_else(gloo_world_of_one):
    # torch 2.13 warns so (the filter is not stale); 2.11, the GPU machine's, did not yet
    assert len(_future_warnings(silenced=False)) == (3 if torch.__version__ >= "2.13" else 1)
    assert _future_warnings(silenced=True) == ["another FutureWarning"]


def test_dtensors_sequential_redistribute_advice_is_silenced(gloo_world_of_one):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._redistribute import _warn_flatten_optimization_not_possible

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_shard", "tp"))
    logger = logging.getLogger(known_warnings.DTENSOR_LOGGER)  # torch's: it does not propagate
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    saved = list(logger.filters)
    logger.addHandler(handler)
    try:
        def advise(dims):  # torch's own line (a (mesh, dims) pair advises once)
            _warn_flatten_optimization_not_possible(mesh, dims, (Replicate(),) * 2, (Replicate(),) * 2, 2,
                                                    "all_reduce", "no_flattened_mesh")

        advise((0, 1))
        assert len(seen) == 1 and "2 sequential all_reduce operations" in seen[0]  # the filter is not stale
        known_warnings.silence_dtensor_sequential_redistribute()
        advise((1, 0))
        logger.warning("another DTensor warning")
        assert seen[1:] == ["another DTensor warning"]
    finally:
        logger.removeHandler(handler)
        logger.filters[:] = saved


# ---------------------------------------------------------------------------------------------
# The end-of-run report: tokens/s and the offload figures say what they are

SUMMARY = {"steps": 10, "elapsed_s": 3.0, "first_loss": 5.5, "final_loss": 5.0, "eval_loss": None,
           "tokens_per_s": 1000.0}
RANK = {"params_bytes": 2**20, "grads_bytes": 0, "optimizer_bytes": 0, "model_state_bytes": 2**20,
        "peak_bytes": None, "resident_bytes": 3 * 2**20, "nvme_bytes": 3 * 2**20}


def test_tokens_per_s_says_it_excludes_warm_up(capsys):
    record.print_summary(SUMMARY, [RANK], "16Ψ", 4 * 2**20, None)
    assert "1,000 tokens/s (warm-up excluded: steps 1-2 not timed)" in capsys.readouterr().out
    record.print_summary({**SUMMARY, "steps": 2}, [RANK], "16Ψ", 4 * 2**20, None)
    assert "tokens/s (every step timed, warm-up included)" in capsys.readouterr().out


def test_offload_figures_are_labelled(capsys):
    record.print_summary(SUMMARY, [RANK], "16Ψ", 4 * 2**20, None, ("nvme",))
    out = capsys.readouterr().out
    assert "measured/formula 0.250" in out
    assert "measured/formula: them ÷ the formula's 4.00 MiB" in out
    assert "offloaded to NVMe are on disk, not in memory" in out and "below 1" in out
    row = {"rank": 0, "model_state_bytes": [25 * 2**20, 6.25 * 2**20], "activation_peak_bytes": [None, 0],
           "comm_payload_bytes": [None, None], "nvme_bytes": [None, 0], "comm_by_kind": {},
           "comm_modelled_wire_bytes": [None, 0]}
    record.print_measured_vs_planned([row], ("cpu",))
    out = capsys.readouterr().out
    assert "25.00 /     6.25  4.00" in out
    assert "(each: measured MiB / planned MiB, then measured ÷ planned" in out
    assert "on a CPU device they are in this rank's memory" in out
    record.print_measured_vs_planned([row])
    assert "CPU device" not in capsys.readouterr().out  # no offload: no offload note
    record.print_measured_vs_planned([{**row, "host_bytes": [12 * 2**20, 8 * 2**20]}])
    assert "in host memory" in (out := capsys.readouterr().out) and "12.00 /     8.00  1.50" in out
    record.print_measured_vs_planned([{**row, "host_bytes": [12 * 2**20, 0.0]}])
    assert "in host memory" not in capsys.readouterr().out  # nothing planned off the device


# ---------------------------------------------------------------------------------------------
# Config: hsdp over one replica, the batch error, a tokenizer folder and its vocabulary


def test_hsdp_over_one_replica_is_refused_before_launch():
    with pytest.raises(ConfigError, match=r"dp_replicate = 1 is zero3 with a useless all-reduce; use "
                                          r"parallel.strategy=zero3, or set parallel.dp_replicate ≥ 2"):
        validate(load_config(None, ["parallel.strategy=hsdp"]), 4)
    validate(load_config(None, ["parallel.strategy=hsdp", "parallel.dp_replicate=2"]), 4)
    out = _run("-m", "loom.cli", "train", "--nproc", "4", "--set", "parallel.strategy=hsdp")
    assert out.returncode != 0 and "dp_replicate = 1 is zero3" in out.stderr, out
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr, out.stderr


@pytest.mark.parametrize("batch,suggested", [(17, "12 or 18"), (2, ": 6;"), (25, "24 or 30")])
def test_batch_error_suggests_the_nearest_valid_sizes(batch, suggested):
    cfg = load_config(None, [f"train.batch_size={batch}", "train.grad_accum=3"])
    with pytest.raises(ConfigError, match="use a multiple of 6") as e:
        validate(cfg, 2)
    assert suggested in str(e.value) + ";", str(e.value)


def _tokenizer_folder(folder: Path, words: int = 40) -> Path:
    tk = require_module("tokenizers", TEST_EXTRA)
    vocab = {"</s>": 0, **{f"w{i}": i + 1 for i in range(words - 1)}}
    tk.Tokenizer(tk.models.WordLevel(vocab, unk_token="</s>")).save(str(folder / "tokenizer.json"))
    return folder


def test_a_model_folder_is_a_tokenizer_as_for_data_prepare(tmp_path):
    folder = _tokenizer_folder(tmp_path)
    for given in (folder, folder / "tokenizer.json"):
        validate(load_config(None, [f'data.tokenizer="{given}"']), 2)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="is a folder without a tokenizer.json"):
        validate(load_config(None, [f'data.tokenizer="{empty}"']), 2)
    with pytest.raises(ConfigError, match="did you mean 'byte'"):
        validate(load_config(None, ["data.tokenizer=btye"]), 2)


def test_a_tokenizers_vocabulary_is_the_models_unless_set(tmp_path):
    path = str(_tokenizer_folder(tmp_path))
    assert model_config(load_config(None, [f'data.tokenizer="{path}"']), 40).vocab_size == 40
    set_here = load_config(None, [f'data.tokenizer="{path}"', "model.vocab_size=64"])
    assert model_config(set_here, 40).vocab_size == 64
    byte = load_config(None, ["data.tokenizer=byte", "model.preset=125m"])  # the preset's vocabulary stays
    assert model_config(byte, 256).vocab_size == preset("125m").vocab_size


# ---------------------------------------------------------------------------------------------
# examples/hf_llama.py keeps an earlier run; the sample config


def test_hf_llama_example_never_writes_over_an_earlier_run(tmp_path):
    require_module("transformers", TEST_EXTRA)
    run = tmp_path / "run"
    claim_run_dir(run)
    (run / "metrics.jsonl").write_text("{}\n")
    out = _run(str(ROOT / "examples" / "hf_llama.py"), "--out", str(run))
    assert out.returncode != 0 and f"run directory {run} already exists" in out.stderr, out
    assert "--overwrite" in out.stderr and (run / "metrics.jsonl").read_text() == "{}\n"
    spec = importlib.util.spec_from_file_location("hf_llama_example", ROOT / "examples" / "hf_llama.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    with pytest.raises(SystemExit, match="replaces only a run directory loom made"):
        example.take_run_dir(foreign, overwrite=True)
    assert (foreign / "notes.txt").read_text() == "keep"
    example.take_run_dir(run, overwrite=True)  # loom's own run: replaced, marked again
    assert [p.name for p in run.iterdir()] == [".loom-run"]


def test_sample_config_runs_as_the_defaults_and_shows_every_key():
    cfg = load_config(SAMPLE)  # unknown keys are refused here
    assert cfg == Config()
    validate(cfg, 2)
    text = SAMPLE.read_text()
    for section in dataclasses.fields(Config):
        assert f"[{section.name}]" in text, section.name
        for key in dataclasses.fields(getattr(Config(), section.name)):
            assert re.search(rf"^(# )?{key.name} = ", text, re.M), f"{section.name}.{key.name}"


@pytest.mark.parametrize("torchrun", [False, True])
def test_the_continue_command_relaunches_srun_tasks(monkeypatch, torchrun):
    """Ranks srun started as its tasks are continued by srun with as many tasks; under torchrun
    (per node, under srun or not) the command is loom's own launch."""
    from loom.cli import _continue_command, build_parser

    for key in [k for k in os.environ if k.startswith("SLURM_") or k == "TORCHELASTIC_RUN_ID"]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("SLURM_NTASKS", "16")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    if torchrun:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    args = build_parser().parse_args(["train", "--out", "runs/x"])
    srun = "" if torchrun else "srun --nodes 2 --ntasks 16 "
    assert _continue_command(args, Path("runs/x")) == f"{srun}loom train --resume auto --out runs/x"
