"""The planner's arithmetic, recorded as it is computed (issue 26): one source for the numbers and
their explanation.

The functions that price a candidate (plan/comm.py, step.py, memory.py) take a `Terms` and write into
it, beside each quantity they compute, a line naming it: its formula in symbols, the same formula
with this candidate's numbers, and the result. `loom plan --explain N` (plan/explain.py) prices the
candidate once more with a recording Terms and prints what was recorded; it computes nothing of its
own. The search prices thousands of candidates with NO_TERMS, which records nothing (and, being
false, spares the planner formatting its lines: `if terms: terms.item(...)`).
"""

from __future__ import annotations

import math

GB = 1e9


def num(x: float) -> str:
    """A number as the explanation prints it: integers exactly, others to 5 significant digits."""
    if x == 0:
        return "0"
    if float(x).is_integer() and abs(x) < 1e13:
        return f"{int(x):,}"
    return f"{x:.5g}"


def gb(x: float) -> str:
    return f"{num(x / GB)} GB"


def sec(x: float) -> str:
    return f"{num(x)} s"


class Terms:
    """The lines of an explanation, in the order the planner computed them."""

    recording = True

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __bool__(self) -> bool:
        """Whether lines are kept: the planner formats its lines only `if terms:`."""
        return self.recording

    def section(self, title: str) -> None:
        self.lines += ["", title]

    def note(self, text: str) -> None:
        self.lines.append(f"  {text}")

    def item(self, what: str, formula: str, numbers: str | None, result: str) -> None:
        """what: formula = numbers = result (numbers left out when they add nothing)."""
        middle = f" = {numbers}" if numbers and numbers != formula and numbers != result else ""
        self.lines.append(f"  {what:<24} {formula}{middle} = {result}")

    def check(self, parts: list[tuple[str, float]], total: float, expected: float, unit) -> bool:
        """`check: a x + b y = total; the record: expected ✓`: the recorded parts add up to what the
        candidate's record holds (✗ when they do not: a term priced but not recorded, or twice)."""
        ok = math.isclose(total, expected, rel_tol=1e-9, abs_tol=1e-12 * max(1.0, abs(expected)))
        added = math.isclose(sum(v for _, v in parts), total, rel_tol=1e-9, abs_tol=1e-12)
        text = " + ".join(f"{name} {unit(v)}" for name, v in parts) or "nothing"
        mark = "✓" if ok and added else "✗ (this explanation and the planner disagree)"
        self.lines.append(f"  check: {text} = {unit(total)}; the record: {unit(expected)} {mark}")
        return ok and added


class _NoTerms(Terms):
    """What the search passes: every line dropped."""

    recording = False

    def section(self, title: str) -> None:
        pass

    def note(self, text: str) -> None:
        pass

    def item(self, what: str, formula: str, numbers: str | None, result: str) -> None:
        pass

    def check(self, parts, total, expected, unit) -> bool:
        return True


NO_TERMS = _NoTerms()
