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
    "loom plan --model 8b --gpu H100-SXM --set data.seq_len=131072 --set train.batch_size=8":
        "long context: plan 8B at 128k tokens, train with cp 2",
    "loom profile --out runs/zero3": "observability: profile two layouts and compare them",
}
# Blocks run elsewhere, or by tools outside loom: first command → why it is not run here.
ELSEWHERE = {
    "python -m pytest -n auto": "the test command itself (CI runs it)",
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
            f"{readme.where(block.page)}:{block.line}: a new command block ({first!r}); run it in "
            f"tests/distributed/test_readme_commands.py (add it to RUN) or say in ELSEWHERE what covers it")
    firsts = {b.commands[0] for b in readme.blocks()}
    assert not (set(RUN) | set(ELSEWHERE)) - firsts, "a listed block is no longer in any page"


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
        assert _is_mention(error), f"{line}: `{command}` does not parse: {error}"
        words = readme.argv(command)
        flags = {w for w in words if w.startswith("--")}
        assert flags <= _options(words), f"{line}: `{command}` names a flag loom does not take"


def test_run_blocks_parse():
    for block in readme.blocks():
        if block.synopsis or block.commands[0] not in RUN:
            continue
        for command in block.commands:
            for part in command.split(" && "):
                if part.startswith("loom "):
                    _parse(part)


def test_every_see_points_at_a_section_where_it_says():
    """A bare `see "X"` names a section of its own page (above/below true, when given); a section
    of another page is reached by a link, which the link test checks."""
    refs = [(page, *ref) for page in readme.PAGES for ref in readme.cross_references(page)]
    assert refs
    for page, line, title, direction in refs:
        titles = readme.headings(page)
        at = f"{readme.where(page)}:{line}"
        assert title in titles, f'{at}: see "{title}", but no section of this page has it (link the page)'
        if direction:
            actual = "above" if titles[title] < line else "below"
            assert actual == direction, f'{at}: see "{title}" {direction}, but it is {actual}'


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, spaces to '-', punctuation but '-' and '_' dropped."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_slug_is_githubs():
    assert _slug("Planning: `loom plan`") == "planning-loom-plan"
    assert _slug("Checkpoints, resume and faults") == "checkpoints-resume-and-faults"


def test_every_relative_link_points_at_a_file_and_heading_that_exist():
    links = 0
    for page in readme.PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):  # http(s):, mailto:
                continue
            links += 1
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            assert file.exists(), f"{readme.where(page)}: link to {target}, no such file"
            if anchor:
                lines = file.read_text(encoding="utf-8").splitlines()
                slugs = {_slug(line.lstrip("#")) for line in lines if line.startswith("#")}
                slugs |= {m for line in lines for m in re.findall(r'<a id="([^"]+)">', line)}
                assert anchor in slugs, f"{readme.where(page)}: link to {target}, no such heading"
    assert links >= 10


def test_every_docs_page_is_linked_from_the_readme():
    text = readme.README.read_text(encoding="utf-8")
    for page in sorted((readme.ROOT / "docs").glob("*.md")):
        assert f"(docs/{page.name})" in text, f"README does not link docs/{page.name}"
