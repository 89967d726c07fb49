"""Config loading, overrides, type checks and validation (no processes, no torch needed)."""

from __future__ import annotations

import tomllib

import pytest

from loom.config import Config, load_config, resolve_dims, to_toml, validate
from loom.errors import ConfigError


def test_defaults_are_the_quick_start_job():
    cfg = load_config()
    assert cfg.parallel.strategy == "zero3" and cfg.data.source == "stdlib" and cfg.model.preset == "small"


def test_toml_file_then_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[train]\nsteps = 7\nlr = 1\n[parallel]\nstrategy = "fsdp"\n')
    cfg = load_config(path, ["train.steps=9", 'data.source="a b.txt"', "parallel.offload=none"])
    assert cfg.train.steps == 9 and cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert cfg.parallel.strategy == "zero3"  # alias resolved
    assert cfg.data.source == "a b.txt"


@pytest.mark.parametrize("override,message", [
    ("train.stepz=3", "did you mean 'train.steps'"),
    ("train.strategy=ddp", "did you mean 'parallel.strategy'"),
    ("trian.steps=3", "did you mean 'train'"),
    ("train.steps=1.5", "train.steps must be int, got float"),
    ("train.steps=true", "train.steps must be int, got bool"),
    ("parallel.ddp_static_graph=3", "must be bool"),
    ("model.d_model=x", "model.d_model must be int"),
])
def test_bad_overrides(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(None, [override])


def test_unknown_key_in_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[parallel]\nstrategi = 'ddp'\n")
    with pytest.raises(ConfigError, match="did you mean 'parallel.strategy'"):
        load_config(path)


@pytest.mark.parametrize("strategy,world,expected", [
    ("ddp", 4, (4, 1)), ("zero1", 4, (4, 1)), ("zero2", 4, (1, 4)), ("zero3", 8, (1, 8)),
])
def test_dims_per_strategy(strategy, world, expected):
    dims = resolve_dims(load_config(None, [f"parallel.strategy={strategy}"]).parallel, world)
    assert (dims.dp_replicate, dims.dp_shard) == expected and dims.dp == world


def test_hsdp_dims():
    cfg = load_config(None, ["parallel.strategy=hsdp", "parallel.dp_replicate=2"])
    dims = resolve_dims(cfg.parallel, 8)
    assert (dims.dp_replicate, dims.dp_shard) == (2, 4)
    cfg.parallel.dp_shard = 3
    with pytest.raises(ConfigError, match="1 × 2 × 3 × 1 = 6 ≠ 8"):
        resolve_dims(cfg.parallel, 8)


@pytest.mark.parametrize("overrides,message", [
    (["parallel.strategy=zero9"], "did you mean 'zero3'"),
    (["train.grad_accum=0"], "train.grad_accum = 0 must be ≥ 1"),
    (["train.batch_size=12", "train.grad_accum=2"], "multiple of 8 such as 8, 16, 24"),
    (["parallel.strategy=zero1", "parallel.offload=cpu"], "needs a sharded strategy"),
    (["train.precision=fp8"], "train.precision"),
    (["parallel.strategy=zero1", "parallel.tp=2", "train.precision=fp16"], "does not take fp16 loss scaling"),
    (["parallel.tp=3"], "does not divide the world size 4"),
    (["parallel.tp=2", "parallel.sequence_parallel=true", "data.seq_len=33"], "divisible by 2"),
    (["parallel.activation_checkpointing=some"], "none, full, selective"),
])
def test_validation_errors_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate(load_config(None, overrides), 4, cuda_available=False)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_offload_refused_without_accelerator_allowed_with_one():
    cfg = load_config(None, ["parallel.offload=cpu"])
    with pytest.raises(ConfigError, match="needs an accelerator"):
        validate(cfg, 2, cuda_available=False)
    validate(cfg, 2, cuda_available=True)


def test_resolved_config_round_trips_through_toml(tmp_path):
    cfg = load_config(None, ["train.steps=5", "model.d_model=96", "parallel.strategy=hsdp"])
    path = tmp_path / "config.toml"
    path.write_text(to_toml(cfg))
    tomllib.loads(path.read_text())
    assert load_config(path) == cfg
    assert load_config(path) != Config()


@pytest.mark.parametrize("heads,kv,ffn,vocab,name", [(3, 1, 128, 256, "n_heads"),
                                                     (4, 1, 128, 256, "n_kv_heads"),
                                                     (4, 2, 129, 256, "ffn_hidden"),
                                                     (4, 2, 128, 255, "vocab_size")])
def test_tp_must_divide_every_split_dimension(heads, kv, ffn, vocab, name):
    from loom.parallel.tensor_parallel import check_tp_shapes

    with pytest.raises(ConfigError, match=f"does not divide model.{name}") as err:
        check_tp_shapes(heads, kv, ffn, vocab, 2)
    assert "\n" not in str(err.value)
