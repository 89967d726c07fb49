"""The README is tested: every command block is either run (tests/distributed/test_readme_commands.py,
tiny sizes substituted), a usage synopsis whose every flag exists, or named here with the test that
covers it; every `loom ...` in the prose parses, with config keys that exist; every `see "X"
above/below` points at a section that is there."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
import readme

from loom.cli import build_parser
from loom.config import load_config

ROOT = Path(__file__).resolve().parents[2]

# Blocks the README test runs, by their first command (tests/distributed/test_readme_commands.py).
RUN = {
    "bash install.sh && loom train": "the quick start: `loom train` on its default (CI runs install.sh)",
    "python examples/make_tiny_llama.py models/tiny-llama data": "the fine-tune walk-through",
    "loom data prepare data/corpus.jsonl data/prepared --tokenizer models/tiny-llama":
        "continued pre-training",
    readme.LORA_BLOCK: "LoRA fine-tuning from the walk-through's Llama, exported both ways",
}
# Blocks run elsewhere, or by tools outside loom: first command → why it is not run here.
ELSEWHERE = {
    "python -m pytest": "the test command itself (CI runs it)",
    "python -m torch.distributed.run --standalone --nproc-per-node 4 examples/hf_llama.py":
        "tests/distributed/test_init_from.py runs examples/hf_llama.py",
    "loom train --nproc 2 --set model.preset=tiny-moe --set parallel.ep=2 --set train.steps=20":
        "tests/distributed/test_moe_ranks.py trains this layout (ep2-zero3-units) against one process",
    "tensorboard --logdir RUN_DIR/tensorboard":
        "TensorBoard's own command (tests/unit/test_tracking.py reads the events)",
}


def test_every_command_block_is_run_read_or_accounted_for():
    for block in readme.blocks():
        if block.synopsis:
            continue
        first = block.commands[0]
        assert first in RUN or first in ELSEWHERE, (
            f"README line {block.line}: a new command block ({first!r}); run it in "
            f"tests/distributed/test_readme_commands.py (add it to RUN) or say in ELSEWHERE what covers it")
    firsts = {b.commands[0] for b in readme.blocks()}
    assert not (set(RUN) | set(ELSEWHERE)) - firsts, "a listed block is no longer in the README"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _options(words: list[str]) -> set[str]:
    """The options of `loom WORDS...` (a subcommand, or `data prepare`)."""
    if words[0] == "bench":  # bench parses its own arguments (bench/suite.py)
        return set(re.findall(r'add_argument\(\s*"(--[\w-]+)"', (ROOT / "bench" / "suite.py").read_text()))
    parser = _subparsers(build_parser())[words[0]]
    if words[0] == "data":
        parser = _subparsers(parser)[words[1]]
    return {s for a in parser._actions for s in a.option_strings}


def test_every_flag_of_a_usage_synopsis_exists():
    synopses = [c for b in readme.blocks() if b.synopsis for c in b.commands]
    assert len(synopses) >= 6
    for command in synopses:
        for usage in command.split(" / "):  # `loom profile ... / loom analyze ...`
            words = usage.split()
            assert words[0] == "loom", usage
            flags = set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", usage))
            missing = flags - _options(words[1:])
            assert not missing, f"README: `{usage}` names {sorted(missing)}, not options of loom {words[1]}"


def _parse(command: str) -> None:
    words = readme.argv(command)
    if words[0] == "bench":
        return
    args = build_parser().parse_args(words)
    if getattr(args, "set", None):
        load_config(None, args.set)  # every key exists and every value is its type


def _is_mention(error: str) -> bool:
    """`loom export` or `loom train --resume` in a sentence: a command's (or flag's) name, its
    arguments left out."""
    return "arguments are required" in error or re.search(r"expected (one|\d+) argument", error) is not None


@pytest.mark.parametrize("line, command", readme.inline_commands(), ids=lambda x: str(x))
def test_every_command_in_the_prose_parses(line, command, capsys):
    """A whole command parses (and its --set keys exist); a mention names a command and flags that
    exist."""
    try:
        _parse(command)
    except SystemExit:
        error = capsys.readouterr().err.strip()
        assert _is_mention(error), f"README line {line}: `{command}` does not parse: {error}"
        words = readme.argv(command)
        flags = {w for w in words if w.startswith("--")}
        assert flags <= _options(words), f"README line {line}: `{command}` names a flag loom does not take"


def test_run_blocks_parse():
    for block in readme.blocks():
        if block.synopsis or block.commands[0] not in RUN:
            continue
        for command in block.commands:
            for part in command.split(" && "):
                if part.startswith("loom "):
                    _parse(part)


def test_every_see_points_at_a_section_where_it_says():
    titles = readme.headings()
    refs = readme.cross_references()
    assert len(refs) >= 5
    for line, title, direction in refs:
        assert title in titles, f'README line {line}: see "{title}", but no section has that title'
        if direction:
            actual = "above" if titles[title] < line else "below"
            assert actual == direction, f'README line {line}: see "{title}" {direction}, but it is {actual}'
