"""The bad-input catalogue's harness (docs/bad-input.md): its rows, the context a case runs in,
and the registry `@case` fills.

Cases live in tests/unit/test_bad_input.py and in tests/unit/bad_input_cases_*.py (one module an
area, imported by test_bad_input.py); each produces a bad input for real (through
`loom.cli.main` or `load_config` + `validate`) and returns loom's one-line message.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

import loom.cli
import loom.launch
from loom.config import load_config, validate
from loom.errors import ConfigError

# Imported now, not inside a case: loom.train.meters binds `sys.stderr` as a default argument when
# first imported, and a case's capsys stream is closed once that case ends.
from loom.train import driver as _driver  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "bad-input.md"

# Every `loom train` case starts from a small valid run and adds the bad input after it (later
# --set values win): the tiny model on a small text corpus, so loading data takes milliseconds.
TINY = ["--set", "model.preset=tiny", "--set", "data.seq_len=32", "--set", "train.batch_size=4",
        "--set", "data.num_workers=0", "--set", "train.device=cpu", "--set", "parallel.strategy=ddp"]


# ---------------------------------------------------------------------------------------------
# The catalogue: every row of every `| id | input | message |` table in docs/bad-input.md


@dataclass
class Row:
    id: str
    input: str
    message: str


def _cells(line: str) -> list[str]:
    """A Markdown table line's cells (a `\\|` inside a cell is a literal bar)."""
    inner = line.strip().removeprefix("|").removesuffix("|")
    return [c.replace("\\|", "|").strip() for c in re.split(r"(?<!\\)\|", inner)]


def catalogue_rows(text: str) -> list[Row]:
    rows, columns = [], None
    for line in text.splitlines():
        if not line.lstrip().startswith("|"):
            columns = None
            continue
        cells = _cells(line)
        if columns is None:
            columns = [c.lower() for c in cells]
            continue
        if columns != ["id", "input", "message"] or all(set(c) <= set("-: ") for c in cells):
            continue
        assert len(cells) == 3, f"a catalogue row must have 3 cells: {line!r}"
        rows.append(Row(*(c.strip("`") if i == 0 else c for i, c in enumerate(cells))))
    return rows


def expected_pieces(message_cell: str) -> list[str]:
    """The message cell without backticks, split on `…` (a part that varies from run to run)."""
    text = message_cell.replace("`", "")
    return [piece.strip() for piece in text.split("…") if piece.strip()]


def assert_message(message: str, message_cell: str) -> None:
    assert "\n" not in message.strip(), f"the message is more than one line:\n{message}"
    at = 0
    for piece in expected_pieces(message_cell):
        found = message.find(piece, at)
        assert found >= 0, f"{piece!r} is not in the message (after position {at}):\n{message}"
        at = found + len(piece)


ROWS = catalogue_rows(DOC.read_text(encoding="utf-8")) if DOC.is_file() else []
BY_ID = {row.id: row for row in ROWS}


# ---------------------------------------------------------------------------------------------
# How a case runs


@dataclass
class Ctx:
    tmp: Path
    corpus: Path
    capsys: pytest.CaptureFixture
    request: pytest.FixtureRequest

    @property
    def monkeypatch(self) -> pytest.MonkeyPatch:
        return self.request.getfixturevalue("monkeypatch")

    @property
    def ckpt_run(self) -> Path:
        """A real run directory with checkpoints/step_2 (made once per module, read-only to cases)."""
        return self.request.getfixturevalue("checkpoint_run")

    @property
    def step_2(self) -> Path:
        return self.ckpt_run / "checkpoints" / "step_2"

    def base(self) -> list[str]:
        return [*TINY, "--set", f'data.source="{self.corpus}"']

    def train(self, *args: str, nproc: int = 1, out: Path | None = None) -> str:
        """`loom train --nproc N --out OUT <tiny base> ARGS`: the one-line error it prints."""
        out = out or self.tmp / "run"
        return cli("train", "--nproc", str(nproc), "--out", str(out), *self.base(), *args, capsys=self.capsys)

    def config(self, *overrides: str, world: int = 1) -> str:
        """`validate(load_config(None, overrides), world)`: the ConfigError's message."""
        with pytest.raises(ConfigError) as e:
            validate(load_config(None, overrides), world)
        return str(e.value)


def cli(*argv: str, capsys: pytest.CaptureFixture) -> str:
    capsys.readouterr()
    try:
        rc = loom.cli.main(list(argv))
    except SystemExit as e:  # argparse
        pytest.fail(f"argparse exit {e.code}: {capsys.readouterr().err}")
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - anything but a LoomError is a traceback for the user
        pytest.fail(f"a traceback instead of one line: {type(e).__name__}: {str(e).splitlines()[:1]}")
    err = capsys.readouterr().err
    assert rc == 2, f"loom {' '.join(argv)} returned {rc}, stderr:\n{err}"
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("loom: error: "), f"not one error line:\n{err}"
    return lines[0].removeprefix("loom: error: ")


CASES: dict[str, Callable[[Ctx], str]] = {}
XFAIL: dict[str, str] = {}


def case(case_id: str, xfail: str | None = None):
    def register(fn: Callable[[Ctx], str]) -> Callable[[Ctx], str]:
        assert case_id not in CASES, f"duplicate case id {case_id}"
        CASES[case_id] = fn
        if xfail:
            XFAIL[case_id] = xfail
        return fn
    return register


