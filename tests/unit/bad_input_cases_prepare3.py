"""Bad-input cases of `loom data prepare` (docs/bad-input.md, "Data"): a source whose every record
has an empty text, which prepare skips as training does, is refused once every shard is made."""

from __future__ import annotations

from bad_input import Ctx, case, cli
from bad_input_cases_data import _jsonl


@case("data-prepare-all-empty")
def _(c: Ctx) -> str:
    source = _jsonl(c.tmp / "notes.jsonl", [{"text": ""}] * 200)
    return cli("data", "prepare", str(source), str(c.tmp / "out"), "--shard-docs", "64", "--workers", "1",
               "--cache-dir", str(c.tmp / "cache"), capsys=c.capsys)
