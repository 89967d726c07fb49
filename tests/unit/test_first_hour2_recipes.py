"""examples/recipes/: each recipe's layout is checked by `loom plan` for the cluster its header names
(`# check: loom plan RECIPE --gpu … --gpus-per-node … [--nodes …] [--model …]`): it fits under the
planner's headroom rule, and the figures its header states (`# planned: LABEL, X GB per GPU of Y
GB, N tokens/s`) are the planner's within a tolerance, so a planner change that invalidates a
recipe fails here; where the header says `# recommended by: loom plan …`, that search recommends it.
Its step count is its stated token budget over its tokens a step, its data are placeholders (never
the CPU demo's corpus) that `loom train` refuses, and the commands it gives to run it set them and
parse. (Each also trains at a tiny size on CPU ranks: tests/distributed/test_recipes_tiny.py.)"""

from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path

import pytest

from loom.cli import build_parser, main
from loom.config import DataConfig, is_placeholder, load_config, validate
from loom.errors import ConfigError
from loom.plan.command import checked_config, cluster_of, model_shape, planned_precision, workload_of
from loom.plan.search import TIGHT, config_candidate, estimate

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "examples" / "recipes"
NAMES = ["llama3-70b-3d", "llama3-70b-lora", "llama3-8b-128k-context", "llama3-8b-fsdp",
         "llama3-8b-offload-1gpu", "mixtral-8x7b-ep"]
PLANNED = re.compile(r"^# planned: (.+), ([\d.]+) GB per GPU of (\d+) GB, ([\d,]+) tokens/s$", re.M)
CHECK = re.compile(r"^# check: (loom plan .+)$", re.M)
RECOMMENDED = re.compile(r"^# recommended by: (loom plan .+)$", re.M)
BUDGET = re.compile(r"^# token budget: ([\d.e]+) tokens = train.steps × batch_size × seq_len$", re.M)
# The header's figures against the planner's: rounding (0.1 GB, 1 token/s) passes, a real change
# of the plan (1% of memory or speed) does not.
TOLERANCE = 0.005


def header(name: str) -> dict:
    text = (RECIPES / f"{name}.toml").read_text()
    (label, gb, of_gb, tokens), = PLANNED.findall(text)
    (check,), (budget,) = CHECK.findall(text), BUDGET.findall(text)
    return {"label": label, "gb": float(gb), "of_gb": float(of_gb),
            "tokens_per_s": float(tokens.replace(",", "")), "check": check, "budget": float(budget),
            "recommended_by": RECOMMENDED.findall(text)}


def priced(command: str) -> tuple[dict, object, object]:
    """What `loom plan RECIPE …` prints as "your config": the recipe's own layout priced on its own
    batch for the named cluster (loom/plan/command.py's run, without the search of every layout).
    Returns (the estimate, the config, the cluster)."""
    args = build_parser().parse_args(shlex.split(command)[1:])
    cfg = load_config(args.config, args.set)
    cluster = cluster_of(args, cfg)
    precision = planned_precision(cfg, local=False)
    dims = checked_config(cfg, cluster, precision if cfg.lora.rank is not None else None)
    shape = model_shape(cfg, args.model, args.params)
    workload, origin = workload_of(args, cfg, shape, args.model, cluster.world_size, precision)
    assert origin.startswith("the config's batch"), origin  # planned on the recipe's own batch
    candidate = config_candidate(cfg, dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp)
    return estimate(workload, candidate, cluster), cfg, cluster


def test_the_recipes_are_the_six_the_readme_lists():
    assert sorted(p.stem for p in RECIPES.glob("*.toml")) == NAMES
    listed = (RECIPES / "README.md").read_text()
    assert all(f"{name}.toml" in listed for name in NAMES)


def test_the_recipes_table_quotes_each_header():
    """The table's "planned per GPU" and tokens/s are its recipe's header's (which the planner checks
    above), so neither can drift alone."""
    rows = re.findall(r"^\| \[([\w-]+)\.toml\].*\| ([\d.]+) GB \| ([\d,]+) \|$",
                      (RECIPES / "README.md").read_text(), re.M)
    assert sorted(name for name, _, _ in rows) == NAMES
    for name, gb, tokens in rows:
        said = header(name)
        assert (float(gb), float(tokens.replace(",", ""))) == (said["gb"], said["tokens_per_s"]), name


@pytest.mark.parametrize("name", NAMES)
def test_recipe_fits_as_its_header_says(name, monkeypatch):
    monkeypatch.chdir(ROOT)  # the header's command names the recipe from the repository's root
    said = header(name)
    assert shlex.split(said["check"])[2] == f"examples/recipes/{name}.toml"  # it checks itself
    got, cfg, cluster = priced(said["check"])
    capacity = cluster.gpu.memory_gb * 1e9
    total = got["memory_bytes"]["total"]
    assert got["fits"], (name, got["why_not"])
    assert total <= TIGHT * capacity, (name, total / 1e9, "GB: over the planner's headroom rule")
    assert got["label"] == said["label"], (name, got["label"])
    assert said["of_gb"] == cluster.gpu.memory_gb
    assert total / 1e9 == pytest.approx(said["gb"], rel=TOLERANCE), name
    assert got["tokens_per_s"] == pytest.approx(said["tokens_per_s"], rel=TOLERANCE), name


RECOMMENDED_RECIPES = [name for name in NAMES if name != "llama3-70b-3d"]  # 3-D: the planner adds cp


@pytest.mark.parametrize("name", RECOMMENDED_RECIPES)
def test_recipe_is_what_its_plan_command_recommends(name, capsys):
    """A header's `# recommended by: loom plan …` (a bare model on the recipe's cluster, the planner's
    own workload) recommends the recipe's layout: the search of every layout agrees with the recipe."""
    said = header(name)
    (command,) = said["recommended_by"]
    assert main([*shlex.split(command)[1:], "--format", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    best = plan["candidates"][plan["recommended"]]
    assert best["label"] == said["label"], (name, best["label"], plan["reason"])
    assert best["memory_bytes"]["total"] / 1e9 == pytest.approx(said["gb"], rel=TOLERANCE), name


def run_commands(name: str) -> list[str]:
    """The header's commands that run the recipe (`loom train …`, `sbatch …`), continuation lines
    joined."""
    lines = [line[1:].strip() for line in (RECIPES / f"{name}.toml").read_text().splitlines()
             if line.startswith("#")]
    joined = " ".join(line[:-1].strip() if line.endswith("\\") else line + "\n" for line in lines)
    return [m.group(1) for m in re.finditer(r"((?:loom train|sbatch) [^\n]+)", joined)]


@pytest.mark.parametrize("name", NAMES)
def test_recipe_run_commands_parse(name, monkeypatch):
    """Each command a header gives to run the recipe names it, parses as `loom train` does, and its
    --set keys exist (with them, the placeholders are set and the config loads)."""
    monkeypatch.chdir(ROOT)
    commands = run_commands(name)
    assert any(c.startswith("loom train") for c in commands), commands
    for command in commands:
        words = shlex.split(command.replace("$NODE", "0"))  # each node's number
        if words[0] == "sbatch":  # sbatch [options] SCRIPT CONFIG [loom train's options]
            words = ["loom", "train", *words[words.index("examples/slurm/train.sbatch") + 1:]]
        args = build_parser().parse_args(words[1:])
        assert args.command == "train" and args.config == f"examples/recipes/{name}.toml", command
        cfg = load_config(args.config, args.set)
        unset = [v for v in (cfg.data.source, cfg.data.tokenizer, cfg.model.init_from) if is_placeholder(v)]
        assert not unset, (command, unset)  # the command sets every placeholder


@pytest.mark.parametrize("name", NAMES)
def test_recipe_steps_come_from_its_token_budget(name):
    said = header(name)
    cfg = load_config(RECIPES / f"{name}.toml", [])
    per_step = cfg.train.batch_size * cfg.data.seq_len
    assert cfg.train.steps == math.ceil(said["budget"] / per_step), (name, said["budget"] / per_step)
    assert cfg.train.warmup_steps < cfg.train.steps // 5  # a warmup, not most of the run


@pytest.mark.parametrize("name", NAMES)
def test_recipe_data_are_placeholders_not_the_demo(name, monkeypatch):
    """A copied recipe never trains on the CPU demo's corpus (the standard library) or its byte
    tokenizer: the data, and the tokenizer or the base model it comes from, are `<your …>`
    placeholders, and `loom train` refuses the recipe as copied in one line naming data.source."""
    monkeypatch.chdir(ROOT)
    cfg = load_config(RECIPES / f"{name}.toml", [])
    assert cfg.data.source != DataConfig.source and is_placeholder(cfg.data.source), cfg.data.source
    tokenizer_from = cfg.model.init_from if cfg.data.tokenizer == "auto" else cfg.data.tokenizer
    assert is_placeholder(tokenizer_from), (name, tokenizer_from)
    assert cfg.train.precision == "bf16" and cfg.train.lr < 1e-3  # not the demo's fp32 and 3e-3
    world = priced(header(name)["check"])[2].world_size
    with pytest.raises(ConfigError, match=r"^data\.source = '<your .*--set data\.source=PATH$"):
        validate(cfg, world, cuda_available=True)
