"""`loom plan --emit` writes a starting point for a real run (issue 40, item 5): the data and tokenizer
as placeholders `loom train` refuses until set, an LR and warmup from GPT-3's table, steps from
Chinchilla's token budget, and for --params a base preset of the shape's own size."""

from __future__ import annotations

import json
import math

import pytest

from loom.cli import main
from loom.config import load_config, validate
from loom.errors import ConfigError
from loom.plan.command import model_shape
from loom.plan.starting_point import DATA_PLACEHOLDER, TOKENIZER_PLACEHOLDER, peak_lr


def _emit(tmp_path, capsys, *args: str) -> tuple[dict, object, str, str]:
    """(the plan as JSON, the emitted config, its text, the line `plan` printed about it)."""
    target = tmp_path / "run.toml"
    assert main(["plan", *args, "--gpu", "H100-SXM", "--format", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert main(["plan", *args, "--gpu", "H100-SXM", "--emit", str(target)]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("in it: ")]
    assert len(said) == 1
    return plan, load_config(target), target.read_text(), said[0]


def _tokens_per_step(plan: dict) -> int:
    return plan["model"]["global_batch"] * plan["model"]["seq_len"]


@pytest.mark.parametrize("model, lr", [("8b", 1.1e-4), ("70b", 7.2e-5)])
def test_a_preset_emit_derives_lr_warmup_and_steps_and_leaves_the_data_to_the_user(tmp_path, capsys,
                                                                                   model, lr):
    plan, cfg, text, said = _emit(tmp_path, capsys, "--model", model)
    params, tokens = plan["model"]["num_params"], _tokens_per_step(plan)
    assert cfg.model.preset == model
    assert (cfg.data.source, cfg.data.tokenizer) == (DATA_PLACEHOLDER, TOKENIZER_PLACEHOLDER)
    assert cfg.train.lr == pytest.approx(lr, rel=0.01)  # GPT-3's table, between its 6.7B/13B (175B) rows
    assert cfg.train.steps == math.ceil(20 * params / tokens)
    assert cfg.train.warmup_steps == math.ceil(375e6 / tokens)
    assert 100 < cfg.train.warmup_steps < cfg.train.steps // 10
    assert "# Chinchilla: 20 tokens per parameter" in text and "# GPT-3's table" in text
    assert "--set data.source=PATH" in text
    assert said.startswith("in it: placeholders to set before loom train: data.source, data.tokenizer")
    assert f"train.steps = {cfg.train.steps:,}" in said and f"train.lr = {cfg.train.lr:g}" in said
    assert f"train.warmup_steps = {cfg.train.warmup_steps:,}" in said


def test_loom_train_refuses_the_placeholders_until_set(tmp_path, capsys):
    _emit(tmp_path, capsys, "--model", "8b")
    path = tmp_path / "run.toml"
    with pytest.raises(ConfigError) as e:
        validate(load_config(path), 8, cuda_available=True)
    assert str(e.value) == (f"data.source = '{DATA_PLACEHOLDER}' is a placeholder (of an emitted config or a "
                            f"recipe); set it in the config file or with --set data.source=PATH")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text\n")
    refused = r"^data.tokenizer = '<your tokenizer: .*--set data.tokenizer=PATH$"
    with pytest.raises(ConfigError, match=refused):
        validate(load_config(path, [f"data.source={corpus}"]), 8, cuda_available=True)
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text("{}")
    dims = validate(load_config(path, [f"data.source={corpus}", f"data.tokenizer={tokenizer}"]), 8,
                    cuda_available=True)
    assert dims.world_size == 8
    # a plan of another machine's run reads the file as it is
    assert validate(load_config(path), 8, cuda_available=True, this_machine=False).world_size == 8


@pytest.mark.parametrize("params, base", [(70e9, "70b"), (8e9, "8b"), (1.3e9, "1b")])
def test_a_params_emit_writes_a_preset_of_its_own_size(tmp_path, capsys, params, base):
    plan, cfg, text, _ = _emit(tmp_path, capsys, "--params", f"{params:g}")
    assert cfg.model.preset == base
    planned = plan["model"]["num_params"]
    assert planned == pytest.approx(params)
    written = model_shape(cfg, None, None).num_params
    assert written == pytest.approx(planned, rel=0.01)
    assert cfg.train.lr == peak_lr(planned)
    assert f"# model: preset {base} with its shape below ({written / 1e9:.3g}B parameters)" in text


def test_peak_lr_is_gpt3s_table_at_its_rows_and_held_at_the_ends():
    assert [peak_lr(n) for n in (125e6, 1.3e9, 13e9, 175e9)] == [6e-4, 2e-4, 1e-4, 6e-5]
    assert peak_lr(10e6) == 6e-4 and peak_lr(1e12) == 6e-5


def test_a_users_own_data_and_training_settings_are_kept(tmp_path, capsys):
    _, cfg, text, said = _emit(tmp_path, capsys, "--model", "8b", "--set", "data.source=/data/web",
                               "--set", "data.tokenizer=byte", "--set", "train.lr=2e-4",
                               "--set", "train.steps=1000")
    assert (cfg.data.source, cfg.data.tokenizer, cfg.train.lr, cfg.train.steps) == ("/data/web", "byte",
                                                                                    2e-4, 1000)
    assert cfg.train.warmup_steps == 100  # a tenth of the user's steps: below GPT-3's 358
    assert "placeholder" not in said and "<your" not in text
    assert said == "in it: derived: train.warmup_steps = 100 (GPT-3's 375M tokens)"


def test_a_json_plan_stays_json_with_emit(tmp_path, capsys):
    assert main(["plan", "--model", "8b", "--gpu", "H100-SXM", "--format", "json",
                 "--emit", str(tmp_path / "run.toml")]) == 0
    assert json.loads(capsys.readouterr().out)["recommended"] is not None
