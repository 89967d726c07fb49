"""Discoverability (issue 40, item 8): `loom config show`, `loom train --dry-run`, `loom presets`,
`loom train --help` pointing at them, and a `--gpu` alias said when used. All in-process."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
from pathlib import Path

import pytest

import loom.cli
import loom.train.driver
from loom.cli import main
from loom.config import Config, load_config, load_config_text
from loom.config_show import field_docs
from loom.models.gpt.config import PRESETS
from loom.plan.report import params_text

ROOT = Path(__file__).resolve().parents[2]


def _keys() -> list[str]:
    return [f"{s.name}.{k.name}" for s in dataclasses.fields(Config)
            for k in dataclasses.fields(type(getattr(Config(), s.name)))]


def _show(capsys, *argv: str) -> str:
    assert main(["config", "show", *argv]) == 0
    return capsys.readouterr().out


# ---- loom config show


def test_every_key_has_its_doc_line_from_the_source():
    docs = field_docs()
    assert sorted(docs) == sorted(_keys())
    assert [k for k in _keys() if not docs[k]] == []
    # the comment beside the field, the comment lines above it, a GPT field's own comment
    assert docs["train.grad_clip"] == "0 disables clipping (the norm is still measured)"
    assert docs["data.source"].startswith('"stdlib" | text file | directory | glob | .bin token file')
    assert docs["data.source"].endswith("a Hugging Face dataset saved with save_to_disk")
    assert docs["model.moe_top_k"] == "routed experts per token"


def test_config_show_puts_each_key_under_its_doc(capsys):
    lines = _show(capsys).splitlines()
    assert lines[0] == "# loom config: defaults"
    docs, section, seen = field_docs(), None, []
    for i, line in enumerate(lines):
        if line.startswith("["):
            section = line.strip("[]")
        m = re.match(r"^(?:# )?(\w+)(?: = |: )", line)
        key = f"{section}.{m.group(1)}" if section and m else None
        if key in docs and lines[i - 1] == f"# {docs[key]}":
            seen.append(key)
    assert seen == _keys()
    assert "# peak learning rate (linear warmup, then cosine decay)\nlr = 0.003" in "\n".join(lines)


def test_config_show_applies_the_file_and_set_and_loads_back(capsys):
    argv = ["examples/train.toml", "--set", "train.steps=5", "--set", "model.d_model=128",
            "--set", "parallel.strategy=fsdp", "--set", 'data.mix=[{source = "a.jsonl", weight = 2}]',
            "--set", "data.source=stdlib"]
    text = _show(capsys, *argv)
    assert text.splitlines()[0] == (
        "# loom config: defaults ← examples/train.toml ← --set train.steps=5 ← --set model.d_model=128 ← "
        "--set parallel.strategy=fsdp ← --set data.mix=[{source = \"a.jsonl\", weight = 2}] ← "
        "--set data.source=stdlib")
    assert "\nsteps = 5\n" in text and "\nd_model = 128\n" in text
    assert '\nstrategy = "zero3"\n' in text  # the alias resolved
    shown = load_config_text(text).to_dict()
    assert shown == load_config("examples/train.toml", argv[2::2]).to_dict()
    assert shown["train"]["steps"] == 5 and shown["data"]["mix"] == [{"source": "a.jsonl", "weight": 2}]


def test_config_show_resolves_the_preset(capsys):
    small = _show(capsys)
    assert "\n# d_model = 256  (preset small's)\n" in small
    assert "\n# n_layers = 4  (preset small's)\n" in small
    big = _show(capsys, "--set", "model.preset=8b", "--set", "model.n_layers=2")
    assert "\n# d_model = 4096  (preset 8b's)\n" in big and "\n# ffn_hidden = 14336  (preset 8b's)\n" in big
    assert "\nn_layers = 2\n" in big
    assert "\n# vocab_size: data.tokenizer's\n" in _show(capsys, "--set", "data.tokenizer=bpe")
    assert "\n# rank: unset\n" in small  # lora.rank: None is not the preset's


@pytest.mark.parametrize("argv", [["--set", "train.stpes=5"], ["missing.toml"], ["--set", "train.steps=-1"],
                                  ["--set", "parallel.strategy=zero4"]])
def test_config_show_refuses_bad_input_as_train_does(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["config", "show", *argv]) == 2
    shown = capsys.readouterr()
    assert shown.out == ""
    assert main(["train", *argv]) == 2
    trained = capsys.readouterr()
    assert shown.err == trained.err and shown.err.count("\n") == 1 and shown.err.startswith("loom: error: ")
    assert list(tmp_path.iterdir()) == []


# ---- loom train --dry-run


@pytest.fixture
def nothing_starts(monkeypatch):
    """Any way a run starts fails the test: the launcher, an in-process run, a subprocess."""
    def started(*args, **kwargs):
        raise AssertionError("a dry run started something")

    monkeypatch.setattr(loom.cli, "_relaunch", started)
    monkeypatch.setattr(loom.train.driver, "train", started)
    monkeypatch.setattr(subprocess, "Popen", started)


@pytest.mark.parametrize("argv, world, layout", [
    (["--nproc", "1"], 1, "dp=1 [replicate 1 × shard 1]"),
    (["--nproc", "2", "--set", "parallel.strategy=zero3"], 2, "dp=2 [replicate 1 × shard 2]"),
])
def test_dry_run_checks_plans_and_starts_nothing(argv, world, layout, nothing_starts, capsys, tmp_path,
                                                 monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    assert main(["train", "--dry-run", "--set", "model.preset=tiny", "--out", str(out), *argv]) == 0
    text = capsys.readouterr().out
    assert not out.exists() and list(tmp_path.iterdir()) == []
    lines = text.splitlines()
    psi = PRESETS["tiny"].num_params()
    assert lines[0] == (f"loom: dry run: zero3 on {world} rank(s) (cpu), {layout}, GPT 2L d64 = "
                        f"{params_text(psi)} params, global batch 16 = micro-batch {16 // world} × "
                        f"grad_accum 1 × dp {world}, 128 tokens each, precision fp32")
    # zero3: 16Ψ/N bytes of model states per rank
    states = 16 * psi / world / 2**20
    assert lines[1].startswith(f"plan: each rank: model states {states:.2f} MiB, activation peak ")
    assert any(line.startswith("plan: step time ") for line in lines)
    assert lines[-1].startswith("loom: dry run: every check passed; nothing was started and nothing written")


def test_dry_run_of_a_pipeline_plans_each_stage(nothing_starts, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["--nproc", "2", "--set", "parallel.pp=2", "--set", "parallel.strategy=ddp"]
    assert main(["train", "--dry-run", "--set", "model.preset=tiny", "--out", "run", *argv]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert ", pp=2 × dp=1 [replicate 1 × shard 1], " in lines[0]
    assert lines[1] == ("pipeline: 2 stages × 1 virtual, 1f1b, 2 micro-batches per step: bubble "
                        "(p−1)(F+B+W) / (m(F+B+W) + bubble) = 0.333 (F:B:W = 0.33:0.42:0.24); blocks per "
                        "stage 1/1")
    assert [line.split(":")[1] for line in lines[2:4]] == [" stage 0", " stage 1"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, error", [
    (["--nproc", "2", "--set", "train.batch_size=15"], "train.batch_size = 15 is not divisible by"),
    (["--set", "data.source=missing.txt"], "missing.txt"),
    (["--resume", "runs/none/checkpoints/step_5"], "runs/none/checkpoints/step_5"),
])
def test_dry_run_refuses_what_the_run_would(argv, error, nothing_starts, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--dry-run", "--set", "model.preset=tiny", "--out", "run", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("loom: error: ") and error in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_dry_run_of_several_nodes_plans_across_them(nothing_starts, capsys, tmp_path, monkeypatch):
    """--nnodes 2 --nproc 2: the plan's cluster is 2 nodes of 2 ranks (its links across nodes priced
    as such), not one node of 4; DDP's all-reduce count, the engine's, is said as such."""
    from loom.train import record

    clusters, estimate = [], record.estimate
    monkeypatch.setattr(record, "estimate", lambda w, c, cluster: clusters.append(cluster) or
                        estimate(w, c, cluster))
    monkeypatch.chdir(tmp_path)
    argv = ["--nproc", "2", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:29555",
            "--set", "parallel.strategy=ddp"]
    assert main(["train", "--dry-run", "--set", "model.preset=tiny", "--out", "run", *argv]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("loom: dry run: ddp on 2 node(s) × 2 rank(s) (cpu), ")
    assert [(c.gpus_per_node, c.nodes) for c in clusters] == [(2, 2)]
    assert "plan: collectives per step: all_reduce (a count the engine chooses), broadcast ×2" in lines


def test_dry_run_refuses_an_existing_run_directory(nothing_starts, capsys, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    assert main(["train", "--dry-run", "--set", "model.preset=tiny", "--out", str(tmp_path / "run")]) == 2
    assert "already exists" in capsys.readouterr().err


# ---- loom presets


def test_presets_table_lists_every_shape(capsys):
    assert main(["presets"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["name", "params", "d_model", "n_layers", "heads", "kv", "heads", "ffn",
                                "vocab", "context", "experts"]
    rows = {line.split()[0]: line for line in lines[1:len(PRESETS) + 1]}
    assert list(rows) == list(PRESETS)
    assert rows["8b"].split() == ["8b", "8.03B", "4096", "32", "32", "8", "14336", "128,256", "8,192", "-"]
    assert rows["mixtral-8x7b"].split() == ["mixtral-8x7b", "46.7B", "(12.9B", "active)", "4096", "32", "32",
                                            "8", "14336", "32,000", "32,768", "8", "(top", "2)"]
    assert rows["tiny-moe"].split()[-4:] == ["2)", "+", "1", "shared"]


# ---- loom train --help


def test_train_help_points_to_the_discovery_commands(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for command in ("loom config show", "loom train --dry-run", "loom presets"):
        assert command in text
    assert "--dry-run resolve, check and plan the run, print its layout, and start nothing" in text


# ---- --gpu aliases


def _plan(gpu: str) -> int:
    return main(["plan", "--model", "small", "--gpu", gpu, "--gpus-per-node", "2", "--format", "json"])


def test_a_gpu_alias_is_said_once(capsys):
    assert _plan("H100") == 0
    out, err = capsys.readouterr()
    notes = [line for line in err.splitlines() if line.startswith("loom: note:")]
    assert notes == ["loom: note: --gpu H100 is taken as H100-SXM (80 GB, 989 bf16 TFLOPS); if yours is "
                     "another, name it: A100-40GB, A100-80GB, H100-SXM, H100-PCIe, H200, B200, MI300X, L40S, "
                     "RTX-4090"]
    assert json.loads(out)["cluster"]["gpu"]["name"] == "H100-SXM"  # stdout: the JSON alone
    assert _plan("h100") == 0
    assert "taken as H100-SXM" in capsys.readouterr().err  # any case, as catalog names
    assert _plan("H100-SXM") == 0
    assert "loom: note:" not in capsys.readouterr().err
