"""The README's commands, as a reader finds them: indented command blocks (one command per line,
a trailing backslash continuing it) and `loom ...` in backticks within the prose. The tests that
keep the README true (tests/unit/test_readme.py, tests/distributed/test_readme_commands.py) read
them from here, so a command added to or changed in the README is a command tested."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# The pages a user reads: README and the docs pages it links (bad-input, calibration, security and
# architecture hold no `loom` commands to check).
DOCS = [ROOT / "docs" / f"{name}.md" for name in (
    "strategies", "memory", "long-context", "moe", "planner", "observability", "lora", "muon", "hugging-face",
    "checkpoints", "data", "config")]
PAGES = [README, *DOCS]


def text() -> str:
    """Every user page's text, for the tests that check a sentence wherever it now lives."""
    return "\n".join(page.read_text(encoding="utf-8") for page in PAGES)


@dataclass(frozen=True)
class Block:
    line: int                 # where it starts in its page (1-based)
    commands: tuple[str, ...]  # each with its continuation lines joined
    page: Path = README

    @property
    def text(self) -> str:
        return "\n".join(self.commands)

    @property
    def synopsis(self) -> bool:
        """A usage line ([optional] arguments, a|b choices), to read, not to run."""
        return any(re.search(r"\[(--|[A-Z]|\.\.\.)|\w\|\w", c) for c in self.commands)


def _lines(page: Path = README) -> list[str]:
    return page.read_text(encoding="utf-8").splitlines()


def blocks() -> list[Block]:
    """Every indented block of every page (a paragraph each of whose lines starts with 4 spaces)."""
    return [b for page in PAGES for b in _blocks(page)]


def _blocks(page: Path) -> list[Block]:
    lines, found, i = _lines(page), [], 0
    while i < len(lines):
        starts = lines[i].startswith("    ") and lines[i].strip() and (i == 0 or not lines[i - 1].strip())
        if not starts:
            i += 1
            continue
        first, body = i, []
        while i < len(lines) and lines[i].startswith("    "):
            body.append(lines[i][4:])
            i += 1
        commands, current = [], ""
        for text in body:
            if text.startswith(" ") and commands and not current:  # a usage line's continuation
                commands[-1] += " " + text.strip()
                continue
            current += text.strip() if current else text.rstrip()
            if current.endswith("\\"):
                current = current[:-1].rstrip() + " "
                continue
            commands.append(current)
            current = ""
        found.append(Block(first + 1, tuple(commands), page))
    return found


def inline_commands() -> list[tuple[str, str]]:
    """`loom ...` in backticks in the prose of every page: ("page:line", command)."""
    found = []
    for page in PAGES:
        for n, line in enumerate(_lines(page), 1):
            if not line.startswith("    "):
                found += [(f"{where(page)}:{n}", m) for m in re.findall(r"`(loom [^`]+)`", line)]
    return found


def where(page: Path) -> str:
    """A page's path from the repository root, for messages."""
    return str(page.relative_to(ROOT))


def argv(command: str) -> list[str]:
    """A command line's words after `loom`, a trailing `# comment` dropped."""
    words = shlex.split(command, comments=True)
    assert words[0] == "loom", command
    return words[1:]


def headings(page: Path = README) -> dict[str, int]:
    """Each section's title → its line: a heading, its part before a colon ("Planning" of
    "Planning: `loom plan`"), and a paragraph's bold lead-in (**This machine.**)."""
    found = {}
    for n, line in enumerate(_lines(page), 1):
        if line.startswith("#"):
            title = line.lstrip("#").strip()
            found.setdefault(title, n)
            found.setdefault(title.partition(":")[0].strip(), n)
        elif m := re.match(r"\*\*([^*]+?)\.?\*\*", line):
            found.setdefault(m.group(1), n)
            found.setdefault(m.group(1).partition(":")[0].strip(), n)
    return found


def cross_references(page: Path = README) -> list[tuple[int, str, str]]:
    """`see "Title" above|below` in a page, the title possibly wrapped across lines:
    (line, title, direction or "")."""
    text = page.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split()), m.group(2) or "")
            for m in re.finditer(r'see "([^"]+)"\s*(above|below)?', text)]


# The LoRA block (docs/lora.md), by its first command (run by tests/distributed/test_readme_commands.py).
LORA_BLOCK = ("loom train --out runs/lora --set model.init_from=models/tiny-llama "
              "--set data.source=data/sft.jsonl --set data.format=sft --set data.seq_len=64 "
              "--set lora.rank=16 --set lora.alpha=32")
