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
    with pytest.raises(ConfigError, match="1 × 2 × 3 × 1 × 1 = 6 ≠ 8"):
        resolve_dims(cfg.parallel, 8)


@pytest.mark.parametrize("overrides,message", [
    (["parallel.strategy=zero9"], "did you mean 'zero3'"),
    (["train.grad_accum=0"], "train.grad_accum = 0 must be ≥ 1"),
    (["train.batch_size=12", "train.grad_accum=2"], "multiple of 8: 8 or 16"),
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
    from loom.layout import check_tp_shapes

    with pytest.raises(ConfigError, match=f"does not divide model.{name}") as err:
        check_tp_shapes(heads, kv, ffn, vocab, 2)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------
# Every field's type and range (loom.config.RULES)


def _fields() -> list[tuple[str, object]]:
    import dataclasses
    import typing

    out = []
    for section in dataclasses.fields(Config):
        for key, hint in typing.get_type_hints(type(getattr(Config(), section.name))).items():
            out.append((f"{section.name}.{key}", hint))
    return out


def _kind(hint) -> type:
    import typing

    if typing.get_origin(hint) is list:
        return list
    args = [a for a in typing.get_args(hint) if a is not type(None)]  # `int | None`: int
    return args[0] if args else hint


# Fields whose values the table leaves to another check, and which one.
OPEN = {"model.preset": "loom/models/gpt/config.py preset()",
        "data.mix": "config._check_mix (sources, weights) and loom/data/mix.py parse_mix (keys)"}


def test_every_field_has_a_rule_or_is_a_bool():
    from loom.config import RULES

    missing = [path for path, hint in _fields() if _kind(hint) is not bool and path not in RULES
               and path not in OPEN]
    assert not missing, f"fields without a range or choice in loom.config.RULES: {missing}"
    assert set(RULES) <= {path for path, _ in _fields()}


NUMBERS = [(path, hint) for path, hint in _fields() if _kind(hint) in (int, float)]


@pytest.mark.parametrize("path", [p for p, h in NUMBERS if _kind(h) is float])
@pytest.mark.parametrize("literal", ["inf", "-inf", "nan"])
def test_every_float_field_refuses_non_finite_values_from_set_and_toml(path, literal, tmp_path):
    with pytest.raises(ConfigError, match=rf"^{path} = .* must be a finite number"):
        load_config(None, [f"{path}={literal}"])
    section, key = path.split(".")
    toml = tmp_path / "run.toml"
    toml.write_text(f"[{section}]\n{key} = {literal}\n")  # TOML's own literals
    with pytest.raises(ConfigError, match=rf"run.toml: {path} = .* must be a finite number"):
        load_config(toml)


@pytest.mark.parametrize("path", [p for p, _ in NUMBERS])
def test_every_number_field_takes_its_bounds_and_refuses_beyond_them(path):
    from loom.config import RULES

    rule = RULES[path]
    float_field = _kind(dict(NUMBERS)[path]) is float
    step = 1e-9 if float_field else 1
    for bound, outside, closed in ((rule.low, -step, not rule.above), (rule.high, step, not rule.below)):
        if bound is None:
            continue
        value = bound if closed else bound - outside
        assert _read_back(load_config(None, [f"{path}={value!r}"]), path) == value
        with pytest.raises(ConfigError, match=rf"^{path} = "):
            load_config(None, [f"{path}={(bound + outside if closed else bound)!r}"])


def _read_back(cfg, path):
    section, key = path.split(".")
    return getattr(getattr(cfg, section), key)


def test_an_integer_too_big_for_a_float_is_refused_as_a_float_field():
    with pytest.raises(ConfigError, match="train.lr = 1000.* must be a finite number"):
        load_config(None, ["train.lr=1" + "0" * 400])


def test_the_seed_range_is_what_every_rng_loom_seeds_takes():
    import numpy as np
    import torch

    from loom.config import MAX_SEED, RULES

    assert (RULES["train.seed"].low, RULES["train.seed"].high) == (0, MAX_SEED) == (0, 2**32 - 1)
    torch.manual_seed(MAX_SEED)  # the driver
    a = np.random.default_rng(MAX_SEED + 7).permutation(5)  # the loader: seed + epoch
    b = np.random.default_rng([MAX_SEED, 1]).random()  # the mix: [seed, stream]
    assert sorted(a.tolist()) == [0, 1, 2, 3, 4] and 0 <= b < 1
    with pytest.raises(ValueError):
        np.random.default_rng(-1)  # what seed = -1 did in a rank


@pytest.mark.parametrize("path", [p for p, _ in _fields() if _kind(_) is str and p not in OPEN])
def test_every_string_field_refuses_blank_or_unknown_values(path):
    from loom.config import RULES

    rule = RULES[path]
    bad = ["bogus-choice"] if rule.choices else ["   ", "a\x00b"] + ([] if rule.optional else [""])
    for value in bad:
        with pytest.raises(ConfigError, match=rf"^{path} = "):
            load_config(None, [f"{path}={json_str(value)}"])
    if rule.optional:
        assert _read_back(load_config(None, [f'{path}=""']), path) == ""


def json_str(value: str) -> str:
    import json

    return json.dumps(value)


def test_the_checks_also_run_on_a_config_built_in_python():
    cfg = Config()
    cfg.train.lr = float("inf")
    with pytest.raises(ConfigError, match="train.lr = inf must be a finite number > 0"):
        validate(cfg, 1, cuda_available=False)
    cfg = Config()
    cfg.train.seed = "7"
    with pytest.raises(ConfigError, match="train.seed must be int, got str '7'"):
        validate(cfg, 1, cuda_available=False)


def test_a_mix_weight_and_source_are_checked():
    ok = load_config(None, ['data.mix=[{source = "a.txt", weight = 2}]', "train.device=cpu"])
    validate(ok, 1, cuda_available=False)
    for entry, message in (('{source = "a.txt", weight = nan}', r"weight = nan must be a finite number > 0"),
                           ('{source = "a.txt", weight = 0}', r"weight = 0 must be a finite number > 0"),
                           ('{source = " ", weight = 1}', r"source = ' ' must name")):
        with pytest.raises(ConfigError, match=r"^data.mix\[0\] " + message):
            validate(load_config(None, [f"data.mix=[{entry}]"]), 1, cuda_available=False)


def test_to_toml_round_trips_non_finite_floats_as_toml_literals():
    import math

    text = to_toml({"train": {"lr": float("inf"), "grad_clip": float("nan")}, "steps": 3})
    parsed = tomllib.loads(text)
    assert parsed["steps"] == 3 and parsed["train"]["lr"] == math.inf
    assert math.isnan(parsed["train"]["grad_clip"])
    assert text.startswith("steps = 3\n[train]\nlr = inf\ngrad_clip = nan\n")


# ---------------------------------------------------------------------------------------------
# The device and the model's size, before any rank starts


def test_cuda_refused_where_there_is_none_and_accepted_where_there_is():
    cfg = load_config(None, ["train.device=cuda"])
    with pytest.raises(ConfigError, match="train.device = 'cuda' but no CUDA device is visible; this machine "
                                          "trains on the CPU: set train.device=cpu"):
        validate(cfg, 1, cuda_available=False)
    validate(cfg, 4, cuda_available=True)


def test_cuda_asks_torch_when_not_told(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="train.device = 'cuda' but "):
        validate(load_config(None, ["train.device=cuda"]), 1)


def test_a_model_too_big_for_the_machine_is_refused_from_its_shape_alone():
    import os
    import time

    from loom.models.gpt.config import preset

    shape = ["model.preset=tiny", "model.d_model=131072", "model.n_layers=1024", "model.ffn_hidden=1048576"]
    params = preset("tiny", d_model=131072, n_layers=1024, ffn_hidden=1048576).num_params()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 4 * params > 100 * memory  # far beyond any machine this runs on
    start = time.monotonic()
    with pytest.raises(ConfigError, match=f"the model has {params:,} parameters"):
        validate(load_config(None, [*shape, "train.device=cpu"]), 1, cuda_available=False)
    assert time.monotonic() - start < 1.0  # arithmetic, nothing built
    # sharded over enough ranks, the same shape is not refused for its size
    ranks = 2 ** ((16 * params // memory).bit_length() + 1)  # zero3: 16 bytes a parameter, all sharded
    cfg = load_config(None, [*shape, "train.device=cpu", f"train.batch_size={ranks}"])
    validate(cfg, ranks, cuda_available=False)
    validate(load_config(None, shape), 1, cuda_available=False, this_machine=False)  # the planner's


# ---------------------------------------------------------------------------------------------
# DeepSpeed JSON: what loom derives is refused, everything else is DeepSpeed's to check

DS_TUNABLE = {"zero_optimization.overlap_comm", "zero_optimization.contiguous_gradients",
              "zero_optimization.sub_group_size", "zero_optimization.offload_optimizer.pin_memory",
              "zero_optimization.offload_param.pin_memory", "fp16.initial_scale_power", "steps_per_print",
              "wall_clock_breakdown"}


def _leaves(doc: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in doc.items():
        path = f"{prefix}{key}"
        out += _leaves(value, path + ".") if isinstance(value, dict) else [path]
    return out


def _ds_cfg(tmp_path, user: dict | None, *overrides: str):
    import json

    sets = ["parallel.engine=deepspeed", "train.device=cpu", *overrides]
    if user is not None:
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(user))
        sets.append(f'parallel.deepspeed_config="{path}"')
    return load_config(None, sets)


def test_every_deepspeed_key_loom_derives_is_refused_in_a_users_json(tmp_path):
    pytest.importorskip("deepspeed")
    from loom.config import DEEPSPEED_DERIVED
    from loom.parallel.deepspeed_engine import deepspeed_config

    cfg = _ds_cfg(tmp_path, None, "parallel.strategy=zero3", "parallel.offload_optimizer=nvme",
                  "parallel.offload_params=nvme", f'parallel.nvme_path="{tmp_path}"')
    derived = _leaves(deepspeed_config(cfg, 2))
    untracked = [k for k in derived if k not in DS_TUNABLE
                 and not any(k == d or k.startswith(d + ".") for d in DEEPSPEED_DERIVED)]
    assert not untracked, f"keys loom derives but lets a user's JSON replace: {untracked}"
    for key, ours in DEEPSPEED_DERIVED.items():
        user: dict = {}
        node = user
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = 3
        with pytest.raises(ConfigError, match=f"ds.json: {key} = 3 is loom's to set, from ") as e:
            validate(_ds_cfg(tmp_path, user, "parallel.strategy=zero2"), 1, cuda_available=False)
        assert f"set {ours} instead" in str(e.value)


def test_a_users_deepspeed_tunables_merge_under_loom_s_own_keys(tmp_path):
    pytest.importorskip("deepspeed")
    from loom.parallel.deepspeed_engine import deepspeed_config

    user = {"zero_optimization": {"overlap_comm": False, "stage3_prefetch_bucket_size": 1000},
            "fp16": {"loss_scale_window": 50}, "steps_per_print": 7}
    cfg = _ds_cfg(tmp_path, user, "parallel.strategy=zero3", "train.batch_size=8", "train.grad_accum=2")
    validate(cfg, 2, cuda_available=False)
    ds = deepspeed_config(cfg, 2)
    assert ds["zero_optimization"]["stage"] == 3 and ds["zero_optimization"]["overlap_comm"] is False
    assert ds["zero_optimization"]["stage3_prefetch_bucket_size"] == 1000
    assert (ds["train_batch_size"], ds["gradient_accumulation_steps"], ds["steps_per_print"]) == (8, 2, 7)
    assert ds["fp16"] == {"enabled": False, "initial_scale_power": 16, "loss_scale_window": 50}


def test_the_engine_reads_the_json_through_the_same_check(tmp_path):
    """In the ranks too (a JSON changed since the launcher checked it): loom's keys stay loom's."""
    pytest.importorskip("deepspeed")
    from loom.parallel.deepspeed_engine import deepspeed_config

    cfg = _ds_cfg(tmp_path, {"zero_optimization": {"stage": 3}}, "parallel.strategy=ddp")
    with pytest.raises(ConfigError, match="zero_optimization.stage = 3 is loom's to set, from parallel.str"):
        deepspeed_config(cfg, 2)


# ---------------------------------------------------------------------------------------------
# An error a rank raises on its own: left for the launcher, torchrun ended before it reports


def _rank_under_a_parent(tmp_path, **env: str):
    """A stand-in for torchrun (a parent process that waits for its one rank, then would print its
    report) and the rank, which calls end_launch: never in the test's own process, whose parent
    end_launch would end."""
    import os
    import subprocess
    import sys

    rank = ("from loom.launch import end_launch; "
            "print('returned', end_launch('checkpoint x could not be read'))")
    parent = ("import subprocess, sys; subprocess.run([sys.executable, '-c', sys.argv[1]]); "
              "print('torchrun would report here')")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "LOOM_REPORT"))}
    return subprocess.run([sys.executable, "-c", parent, rank], capture_output=True, text=True, timeout=60,
                          env={**base, **env})


def test_end_launch_leaves_the_error_and_ends_its_parent_at_once(tmp_path):
    import signal

    report = tmp_path / "report"
    r = _rank_under_a_parent(tmp_path, LOOM_REPORT_FILE=str(report))
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stdout, r.stderr)
    assert "report here" not in r.stdout and "returned" not in r.stdout
    assert report.read_text() == "checkpoint x could not be read"
    assert list(tmp_path.iterdir()) == [report]  # the temporary file was renamed, not left


def test_end_launch_leaves_restarts_to_torchrun_and_srun_ranks_to_themselves(tmp_path):
    report = tmp_path / "report"
    for env in ({"LOOM_REPORT_FILE": str(report), "TORCHELASTIC_MAX_RESTARTS": "2",
                 "TORCHELASTIC_RESTART_COUNT": "1"},  # torchrun restarts the group: the rank prints it
                {}):  # srun started the rank: no launcher to leave it for
        r = _rank_under_a_parent(tmp_path, **env)
        assert r.returncode == 0, (r.stdout, r.stderr)
        assert r.stdout.split("\n")[:2] == ["returned False", "torchrun would report here"]
        assert not report.exists()
