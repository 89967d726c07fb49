"""A LoRA run resumes (its checkpoint holds the adapters alone, and the pre-launch check expects
just that), a MoE LoRA run exports its adapter (the expert bias is a routing buffer, not a weight
trained whole), and a str-typed key's `--set` value is the text as written (`data.source=2024`)."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import torch
from in_process import world_of_one

import loom.cli
from loom import config as config_module
from loom.config import load_config
from loom.errors import LoomError
from loom.train import export_lora, safe_load
from loom.train.checkpoint import read_meta, read_tensors
from loom.train.export import export

TINY = ["model.preset=tiny", "data.seq_len=32", "train.batch_size=4", "data.num_workers=0",
        "train.device=cpu", "parallel.strategy=ddp", "train.log_every=100", "train.eval_batches=0",
        "train.ckpt_every_min=0", "lora.rank=4"]


def _sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, corpus) -> tuple[Path, list[str]]:
    """A 2-step LoRA run of the tiny GPT, trained in this process."""
    run = tmp_path_factory.mktemp("lora") / "run"
    overrides = [*TINY, f'data.source="{corpus}"']
    with world_of_one():
        assert loom.cli.main(["train", "--nproc", "1", "--out", str(run), *_sets(overrides),
                              "--set", "train.steps=2"]) == 0
    return run, overrides


def _check(run: Path, overrides: list[str], resume: str) -> None:
    cfg = load_config(None, [*overrides, "train.steps=4"])
    loom.cli._check_resume(cfg, run, resume, loom.cli._preflight_data(cfg, 1))


def test_the_pre_launch_check_accepts_a_lora_checkpoint(lora_run):
    run, overrides = lora_run
    _check(run, overrides, "auto")
    _check(run, overrides, str(run / "checkpoints" / "step_2"))


def test_a_lora_checkpoint_without_an_adapter_entry_is_refused(lora_run, monkeypatch):
    run, overrides = lora_run
    real = safe_load.read_metadata
    gone = "model.layers.1.attention.wq.lora_B"

    def lacking(path):
        metadata = real(path)
        del metadata.state_dict_metadata[gone]
        return metadata

    monkeypatch.setattr(safe_load, "read_metadata", lacking)
    with pytest.raises(LoomError, match=f"it lacks '{gone}'"):
        _check(run, overrides, "auto")


def test_a_moe_lora_adapter_leaves_out_the_routing_bias(tmp_path, corpus):
    """expert_bias is a buffer aux-loss-free balancing moves, not a weight the optimizer trained: a MoE
    LoRA run (attention adapted) exports its adapter."""
    run = tmp_path / "run"
    overrides = [*TINY, f'data.source="{corpus}"', "model.preset=tiny-moe", 'lora.targets=["q", "v"]',
                 "train.steps=2"]
    with world_of_one():
        assert loom.cli.main(["train", "--nproc", "1", "--out", str(run), *_sets(overrides)]) == 0
    held = read_tensors(run / "checkpoints" / "step_2")
    assert any(n.endswith("expert_bias") for n in held)  # the checkpoint keeps the buffer
    written = export(run, tmp_path / "adapter", lora="adapter")
    assert sorted(p.name for p in written) == ["adapter_config.json", "adapter_model.safetensors"]
    tensors, config = export_lora.adapter_files(read_meta(run / "checkpoints" / "step_2"), run, held, None)
    assert tensors and all(n.endswith(("lora_A.weight", "lora_B.weight")) for n in tensors), sorted(tensors)
    assert config["target_modules"] == ["wq", "wv"]
    norm = {**held, "layers.0.attention_norm.weight": torch.ones(64)}  # a weight trained whole: refused
    with pytest.raises(LoomError, match="also trained layers.0.attention_norm.weight whole"):
        export_lora.adapter_files(read_meta(run / "checkpoints" / "step_2"), run, norm, None)
    bias = next(n for n in held if n.endswith("expert_bias"))  # one balancing moved: refused, not dropped
    moved = {**held, bias: held[bias] + 0.5}
    with pytest.raises(LoomError, match=f"{bias} is not zero .*export the merged model with --lora merged"):
        export_lora.adapter_files(read_meta(run / "checkpoints" / "step_2"), run, moved, None)


def _str_keys() -> list[str]:
    """Every key whose type is str (or str | None): not lists of strings."""
    keys = []
    for section, kind in typing.get_type_hints(config_module.Config).items():
        for name, hint in typing.get_type_hints(kind).items():
            if typing.get_origin(hint) is not list and str in (typing.get_args(hint) or (hint,)):
                keys.append(f"{section}.{name}")
    return keys


STR_KEYS = _str_keys()


def test_there_are_str_keys():
    assert {"data.source", "model.init_from", "train.device"} <= set(STR_KEYS), STR_KEYS
    assert "lora.targets" not in STR_KEYS


def test_a_list_key_keeps_its_type_error():
    with pytest.raises(LoomError, match=r"lora.targets must be a list of strings, got 5;"):
        load_config(None, ["lora.targets=5"])


@pytest.mark.parametrize("raw", ["2024", "1.5", "true", "1e3"])
def test_a_str_keys_set_value_is_its_text(raw):
    for key in STR_KEYS:
        section, name = key.split(".")
        try:
            cfg = load_config(None, [f"{key}={raw}"])
        except LoomError as e:  # a choice or a rule of the key's own may refuse the text, never its type
            assert "must be str" not in str(e), (key, str(e))
            continue
        assert getattr(getattr(cfg, section), name) == raw, key


def test_the_closing_hint_names_the_export_a_peft_adapter_can_hold():
    """The end-of-run hint offers `--lora adapter` only where a PEFT adapter holds what trained:
    a run that adapted MoE experts (all-linear on an MoE model) or trained norms whole is pointed at
    `--lora merged`, which exports it (the adapter export refuses it)."""
    attention = ["layers.0.attention.wq.lora_A", "layers.0.attention.wq.lora_B"]
    assert export_lora.peft_holds(attention)
    assert not export_lora.peft_holds([*attention, "layers.1.feed_forward.experts.w1_lora_A"])
    assert not export_lora.peft_holds([*attention, "norm.weight"])
