"""Planted bugs: plausible one-line mistakes, each with the tests that must catch it.

`python tests/planted_bugs.py` applies each bug to a scratch copy of the repository and runs its
tests there; a bug whose tests all pass is a hole in the suite. Bugs are listed by area in this
package's modules (each defines `BUGS: list[Bug]`); the runner collects them all.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bug:
    id: str            # a short slug: zero3-as-zero2
    what: str          # the mistake, in words
    file: str          # repository-relative path of the file the bug edits
    old: str           # text that occurs exactly once in that file
    new: str           # what it becomes
    tests: tuple[str, ...]  # pytest node ids (or files) that must fail with the bug in place
