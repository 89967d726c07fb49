"""Fuzzing the config (tests/fuzz.py): a valid config perturbed — as a TOML file written by loom's
`to_toml`, and as `--set` strings — through `load_config` + `validate` gives a config or one
ConfigError line, and so does a perturbed DeepSpeed JSON through its check; the DeepSpeed config
loom then builds still holds loom's own keys."""

from __future__ import annotations

import json
import math

import pytest
from fuzz import FUZZ, HOSTILE_NUMBERS, hostile, must_read, perturbed, write_json
from hypothesis import given
from hypothesis import strategies as st

from loom.config import Config, load_config, to_toml, validate

# A valid config, every section present, the values a small CPU run would take.
VALID = Config().to_dict()
VALID["model"].update(preset="tiny", n_layers=2, tie_embeddings=False)
VALID["data"].update(seq_len=32, mix=[{"source": "a.txt", "weight": 2}])
VALID["train"].update(device="cpu", steps=4, batch_size=4, log_to=["tensorboard"])
VALID["parallel"].update(strategy="ddp")
VALID = {section: {k: v for k, v in table.items() if v is not None} for section, table in VALID.items()}
PATHS = [f"{s}.{k}" for s, table in VALID.items() for k in table]


def _check(cfg: Config) -> None:
    """A config that validates has finite numbers where they are floats, whatever the edit."""
    validate(cfg, 1, cuda_available=False)
    for section in VALID:
        for key, value in vars(getattr(cfg, section)).items():
            assert not isinstance(value, float) or math.isfinite(value), f"{section}.{key} = {value}"


@FUZZ
@given(doc=perturbed(VALID))
def test_a_perturbed_config_file_loads_or_is_one_line(doc, tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "run.toml"
    path.write_text(to_toml(doc) if isinstance(doc, dict) else json.dumps(doc))  # a root that is no table
    cfg = must_read(lambda: load_config(path), names=["run.toml"])
    if cfg is not None:
        must_read(lambda: _check(cfg))


@FUZZ
@given(path=st.sampled_from(PATHS), value=hostile(), raw=st.booleans(), text=st.text(max_size=20))
def test_a_perturbed_set_loads_or_is_one_line(path, value, raw, text):
    from loom.config import _toml_value

    override = f"{path}={text if raw else _toml_value(value)}"
    cfg = must_read(lambda: load_config(None, [override]))
    if cfg is not None:
        must_read(lambda: _check(cfg))


NUMBERS = [path for path in PATHS if isinstance(VALID[path.split(".")[0]][path.split(".")[1]], (int, float))
           and not isinstance(VALID[path.split(".")[0]][path.split(".")[1]], bool)]


@FUZZ
@given(path=st.sampled_from(NUMBERS), value=st.one_of(st.sampled_from([math.inf, -math.inf, math.nan]),
                                                     st.sampled_from(HOSTILE_NUMBERS), hostile()))
def test_a_hostile_number_is_refused_or_inside_its_range(path, value):
    """Accepted only if finite and inside the field's rule: what every caller may then assume."""
    from loom.config import RULES, _toml_value

    cfg = must_read(lambda: load_config(None, [f"{path}={_toml_value(value)}"]))
    if cfg is None:
        return
    section, key = path.split(".")
    got, rule = getattr(getattr(cfg, section), key), RULES[path]
    assert isinstance(got, (int, float)) and math.isfinite(got), f"{path} = {got!r} accepted"
    assert rule.low is None or (got > rule.low if rule.above else got >= rule.low), f"{path} = {got!r}"
    assert rule.high is None or (got < rule.high if rule.below else got <= rule.high), f"{path} = {got!r}"
    must_read(lambda: _check(cfg))


# A user's DeepSpeed JSON: tunables only (loom derives the rest)
VALID_DS = {"zero_optimization": {"overlap_comm": True, "contiguous_gradients": True,
                                  "stage3_prefetch_bucket_size": 50_000_000, "sub_group_size": 1_000_000},
            "fp16": {"initial_scale_power": 12, "loss_scale_window": 500, "hysteresis": 2},
            "steps_per_print": 100, "wall_clock_breakdown": False, "gradient_predivide_factor": 1.0,
            "communication_data_type": "fp32", "aio": {"block_size": 1048576, "queue_depth": 8}}


@pytest.fixture(scope="module")
def deepspeed_config():
    pytest.importorskip("deepspeed")
    from loom.parallel.deepspeed_engine import deepspeed_config

    return deepspeed_config


@FUZZ
@given(doc=perturbed(VALID_DS))
def test_a_perturbed_deepspeed_json_is_checked_or_one_line(doc, tmp_path_factory, deepspeed_config):
    path = write_json(tmp_path_factory.mktemp("ds") / "ds.json", doc)
    cfg = load_config(None, ["parallel.engine=deepspeed", "parallel.strategy=zero2", "train.device=cpu",
                             "train.batch_size=8", "train.grad_accum=2",
                             f"parallel.deepspeed_config={json.dumps(str(path))}"])
    if must_read(lambda: validate(cfg, 2, cuda_available=False), names=["ds.json"]) is None:
        return
    ds = deepspeed_config(cfg, 2)  # accepted: loom's own keys are still loom's
    assert ds["zero_optimization"]["stage"] == 2
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) \
        == (8, 2, 2)
    assert ds["gradient_clipping"] == 1.0 and ds["bf16"]["enabled"] is False and "optimizer" not in ds
